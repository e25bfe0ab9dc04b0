// conveyor/detail/engine.h: the threaded engine's interface to the loader.
// The implementation (oneTBB arena, moodycamel queues, the reorder window)
// lives in runtime/ and is not installed.
//
// Most code does not use the Engine directly but SequencedWindow<Payload>
// (sequenced_window.h), which keeps each slot's payload with its turn.
//
// Contract. One consumer thread owns the Engine: it submits jobs (the
// dispatcher), waits for results and releases them. Jobs run on the engine's
// workers, calling back into a TaskRunner (the loader's typed half), which
// writes each batch into its own storage for the job's slot. The engine then
// publishes the slot and the consumer collects it:
//   - in_order: results come out in submission order;
//   - otherwise: in completion order, each exactly once.
// At most `window` jobs are in flight (submitted, not yet released); submit()
// requires has_room(). The hot path takes no mutex.
//
// Memory ordering: everything a TaskRunner writes for a job happens-before the
// consumer's return from wait_ready() for that job (a release store of the
// slot's turn, acquired by the consumer).
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <span>
#include <string>

#include "conveyor/options.h"
#include "conveyor/sampler.h"
#include "conveyor/worker_info.h"

namespace conveyor::detail {

// One batch's work, handed to a worker.
struct Job {
  uint64_t seq = 0;          // engine-wide sequence number; compared for equality only
  uint64_t batch_index = 0;  // position within the epoch
  uint32_t slot = 0;         // reorder-window place the result goes to
  int worker = -1;           // logical worker; -1: whichever is free (work_stealing)
  uint64_t generation = 0;   // a cancelled generation's jobs are skipped
  int64_t base_seed = 0;
  uint64_t epoch = 0;
  uint64_t pass = 0;         // counts begin_epoch() calls: a new pass restarts replicas
  // Map-style datasets: the samples. Points into the engine's buffer for the
  // slot, which the job owns until the consumer releases the slot.
  std::span<const size_t> indices;
};

// The loader's typed half: how to turn a Job into a batch.
class TaskRunner {
 public:
  virtual ~TaskRunner() = default;
  // Once per worker (per engine lifetime) before its first job, inside the
  // worker's scope: worker_init_fn. May throw; the engine records it.
  virtual void init_worker(int worker) = 0;
  // Produces the batch of `job` into the storage for job.slot, or records why
  // it could not (`init_failure`: the worker's init threw). Runs inside the
  // worker's scope. Must not throw.
  virtual void run(Job& job, int worker, const std::exception_ptr& init_failure) noexcept = 0;
  // Drops whatever is held for `slot` (a cancelled epoch's leftovers).
  virtual void clear(uint32_t slot) noexcept = 0;
};

struct EngineConfig {
  size_t num_workers = 1;
  size_t window = 2;  // prefetch_factor * num_workers
  bool in_order = true;
  // Logical workers with their own queue each (round_robin, iterable
  // datasets), or one shared queue (work_stealing).
  bool per_worker_queues = true;
  // Each batch's default_generator() is seeded from (base_seed, epoch,
  // batch_index) (work_stealing) instead of being its worker's stream.
  bool per_batch_generators = false;
  // Reseed worker generators only at the first epoch (persistent_workers).
  bool persistent = false;
  std::chrono::nanoseconds timeout{0};  // zero: wait forever
  WorkerInfo worker_prototype;          // the dataset; id, num_workers and seed are filled in
  uint64_t first_seq = 0;               // tests start near the wrap point
};

// A finished job, ready for the consumer.
struct ReadyBatch {
  uint64_t seq = 0;
  uint64_t batch_index = 0;
  uint32_t slot = 0;
  int worker = -1;
};

// Runs `work` on a thread of its own, detached: how a loader that co-owns
// everything a stuck task touches stops without waiting for that task. Runs
// `work` here instead if no thread can be started. Never throws.
void finish_in_background(std::function<void()> work) noexcept;

// The most worker threads oneTBB starts in this process, given the
// parallelism limit in force when it started.
size_t tbb_worker_limit(size_t parallelism_at_start);

// What the engine warns when `workers_wanted` worker threads (every live
// loader's together) cannot all run at once: `parallelism_in_force` is TBB's
// max_allowed_parallelism now (the minimum over every tbb::global_control),
// `tbb_worker_limit` what oneTBB itself allows. Empty when they all can.
std::string thread_limit_warning(size_t workers_wanted, size_t parallelism_in_force,
                                 size_t tbb_worker_limit);

// The seed of batch `batch_index`'s generator under work_stealing: the same
// for any number of workers (declared again in loader_core.h).
uint64_t work_stealing_seed(int64_t base_seed, uint64_t epoch, uint64_t batch_index);

// What the consumer sees of the engine's progress (for metrics and tests).
struct EngineStats {
  size_t in_flight = 0;
  size_t window = 0;
  uint64_t submitted = 0;
  uint64_t released = 0;
};

class Engine {
 public:
  // Starts the arena. `runner` must outlive the engine.
  Engine(const EngineConfig& config, TaskRunner& runner);
  // Cancels queued jobs, waits for running ones and returns. Never throws.
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // ---- consumer thread only -------------------------------------------------

  // Starts a pass: batch indices restart at 0 and round-robin workers are
  // seeded base_seed + id (first pass only when persistent). The window must
  // be empty (cancel() empties it).
  void begin_epoch(int64_t base_seed, uint64_t epoch);
  bool has_room() const noexcept;
  // The window slot the next submit() will use (requires has_room()): a
  // runner that keeps per-slot input writes it there before submitting.
  uint32_t next_slot() const noexcept;
  // Queues the next batch for `worker` (-1: any), copying `indices` into the
  // slot's buffer (reused: no allocation once warm). Requires has_room().
  void submit(int worker, std::span<const size_t> indices);
  // Blocks until a result is ready (see the contract). With a timeout
  // configured, throws TimeoutError once `deadline` passes, naming the batch,
  // its worker and how long it has run; the engine stays usable and the wait
  // can be retried. The caller sets the deadline once per consumer request,
  // so a request that waits twice still waits `timeout` in all.
  ReadyBatch wait_ready(std::chrono::steady_clock::time_point deadline);
  ReadyBatch wait_ready() { return wait_ready(deadline_from_now()); }
  // The same without waiting: false when no result is ready yet.
  bool try_ready(ReadyBatch& ready);
  // Frees the result's place in the window once the consumer has taken it.
  void release(const ReadyBatch& ready) noexcept;
  // Drops every job in flight: queued ones are skipped, running ones are
  // waited for. Afterwards the window is empty.
  void cancel() noexcept;

  EngineStats stats() const noexcept;
  size_t num_workers() const noexcept;
  // When wait_ready() gives up: now + the configured timeout, or never.
  std::chrono::steady_clock::time_point deadline_from_now() const noexcept;

  // How many times cancel() has dropped jobs. Thread-safe: tests use it to
  // know that a cancellation has begun.
  uint64_t cancellations() const noexcept;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace conveyor::detail
