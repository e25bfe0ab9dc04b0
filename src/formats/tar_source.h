// src/formats/tar_source.h: where a tar's bytes come from, for every tar
// reader (the untar node, which TarShardDataset reads through) and writer,
// internal.
#pragma once

#include <archive.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>
#include <memory>
#include <new>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

#include "conveyor/byte_stream.h"
#include "regular_file.h"

namespace conveyor::detail {

// ARCHIVE_WARN still delivers the entry; everything else but OK is a
// failure. ARCHIVE_RETRY (a damaged header, which libarchive would skip
// block by block to the next plausible one) ranks above WARN numerically, so
// `status < ARCHIVE_WARN` would let it through and lose members silently.
inline bool succeeded(int status) { return status == ARCHIVE_OK || status == ARCHIVE_WARN; }

inline std::string archive_reason(struct archive* archive) {
  const char* reason = archive != nullptr ? archive_error_string(archive) : nullptr;
  return reason != nullptr ? reason : "unknown libarchive error";
}

inline constexpr size_t kTarReadBlockBytes = 64 * 1024;  // what each read callback hands libarchive
inline constexpr size_t kTarBlockBytes = 512;

// Where a shard's bytes come from: a file read in 64 KiB blocks, a
// ByteStream (an HTTP body) read in place or in 64 KiB blocks, or memory.
// libarchive pulls them through read(). The source remembers how many bytes it
// handed out and whether the stream ended: libarchive accepts a tar that
// stops at a member boundary without its end-of-archive blocks, and these,
// with where the last entry ended, tell such a truncated shard from one
// that ends properly.
// A file's read() failed: its reason, and errno for libarchive.
struct ReadFailure : std::runtime_error {
  ReadFailure(const std::string& what, int error) : std::runtime_error(what), error_number(error) {}
  int error_number;
};

class TarSource {
 public:
  explicit TarSource(std::span<const uint8_t> bytes) : size_(bytes.size()), memory_(bytes) {}
  explicit TarSource(std::unique_ptr<ByteStream> stream) : stream_(std::move(stream)) {}
  ~TarSource() {
    if (fd_ >= 0) ::close(fd_);
  }
  TarSource(const TarSource&) = delete;
  TarSource& operator=(const TarSource&) = delete;

  // Opens `path` for reading. Returns the reason on failure, "" on success.
  // Only a regular file is a shard (see open_regular_file): /dev/zero would
  // read as an empty archive, its zero blocks being tar's end marker.
  std::string open_file(const std::string& path) {
    OpenedFile opened = open_regular_file(path);
    if (!opened.problem.empty() && (path.starts_with("http://") || path.starts_with("https://"))) {
      // Read as a local path, a URL fails with ENOENT: say what was missing.
      opened.problem += " (a URL is read through an opener: UntarOptions::open or TarShardOptions::open = "
                        "conveyor::nodes::http_opener(), in conveyor::io)";
    }
    if (opened.problem.starts_with("cannot ")) {
      return opened.problem.insert(opened.problem.find(':'), " shard");  // "cannot open shard: ..."
    }
    if (!opened.problem.empty()) return "cannot read shard: " + opened.problem;
    fd_ = opened.fd;
    size_ = opened.size;
    file_buffer_.resize(kTarReadBlockBytes);
    return {};
  }

  // Nothing may unwind through libarchive's C frames: the failure's text
  // becomes libarchive's error (a stream's DataError names its URL).
  static la_ssize_t read_callback(struct archive* archive, void* self, const void** block) {
    try {
      const uint8_t* bytes = nullptr;
      const size_t count = static_cast<TarSource*>(self)->next_block(&bytes);
      *block = bytes;
      return static_cast<la_ssize_t>(count);
    } catch (const std::bad_alloc&) {
      archive_set_error(archive, ENOMEM, "out of memory while reading");
    } catch (const ReadFailure& failure) {
      archive_set_error(archive, failure.error_number, "%s", failure.what());
    } catch (const std::exception& error) {
      archive_set_error(archive, EIO, "%s", error.what());
    } catch (...) {
      archive_set_error(archive, EIO, "unknown failure while reading");
    }
    return ARCHIVE_FATAL;
  }

