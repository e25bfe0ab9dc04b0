// Allocations through the plain operator new in a test binary that links
// tests/support/allocations.cpp (which replaces it, for the whole binary).
#pragma once

#include <cstddef>

namespace conveyor::testing {

// How many plain operator new calls this process has made so far.
size_t allocations_so_far() noexcept;

}  // namespace conveyor::testing
