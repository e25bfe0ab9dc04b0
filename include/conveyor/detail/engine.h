// conveyor/detail/engine.h: the task-graph runtime's window of jobs. The
// implementation (oneTBB arena, moodycamel queues, the reorder window) lives
// in runtime/ and is not installed.
//
// Most code does not use the Engine directly but SequencedWindow<Payload>
// (sequenced_window.h), which keeps each slot's payload with its turn.
//
// The runtime knows jobs, lanes, workers and turns, nothing of what a job
// computes: a DataLoader's seeds, epochs, indices and worker identities are
// the loader's (loader_batches.h), a node's item seeds the node's.
//
// Contract. One consumer thread owns the Engine: it submits jobs (the
// dispatcher), waits for results and releases them. Jobs run on the engine's
// workers, calling back into a TaskRunner (the typed half), which writes each
// result into its own storage for the job's slot. The engine then publishes
// the slot and the consumer collects it:
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
#include <string>

namespace conveyor::detail {

// One unit of work, handed to a worker. What it computes is in its slot's
// payload, written by the consumer before submit().
struct Job {
  uint64_t seq = 0;         // engine-wide sequence number; compared for equality only
  uint64_t index = 0;       // position within the pass: the k-th job submitted since begin_pass()
  uint32_t slot = 0;        // window place the result goes to
  int lane = -1;            // the lane it was queued on; -1: the shared lane
  uint64_t generation = 0;  // a cancelled generation's jobs are skipped
};

// The typed half: what a job computes.
class TaskRunner {
 public:
  virtual ~TaskRunner() = default;
  // Once per worker (per engine lifetime) before its first job, on the
  // thread about to run that job. May throw; the engine records it.
  virtual void init_worker(int worker) = 0;
  // Produces the result of `job` into the storage for job.slot, or records
  // why it could not (`init_failure`: the worker's init threw). `worker` is
  // the job's lane with per-lane queues; on the shared lane, a worker no
  // other thread runs as meanwhile, also on an Executor shared by several
  // engines (a worker's jobs never overlap, but two threads may take turns
  // as one worker). Must not throw.
  virtual void run(Job& job, int worker, const std::exception_ptr& init_failure) noexcept = 0;
  // Drops whatever is held for `slot` (a cancelled pass's leftovers).
  virtual void clear(uint32_t slot) noexcept = 0;
};

struct EngineConfig {
  size_t num_workers = 1;
  size_t window = 2;  // jobs in flight at most
  bool in_order = true;
  // A queue per worker, its jobs run one at a time in submission order (a
  // strand each), or one shared queue any worker takes from.
  bool per_worker_queues = true;
  std::chrono::nanoseconds timeout{0};  // zero: wait forever
  // What a timeout's message calls the waiter and its jobs ("DataLoader
  // timed out after 2 seconds waiting for batch 7").
  std::string timeout_subject = "DataLoader";
  std::string job_noun = "batch";
  std::string jobs_noun = "batches";
  // The number a timeout's message gives job i of the pass (none: i). A
  // resumed loader's jobs skip the batches its consumer had: job 0 may be
  // batch 3. Called on the consumer's thread.
  std::function<uint64_t(uint64_t)> job_number;
  uint64_t first_seq = 0;  // tests start near the wrap point
  // In order, with more busy threads than cores and no timeout: a consumer
  // that must park asks to be woken when the job `wake_after` places behind
  // the one it waits for is done (or after kRunWaitLimit), not that one.
  // One wake-up then hands it a run of items: each wake-up is a futex call
  // and the preemption of a worker. 0: woken for each job. A loader leaves it
  // 0 (its consumer wants each batch as soon as it is done); a map sets it.
  size_t wake_after = 0;
};

// A finished job, ready for the consumer.
struct ReadyJob {
  uint64_t seq = 0;
  uint64_t index = 0;
  uint32_t slot = 0;
  int lane = -1;
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

// What the consumer sees of the engine's progress (for metrics and tests).
struct EngineStats {
  size_t in_flight = 0;
  size_t window = 0;
  uint64_t submitted = 0;
  uint64_t released = 0;
  size_t run_ahead = 0;  // how far ahead a parking consumer waits now (see EngineConfig::wake_after)
};

// The threads a graph's engines run on: one oneTBB arena, shared by every
// engine given this executor (a pipeline's parallel nodes), sized by what
// they reserved before the first of them started. Lanes cap their tasks at
// their workers, so with every engine's workers reserved each queued task
// finds a thread: a strand waiting on a window upstream never starves it.
class Executor {
 public:
  Executor();
  // Every engine that uses the executor holds it: it goes with the last.
  ~Executor();
  Executor(const Executor&) = delete;
  Executor& operator=(const Executor&) = delete;

  // Adds `threads` to the arena. False once the arena has started (an
  // engine then gets an arena of its own). Thread-safe.
  bool reserve(size_t threads);
  // The threads reserved so far (the arena's size once it starts).
  size_t reserved() const;

 private:
  friend class Engine;
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

class Engine {
 public:
  // Starts the engine on `executor`, on which the caller reserved
  // config.num_workers threads, or (nullptr) on an arena of its own.
  // `runner` must outlive the engine.
  Engine(const EngineConfig& config, TaskRunner& runner, std::shared_ptr<Executor> executor = nullptr);
  // Cancels queued jobs, waits for running ones and returns. Never throws.
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // ---- consumer thread only -------------------------------------------------

  // Starts a pass: job indices restart at 0. The window must be empty
  // (cancel() empties it).
  void begin_pass();
  bool has_room() const noexcept;
  // The window slot the next submit() will use (requires has_room()): a
  // runner that keeps per-slot input writes it there before submitting.
  uint32_t next_slot() const noexcept;
  // Queues the next job, whose input is in the payload for next_slot(), on
  // `lane` (per-worker queues: 0 to num_workers - 1; otherwise -1).
  // Requires has_room().
  void submit(int lane);
  // Blocks until a result is ready (see the contract). With a timeout
  // configured, throws TimeoutError once `deadline` passes, naming the job,
  // its worker and how long it has run; the engine stays usable and the wait
  // can be retried. The caller sets the deadline once per consumer request,
  // so a request that waits twice still waits `timeout` in all.
  ReadyJob wait_ready(std::chrono::steady_clock::time_point deadline);
  ReadyJob wait_ready() { return wait_ready(deadline_from_now()); }
  // The same without waiting: false when no result is ready yet.
  bool try_ready(ReadyJob& ready);
  // Frees the result's place in the window once the consumer has taken it.
  void release(const ReadyJob& ready) noexcept;
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
