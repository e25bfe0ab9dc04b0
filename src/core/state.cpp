// State: a JSON-like tree, its JSON text, and files that survive a crash.
#include "conveyor/state.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <unordered_set>

namespace conveyor {

namespace {

const char* type_name(const State& value) {
  if (value.is_null()) return "null";
  if (value.is_object()) return "an object";
  if (value.is_array()) return "an array";
  return "a value of another type";
}

[[noreturn]] void wrong_type(std::string_view what, std::string_view wanted, const State& value) {
  throw StateError("state: " + std::string(what) + " should be " + std::string(wanted) + ", but is " +
                   type_name(value) + " (" + value.to_json().substr(0, 80) + ")");
}

void append_escaped(std::string& out, const std::string& text) {
  out += '"';
  for (const char c : text) {
    const auto byte = static_cast<unsigned char>(c);
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\r': out += "\\r"; break;
      case '\t': out += "\\t"; break;
      default:
        if (byte < 0x20) {
          char escape[8];
          std::snprintf(escape, sizeof escape, "\\u%04x", byte);
          out += escape;
        } else {
          out += c;
        }
    }
  }
  out += '"';
}

// A recursive-descent JSON parser with a depth limit: a hostile file can make
// it throw, never overflow the stack.
class Parser {
 public:
  explicit Parser(std::string_view text) : text_(text) {}

  State parse_document() {
    State value = parse_value(0);
    skip_space();
    if (at_ != text_.size()) fail("text after the end of the value");
    return value;
  }

 private:
  static constexpr int kMaxDepth = 64;

  [[noreturn]] void fail(const std::string& why) const {
    throw StateError("state: not valid JSON at byte " + std::to_string(at_) + ": " + why);
  }
  void skip_space() {
    while (at_ < text_.size() && (text_[at_] == ' ' || text_[at_] == '\n' || text_[at_] == '\r' || text_[at_] == '\t')) {
      ++at_;
    }
  }
  bool consume(char c) {
    skip_space();
    if (at_ < text_.size() && text_[at_] == c) {
      ++at_;
      return true;
    }
    return false;
  }
  void expect(char c) {
    if (!consume(c)) fail(std::string("expected '") + c + "'");
  }
  bool literal(std::string_view word) {
    if (text_.substr(at_, word.size()) != word) return false;
    at_ += word.size();
    return true;
  }

  State parse_value(int depth) {
    if (depth > kMaxDepth) fail("nested deeper than " + std::to_string(kMaxDepth) + " levels");
    skip_space();
    if (at_ == text_.size()) fail("unexpected end");
    const char c = text_[at_];
    if (c == '{') return parse_object(depth);
    if (c == '[') return parse_array(depth);
    if (c == '"') return State(parse_string());
    if (literal("true")) return State(true);
    if (literal("false")) return State(false);
    if (literal("null")) return State();
    if (literal("NaN")) return State(std::numeric_limits<double>::quiet_NaN());
    if (literal("Infinity")) return State(std::numeric_limits<double>::infinity());
    if (literal("-Infinity")) return State(-std::numeric_limits<double>::infinity());
    if (c == '-' || (c >= '0' && c <= '9')) return parse_number();
    fail("unexpected character " + printable(c));
  }
  // A byte as a message can show it: a NUL would end the message there.
  static std::string printable(char c) {
    const auto byte = static_cast<unsigned char>(c);
    if (byte >= 0x20 && byte < 0x7F) return std::string("'") + c + "'";
    char text[8];
    std::snprintf(text, sizeof text, "\\x%02X", byte);
    return text;
  }

  State parse_object(int depth) {
    ++at_;
    State::Object members;
    if (consume('}')) return State(std::move(members));
    std::unordered_set<std::string> keys;  // a linear search would make n members cost n^2
    do {
      skip_space();
      if (at_ == text_.size() || text_[at_] != '"') fail("expected a member name");
      std::string key = parse_string();
      if (!keys.insert(key).second) fail("member '" + key + "' appears twice");
      expect(':');
      State value = parse_value(depth + 1);
      members.emplace_back(std::move(key), std::move(value));
    } while (consume(','));
    expect('}');
    return State(std::move(members));
  }