  // The next block of the archive (0 bytes: its end), valid until the next
  // call. A failed read throws, its text naming the reason.
  size_t next_block(const uint8_t** block) {
    if (given_back_) {
      // Already counted when first read: handed out as they are.
      handed_back_ = std::move(*given_back_);
      given_back_.reset();
      *block = handed_back_.data();
      return handed_back_.size();
    }
    if (exhausted_) {
      // As libarchive alone does: nothing is read after the end (a growing
      // file, or a stream read again, would otherwise give more).
      *block = nullptr;
      return 0;
    }
    size_t count = 0;
    if (stream_) {
      count = next_stream_block(block);
    } else if (fd_ >= 0) {
      ssize_t got = 0;
      do {
        got = ::read(fd_, file_buffer_.data(), file_buffer_.size());
      } while (got < 0 && errno == EINTR);
      if (got < 0) {
        const int error_number = errno;
        throw ReadFailure("read failed: " + os_reason(error_number), error_number);
      }
      count = static_cast<size_t>(got);
      *block = file_buffer_.data();
    } else {
      count = std::min(kTarReadBlockBytes, memory_.size() - memory_offset_);
      *block = memory_.data() + memory_offset_;
      memory_offset_ += count;
    }
    remember(count);
    return count;
  }

  // Hands `bytes` (the unconsumed rest of what next_block() gave, copied)
  // back: the next call returns them first. `consumed` is how many bytes of
  // the archive came before them; ends_mid_archive() counts from there.
  void give_back(std::vector<uint8_t> bytes, uint64_t consumed) {
    given_back_ = std::move(bytes);
    consumed_before_ = consumed;
  }

  // Whether the reader has asked past the archive's last byte.
  bool exhausted() const noexcept { return exhausted_; }

  // An upper bound on any member's size, when the source's size is known.
  std::optional<uint64_t> size() const { return stream_ ? stream_->size() : size_; }

  // True when the stream ended exactly where the reader stopped consuming
  // (`consumed` bytes since the last give_back(), libarchive's count) with
  // no end-of-archive block after the last entry, whose header and padded
  // data ended at `last_entry_end` (same count). Not the last block's bytes:
  // a member's data may well end in a block of zeros.
  bool ends_mid_archive(int64_t consumed, int64_t last_entry_end) const {
    if (!exhausted_ || delivered_ == 0 || consumed < 0) return false;
    if (consumed_before_ + static_cast<uint64_t>(consumed) != delivered_) return false;
    return consumed - last_entry_end < static_cast<int64_t>(kTarBlockBytes);
  }

 private:
  // In place where the stream lends its buffer (an HTTP body: one copy of
  // every byte fewer), else read into ours.
  size_t next_stream_block(const uint8_t** block) {
    if (stream_lends_) {
      if (std::optional<std::span<const uint8_t>> lent = stream_->read_in_place()) {
        *block = lent->data();
        return lent->size();
      }
      stream_lends_ = false;
      file_buffer_.resize(kTarReadBlockBytes);
    }
    const size_t count = stream_->read(file_buffer_);
    *block = file_buffer_.data();
    return count;
  }

  void remember(size_t count) {
    if (count == 0) {
      exhausted_ = true;
      return;
    }
    delivered_ += count;
  }

  int fd_ = -1;
  std::unique_ptr<ByteStream> stream_;
  bool stream_lends_ = true;  // until its read_in_place() says otherwise
  std::optional<uint64_t> size_;
  std::vector<uint8_t> file_buffer_;  // files and streams
  std::span<const uint8_t> memory_;
  size_t memory_offset_ = 0;
  uint64_t delivered_ = 0;
  bool exhausted_ = false;
  std::optional<std::vector<uint8_t>> given_back_;  // handed out by the next next_block()
  std::vector<uint8_t> handed_back_;                // what it handed out, alive until the call after
  uint64_t consumed_before_ = 0;                    // of the archive, before what was given back
};

}  // namespace conveyor::detail
