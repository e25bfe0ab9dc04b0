#include "conveyor/detail/worker_scope.h"

namespace conveyor {
namespace {
// Thread-local by nature: each thread runs at most one task at a time.
thread_local const WorkerInfo* tls_worker_info = nullptr;
thread_local Generator* tls_worker_generator = nullptr;
}  // namespace

const WorkerInfo* get_worker_info() noexcept { return tls_worker_info; }

namespace detail {

Generator* current_worker_generator() noexcept { return tls_worker_generator; }

WorkerScope::WorkerScope(const WorkerInfo* info, Generator* generator) noexcept
    : previous_info_(tls_worker_info), previous_generator_(tls_worker_generator) {
  tls_worker_info = info;
  tls_worker_generator = generator;
}

WorkerScope::~WorkerScope() {
  tls_worker_info = previous_info_;
  tls_worker_generator = previous_generator_;
}

}  // namespace detail
}  // namespace conveyor
