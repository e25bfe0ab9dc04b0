// The host stand-in transfer device: "device" memory is heap memory and the
// copy stream is one thread doing memcpy in order, completing events and
// waiting for others (wait_for) as it reaches them. Lets CI (no GPU)
// exercise ordering, overlap, buffer recycling and shutdown of the transfer
// stage. As on a CUDA stream, an event waited for that never completes holds
// every later copy, and the device's destruction.
#include <blockingconcurrentqueue.h>

#include <atomic>
#include <cstring>
#include <new>
#include <optional>
#include <string>
#include <thread>

#include "conveyor/transfer.h"
#include "conveyor/warnings.h"

namespace conveyor {
namespace {

constexpr std::align_val_t kAlignment{64};

class StandinEvent final : public detail::EventState {
 public:
  bool query() override { return done_.load(std::memory_order_acquire) != 0; }  // pairs with complete()
  void synchronize() override {
    while (done_.load(std::memory_order_acquire) == 0) done_.wait(0, std::memory_order_acquire);
  }
  void* native() noexcept override { return nullptr; }
  // The copies before this event happen-before whoever sees it done.
  void complete() {
    done_.store(1, std::memory_order_release);
    done_.notify_all();
  }

 private:
  std::atomic<int> done_{0};
};

class HostStandinDevice final : public TransferDevice {
 public:
  HostStandinDevice() : stream_([this] { run(); }) {}
  // Finishes every queued copy and event, then stops the stream thread.
  ~HostStandinDevice() override {
    queue_.enqueue(Op{.stop = true});
    stream_.join();
  }

  std::string name() const override { return "host-standin"; }
  void* allocate_pinned(size_t bytes) override { return ::operator new(bytes ? bytes : 1, kAlignment); }
  void free_pinned(void* memory) noexcept override { ::operator delete(memory, kAlignment); }
  void* allocate_device(size_t bytes) override { return ::operator new(bytes ? bytes : 1, kAlignment); }
  void free_device(void* memory) noexcept override { ::operator delete(memory, kAlignment); }

  void copy_to_device(void* device, const void* host, size_t bytes) override {
    queue_.enqueue(Op{.device = device, .host = host, .bytes = bytes});
  }
  TransferEvent record() override {
    auto event = std::make_shared<StandinEvent>();
    queue_.enqueue(Op{.event = event});
    return TransferEvent(std::move(event));
  }
  // The copy thread waits for it in turn, as a stream waits on an event.
  void wait_for(const TransferEvent& event) override { queue_.enqueue(Op{.wait = event}); }

 private:
  struct Op {
    void* device = nullptr;
    const void* host = nullptr;
    size_t bytes = 0;
    std::shared_ptr<StandinEvent> event{};
    std::optional<TransferEvent> wait{};
    bool stop = false;
  };

  void run() {
    Op op;
    while (true) {
      queue_.wait_dequeue(op);  // parks when idle; no polling
      if (op.stop) return;
      if (op.event) {
        op.event->complete();
        op.event.reset();
      } else if (op.wait) {
        op.wait->synchronize();
        op.wait.reset();
      } else {
        std::memcpy(op.device, op.host, op.bytes);
      }
    }
  }

  moodycamel::BlockingConcurrentQueue<Op> queue_;
  std::thread stream_;  // last: started once the queue exists
};

}  // namespace

void TransferEvent::synchronize_before_release(const char* what) const noexcept {
  try {
    synchronize();
  } catch (const std::exception& error) {
    try {
      warn(std::string("waiting for the device before freeing ") + what + " failed: " + error.what() +
           "; freeing it anyway (a device in this state runs nothing more)");
    } catch (...) {
      // The warning is a report: losing it never stops a release.
    }
  }
}

std::shared_ptr<TransferDevice> make_host_standin_device() {
  return std::make_shared<HostStandinDevice>();
}

}  // namespace conveyor
