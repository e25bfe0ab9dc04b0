// conveyor/detail/worker_scope.h: binds a worker's identity to the calling
// thread for the duration of a task. Used by the loader; not user API.
#pragma once

#include <cstdint>
#include <optional>

#include "conveyor/generator.h"
#include "conveyor/worker_info.h"

namespace conveyor::detail {

// The generator default_generator() returns on this thread, or nullptr.
Generator* current_worker_generator();

// While alive, get_worker_info() returns `info` and default_generator()
// returns the scope's generator on this thread; restores the previous binding
// on exit, so scopes nest (a task run inside another task's parallel_for).
// Thread-confined: created and destroyed on one thread.
class WorkerScope {
 public:
  WorkerScope(const WorkerInfo* info, Generator* generator) noexcept;
  // Generator::for_item(lazy_seed), built only if the task asks for it (a
  // pipeline node's per-item generator).
  WorkerScope(const WorkerInfo* info, uint64_t lazy_seed) noexcept;
  ~WorkerScope();
  WorkerScope(const WorkerScope&) = delete;
  WorkerScope& operator=(const WorkerScope&) = delete;

  const WorkerInfo* info() const noexcept { return info_; }
  Generator* generator();

 private:
  const WorkerInfo* info_;
  Generator* generator_;
  uint64_t lazy_seed_ = 0;
  std::optional<Generator> lazy_;
  WorkerScope* previous_;
};

}  // namespace conveyor::detail