  // Non-negative integers are read straight into a packed list (8 bytes a
  // value, not a State's 40) until the first element of another kind.
  State parse_array(int depth) {
    ++at_;
    if (consume(']')) return State::array();
    if (depth + 1 > kMaxDepth) fail("nested deeper than " + std::to_string(kMaxDepth) + " levels");
    std::vector<uint64_t> integers;
    do {
      skip_space();
      if (parse_plain_uint(integers)) continue;
      State::Array items;
      items.reserve(integers.size() + 1);
      for (const uint64_t value : integers) items.emplace_back(value);
      std::vector<uint64_t>().swap(integers);
      items.push_back(parse_value(depth + 1));
      while (consume(',')) items.push_back(parse_value(depth + 1));
      expect(']');
      return State(std::move(items));
    } while (consume(','));
    expect(']');
    return State::list(std::move(integers));
  }

  // Appends the integer at at_ when it is one without sign, point or
  // exponent; otherwise leaves at_ where it was and returns false.
  bool parse_plain_uint(std::vector<uint64_t>& out) {
    if (at_ == text_.size() || text_[at_] < '0' || text_[at_] > '9') return false;
    const size_t start = at_;
    skip_digits();
    if (at_ < text_.size() && (text_[at_] == '.' || text_[at_] == 'e' || text_[at_] == 'E')) {
      at_ = start;
      return false;
    }
    if (text_[start] == '0' && at_ - start > 1) fail("a number with a leading zero");
    uint64_t value = 0;
    const char* last = text_.data() + at_;
    const auto [end, error] = std::from_chars(text_.data() + start, last, value);
    if (error != std::errc() || end != last) fail("an integer out of 64-bit range");
    out.push_back(value);
    return true;
  }

  std::string parse_string() {
    ++at_;  // the opening quote
    std::string out;
    while (true) {
      if (at_ >= text_.size()) fail("a string without its closing quote");
      const char c = text_[at_++];
      if (c == '"') return out;
      if (static_cast<unsigned char>(c) < 0x20) fail("a control character inside a string");
      if (c != '\\') {
        out += c;
        continue;
      }
      if (at_ >= text_.size()) fail("a string without its closing quote");
      const char escaped = text_[at_++];
      switch (escaped) {
        case '"': out += '"'; break;
        case '\\': out += '\\'; break;
        case '/': out += '/'; break;
        case 'b': out += '\b'; break;
        case 'f': out += '\f'; break;
        case 'n': out += '\n'; break;
        case 'r': out += '\r'; break;
        case 't': out += '\t'; break;
        case 'u': append_code_point(out); break;
        default: fail("an unknown escape after '\\': " + printable(escaped));
      }
    }
  }

  // \uXXXX (one UTF-16 unit; a surrogate pair is two) as UTF-8.
  void append_code_point(std::string& out) {
    auto hex4 = [this] {
      if (at_ + 4 > text_.size()) fail("a \\u escape cut short");
      unsigned value = 0;
      const auto [end, error] = std::from_chars(text_.data() + at_, text_.data() + at_ + 4, value, 16);
      if (error != std::errc() || end != text_.data() + at_ + 4) fail("a \\u escape that is not four hex digits");
      at_ += 4;
      return value;
    };
    unsigned code = hex4();
    if (code >= 0xd800 && code < 0xdc00) {
      if (!literal("\\u")) fail("a lone UTF-16 surrogate");
      const unsigned low = hex4();
      if (low < 0xdc00 || low >= 0xe000) fail("a lone UTF-16 surrogate");
      code = 0x10000 + ((code - 0xd800) << 10) + (low - 0xdc00);
    } else if (code >= 0xdc00 && code < 0xe000) {
      fail("a lone UTF-16 surrogate");
    }
    if (code < 0x80) {
      out += static_cast<char>(code);
    } else if (code < 0x800) {
      out += static_cast<char>(0xc0 | (code >> 6));
      out += static_cast<char>(0x80 | (code & 0x3f));
    } else if (code < 0x10000) {
      out += static_cast<char>(0xe0 | (code >> 12));
      out += static_cast<char>(0x80 | ((code >> 6) & 0x3f));
      out += static_cast<char>(0x80 | (code & 0x3f));
    } else {
      out += static_cast<char>(0xf0 | (code >> 18));
      out += static_cast<char>(0x80 | ((code >> 12) & 0x3f));
      out += static_cast<char>(0x80 | ((code >> 6) & 0x3f));
      out += static_cast<char>(0x80 | (code & 0x3f));
    }
  }

