// conveyor/state.h: what a checkpoint holds. A loader's or a pipeline's
// position (DataLoader::state_dict(), Pipeline::state()) is a State: a small
// JSON-like tree, written as JSON text.
//
// JSON, not a binary format: a checkpoint is small (counts, seeds, generator
// states; never the data), a person debugging a resume can read and diff
// it, and any language can inspect it. Integers keep all 64 bits (seeds).
//
// Every state a loader or pipeline writes carries an envelope:
//   {"format": "conveyor.DataLoader", "version": 1,
//    "fingerprint": {...what must match...}, ...}
// Loading checks the format and version, then compares the fingerprint field
// by field: a mismatch is a StateError naming the field and both values.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <string_view>
#include <utility>
#include <variant>
#include <vector>

#include "conveyor/errors.h"

namespace conveyor {

// A state that cannot be read or does not fit what loads it.
class StateError : public ValueError {
 public:
  using ValueError::ValueError;
};

class State {
 public:
  using Array = std::vector<State>;
  using Member = std::pair<std::string, State>;
  // Members in insertion order: the JSON text reads in the order written.
  using Object = std::vector<Member>;

  State() = default;  // null
  State(bool value) : value_(value) {}  // NOLINT: implicit, as JSON values are
  State(int value) : value_(static_cast<int64_t>(value)) {}
  State(unsigned value) : value_(static_cast<uint64_t>(value)) {}
  State(int64_t value) : value_(value) {}
  State(uint64_t value) : value_(value) {}
  State(double value) : value_(value) {}
  State(const char* value) : value_(std::string(value)) {}
  State(std::string value) : value_(std::move(value)) {}
  State(Array value) : value_(std::move(value)) {}
  State(Object value) : value_(std::move(value)) {}

  static State object() { return State(Object{}); }
  static State array() { return State(Array{}); }
  // An array of unsigned integers, kept packed: 8 bytes a value where a
  // State is 40 (a decision log holds up to 2^26 of them). from_json packs
  // every array of non-negative integers the same way.
  static State list(const std::vector<uint64_t>& values);
  static State list(std::vector<uint64_t>&& values);

  bool is_null() const noexcept { return std::holds_alternative<std::monostate>(value_); }
  bool is_object() const noexcept { return std::holds_alternative<Object>(value_); }
  bool is_array() const noexcept {
    return std::holds_alternative<Array>(value_) || std::holds_alternative<PackedUints>(value_);
  }

  // Objects. set() replaces a member of that name or appends one.
  State& set(std::string_view key, State value);
  bool contains(std::string_view key) const noexcept { return find(key) != nullptr; }
  // Throws StateError naming the missing key.
  const State& at(std::string_view key) const;
  const State* find(std::string_view key) const noexcept;
  const Object& members() const;

  // Arrays. items() of a packed list (list(), or integers read by
  // from_json) makes its States once, at the first call; a push_back()
  // invalidates what it returned, as a vector's would.
  State& push_back(State value);
  const Array& items() const;
  size_t size() const;  // of an array or an object

  // Values; each throws StateError when the value is of another type (or an
  // integer out of range). `what` names the value in that message.
  bool as_bool(std::string_view what = "value") const;
  int64_t as_int(std::string_view what = "value") const;
  uint64_t as_uint(std::string_view what = "value") const;
  double as_double(std::string_view what = "value") const;
  const std::string& as_string(std::string_view what = "value") const;
  std::vector<uint64_t> as_uint_list(std::string_view what = "value") const;

  // Shorthands: at(key).as_uint(key), ...
  uint64_t uint_at(std::string_view key) const { return at(key).as_uint(key); }
  int64_t int_at(std::string_view key) const { return at(key).as_int(key); }
  bool bool_at(std::string_view key) const { return at(key).as_bool(key); }
  const std::string& string_at(std::string_view key) const { return at(key).as_string(key); }

  // Compact JSON text.
  std::string to_json() const;
  // Parses JSON text (at most 64 levels deep). Throws StateError saying
  // where the text went wrong.
  static State from_json(std::string_view text);

  friend bool operator==(const State& a, const State& b);

 private:
  // An array of non-negative integers as the integers themselves. The
  // States items() hands out are made on its first call, by whichever
  // caller gets there (concurrent const calls are safe, as on a vector).
  class PackedUints {
   public:
    explicit PackedUints(std::vector<uint64_t> values) noexcept : values_(std::move(values)) {}
    PackedUints(const PackedUints& other) : values_(other.values_) {}
    PackedUints(PackedUints&& other) noexcept;
    PackedUints& operator=(const PackedUints& other);
    PackedUints& operator=(PackedUints&& other) noexcept;
    ~PackedUints();

    const std::vector<uint64_t>& values() const noexcept { return values_; }
    const Array& unpacked() const;
    friend bool operator==(const PackedUints& a, const PackedUints& b) { return a.values_ == b.values_; }

   private:
    std::vector<uint64_t> values_;
    mutable std::atomic<const Array*> unpacked_{nullptr};  // owned; null until items()
  };
  explicit State(PackedUints value) : value_(std::move(value)) {}
  void write_json(std::string& out) const;

  std::variant<std::monostate, bool, int64_t, uint64_t, double, std::string, Array, Object, PackedUints> value_;
};

// The envelope's checks. `kind` is "conveyor.DataLoader" or
// "conveyor.Pipeline"; `what` names the loading call in messages.
State state_envelope(std::string_view kind, State fingerprint);
void check_state_envelope(const State& state, std::string_view kind, const State& fingerprint,
                          std::string_view what);

// Writes `state` to `path` so that a crash at any moment leaves either the
// old file or the new one, whole: a temporary file beside it, fsync, rename,
// fsync of the directory. Throws RuntimeError naming the path and errno's text.
void save_state_file(const std::string& path, const State& state);
// Reads a state saved by save_state_file. A path that is not a regular file,
// a file over 256 MiB, or text that is not JSON is a StateError naming it.
State load_state_file(const std::string& path);

}  // namespace conveyor
