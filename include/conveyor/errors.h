// conveyor/errors.h: the exceptions conveyor throws.
//
// The names follow the Python exception PyTorch raises for the same mistake
// (ValueError, TypeError, ...), so a message checked against PyTorch also
// checks the kind of error. Every conveyor exception derives from
// conveyor::Error, itself a std::runtime_error.
#pragma once

#include <cstddef>
#include <cstdint>
#include <exception>
#include <stdexcept>
#include <string>
#include <vector>

namespace conveyor {

class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// A bad value: an option out of range, lengths that do not add up.
class ValueError : public Error {
 public:
  using Error::Error;
};

// A call that does not fit the object: len() of an unsized dataset, a
// collate function that cannot take what the loader hands it.
class TypeError : public Error {
 public:
  using Error::Error;
};

// An index past the end of a dataset.
class IndexError : public Error {
 public:
  using Error::Error;
};

// A key missing from a mapping sample during collate.
class KeyError : public Error {
 public:
  using Error::Error;
};

// What LibTorch raises as c10::Error / Python's RuntimeError, e.g. an invalid
// multinomial distribution.
class RuntimeError : public Error {
 public:
  using Error::Error;
};

// Where a batch failed inside the loader: which worker, which batch, which
// samples. Carried from the worker to the consumer with the original error.
struct FailureContext {
  int worker_id = -1;  // -1: the consumer's own thread (num_workers == 0)
  uint64_t batch_seq = 0;
  std::vector<size_t> indices;  // sample indices of the batch; empty for iterable datasets
  std::string stage;            // "fetch", "collate", "worker_init_fn", ...
};

// An exception thrown by user code (dataset, collate, worker_init_fn, an
// iterable replica) while the loader produced a batch. Rethrown from the
// iterator at that batch's position; the original is nested:
// `std::rethrow_if_nested(e)` or `e.original()` gives it back.
class WorkerError : public Error, public std::nested_exception {
 public:
  // Must be constructed inside the catch block of the original exception,
  // which std::nested_exception captures.
  WorkerError(const std::string& what, FailureContext context)
      : Error(what), context_(std::move(context)) {}

  const FailureContext& context() const noexcept { return context_; }
  std::exception_ptr original() const noexcept { return nested_ptr(); }

 private:
  FailureContext context_;
};

// next() waited longer than the loader's `timeout`.
class TimeoutError : public Error {
 public:
  using Error::Error;
};

}  // namespace conveyor
