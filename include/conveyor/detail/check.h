// conveyor/detail/check.h: always-on invariant checks. A failed check is a
// bug in conveyor, not bad input: it prints where and why, then aborts.
// (Bad input throws conveyor::ValueError and friends instead.)
#pragma once

#include <cstdio>
#include <cstdlib>

#define CONVEYOR_CHECK(condition, message)                                                  \
  do {                                                                                      \
    if (!(condition)) [[unlikely]] {                                                        \
      std::fprintf(stderr, "conveyor: internal check failed at %s:%d: %s (%s)\n", __FILE__, \
                   __LINE__, message, #condition);                                          \
      std::abort();                                                                         \
    }                                                                                       \
  } while (0)
