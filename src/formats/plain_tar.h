// src/formats/plain_tar.h: the tar reader untar tries before libarchive
// (internal).
//
// libarchive reads every tar dialect, and pays for it on every member: it
// fills a whole archive_entry, widens the name to check for a trailing '/',
// and sums each header twice over. On W5's shards (two small members per
// sample) that was 1.9 µs per member on the consumer's thread, more than
// the rest of the pipeline's own work there. Most shards hold nothing but
// ustar or GNU headers of regular files, which this reader takes as
// libarchive does, field for field:
//
//   - the header's checksum, unsigned or (old writers) signed, its field
//     octal; a damaged header is "Damaged tar archive", a short one
//     "Truncated tar archive", as libarchive says;
//   - the name: ustar's prefix + '/' + name, GNU's name alone;
//   - the size, octal after optional blanks, and the padding to 512 bytes;
//   - symlinks, devices, FIFOs and directories are skipped with no data;
//   - a block of zeros ends the archive; so does the stream's end at a
//     header's place (ended_without_end_block(), which the caller checks).
//
// Anything else, from that header on, is libarchive's: pax and GNU
// extension headers, hard links, sparse and multi-volume members, GNU's
// sparse fields on any type, base-256 or negative sizes on any type, old
// (pre-POSIX) headers, unnamed members, and regular members named with a
// trailing '/' (libarchive's versions disagree on those).
// hand_over() gives libarchive the bytes from that header's first byte, so
// the archive is read as if libarchive had read it all. At the archive's
// first block the reader is stricter still (libarchive's format check:
// numeric fields in octal) and hands anything it doubts to libarchive's
// format detection, so a file that is not a tar fails as before.
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <new>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "tar_source.h"

namespace conveyor::detail {

// A damaged or truncated archive, in libarchive's words; the archive ends.
class PlainTarFailure : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

class PlainTarReader {
 public:
  enum class Next {
    member,     // a regular member: name() and size(); read_data() reads it
    end,        // a block of zeros, or the stream's end at a header's place
    hand_over,  // a header for libarchive: call hand_over()
  };

  explicit PlainTarReader(TarSource& source) : source_(source) {}
  PlainTarReader(const PlainTarReader&) = delete;
  PlainTarReader& operator=(const PlainTarReader&) = delete;

  // The next regular member's header. The previous member's data, unless
  // read, is skipped first (as libarchive skips it at its next header).
  // Throws PlainTarFailure.
  Next next() {
    skip(unread_ + padding_);
    unread_ = padding_ = 0;
    while (true) {
      header_start_ = consumed_;
      const uint8_t* header = take_header();
      if (header == nullptr) {
        if (at_start()) return Next::hand_over;  // empty or shorter than a block: libarchive says what it is
        if (header_bytes_ == 0) {  // the stream ended at a header's place
          stream_ended_ = true;
          return Next::end;
        }
        throw PlainTarFailure("Truncated tar archive");
      }
      if (header[0] == 0 && std::all_of(header, header + kTarBlockBytes, [](uint8_t b) { return b == 0; })) {
        return Next::end;
      }
      if (!checksum_valid(header)) {
        if (at_start()) return Next::hand_over;
        throw PlainTarFailure("Damaged tar archive");
      }
      switch (classify(header)) {
        case Kind::regular:
          name_ = member_name(header);
          // A "regular" member named like a directory: libarchive's
          // versions differ on whether its data follows.
          if (name_.empty() || name_.back() == '/') return Next::hand_over;
          unread_ = octal(header + kSizeOffset, kSizeLength);
          padding_ = (kTarBlockBytes - unread_ % kTarBlockBytes) % kTarBlockBytes;
          prefetch_next_header();
          return Next::member;
        case Kind::no_data:
          continue;
        case Kind::other:
          return Next::hand_over;
      }
    }
  }

  const std::string& name() const { return name_; }
  uint64_t size() const { return unread_; }

  // Appends the member's data to `out`, then consumes its padding. Throws
  // PlainTarFailure when the stream ends first.
  void read_data(std::vector<uint8_t>& out) {
    while (unread_ > 0) {
      if (!fill()) throw PlainTarFailure("Truncated tar archive");
      const size_t count = static_cast<size_t>(std::min<uint64_t>(unread_, static_cast<uint64_t>(end_ - next_)));
      out.insert(out.end(), next_, next_ + count);
      advance(count);
      unread_ -= count;
    }
    skip(std::exchange(padding_, 0));
  }

  // After next() returned hand_over: the unread bytes, from the header
  // that returned it, go back to the source for libarchive to read.
  void hand_over() {
    // In place, the header is still in the source's block, just before next_.
    std::vector<uint8_t> rest(header_in_place_ ? next_ - kTarBlockBytes : staging_.data(),
                              header_in_place_ ? next_ : staging_.data() + header_bytes_);
    rest.insert(rest.end(), next_, end_);
    next_ = end_ = nullptr;
    source_.give_back(std::move(rest), header_start_);
  }

