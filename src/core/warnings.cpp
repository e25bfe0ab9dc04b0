#include "conveyor/warnings.h"

#include <iostream>
#include <mutex>
#include <set>
#include <utility>

namespace conveyor {
namespace {
std::mutex& handler_mutex() {
  static std::mutex mutex;
  return mutex;
}
WarningHandler& handler() {
  static WarningHandler current = [](const std::string& message) {
    std::cerr << "conveyor warning: " << message << std::endl;
  };
  return current;
}
}  // namespace

WarningHandler set_warning_handler(WarningHandler replacement) {
  std::lock_guard lock(handler_mutex());
  return std::exchange(handler(), std::move(replacement));
}

void warn(const std::string& message) {
  WarningHandler current;
  {
    std::lock_guard lock(handler_mutex());
    current = handler();
  }
  if (current) current(message);
}

namespace detail {
void warn_once(const std::string& message) {
  static std::mutex mutex;
  static std::set<std::string> seen;
  {
    std::lock_guard lock(mutex);
    if (seen.contains(message)) return;
  }
  // Recorded once shown: a handler raising it as an error (Python's "error"
  // filter) raises it every time. Two threads meeting it at once may both
  // show it; neither drops it.
  warn(message);
  std::lock_guard lock(mutex);
  seen.insert(message);
}
}  // namespace detail

}  // namespace conveyor