  // Integers keep 64 bits (int64 or uint64); anything with a fraction or an
  // exponent is a double.
  State parse_number() {
    const size_t start = at_;
    if (text_[at_] == '-') ++at_;
    // JSON's grammar: no leading zeros, digits after a point and in an
    // exponent.
    const size_t digits = at_;
    skip_digits();
    if (at_ == digits) fail("a number without digits");
    if (text_[digits] == '0' && at_ - digits > 1) fail("a number with a leading zero");
    bool integral = true;
    if (at_ < text_.size() && text_[at_] == '.') {
      integral = false;
      ++at_;
      if (!skip_digits()) fail("a number without digits after its point");
    }
    if (at_ < text_.size() && (text_[at_] == 'e' || text_[at_] == 'E')) {
      integral = false;
      ++at_;
      if (at_ < text_.size() && (text_[at_] == '+' || text_[at_] == '-')) ++at_;
      if (!skip_digits()) fail("a number without digits in its exponent");
    }
    const char* first = text_.data() + start;
    const char* last = text_.data() + at_;
    if (integral) {
      if (*first == '-') {
        int64_t value = 0;
        const auto [end, error] = std::from_chars(first, last, value);
        if (error == std::errc() && end == last) return State(value);
      } else {
        uint64_t value = 0;
        const auto [end, error] = std::from_chars(first, last, value);
        if (error == std::errc() && end == last) return State(value);
      }
      fail("an integer out of 64-bit range");
    }
    // from_chars: the same in every locale (strtod reads "0,5" under some).
    double value = 0;
    const auto [end, error] = std::from_chars(first, last, value);
    if (error != std::errc() || end != last) fail("a number out of a double's range");
    return State(value);
  }
  bool skip_digits() {
    const size_t start = at_;
    while (at_ < text_.size() && text_[at_] >= '0' && text_[at_] <= '9') ++at_;
    return at_ > start;
  }

  std::string_view text_;
  size_t at_ = 0;
};

}  // namespace

// ---- packed lists ------------------------------------------------------------

// Moves and assignments are not concurrent with anything (as on any
// object): relaxed is enough there. Only unpacked() races with itself.
State::PackedUints::PackedUints(PackedUints&& other) noexcept
    : values_(std::move(other.values_)), unpacked_(other.unpacked_.exchange(nullptr, std::memory_order_relaxed)) {
  other.values_.clear();
}
State::PackedUints& State::PackedUints::operator=(const PackedUints& other) {
  if (this != &other) *this = PackedUints(other);
  return *this;
}
State::PackedUints& State::PackedUints::operator=(PackedUints&& other) noexcept {
  if (this != &other) {
    values_ = std::move(other.values_);
    other.values_.clear();
    delete unpacked_.exchange(other.unpacked_.exchange(nullptr, std::memory_order_relaxed),
                              std::memory_order_relaxed);
  }
  return *this;
}
State::PackedUints::~PackedUints() { delete unpacked_.load(std::memory_order_relaxed); }

const State::Array& State::PackedUints::unpacked() const {
  // Acquire pairs with the release of the compare-exchange below: a caller
  // that sees the pointer sees the States written before it was published.
  if (const Array* made = unpacked_.load(std::memory_order_acquire)) return *made;
  auto fresh = std::make_unique<Array>();
  fresh->reserve(values_.size());
  for (const uint64_t value : values_) fresh->emplace_back(value);
  const Array* expected = nullptr;
  // Release publishes the States; on losing the race, acquire reads the
  // winner's (this caller's copy is dropped).
  if (unpacked_.compare_exchange_strong(expected, fresh.get(), std::memory_order_acq_rel,
                                        std::memory_order_acquire)) {
    return *fresh.release();
  }
  return *expected;
}

State State::list(const std::vector<uint64_t>& values) { return State(PackedUints(values)); }
State State::list(std::vector<uint64_t>&& values) { return State(PackedUints(std::move(values))); }

State& State::set(std::string_view key, State value) {
  if (is_null()) value_ = Object{};
  auto* object = std::get_if<Object>(&value_);
  if (!object) wrong_type(key, "an object", *this);
  for (Member& member : *object) {
    if (member.first == key) {
      member.second = std::move(value);
      return member.second;
    }
  }
  object->emplace_back(std::string(key), std::move(value));
  return object->back().second;
}

const State* State::find(std::string_view key) const noexcept {
  const auto* object = std::get_if<Object>(&value_);
  if (!object) return nullptr;
  for (const Member& member : *object) {
    if (member.first == key) return &member.second;
  }
  return nullptr;
}

