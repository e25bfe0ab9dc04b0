#include "conveyor/buffer.h"

#include "conveyor/detail/buffer_pool.h"

#include <new>

namespace conveyor {
namespace {
thread_local BufferAllocator* tls_allocator = nullptr;  // per thread by nature
constexpr std::align_val_t kAlignment{64};
}  // namespace

std::shared_ptr<std::byte> allocate_batch_buffer(size_t bytes) {
  if (tls_allocator != nullptr) return tls_allocator->allocate(bytes);
  return detail::allocate_heap_buffer(bytes);
}

namespace detail {
std::shared_ptr<std::byte> allocate_heap_buffer(size_t bytes) {
  auto* memory = static_cast<std::byte*>(::operator new(bytes == 0 ? 1 : bytes, kAlignment));
  return std::shared_ptr<std::byte>(memory, [](std::byte* p) { ::operator delete(p, kAlignment); });
}

AllocatorScope::AllocatorScope(BufferAllocator* allocator) noexcept : previous_(tls_allocator) {
  tls_allocator = allocator;
}
AllocatorScope::~AllocatorScope() { tls_allocator = previous_; }
}  // namespace detail

}  // namespace conveyor
