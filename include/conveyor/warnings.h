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

}  // namespace conveyor
