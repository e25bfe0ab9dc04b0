// conveyor/detail/sequenced_window.h: the engine's window with its payloads.
//
// Every threaded node and the loader's workers hand results over the same
// way: the consumer writes a job's input into its window slot and submits
// it, a worker fills the slot, the consumer takes the slot back in turn.
// SequencedWindow<Payload> keeps each slot's payload beside the engine's
// turn for it, so what a worker wrote and the turn that publishes it travel
// together: take() returns the payload with its place, and nothing outside
// the window indexes slots or clears them after a cancelled pass.
//
// Memory: `window` payloads, made once. take() moves a payload out and
// leaves the slot empty (Payload{}); nothing grows with a slow worker.
// Threads: the consumer owns the window (submit, take, cancel); a job's
// payload belongs to the worker running it from submit() until its
// publication, which happens-before take() (the engine's contract).
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <optional>
#include <span>
#include <utility>
#include <vector>

#include "conveyor/detail/engine.h"

namespace conveyor::detail {

template <class Payload>
class SequencedWindow final : private TaskRunner {
 public:
  // What the workers do with a job: the typed side of the engine.
  class Work {
   public:
    virtual ~Work() = default;
    // Once per worker before its first job (worker_init_fn). May throw: the
    // engine hands the failure to that worker's jobs.
    virtual void init_worker(int /*worker*/) {}
    // Fills `payload` (which holds what the consumer wrote before submit())
    // for `job`. Runs on a worker; must not throw.
    virtual void run(Job& job, Payload& payload, int worker, const std::exception_ptr& init_failure) noexcept = 0;
  };

  // A finished job: its payload and where it came from.
  struct Taken {
    Payload payload;
    uint64_t batch_index = 0;
    int worker = -1;
  };

  // Starts the engine's workers; `work` must outlive the window.
  SequencedWindow(const EngineConfig& config, Work& work)
      : work_(work), payloads_(config.window), engine_(std::in_place, config, static_cast<TaskRunner&>(*this)) {}
  // Stops the workers (cancelling what is queued) before the payloads go.
  ~SequencedWindow() override { engine_.reset(); }
  SequencedWindow(const SequencedWindow&) = delete;
  SequencedWindow& operator=(const SequencedWindow&) = delete;

  // ---- consumer thread only ----

  void begin_epoch(int64_t base_seed, uint64_t epoch) { engine_->begin_epoch(base_seed, epoch); }
  bool has_room() const noexcept { return engine_->has_room(); }
  size_t in_flight() const noexcept { return engine_->stats().in_flight; }
  size_t window() const noexcept { return payloads_.size(); }
  // The payload the next submit() sends (requires has_room()): the slot is
  // free by the window's invariant, so its input can be written now.
  Payload& next_payload() noexcept { return payloads_[engine_->next_slot()]; }
  // Queues the job whose input is in next_payload(), for `worker` (-1: any).
  void submit(int worker = -1, std::span<const size_t> indices = {}) { engine_->submit(worker, indices); }

  // The next finished job (in order or as they finish, per the config),
  // waiting until `deadline` (TimeoutError past it; retrying is allowed).
  // Its slot is free again on return.
  Taken take(std::chrono::steady_clock::time_point deadline) { return take_slot(engine_->wait_ready(deadline)); }
  Taken take() { return take(engine_->deadline_from_now()); }
  // The same without waiting: nullopt when none has finished (or none is
  // in flight).
  std::optional<Taken> try_take() {
    ReadyBatch ready;
    if (in_flight() == 0 || !engine_->try_ready(ready)) return std::nullopt;
    return take_slot(ready);
  }

  // Drops every job in flight (queued ones skipped, running ones waited
  // for) and empties their payloads.
  void cancel() noexcept { engine_->cancel(); }

  std::chrono::steady_clock::time_point deadline_from_now() const noexcept { return engine_->deadline_from_now(); }
  size_t num_workers() const noexcept { return engine_->num_workers(); }
  uint64_t cancellations() const noexcept { return engine_->cancellations(); }

 private:
  Taken take_slot(const ReadyBatch& ready) {
    Taken taken{std::move(payloads_[ready.slot]), ready.batch_index, ready.worker};
    payloads_[ready.slot] = Payload{};
    engine_->release(ready);
    return taken;
  }

  // ---- TaskRunner, on the workers; clear() on the consumer's thread inside cancel() ----
  void init_worker(int worker) override { work_.init_worker(worker); }
  void run(Job& job, int worker, const std::exception_ptr& init_failure) noexcept override {
    work_.run(job, payloads_[job.slot], worker, init_failure);
  }
  void clear(uint32_t slot) noexcept override { payloads_[slot] = Payload{}; }

  Work& work_;
  std::vector<Payload> payloads_;  // by slot
  std::optional<Engine> engine_;   // last: stopped first
};

}  // namespace conveyor::detail
