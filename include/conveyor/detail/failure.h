// conveyor/detail/failure.h: turning a caught exception into the
// WorkerError the consumer sees.
#pragma once

#include <exception>

#include "conveyor/errors.h"

namespace conveyor::detail {

// Rethrows `original` wrapped: a WorkerError whose message names the worker,
// the batch, the stage and the samples, with `original` nested.
[[noreturn]] void throw_worker_error(std::exception_ptr original, FailureContext context);

}  // namespace conveyor::detail
