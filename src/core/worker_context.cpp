#include "conveyor/detail/worker_scope.h"

namespace conveyor {
namespace {
// Thread-local by nature: the innermost scope of the task this thread runs.
thread_local detail::WorkerScope* tls_scope = nullptr;
}  // namespace

const WorkerInfo* get_worker_info() noexcept { return tls_scope ? tls_scope->info() : nullptr; }

namespace detail {

Generator* current_worker_generator() {
  return tls_scope ? tls_scope->generator() : nullptr;
}

WorkerScope::WorkerScope(const WorkerInfo* info, Generator* generator) noexcept
    : info_(info), generator_(generator), previous_(tls_scope) {
  tls_scope = this;
}

WorkerScope::WorkerScope(const WorkerInfo* info, uint64_t lazy_seed) noexcept
    : info_(info), generator_(nullptr), lazy_seed_(lazy_seed), previous_(tls_scope) {
  tls_scope = this;
}

WorkerScope::~WorkerScope() { tls_scope = previous_; }

Generator* WorkerScope::generator() {
  if (generator_ == nullptr) {
    lazy_.emplace(Generator::for_item(lazy_seed_));
    generator_ = &*lazy_;
  }
  return generator_;
}

}  // namespace detail
}  // namespace conveyor