const State& State::at(std::string_view key) const {
  if (!is_object()) wrong_type("the parent of '" + std::string(key) + "'", "an object", *this);
  const State* found = find(key);
  if (!found) throw StateError("state: the field '" + std::string(key) + "' is missing");
  return *found;
}

const State::Object& State::members() const {
  const auto* object = std::get_if<Object>(&value_);
  if (!object) wrong_type("value", "an object", *this);
  return *object;
}

State& State::push_back(State value) {
  if (is_null()) value_ = Array{};
  // A packed list becomes an array of States: push_back hands out a
  // reference to the new item, which a packed integer cannot be.
  if (const auto* packed = std::get_if<PackedUints>(&value_)) {
    Array items = packed->unpacked();
    value_ = std::move(items);
  }
  auto* array = std::get_if<Array>(&value_);
  if (!array) wrong_type("value", "an array", *this);
  array->push_back(std::move(value));
  return array->back();
}

const State::Array& State::items() const {
  if (const auto* packed = std::get_if<PackedUints>(&value_)) return packed->unpacked();
  const auto* array = std::get_if<Array>(&value_);
  if (!array) wrong_type("value", "an array", *this);
  return *array;
}

size_t State::size() const {
  if (const auto* array = std::get_if<Array>(&value_)) return array->size();
  if (const auto* packed = std::get_if<PackedUints>(&value_)) return packed->values().size();
  if (const auto* object = std::get_if<Object>(&value_)) return object->size();
  wrong_type("value", "an array or an object", *this);
}

bool State::as_bool(std::string_view what) const {
  if (const bool* value = std::get_if<bool>(&value_)) return *value;
  wrong_type(what, "true or false", *this);
}

int64_t State::as_int(std::string_view what) const {
  if (const auto* value = std::get_if<int64_t>(&value_)) return *value;
  if (const auto* value = std::get_if<uint64_t>(&value_)) {
    if (*value <= static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) return static_cast<int64_t>(*value);
  }
  wrong_type(what, "an integer in int64's range", *this);
}

uint64_t State::as_uint(std::string_view what) const {
  if (const auto* value = std::get_if<uint64_t>(&value_)) return *value;
  if (const auto* value = std::get_if<int64_t>(&value_)) {
    if (*value >= 0) return static_cast<uint64_t>(*value);
  }
  wrong_type(what, "a non-negative integer", *this);
}

double State::as_double(std::string_view what) const {
  if (const auto* value = std::get_if<double>(&value_)) return *value;
  if (const auto* value = std::get_if<int64_t>(&value_)) return static_cast<double>(*value);
  if (const auto* value = std::get_if<uint64_t>(&value_)) return static_cast<double>(*value);
  wrong_type(what, "a number", *this);
}

const std::string& State::as_string(std::string_view what) const {
  if (const auto* value = std::get_if<std::string>(&value_)) return *value;
  wrong_type(what, "a string", *this);
}

std::vector<uint64_t> State::as_uint_list(std::string_view what) const {
  if (const auto* packed = std::get_if<PackedUints>(&value_)) return packed->values();
  const auto* array = std::get_if<Array>(&value_);
  if (!array) wrong_type(what, "an array of non-negative integers", *this);
  std::vector<uint64_t> values;
  values.reserve(array->size());
  for (const State& item : *array) values.push_back(item.as_uint(what));
  return values;
}

bool operator==(const State& a, const State& b) {
  // Integers compare by value whether stored signed or unsigned.
  const bool a_int = std::holds_alternative<int64_t>(a.value_) || std::holds_alternative<uint64_t>(a.value_);
  const bool b_int = std::holds_alternative<int64_t>(b.value_) || std::holds_alternative<uint64_t>(b.value_);
  if (a_int && b_int) {
    const bool a_neg = std::holds_alternative<int64_t>(a.value_) && std::get<int64_t>(a.value_) < 0;
    const bool b_neg = std::holds_alternative<int64_t>(b.value_) && std::get<int64_t>(b.value_) < 0;
    if (a_neg || b_neg) return a_neg && b_neg && std::get<int64_t>(a.value_) == std::get<int64_t>(b.value_);
    return a.as_uint() == b.as_uint();
  }
  const auto* a_packed = std::get_if<State::PackedUints>(&a.value_);
  const auto* b_packed = std::get_if<State::PackedUints>(&b.value_);
  if (a_packed && b_packed) return *a_packed == *b_packed;
  if ((a_packed || b_packed) && a.is_array() && b.is_array()) {
    // A packed list against an array of States: item by item, without
    // making the packed one's States.
    const std::vector<uint64_t>& values = (a_packed ? a_packed : b_packed)->values();
    const State::Array& items = (a_packed ? b : a).items();
    if (values.size() != items.size()) return false;
    for (size_t i = 0; i < values.size(); ++i) {
      if (!(State(values[i]) == items[i])) return false;
    }
    return true;
  }
  return a.value_ == b.value_;
}

