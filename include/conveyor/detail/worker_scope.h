// conveyor/detail/worker_scope.h: binds a worker's identity to the calling
// thread for the duration of a task. Used by the loader; not user API.
#pragma once

#include "conveyor/generator.h"
#include "conveyor/worker_info.h"

namespace conveyor::detail {

// The generator default_generator() returns on this thread, or nullptr.
Generator* current_worker_generator() noexcept;

// While alive, get_worker_info() returns `info` and default_generator()
// returns `generator` on this thread; restores the previous binding on exit,
// so scopes nest (a task running inside another task's parallel_for).
class WorkerScope {
 public:
  WorkerScope(const WorkerInfo* info, Generator* generator) noexcept;
  ~WorkerScope();
  WorkerScope(const WorkerScope&) = delete;
  WorkerScope& operator=(const WorkerScope&) = delete;

 private:
  const WorkerInfo* previous_info_;
  Generator* previous_generator_;
};

}  // namespace conveyor::detail
