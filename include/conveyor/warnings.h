// conveyor/warnings.h: where conveyor's warnings go (PyTorch's warnings.warn).
#pragma once

#include <functional>
#include <string>

namespace conveyor {

using WarningHandler = std::function<void(const std::string& message)>;

// Replaces the handler and returns the previous one. The default prints
// "conveyor warning: <message>" to stderr. Thread-safe; the handler may be
// called from any thread.
WarningHandler set_warning_handler(WarningHandler handler);

// Sends `message` to the current handler.
void warn(const std::string& message);

namespace detail {
// warn(), the first time this process sees `message` (Python's default
// warnings filter: a repeated warning with the same text shows once).
void warn_once(const std::string& message);
}  // namespace detail

}  // namespace conveyor
