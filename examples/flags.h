// The examples' integer flags, read whole: decimal digits only (a leading
// '-' for a signed type), no overflow, within [minimum, maximum]. atoi and
// strtol take "", "2x" and "abc" as numbers and wrap or clamp what does not
// fit; a flag read here is that number or a FlagError naming flag and text.
#pragma once

#include <charconv>
#include <concepts>
#include <cstring>
#include <limits>
#include <optional>
#include <stdexcept>
#include <string>

namespace conveyor::examples {

// A flag's value that is not what the flag takes: the message names both.
// The programs catch it in their parsing and print it with their usage.
class FlagError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// `text` as a T within [minimum, maximum]; nullopt for anything else:
// empty, not all digits, or out of range (of T too).
template <std::integral T>
std::optional<T> parse_integer(const char* text, T minimum, T maximum) {
  const char* const end = text + std::strlen(text);
  T value{};
  const auto [stop, error] = std::from_chars(text, end, value);
  if (error != std::errc() || stop != end || value < minimum || value > maximum) return std::nullopt;
  return value;
}

// `text`, the value of flag `name`, as a T within [minimum, maximum].
// Throws FlagError naming the flag, the range and the text.
template <std::integral T>
T integer_flag(const std::string& name, const char* text, T minimum, T maximum = std::numeric_limits<T>::max()) {
  if (const std::optional<T> value = parse_integer(text, minimum, maximum)) return *value;
  throw FlagError(name + " needs an integer from " + std::to_string(minimum) + " to " + std::to_string(maximum) +
                  ", got '" + text + "'");
}

}  // namespace conveyor::examples