  // Bytes of the archive consumed so far.
  uint64_t consumed() const { return consumed_; }
  // After next() returned end: the stream ended where a header should be,
  // with no end-of-archive block (a tar cut at a member boundary), rather
  // than at a block of zeros.
  bool ended_without_end_block() const { return stream_ended_; }

  // Whether the header just read is the archive's first.
  bool at_start() const { return header_start_ == 0; }

 private:
  enum class Kind { regular, no_data, other };

  static constexpr size_t kSizeOffset = 124;
  static constexpr size_t kSizeLength = 12;
  static constexpr size_t kChecksumOffset = 148;
  static constexpr size_t kChecksumLength = 8;
  static constexpr size_t kTypeOffset = 156;
  static constexpr size_t kMagicOffset = 257;
  static constexpr size_t kPrefixOffset = 345;
  static constexpr size_t kPrefixLength = 155;
  static constexpr size_t kGnuSparseOffset = 386;  // sparse[0].offset[0]
  static constexpr size_t kGnuExtendedOffset = 482;  // isextended
  static constexpr size_t kGnuRealSizeOffset = 483;

  // libarchive's tar_atol8: blanks, then octal digits up to the first other
  // character. The callers have ruled out base-256 and a sign.
  static uint64_t octal(const uint8_t* field, size_t length) {
    size_t i = 0;
    while (i < length && (field[i] == ' ' || field[i] == '\t')) ++i;
    uint64_t value = 0;
    for (; i < length && field[i] >= '0' && field[i] <= '7'; ++i) value = value * 8 + (field[i] - '0');
    return value;  // 12 digits at most: below 2^36, no overflow
  }

  static bool plain_number(const uint8_t* field, size_t length) {
    if ((field[0] & 0x80) != 0) return false;  // base-256
    size_t i = 0;
    while (i < length && (field[i] == ' ' || field[i] == '\t')) ++i;
    return i == length || field[i] != '-';
  }

  static bool checksum_valid(const uint8_t* header) {
    const uint8_t* field = header + kChecksumOffset;
    for (size_t i = 0; i < kChecksumLength; ++i) {
      if (field[i] != ' ' && field[i] != 0 && (field[i] < '0' || field[i] > '7')) return false;
    }
    const int64_t stored = static_cast<int64_t>(octal(field, kChecksumLength));
    // Summed whole (a loop the compiler vectorises), then the checksum
    // field's bytes swapped for the 8 blanks it counts as.
    uint32_t unsigned_sum = 0;
    for (size_t i = 0; i < kTarBlockBytes; ++i) unsigned_sum += header[i];
    for (size_t i = 0; i < kChecksumLength; ++i) unsigned_sum += ' ' - uint32_t{field[i]};
    if (stored == static_cast<int64_t>(unsigned_sum)) return true;
    int32_t signed_sum = 0;  // old writers summed signed chars
    for (size_t i = 0; i < kTarBlockBytes; ++i) signed_sum += static_cast<int8_t>(header[i]);
    for (size_t i = 0; i < kChecksumLength; ++i) signed_sum += ' ' - static_cast<int8_t>(field[i]);
    return stored == signed_sum;
  }

  // libarchive decides from an archive's first header whether it is a tar
  // at all, with checks its versions add to: the mode's first character,
  // and (3.6) every numeric field octal, padded with blanks or NULs. A
  // first header that fails any of them goes to libarchive's own check.
  static bool looks_like_tar_to_libarchive(const uint8_t* header) {
    const uint8_t mode = header[100];
    if (!(mode == 0 || mode == 255 || mode == ' ' || (mode >= '0' && mode <= '7'))) return false;
    constexpr std::array<std::pair<size_t, size_t>, 7> kNumbers{{
        {100, 8}, {108, 8}, {116, 8}, {kSizeOffset, kSizeLength}, {136, 12}, {329, 8}, {337, 8},
    }};  // mode, uid, gid, size, mtime, devmajor, devminor
    for (const auto& [offset, length] : kNumbers) {
      const uint8_t* field = header + offset;
      if (field[0] == 0 || field[0] == 128 || field[0] == 255) continue;  // base-256 or empty
      size_t i = 0;
      while (i < length && field[i] == ' ') ++i;
      while (i < length && field[i] >= '0' && field[i] <= '7') ++i;
      for (; i < length; ++i) {
        if (field[i] != ' ' && field[i] != 0) return false;
      }
    }
    return true;
  }

  static bool gnu_magic(const uint8_t* header) { return std::memcmp(header + kMagicOffset, "ustar  \0", 8) == 0; }

