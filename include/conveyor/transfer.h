// conveyor/transfer.h: the transfer stage's public face. With pin_memory,
// batches are collated straight into page-locked memory; with
// prefetch_to_device they are also copied to the device on a dedicated copy
// stream, a few batches ahead of the consumer, one event per batch.
//
// Devices: CUDA (conveyor/cuda.h, target conveyor::cuda), or the host
// stand-in below, a thread that performs the "copies" with memcpy and
// completes events, so that ordering, overlap, recycling and shutdown are
// exercised on machines without a GPU.
//
// Hand-off: DataLoader::Epoch::device() describes the device copy of the
// batch next() just returned (one buffer per host buffer, in
// transfer_traits order) and its ready event. Make the consumer's stream wait
// on the event (cudaStreamWaitEvent on native()); synchronize() is the host
// fallback. Device buffers belong to their host buffers and are written again
// by a later batch's copy once the host batch is released. Work still queued
// on the device that reads them then needs DeviceBatch::keep_until (PyTorch's
// Tensor.record_stream): later copies into that memory wait for it.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <unordered_map>
#include <utility>
#include <vector>

#include "conveyor/array.h"

namespace conveyor {

namespace detail {
// An event's implementation, per device kind.
class EventState {
 public:
  virtual ~EventState() = default;
  virtual bool query() = 0;         // done?
  virtual void synchronize() = 0;   // block the calling thread until done
  virtual void* native() noexcept = 0;
};
}  // namespace detail

// Completes once the copies recorded before it have. Copyable handle.
class TransferEvent {
 public:
  TransferEvent() = default;  // an event that is always complete
  explicit TransferEvent(std::shared_ptr<detail::EventState> state) : state_(std::move(state)) {}

  bool ready() const { return !state_ || state_->query(); }
  void synchronize() const {
    if (state_) state_->synchronize();
  }
  // synchronize() where memory is released and nothing may throw: a wait
  // that fails (a device in a sticky error state, which runs nothing more)
  // is a warning naming `what`, and the caller frees what it guarded.
  void synchronize_before_release(const char* what) const noexcept;
  // The device's own handle: a cudaEvent_t for CUDA devices, nullptr for the
  // stand-in (use synchronize()).
  void* native() const noexcept { return state_ ? state_->native() : nullptr; }

 private:
  std::shared_ptr<detail::EventState> state_;
};

// Where pin_memory batches go. Implementations are thread-safe.
class TransferDevice {
 public:
  virtual ~TransferDevice() = default;
  virtual std::string name() const = 0;  // "cuda:0", "host-standin"

  // Page-locked host memory (cudaHostAlloc) and device memory (cudaMalloc).
  // Allocation failures throw; frees never do.
  virtual void* allocate_pinned(size_t bytes) = 0;
  virtual void free_pinned(void* memory) noexcept = 0;
  virtual void* allocate_device(size_t bytes) = 0;
  virtual void free_device(void* memory) noexcept = 0;

  // Queues a host-to-device copy on the device's copy stream; copies run in
  // the order queued. Throws if it cannot be queued.
  virtual void copy_to_device(void* device, const void* host, size_t bytes) = 0;
  // An event completing once every copy queued so far has.
  virtual TransferEvent record() = 0;
  // Copies queued after this call start once `event` has completed. CUDA's
  // copy stream waits on the device (cudaStreamWaitEvent), the stand-in's
  // copy thread on the host; this default blocks the calling thread until
  // then, which is correct for any device.
  virtual void wait_for(const TransferEvent& event) { event.synchronize(); }
};

// The host stand-in: "device" memory is ordinary heap memory, copies are
// memcpy on one thread of its own, in order.
std::shared_ptr<TransferDevice> make_host_standin_device();

// One host buffer of a batch and its device copy.
struct DeviceBuffer {
  const void* host = nullptr;
  void* device = nullptr;
  size_t bytes = 0;
};

namespace detail {
// The events of work reading one batch's device copy (DeviceBatch::keep_until).
// Shared by the batch's DeviceBatch, its pooled device twins until their next
// copy (which waits for these first) and its scratch buffers until they are
// freed (after these). A mutex, not a lock-free list: one lock per buffer per
// batch, uncontended, and keep_until may come from any thread.
class DeviceCopyUses {
 public:
  void add(const TransferEvent& done) {
    std::lock_guard lock(mutex_);
    events_.push_back(done);
  }
  std::vector<TransferEvent> events() const {
    std::lock_guard lock(mutex_);
    return events_;
  }

