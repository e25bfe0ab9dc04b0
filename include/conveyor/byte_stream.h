// conveyor/byte_stream.h: bytes read front to back from wherever they live
// (a remote object, a pipe to a decompressor), for the readers that stream:
// untar and TarShardDataset read a shard through one when given an opener.
//
//   TarShardOptions options;
//   options.shards = expand_shard_pattern("http://host/train-{000000..000011}.tar");
//   options.open = nodes::http_opener();  // conveyor/nodes/http.h (conveyor::io)
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>

namespace conveyor {

class ByteStream {
 public:
  virtual ~ByteStream() = default;
  // Up to out.size() bytes into `out`, waiting for at least one; 0 only at
  // the end. Failures throw DataError naming the source.
  virtual size_t read(std::span<uint8_t> out) = 0;
  // The next bytes, read in place: a view of the stream's own buffer, valid
  // until the next call on the stream, which saves read()'s copy of every
  // byte. Empty only at the end; failures throw as read()'s do. A stream
  // with no buffer to lend keeps this default, std::nullopt from its first
  // call on, and its readers call read() instead.
  virtual std::optional<std::span<const uint8_t>> read_in_place() { return std::nullopt; }
  // The stream's length once known (an HTTP Content-Length, after the first
  // read): readers bound what a header may claim by it.
  virtual std::optional<uint64_t> size() const { return std::nullopt; }
};

// Opens `location` (a shard's path or URL) as a stream, or returns nullptr
// to leave it to the reader, which opens it as a local file. Throws
// DataError naming the location when it cannot be opened. Called on the
// thread that reads the shard: an opener shared by a loader's workers must
// be safe to call from several threads at once.
using StreamOpener = std::function<std::unique_ptr<ByteStream>(const std::string& location)>;

}  // namespace conveyor
