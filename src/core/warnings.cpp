#include "conveyor/warnings.h"

#include <iostream>
#include <mutex>
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

}  // namespace conveyor
