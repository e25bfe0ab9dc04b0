// conveyor/data_error.h: errors in the data itself, and what to do with them.
#pragma once

#include <cstdint>
#include <string>
#include <utility>

#include "conveyor/errors.h"

namespace conveyor {

// Malformed input: a truncated gzip, an IDX file with the wrong magic, a tar
// shard missing a member, a corrupt JPEG. Names where: the file, the member
// inside it (a tar entry, a sample key) and the sample index, when known.
class DataError : public Error {
 public:
  DataError(const std::string& what, std::string file, std::string member = {}, int64_t sample = -1)
      : Error(describe(what, file, member, sample)),
        reason_(what),
        file_(std::move(file)),
        member_(std::move(member)),
        sample_(sample) {}

  // What is wrong, without where (what() says both).
  const std::string& reason() const noexcept { return reason_; }
  const std::string& file() const noexcept { return file_; }
  const std::string& member() const noexcept { return member_; }
  int64_t sample() const noexcept { return sample_; }  // -1: not known

 private:
  static std::string describe(const std::string& what, const std::string& file,
                              const std::string& member, int64_t sample) {
    std::string text = file.empty() ? std::string("<memory>") : printable(file);
    if (!member.empty()) text += ", member '" + printable(member) + "'";
    if (sample >= 0) text += ", sample " + std::to_string(sample);
    return text + ": " + what;
  }

  // A NUL byte written as \0: what() is a C string, and a name holding one
  // (refused as a path) would cut the message short there.
  static std::string printable(const std::string& name) {
    std::string out;
    out.reserve(name.size());
    for (char c : name) {
      if (c == '\0') {
        out += "\\0";
      } else {
        out += c;
      }
    }
    return out;
  }

  std::string reason_;
  std::string file_;
  std::string member_;
  int64_t sample_;
};

// What a reader does with a sample it cannot read: raise a DataError (the
// default), or skip it and count it (readers expose the count as skipped()).
enum class OnError { raise, skip };

}  // namespace conveyor
