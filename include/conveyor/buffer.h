// conveyor/buffer.h: where batch memory comes from.
//
// Collate functions allocate their output through allocate_batch_buffer().
// By default that is 64-byte-aligned heap memory; a loader with a transfer
// stage installs its staging pool for the duration of a collate task, so a
// batch is written once, straight into the memory it is copied from. Arrays
// a loader's task makes outside collate (a dataset's samples) come from the
// heap, or from oneTBB's scalable heap, which keeps them for the next batch,
// when 128 KiB or larger.
#pragma once

#include <cstddef>
#include <memory>

namespace conveyor {

class BufferAllocator {
 public:
  virtual ~BufferAllocator() = default;
  // Returns `bytes` of writable memory aligned to at least 64 bytes; the
  // memory is released when the last shared_ptr copy goes. Thread-safe.
  virtual std::shared_ptr<std::byte> allocate(size_t bytes) = 0;
};

// Memory for a batch of `bytes`, from the calling thread's installed
// allocator or the heap. More than PTRDIFF_MAX bytes is a ValueError naming
// the size (the heap); the pool refuses sizes beyond its classes.
std::shared_ptr<std::byte> allocate_batch_buffer(size_t bytes);

namespace detail {
// Installs `allocator` for allocate_batch_buffer() on this thread while alive.
class AllocatorScope {
 public:
  explicit AllocatorScope(BufferAllocator* allocator) noexcept;
  ~AllocatorScope();
  AllocatorScope(const AllocatorScope&) = delete;
  AllocatorScope& operator=(const AllocatorScope&) = delete;

 private:
  BufferAllocator* previous_;
};
}  // namespace detail

}  // namespace conveyor
