// conveyor/detail/buffer_pool.h: the loader's recycling batch allocators.
#pragma once

#include <cstddef>
#include <memory>
#include <optional>

#include "conveyor/buffer.h"
#include "conveyor/transfer.h"

namespace conveyor::detail {

// A BufferAllocator whose buffers, once released, are reused for the next
// batch of their size class (powers of two from 64 bytes). At most
// `max_free_per_class` idle buffers are kept per class, and never more idle
// bytes than were ever in use at once; the rest go back to the heap.
// Buffers outlive the allocator safely. Thread-safe, mutex-free.
// The loader installs it for collate only: what a dataset allocates is not
// the window's memory and comes from the sample heap (make_sample_heap).
std::shared_ptr<BufferAllocator> make_recycling_allocator(size_t max_free_per_class);

// Plain heap memory from oneTBB's scalable allocator, whose per-thread heaps
// take back memory freed on another thread without a lock: for what a
// pipeline's workers make and its consumer frees.
std::shared_ptr<BufferAllocator> make_scalable_heap();

// Where a loader's batch task allocates outside collate: glibc below
// kLargeSampleBytes, the scalable heap from there on (see buffer_pool.cpp).
inline constexpr size_t kLargeSampleBytes = size_t{128} << 10;  // glibc's default mmap threshold
std::shared_ptr<BufferAllocator> make_sample_heap();

// allocate_batch_buffer's memory where no allocator is installed: 64-byte
// aligned, from the C++ heap.
std::shared_ptr<std::byte> allocate_heap_buffer(size_t bytes);

// The same over page-locked memory from `device`. Each buffer gets a device
// twin of its capacity on its first transfer, reused with it; a buffer is not
// handed out again before the device has finished reading it, and its twin
// is not copied into again before the events kept for it
// (DeviceBatch::keep_until) have completed.
std::shared_ptr<BufferAllocator> make_pinned_allocator(std::shared_ptr<TransferDevice> device,
                                                       size_t max_free_per_class);

// What a pool holds, in bytes of block capacity (approximate while buffers
// move).
struct PoolStats {
  size_t idle_bytes = 0;         // on the free lists
  size_t in_use_bytes = 0;       // handed out, not yet back
  size_t peak_in_use_bytes = 0;  // the most ever handed out at once
};
// `pool` must come from make_recycling_allocator / make_pinned_allocator.
PoolStats pool_stats(const BufferAllocator& pool);

// Whether `owner` keeps a pool buffer alive (rather than heap memory).
bool is_pool_buffer(const std::shared_ptr<void>& owner);

// Keeps `memory` alive until the process ends: memory a device copy may
// still use when no event could be recorded to say when it is done. Held
// where leak checkers see it, not leaked.
void hold_forever(std::shared_ptr<void> memory) noexcept;
// Whether `owner` keeps memory from make_scalable_heap() (or the sample
// heap's large side) alive.
bool is_scalable_heap_buffer(const std::shared_ptr<void>& owner);

// A pinned pool buffer's device twin, where to record its copy's event, and
// the work that may still read the twin's last copy (wait for it before
// copying into the twin again, then put the new copy's there).
struct DeviceTwin {
  const void* host_base = nullptr;  // the start of the pool buffer
  void* device = nullptr;           // its twin, same capacity
  size_t capacity = 0;
  TransferEvent* last_copy = nullptr;
  std::shared_ptr<DeviceCopyUses>* last_uses = nullptr;
};

// For memory owned by `owner`: its twin if it is a pinned pool buffer
// (allocated now on first use), else nullopt. Call only while holding the
// buffer (it belongs to the holder).
std::optional<DeviceTwin> device_twin_of(const std::shared_ptr<void>& owner);

}  // namespace conveyor::detail
