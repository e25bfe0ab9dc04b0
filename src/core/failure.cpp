#include "conveyor/detail/failure.h"

#include <string>
#include <utility>

namespace conveyor::detail {
namespace {

std::string describe(const std::exception_ptr& original) {
  try {
    std::rethrow_exception(original);
  } catch (const std::exception& e) {
    return e.what();
  } catch (...) {
    return "an exception of a type not derived from std::exception";
  }
}

std::string index_list(const std::vector<size_t>& indices) {
  constexpr size_t kShown = 16;  // enough to find the sample, short enough to read
  std::string text = "[";
  for (size_t i = 0; i < indices.size() && i < kShown; ++i) {
    if (i > 0) text += ", ";
    text += std::to_string(indices[i]);
  }
  if (indices.size() > kShown) text += ", ... (" + std::to_string(indices.size()) + " in all)";
  return text + "]";
}

}  // namespace

void throw_worker_error(std::exception_ptr original, FailureContext context) {
  std::string where = context.worker_id < 0
                          ? std::string("in the DataLoader's own thread")
                          : "in DataLoader worker " + std::to_string(context.worker_id);
  std::string message = "Caught exception " + where + " (" + context.stage + " of batch " +
                        std::to_string(context.batch_seq);
  if (!context.indices.empty()) message += ", sample indices " + index_list(context.indices);
  message += "): " + describe(original);
  try {
    std::rethrow_exception(original);
  } catch (...) {
    throw WorkerError(message, std::move(context));  // nests the original
  }
}

}  // namespace conveyor::detail