 private:
  mutable std::mutex mutex_;
  std::vector<TransferEvent> events_;
};
}  // namespace detail

// The device copy of one batch.
struct DeviceBatch {
  std::vector<DeviceBuffer> buffers;  // in transfer_traits order
  TransferEvent ready;
  std::shared_ptr<detail::DeviceCopyUses> uses;  // set by the transfer stage

  // The device memory of this copy is read by work that completes with
  // `done` (conveyor::cuda::record_event(stream) for a CUDA stream): no later
  // copy writes it, and no scratch buffer of it is freed, before `done` has
  // completed, even after the host batch is released. Call it after queueing
  // that work and before releasing the host batch: once released, its memory
  // may be copied into again, and a later call comes too late for that copy.
  // Each call adds an event.
  void keep_until(const TransferEvent& done) const {
    if (uses) uses->add(done);
  }

  // The device copy of host memory `host` (nullptr if none).
  void* find(const void* host) const noexcept {
    for (const DeviceBuffer& buffer : buffers) {
      if (buffer.host == host) return buffer.device;
    }
    return nullptr;
  }
  template <class T>
  T* find(const Array<T>& array) const noexcept {
    return static_cast<T*>(find(static_cast<const void*>(array.data())));
  }
};

// Which memory of a batch the transfer stage copies: specialise for your own
// batch types (PyTorch's pin_memory() method on custom batches):
//
//   template <> struct conveyor::transfer_traits<MyBatch> {
//     template <class F> static void for_each_buffer(MyBatch& b, F&& f) {
//       f(b.pixels.data(), b.pixels.numel() * sizeof(float), b.pixels.owner());
//     }
//   };
//
// f(data, bytes, owner): `owner` is what keeps the memory alive (empty if
// unknown); memory from the loader's pinned pool is recognised by it and
// copied into its pooled device twin, anything else into a device buffer
// that lives until the next batch is handed out.
//
// Arrays, std::pair/tuple/array/vector and string maps of them are covered;
// conveyor/torch.h adds at::Tensor. Other types are left on the host.
template <class T>
struct transfer_traits {
  template <class F>
  static void for_each_buffer(T&, F&&) {}
};

template <class U>
struct transfer_traits<Array<U>> {
  template <class F>
  static void for_each_buffer(Array<U>& array, F&& f) {
    if (array.numel() > 0) f(static_cast<void*>(array.data()), array.numel() * sizeof(U), array.owner());
  }
};

template <class A, class B>
struct transfer_traits<std::pair<A, B>> {
  template <class F>
  static void for_each_buffer(std::pair<A, B>& pair, F&& f) {
    transfer_traits<A>::for_each_buffer(pair.first, f);
    transfer_traits<B>::for_each_buffer(pair.second, f);
  }
};

template <class... Ts>
struct transfer_traits<std::tuple<Ts...>> {
  template <class F>
  static void for_each_buffer(std::tuple<Ts...>& tuple, F&& f) {
    std::apply([&f](auto&... part) { (transfer_traits<std::remove_cvref_t<decltype(part)>>::for_each_buffer(part, f), ...); },
               tuple);
  }
};

template <class U, size_t N>
struct transfer_traits<std::array<U, N>> {
  template <class F>
  static void for_each_buffer(std::array<U, N>& parts, F&& f) {
    for (U& part : parts) transfer_traits<U>::for_each_buffer(part, f);
  }
};

template <class U, class A>
struct transfer_traits<std::vector<U, A>> {
  template <class F>
  static void for_each_buffer(std::vector<U, A>& parts, F&& f) {
    for (U& part : parts) transfer_traits<U>::for_each_buffer(part, f);
  }
};

template <class U, class C, class A>
struct transfer_traits<std::map<std::string, U, C, A>> {
  template <class F>
  static void for_each_buffer(std::map<std::string, U, C, A>& parts, F&& f) {
    for (auto& [key, part] : parts) transfer_traits<U>::for_each_buffer(part, f);
  }
};

}  // namespace conveyor
