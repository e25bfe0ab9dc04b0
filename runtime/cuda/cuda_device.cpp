// CUDA as a TransferDevice, through the runtime API (host code only).
//
// Thread-safety: allocations come from worker threads, copies and events from
// the consumer's; every call first makes the device current on the calling
// thread (cudaSetDevice is per thread and cheap). The event pool is the only
// shared mutable state here: a moodycamel queue.
#include "conveyor/cuda.h"

#include <concurrentqueue.h>
#include <cuda_runtime_api.h>

#include <string>
#include <utility>

#include "conveyor/warnings.h"

namespace conveyor::cuda {
namespace {

[[noreturn]] void fail(cudaError_t status, const char* call, const char* where) {
  throw CudaError(std::string(call) + " failed in " + where + ": " + cudaGetErrorName(status) + ": " +
                      cudaGetErrorString(status),
                  static_cast<int>(status));
}

#define CONVEYOR_CUDA(call)                                           \
  do {                                                                \
    const cudaError_t conveyor_status_ = (call);                      \
    if (conveyor_status_ != cudaSuccess) fail(conveyor_status_, #call, __func__); \
  } while (0)

// For destructors and frees: never throws. The runtime may already be
// unloading at process exit (cudaErrorCudartUnloading): then there is nothing
// left to release.
void tolerate(cudaError_t status, const char* call) noexcept {
  if (status == cudaSuccess || status == cudaErrorCudartUnloading) return;
  try {
    warn(std::string("conveyor::cuda: ") + call + " failed while releasing: " + cudaGetErrorString(status));
  } catch (...) {
  }
}

// A CUDA event behind a TransferEvent; subclasses say where it goes when
// the last TransferEvent copy does.
class CudaEventState : public detail::EventState {
 public:
  explicit CudaEventState(cudaEvent_t event) : event_(event) {}
  bool query() override {
    const cudaError_t status = cudaEventQuery(event_);
    if (status == cudaErrorNotReady) return false;
    CONVEYOR_CUDA(status);
    return true;
  }
  void synchronize() override { CONVEYOR_CUDA(cudaEventSynchronize(event_)); }
  void* native() noexcept override { return static_cast<void*>(event_); }

 protected:
  cudaEvent_t event_;
};

class EventPool;

// One batch's event, leased from its device's pool and returned to it.
class CudaEvent final : public CudaEventState {
 public:
  CudaEvent(std::shared_ptr<EventPool> pool, cudaEvent_t event) : CudaEventState(event), pool_(std::move(pool)) {}
  ~CudaEvent() override;

 private:
  std::shared_ptr<EventPool> pool_;
};

class EventPool {
 public:
  explicit EventPool(int device) : device_(device) {}
  ~EventPool() {
    cudaEvent_t event = nullptr;
    while (free_.try_dequeue(event)) tolerate(cudaEventDestroy(event), "cudaEventDestroy");
  }
  cudaEvent_t take() {
    cudaEvent_t event = nullptr;
    if (free_.try_dequeue(event)) return event;
    CONVEYOR_CUDA(cudaSetDevice(device_));
    CONVEYOR_CUDA(cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
    return event;
  }
  void give_back(cudaEvent_t event) noexcept {
    if (!free_.enqueue(event)) tolerate(cudaEventDestroy(event), "cudaEventDestroy");
  }

 private:
  int device_;
  moodycamel::ConcurrentQueue<cudaEvent_t> free_;
};

CudaEvent::~CudaEvent() { pool_->give_back(event_); }

class CudaDevice final : public TransferDevice {
 public:
  explicit CudaDevice(int index) : index_(index), events_(std::make_shared<EventPool>(index)) {
    CONVEYOR_CUDA(cudaSetDevice(index_));
    // Non-blocking: the copy stream does not wait for work on the legacy
    // default stream, so copies overlap the trainer's kernels.
    CONVEYOR_CUDA(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  }
  ~CudaDevice() override {
    tolerate(cudaSetDevice(index_), "cudaSetDevice");
    tolerate(cudaStreamSynchronize(stream_), "cudaStreamSynchronize");
    tolerate(cudaStreamDestroy(stream_), "cudaStreamDestroy");
  }

  std::string name() const override { return "cuda:" + std::to_string(index_); }

  void* allocate_pinned(size_t bytes) override {
    CONVEYOR_CUDA(cudaSetDevice(index_));
    void* memory = nullptr;
    // Portable: usable from every context, whichever thread allocated it.
    CONVEYOR_CUDA(cudaHostAlloc(&memory, bytes, cudaHostAllocPortable));
    return memory;
  }
  void free_pinned(void* memory) noexcept override { tolerate(cudaFreeHost(memory), "cudaFreeHost"); }

  void* allocate_device(size_t bytes) override {
    CONVEYOR_CUDA(cudaSetDevice(index_));
    void* memory = nullptr;
    CONVEYOR_CUDA(cudaMalloc(&memory, bytes));
    return memory;
  }
  void free_device(void* memory) noexcept override {
    tolerate(cudaSetDevice(index_), "cudaSetDevice");
    tolerate(cudaFree(memory), "cudaFree");
  }

  void copy_to_device(void* device, const void* host, size_t bytes) override {
    CONVEYOR_CUDA(cudaSetDevice(index_));
    CONVEYOR_CUDA(cudaMemcpyAsync(device, host, bytes, cudaMemcpyHostToDevice, stream_));
  }

  // A CUDA event (from any device) is waited for on the copy stream; any
  // other on the host.
  void wait_for(const TransferEvent& event) override {
    if (event.ready()) return;
    if (void* native = event.native()) {
      CONVEYOR_CUDA(cudaSetDevice(index_));
      CONVEYOR_CUDA(cudaStreamWaitEvent(stream_, static_cast<cudaEvent_t>(native), 0));
    } else {
      event.synchronize();
    }
  }

  TransferEvent record() override {
    CONVEYOR_CUDA(cudaSetDevice(index_));
    cudaEvent_t event = events_->take();
    const cudaError_t status = cudaEventRecord(event, stream_);
    if (status != cudaSuccess) {
      events_->give_back(event);
      fail(status, "cudaEventRecord", __func__);
    }
    return TransferEvent(std::make_shared<CudaEvent>(events_, event));
  }

 private:
  int index_;
  cudaStream_t stream_ = nullptr;
  std::shared_ptr<EventPool> events_;
};

// An event recorded on a stream of the caller's (record_event), destroyed
// with the last TransferEvent copy (the driver releases it once complete).
class StreamEvent final : public CudaEventState {
 public:
  using CudaEventState::CudaEventState;
  ~StreamEvent() override { tolerate(cudaEventDestroy(event_), "cudaEventDestroy"); }
};

}  // namespace

TransferEvent record_event(void* stream) {
  cudaEvent_t event = nullptr;
  CONVEYOR_CUDA(cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
  const cudaError_t status = cudaEventRecord(event, static_cast<cudaStream_t>(stream));
  if (status != cudaSuccess) {
    tolerate(cudaEventDestroy(event), "cudaEventDestroy");
    fail(status, "cudaEventRecord", __func__);
  }
  return TransferEvent(std::make_shared<StreamEvent>(event));
}

int device_count() noexcept {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky error for later callers
    return 0;
  }
  return count;
}

std::shared_ptr<TransferDevice> make_device(int index) { return std::make_shared<CudaDevice>(index); }

std::shared_ptr<TransferDevice> select_transfer_device(int index, bool standin_fallback) {
  const int count = device_count();
  if (index >= 0 && index < count) return make_device(index);
  warn("no CUDA device " + std::to_string(index) + " (" + std::to_string(count) + " visible): " +
       (standin_fallback ? "using the host stand-in for the transfer stage"
                         : "pin_memory will not use pinned memory"));
  return standin_fallback ? make_host_standin_device() : nullptr;
}

}  // namespace conveyor::cuda
