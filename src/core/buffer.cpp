#include "conveyor/buffer.h"

#include "conveyor/detail/buffer_pool.h"
#include "conveyor/errors.h"

#include <cstdint>
#include <new>
#include <string>

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
  // No object is larger (pointer differences must fit); and above
  // SIZE_MAX - 63 libstdc++'s aligned new rounds the size up past zero and
  // hands out a few bytes for the whole request.
  if (bytes > static_cast<size_t>(PTRDIFF_MAX)) {
    throw ValueError("allocate_batch_buffer: " + std::to_string(bytes) +
                     " bytes is more than one allocation can hold (at most " + std::to_string(PTRDIFF_MAX) + ")");
  }
  auto* memory = static_cast<std::byte*>(::operator new(bytes == 0 ? 1 : bytes, kAlignment));
  return std::shared_ptr<std::byte>(memory, [](std::byte* p) { ::operator delete(p, kAlignment); });
}

AllocatorScope::AllocatorScope(BufferAllocator* allocator) noexcept : previous_(tls_allocator) {
  tls_allocator = allocator;
}
AllocatorScope::~AllocatorScope() { tls_allocator = previous_; }
}  // namespace detail

}  // namespace conveyor