void State::write_json(std::string& out) const {
  if (is_null()) {
    out += "null";
  } else if (is_object()) {
    out += '{';
    bool first = true;
    for (const Member& member : members()) {
      if (!first) out += ',';
      first = false;
      append_escaped(out, member.first);
      out += ':';
      member.second.write_json(out);
    }
    out += '}';
  } else if (const auto* packed = std::get_if<PackedUints>(&value_)) {
    out += '[';
    char text[24];
    bool first = true;
    for (const uint64_t value : packed->values()) {
      if (!first) out += ',';
      first = false;
      out.append(text, std::to_chars(text, text + sizeof text, value).ptr);
    }
    out += ']';
  } else if (is_array()) {
    out += '[';
    bool first = true;
    for (const State& item : items()) {
      if (!first) out += ',';
      first = false;
      item.write_json(out);
    }
    out += ']';
  } else {
    out += to_json();
  }
}

std::string State::to_json() const {
  std::string out;
  if (const bool* value = std::get_if<bool>(&value_)) return *value ? "true" : "false";
  if (const auto* value = std::get_if<int64_t>(&value_)) return std::to_string(*value);
  if (const auto* value = std::get_if<uint64_t>(&value_)) return std::to_string(*value);
  if (const auto* value = std::get_if<double>(&value_)) {
    // JSON has no inf or NaN: written as Python's json module writes them
    // (and from_json reads them), so a state round-trips whatever it holds
    // (a diverged run's loss was written as null, and never read back).
    if (std::isnan(*value)) return "NaN";
    if (std::isinf(*value)) return *value > 0 ? "Infinity" : "-Infinity";
    // to_chars: the shortest text that reads back the same, in every locale.
    char text[64];
    const auto [end, error] = std::to_chars(text, text + sizeof text, *value);
    out.assign(text, error == std::errc() ? end : text);
    // Keep it a double when read back.
    if (out.find_first_of(".eE") == std::string::npos) out += ".0";
    return out;
  }
  if (const auto* value = std::get_if<std::string>(&value_)) {
    append_escaped(out, *value);
    return out;
  }
  write_json(out);
  return out;
}

State State::from_json(std::string_view text) { return Parser(text).parse_document(); }

// ---- the envelope ----------------------------------------------------------

State state_envelope(std::string_view kind, State fingerprint) {
  State state = State::object();
  state.set("format", std::string(kind));
  state.set("version", uint64_t{1});
  state.set("fingerprint", std::move(fingerprint));
  return state;
}

namespace {
void compare_fingerprints(const State& saved, const State& mine, const std::string& path, std::string_view what) {
  if (saved.is_object() && mine.is_object()) {
    for (const State::Member& member : mine.members()) {
      const State* other = saved.find(member.first);
      const std::string field = path.empty() ? member.first : path + "." + member.first;
      if (!other) {
        throw StateError(std::string(what) + ": the saved state has no fingerprint field '" + field +
                         "' (this one has " + member.second.to_json() + ")");
      }
      compare_fingerprints(*other, member.second, field, what);
    }
    for (const State::Member& member : saved.members()) {
      if (!mine.contains(member.first)) {
        const std::string field = path.empty() ? member.first : path + "." + member.first;
        throw StateError(std::string(what) + ": the saved state's fingerprint has a field '" + field +
                         "' (" + member.second.to_json() + ") that this one lacks");
      }
    }
    return;
  }
  if (!(saved == mine)) {
    throw StateError(std::string(what) + ": '" + path + "' does not match: the state was saved with " +
                     saved.to_json() + ", this one has " + mine.to_json());
  }
}
}  // namespace

