// conveyor/detail/sequenced_window.h: the engine's window with its payloads.
//
// Every threaded node and the loader's workers hand results over the same
// way: the consumer writes a job's input into its window slot and submits
// it, a worker fills the slot, the consumer takes the slot back in turn.
// SequencedWindow<Payload, Input> keeps each slot's input and payload beside
// the engine's turn for it, so what a worker wrote and the turn that
// publishes it travel together: take() returns the payload with its place,
// and nothing outside the window indexes slots or clears them after a
// cancelled pass.
//
// Memory: `window` inputs and payloads, made once. take() moves a payload out
// and leaves the slot empty (Payload{}). An input is freed there too, on the
// consumer's thread, which made it (InputsAfterTake::free), or stays in its
// slot for the next job there to overwrite (keep: a vector keeps its
// capacity, no allocation once warm). Nothing grows with a slow worker.
// Threads: the consumer owns the window (submit, take, cancel); a job's
// input and payload belong to the worker running it from submit() until its
// publication, which happens-before take() (the engine's contract).
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <memory>
#include <optional>
#include <utility>
#include <vector>

#include "conveyor/detail/engine.h"

namespace conveyor::detail {

// A window whose jobs need no input of their own.
struct NoInput {};

// What take() does with a job's input: frees it (what the job left of an
// item: a map whose function reads its input without moving from it leaves
// all of it), or keeps it for reuse (a loader's vector of indices).
enum class InputsAfterTake { free, keep };

// A finished job: its payload and where it came from.
template <class Payload>
struct WindowTaken {
  Payload payload;
  uint64_t index = 0;  // the job's position in the pass
  int lane = -1;       // the lane it was submitted to
};

template <class Payload, class Input = NoInput>
class SequencedWindow final : private TaskRunner {
 public:
  // What the workers do with a job: the typed side of the engine.
  class Work {
   public:
    virtual ~Work() = default;
    // Once per worker before its first job (worker_init_fn). May throw: the
    // engine hands the failure to that worker's jobs.
    virtual void init_worker(int /*worker*/) {}
    // Fills `payload` for `job` from `input` (and whatever the consumer
    // wrote into the payload before submit()). Runs on a worker; `worker`
    // as in TaskRunner::run. Must not throw.
    virtual void run(Job& job, Input& input, Payload& payload, int worker,
                     const std::exception_ptr& init_failure) noexcept = 0;
  };

  using Taken = WindowTaken<Payload>;

  // Starts the engine's workers on `executor` (see Engine); `work` must
  // outlive the window.
  SequencedWindow(const EngineConfig& config, Work& work, std::shared_ptr<Executor> executor = nullptr,
                  InputsAfterTake inputs_after_take = InputsAfterTake::free)
      : work_(work),
        inputs_after_take_(inputs_after_take),
        inputs_(config.window),
        payloads_(config.window),
        engine_(std::in_place, config, static_cast<TaskRunner&>(*this), std::move(executor)) {}
  // Stops the workers (cancelling what is queued) before the payloads go.
  ~SequencedWindow() override { engine_.reset(); }
  SequencedWindow(const SequencedWindow&) = delete;
  SequencedWindow& operator=(const SequencedWindow&) = delete;

  // ---- consumer thread only ----

  // Starts a pass: job indices restart at 0. Nothing may be in flight.
  void begin_pass() { engine_->begin_pass(); }
  bool has_room() const noexcept { return engine_->has_room(); }
  size_t in_flight() const noexcept { return engine_->stats().in_flight; }
  size_t window() const noexcept { return payloads_.size(); }
  // The payload the next submit() sends (requires has_room()): the slot is
  // free by the window's invariant, so its input can be written now.
  Payload& next_payload() noexcept { return payloads_[engine_->next_slot()]; }
  Input& next_input() noexcept { return inputs_[engine_->next_slot()]; }
  // Queues the job whose input is in next_input() (and next_payload()), on
  // `lane` (per-worker queues), or -1 (the shared one).
  void submit(int lane = -1) { engine_->submit(lane); }

  // The next finished job (in order or as they finish, per the config),
  // waiting until `deadline` (TimeoutError past it; retrying is allowed).
  // Its slot is free again on return.
  Taken take(std::chrono::steady_clock::time_point deadline) { return take_slot(engine_->wait_ready(deadline)); }
  Taken take() { return take(engine_->deadline_from_now()); }
  // The same without waiting: nullopt when none has finished (or none is
  // in flight).
  std::optional<Taken> try_take() {
    ReadyJob ready;
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
  Taken take_slot(const ReadyJob& ready) {
    Taken taken{std::move(payloads_[ready.slot]), ready.index, ready.lane};
    payloads_[ready.slot] = Payload{};
    if (inputs_after_take_ == InputsAfterTake::free) inputs_[ready.slot] = Input{};
    engine_->release(ready);
    return taken;
  }

  // ---- TaskRunner, on the workers; clear() on the consumer's thread inside cancel() ----
  void init_worker(int worker) override { work_.init_worker(worker); }
  void run(Job& job, int worker, const std::exception_ptr& init_failure) noexcept override {
    work_.run(job, inputs_[job.slot], payloads_[job.slot], worker, init_failure);
  }
  void clear(uint32_t slot) noexcept override {
    inputs_[slot] = Input{};
    payloads_[slot] = Payload{};
  }

  Work& work_;
  const InputsAfterTake inputs_after_take_;
  std::vector<Input> inputs_;      // by slot
  std::vector<Payload> payloads_;  // by slot
  std::optional<Engine> engine_;   // last: stopped first
};

}  // namespace conveyor::detail