  Kind classify(const uint8_t* header) const {
    const bool gnu = gnu_magic(header);
    if (!gnu && std::memcmp(header + kMagicOffset, "ustar", 5) != 0) return Kind::other;  // pre-POSIX
    if (at_start() && !looks_like_tar_to_libarchive(header)) return Kind::other;
    // libarchive checks the size of every entry, whatever its type (a
    // negative or base-256 one may end the archive), and reads GNU's old
    // sparse map (and the blocks that extend it) for every type too.
    if (!plain_number(header + kSizeOffset, kSizeLength)) return Kind::other;
    if (gnu && (header[kGnuSparseOffset] != 0 || header[kGnuExtendedOffset] != 0 ||
                header[kGnuRealSizeOffset] != 0)) {
      return Kind::other;
    }
    switch (header[kTypeOffset]) {
      case '0':
      case '\0':
      case '7':  // contiguous file: a regular file to every reader
        return Kind::regular;
      case '2':  // symlink
      case '3':  // character device
      case '4':  // block device
      case '5':  // directory
      case '6':  // FIFO
        return Kind::no_data;  // libarchive sets their size to 0 whatever the header says
      default:
        return Kind::other;
    }
  }

  // libarchive's names: GNU's is the name field; ustar's is the prefix, a
  // '/' unless the prefix ends with one, and the name field (each up to its
  // first NUL).
  static std::string member_name(const uint8_t* header) {
    const auto field = [](const uint8_t* bytes, size_t length) {
      const auto* chars = reinterpret_cast<const char*>(bytes);
      return std::string_view(chars, ::strnlen(chars, length));
    };
    const std::string_view name = field(header, 100);
    if (gnu_magic(header)) return std::string(name);
    const std::string_view prefix = field(header + kPrefixOffset, kPrefixLength);
    if (prefix.empty()) return std::string(name);
    std::string joined(prefix);
    if (joined.back() != '/') joined += '/';
    joined += name;
    return joined;
  }

  // The next 512 bytes, in place or gathered across blocks; nullptr when the
  // stream ends first (header_bytes_ then says how many it had).
  const uint8_t* take_header() {
    header_bytes_ = 0;
    header_in_place_ = false;
    if (!fill()) return nullptr;
    if (end_ - next_ >= static_cast<std::ptrdiff_t>(kTarBlockBytes)) {
      const uint8_t* header = next_;
      header_bytes_ = kTarBlockBytes;
      header_in_place_ = true;
      advance(kTarBlockBytes);
      return header;
    }
    while (header_bytes_ < kTarBlockBytes) {
      if (!fill()) return nullptr;
      const size_t count = std::min(kTarBlockBytes - header_bytes_, static_cast<size_t>(end_ - next_));
      std::memcpy(staging_.data() + header_bytes_, next_, count);
      header_bytes_ += count;
      advance(count);
    }
    return staging_.data();
  }

  void skip(uint64_t count) {
    while (count > 0) {
      if (!fill()) throw PlainTarFailure("Truncated tar archive");
      const size_t step = static_cast<size_t>(std::min<uint64_t>(count, static_cast<uint64_t>(end_ - next_)));
      advance(step);
      count -= step;
    }
  }

  // A block with bytes left in it; false at the stream's end. A failed
  // read is a PlainTarFailure with the source's reason.
  bool fill() {
    if (next_ != end_) return true;
    try {
      const uint8_t* block = nullptr;
      const size_t count = source_.next_block(&block);
      next_ = block;
      end_ = block + count;
    } catch (const std::bad_alloc&) {
      throw PlainTarFailure("out of memory while reading");
    } catch (const std::exception& error) {
      throw PlainTarFailure(error.what());
    }
    return next_ != end_;
  }

  // A block lent in place (an HTTP body's) may have left the cache since
  // it arrived: the next header's lines are asked for while this member's
  // data is copied, instead of missed one by one in the checksum.
  void prefetch_next_header() const {
    const uint64_t ahead = unread_ + padding_;
    if (ahead + kTarBlockBytes > static_cast<uint64_t>(end_ - next_)) return;
    const uint8_t* header = next_ + ahead;
    for (size_t line = 0; line < kTarBlockBytes; line += 64) __builtin_prefetch(header + line);
  }

  void advance(size_t count) {
    next_ += count;
    consumed_ += count;
  }

  TarSource& source_;
  const uint8_t* next_ = nullptr;  // the unread bytes of the source's block
  const uint8_t* end_ = nullptr;
  uint64_t consumed_ = 0;      // of the archive
  bool stream_ended_ = false;  // next() met the stream's end at a header's place
  uint64_t header_start_ = 0;  // where the last header began
  size_t header_bytes_ = 0;                         // how much of it the stream held
  bool header_in_place_ = false;                    // in the source's block, else in staging_
  std::array<uint8_t, kTarBlockBytes> staging_{};  // a header that straddles two blocks
  std::string name_;
  uint64_t unread_ = 0;   // the member's data bytes not yet read
  uint64_t padding_ = 0;  // after them, to the next 512-byte boundary
};

}  // namespace conveyor::detail