void check_state_envelope(const State& state, std::string_view kind, const State& fingerprint,
                          std::string_view what) {
  if (!state.is_object()) throw StateError(std::string(what) + ": a state is a JSON object, not " + state.to_json().substr(0, 40));
  const State* format = state.find("format");
  if (!format || format->to_json() != State(std::string(kind)).to_json()) {
    throw StateError(std::string(what) + ": this is not a " + std::string(kind) + " state (its format is " +
                     (format ? format->to_json() : std::string("missing")) + ")");
  }
  const uint64_t version = state.uint_at("version");
  if (version != 1) {
    throw StateError(std::string(what) + ": state version " + std::to_string(version) +
                     " is not one this conveyor reads (it reads version 1)");
  }
  compare_fingerprints(state.at("fingerprint"), fingerprint, "", what);
}

// ---- files -----------------------------------------------------------------

namespace {
[[noreturn]] void io_error(const std::string& what, const std::string& path, int error) {
  throw RuntimeError(what + " " + path + ": " + std::strerror(error));
}

void write_all(int fd, const std::string& text, const std::string& path) {
  size_t written = 0;
  while (written < text.size()) {
    const ssize_t n = ::write(fd, text.data() + written, text.size() - written);
    if (n < 0) {
      if (errno == EINTR) continue;
      io_error("save_state_file: cannot write", path, errno);
    }
    written += static_cast<size_t>(n);
  }
}

std::string directory_of(const std::string& path) {
  const size_t slash = path.find_last_of('/');
  if (slash == std::string::npos) return ".";
  if (slash == 0) return "/";
  return path.substr(0, slash);
}
}  // namespace

void save_state_file(const std::string& path, const State& state) {
  const std::string text = state.to_json() + "\n";
  // A name of this call's own, created exclusively and never through a
  // link: two threads (or processes) saving the same path each write their
  // own file, and a planted symlink is not followed.
  static std::atomic<uint64_t> calls{0};
  const std::string temporary = path + ".tmp." + std::to_string(::getpid()) + "." + std::to_string(++calls);
  const int fd = ::open(temporary.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0644);
  if (fd < 0) io_error("save_state_file: cannot create", temporary, errno);
  try {
    write_all(fd, text, temporary);
    if (::fsync(fd) != 0) io_error("save_state_file: cannot fsync", temporary, errno);
  } catch (...) {
    ::close(fd);
    ::unlink(temporary.c_str());
    throw;
  }
  if (::close(fd) != 0) {
    const int error = errno;
    ::unlink(temporary.c_str());
    io_error("save_state_file: cannot close", temporary, error);
  }
  if (::rename(temporary.c_str(), path.c_str()) != 0) {
    const int error = errno;
    ::unlink(temporary.c_str());
    io_error("save_state_file: cannot rename the temporary file to", path, error);
  }
  // The rename is durable once the directory is.
  const std::string directory = directory_of(path);
  const int dir = ::open(directory.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dir < 0) io_error("save_state_file: cannot open the directory", directory, errno);
  const int synced = ::fsync(dir);
  const int error = errno;
  ::close(dir);
  if (synced != 0) io_error("save_state_file: cannot fsync the directory", directory, error);
}

State load_state_file(const std::string& path) {
  constexpr off_t kMaxBytes = off_t{256} << 20;
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK);
  if (fd < 0) {
    const int error = errno;
    if (error == ELOOP) throw StateError("load_state_file: " + path + " is a symbolic link (or its path holds too many), not a state file");
    io_error("load_state_file: cannot open", path, error);
  }
  struct Close {
    int fd;
    ~Close() { ::close(fd); }
  } close_fd{fd};
  struct stat info{};
  if (::fstat(fd, &info) != 0) io_error("load_state_file: cannot stat", path, errno);
  if (!S_ISREG(info.st_mode)) throw StateError("load_state_file: " + path + " is not a regular file");
  if (info.st_size > kMaxBytes) {
    throw StateError("load_state_file: " + path + " has " + std::to_string(info.st_size) +
                     " bytes; a state file is at most 256 MiB");
  }
  std::string text(static_cast<size_t>(info.st_size), '\0');
  size_t read_bytes = 0;
  while (read_bytes < text.size()) {
    const ssize_t n = ::read(fd, text.data() + read_bytes, text.size() - read_bytes);
    if (n < 0) {
      if (errno == EINTR) continue;
      io_error("load_state_file: cannot read", path, errno);
    }
    if (n == 0) break;  // shrank while read: the parser says what is missing
    read_bytes += static_cast<size_t>(n);
  }
  text.resize(read_bytes);
  try {
    return State::from_json(text);
  } catch (const StateError& error) {
    throw StateError("load_state_file: " + path + ": " + error.what());
  }
}

}  // namespace conveyor
