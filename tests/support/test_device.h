// A transfer device for tests: wraps another (the host stand-in), counts
// what it allocates, logs what it is asked to do and can fail a copy or a
// device allocation on demand. ManualEvent stands for the consumer's own
// work on the device.
#pragma once

#include <atomic>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

#include <conveyor/transfer.h>

namespace conveyor::testing {

// Work on the device that the test finishes: complete(). synchronize() waits
// for that, unless made with `done_when_waited_for`: then waiting is what
// completes it (work that has finished by the time anyone asks), and counts.
class ManualEvent final : public conveyor::detail::EventState {
 public:
  explicit ManualEvent(bool done_when_waited_for = false) : done_when_waited_for_(done_when_waited_for) {}
  bool query() override { return done_.load(std::memory_order_acquire) != 0; }  // pairs with complete()
  void synchronize() override {
    waits.fetch_add(1);
    if (done_when_waited_for_) complete();
    while (done_.load(std::memory_order_acquire) == 0) done_.wait(0, std::memory_order_acquire);
  }
  void* native() noexcept override { return nullptr; }
  void complete() {
    done_.store(1, std::memory_order_release);
    done_.notify_all();
  }
  std::atomic<int> waits{0};

 private:
  const bool done_when_waited_for_;
  std::atomic<int> done_{0};
};

// Wraps a device: counts what it allocates, optionally fails, optionally
// holds copies at a gate (its own in-order stream thread).
class TestDevice final : public conveyor::TransferDevice {
 public:
  explicit TestDevice(std::shared_ptr<conveyor::TransferDevice> inner) : inner_(std::move(inner)) {}

  std::string name() const override { return "test(" + inner_->name() + ")"; }
  void* allocate_pinned(size_t bytes) override {
    pinned_allocations.fetch_add(1);
    live_pinned.fetch_add(1);
    return inner_->allocate_pinned(bytes);
  }
  void free_pinned(void* memory) noexcept override {
    live_pinned.fetch_sub(1);
    note_free_while_held();
    inner_->free_pinned(memory);
  }
  void* allocate_device(size_t bytes) override {
    if (fail_device_allocation.load()) throw std::runtime_error("out of device memory (test)");
    device_allocations.fetch_add(1);
    live_device.fetch_add(1);
    return inner_->allocate_device(bytes);
  }
  void free_device(void* memory) noexcept override {
    live_device.fetch_sub(1);
    note_free_while_held();
    note("free", memory);
    inner_->free_device(memory);
  }
  void copy_to_device(void* device, const void* host, size_t bytes) override {
    const int n = copies.fetch_add(1);
    if (fail_copy_number.load() == n) throw std::runtime_error("copy engine fault (test)");
    note("copy", device);
    inner_->copy_to_device(device, host, bytes);
  }
  conveyor::TransferEvent record() override {
    if (fail_record.load()) throw std::runtime_error("event record failed (test)");
    conveyor::TransferEvent recorded = inner_->record();
    if (fail_event_waits.load()) return conveyor::TransferEvent(std::make_shared<FailingWait>(std::move(recorded)));
    if (!stream_gate_) return recorded;
    return conveyor::TransferEvent(std::make_shared<OpensGate>(stream_gate_, std::move(recorded)));
  }
  // Holds the stream: what is queued from now on runs once someone waits
  // for an event recorded after it (as if the copies finished just then),
  // or release_stream(). A free meanwhile counts in frees_while_held.
  void hold_stream() {
    stream_gate_ = std::make_shared<ManualEvent>();
    inner_->wait_for(conveyor::TransferEvent(stream_gate_));
  }
  void release_stream() {
    if (stream_gate_) stream_gate_->complete();
  }
  void wait_for(const conveyor::TransferEvent& event) override {
    note("wait", nullptr);
    inner_->wait_for(event);
  }

  // What the device was asked, in order: "copy" (into the device address),
  // "wait" (wait_for), "free" (a device buffer).
  struct Op {
    std::string what;
    const void* device = nullptr;
  };
  std::vector<Op> ops() const {
    std::lock_guard lock(ops_mutex_);
    return ops_;
  }

  std::atomic<int> pinned_allocations{0}, live_pinned{0};
  std::atomic<int> device_allocations{0}, live_device{0};
  std::atomic<int> copies{0};
  std::atomic<int> fail_copy_number{-1};
  std::atomic<bool> fail_device_allocation{false};
  std::atomic<int> frees_while_held{0};
  // Events recorded from now on fail when waited for, as after a sticky
  // device error.
  std::atomic<bool> fail_event_waits{false};
  // record() throws from now on, as a device that cannot even fence.
  std::atomic<bool> fail_record{false};

 private:
  // An event recorded while the stream is held: waiting for it releases
  // the stream first.
  class OpensGate final : public conveyor::detail::EventState {
   public:
    OpensGate(std::shared_ptr<ManualEvent> gate, conveyor::TransferEvent recorded)
        : gate_(std::move(gate)), recorded_(std::move(recorded)) {}
    bool query() override { return recorded_.ready(); }
    void synchronize() override {
      gate_->complete();
      recorded_.synchronize();
    }
    void* native() noexcept override { return nullptr; }

   private:
    std::shared_ptr<ManualEvent> gate_;
    conveyor::TransferEvent recorded_;
  };
  // Reports an error once the copies before it are done (the stand-in is
  // not really broken: freeing earlier would race with its stream).
  class FailingWait final : public conveyor::detail::EventState {
   public:
    explicit FailingWait(conveyor::TransferEvent recorded) : recorded_(std::move(recorded)) {}
    bool query() override {
      recorded_.synchronize();
      throw std::runtime_error("an illegal memory access was encountered (test)");
    }
    void synchronize() override {
      recorded_.synchronize();
      throw std::runtime_error("an illegal memory access was encountered (test)");
    }
    void* native() noexcept override { return nullptr; }

   private:
    conveyor::TransferEvent recorded_;
  };
  void note_free_while_held() noexcept {
    if (stream_gate_ && !stream_gate_->query()) frees_while_held.fetch_add(1);
  }
  std::shared_ptr<ManualEvent> stream_gate_;  // set before the device is used
  void note(const char* what, const void* device) noexcept {
    try {
      std::lock_guard lock(ops_mutex_);
      ops_.push_back(Op{what, device});
    } catch (...) {
    }
  }

  std::shared_ptr<conveyor::TransferDevice> inner_;
  mutable std::mutex ops_mutex_;
  std::vector<Op> ops_;
};

}  // namespace conveyor::testing
