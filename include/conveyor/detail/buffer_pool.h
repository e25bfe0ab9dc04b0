// conveyor/detail/buffer_pool.h: the loader's recycling batch allocator.
#pragma once

#include <cstddef>
#include <memory>

#include "conveyor/buffer.h"

namespace conveyor::detail {

// A BufferAllocator whose buffers, once released, are reused for the next
// batch of their size class (powers of two from 64 bytes). At most
// `max_free_per_class` idle buffers are kept per class; the rest go back to
// the heap. Buffers outlive the allocator safely. Thread-safe, mutex-free.
std::shared_ptr<BufferAllocator> make_recycling_allocator(size_t max_free_per_class);

}  // namespace conveyor::detail
