// Replaces the plain operator new/delete to count allocations (see
// allocations.h). In a file of its own: where the replacement is inlined,
// GCC misreads malloc-backed new and free-backed delete as a mismatch.
#include "support/allocations.h"

#include <atomic>
#include <cstdlib>
#include <new>

namespace {
std::atomic<size_t> count{0};
}  // namespace

void* operator new(size_t bytes) {
  count.fetch_add(1, std::memory_order_relaxed);  // a tally, not a hand-off
  if (void* memory = std::malloc(bytes == 0 ? 1 : bytes)) return memory;
  throw std::bad_alloc();
}
void operator delete(void* memory) noexcept { std::free(memory); }
void operator delete(void* memory, size_t) noexcept { std::free(memory); }

namespace conveyor::testing {
size_t allocations_so_far() noexcept { return count.load(std::memory_order_relaxed); }
}  // namespace conveyor::testing
