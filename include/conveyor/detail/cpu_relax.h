// conveyor/detail/cpu_relax.h: the pause inside a spin-wait, internal.
#pragma once

namespace conveyor::detail {

// Tells the core a spin-wait is running (x86 PAUSE, ARM YIELD): the sibling
// hyperthread gets the pipeline, and leaving the loop costs no mis-speculation.
inline void cpu_relax() noexcept {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

}  // namespace conveyor::detail
