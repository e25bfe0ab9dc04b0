// The IDX reader: one read (gzip streamed through zlib), one buffer, items as views.
#include "conveyor/idx.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstdio>
#include <filesystem>
#include <limits>
#include <new>
#include <optional>
#include <stdexcept>
#include <system_error>
#include <utility>

#include "conveyor/data_error.h"
#include "conveyor/errors.h"
#include "regular_file.h"

namespace conveyor {
namespace {

using detail::open_regular_file;
using detail::OpenedFile;
using detail::os_reason;

constexpr uint8_t kGzipMagic0 = 0x1f;
constexpr uint8_t kGzipMagic1 = 0x8b;
constexpr uint8_t kUnsignedByteType = 0x08;
constexpr size_t kIdxMagicBytes = 4;  // 0x00 0x00 <type> <dimension count>
constexpr size_t kDimensionBytes = 4;
constexpr size_t kMaxIdxHeaderBytes = kIdxMagicBytes + 255 * kDimensionBytes;
// The gzip trailer's size is believed up to this many bytes per compressed
// byte (MNIST compresses about 2:1; deflate's limit is about 1032:1), so a
// corrupt trailer cannot make a small file allocate gigabytes up front; a
// file that really expands more grows its buffer as the data comes.
constexpr uint64_t kMaxTrustedRatio = 64;
constexpr size_t kGzipTrailerBytes = 8;  // CRC32, ISIZE
constexpr size_t kMinimumOutputBytes = 4096;

std::string hex_byte(uint8_t value) {
  char text[8];
  std::snprintf(text, sizeof text, "0x%02X", static_cast<unsigned>(value));
  return text;
}

// Bytes per element of an IDX type code; 0 for codes the format does not define.
size_t element_size(uint8_t type_code) {
  switch (type_code) {
    case 0x08:  // unsigned byte
    case 0x09:  // signed byte
      return 1;
    case 0x0B:  // int16
      return 2;
    case 0x0C:  // int32
    case 0x0D:  // float32
      return 4;
    case 0x0E:  // float64
      return 8;
    default:
      return 0;
  }
}

std::string type_name(uint8_t type_code) {
  switch (type_code) {
    case 0x08:
      return "unsigned byte (0x08)";
    case 0x09:
      return "signed byte (0x09)";
    case 0x0B:
      return "int16 (0x0B)";
    case 0x0C:
      return "int32 (0x0C)";
    case 0x0D:
      return "float32 (0x0D)";
    case 0x0E:
      return "float64 (0x0E)";
    default:
      return "type " + hex_byte(type_code);
  }
}

bool is_gzip(std::span<const uint8_t> bytes) {
  return bytes.size() >= 2 && bytes[0] == kGzipMagic0 && bytes[1] == kGzipMagic1;
}

// What to allocate before inflating: the ISIZE trailer of the last member
// (the uncompressed size mod 2^32) when it is plausible, else a guess. Only
// a hint; the output grows when it is wrong, and never past what the IDX
// header declares.
size_t initial_output_size(uint64_t compressed_bytes, std::optional<uint32_t> trailer_isize) {
  const uint64_t ceiling = compressed_bytes * kMaxTrustedRatio;
  const uint64_t hint = trailer_isize ? *trailer_isize : compressed_bytes * 4;
  // One spare byte: the reader asks for one byte past the declared size to
  // see whether the data goes on, so an exact hint would regrow at the end.
  return static_cast<size_t>(std::max<uint64_t>(std::min(hint, ceiling) + 1, kMinimumOutputBytes));
}

// The compressed bytes, from memory or from a file. A file is read a chunk
// at a time as the inflater asks, so what lies after the data's end (a
// sparse tail of gigabytes, say) is never read whole: only enough of it to
// tell another gzip member from trailing garbage.
class CompressedInput {
 public:
  explicit CompressedInput(std::span<const uint8_t> bytes)
      : window_(bytes), total_bytes_(bytes.size()) {}

  // `start`: the file's first bytes, already read from `fd`, which is left
  // at the offset just past them; `file_bytes` is fstat's size and
  // `stored_bytes` what the file system holds of it (st_blocks).
  CompressedInput(int fd, std::vector<uint8_t> start, uint64_t file_bytes, uint64_t stored_bytes,
                  const std::string& path)
      : fd_(fd), path_(&path), buffer_(std::move(start)), total_bytes_(file_bytes), stored_bytes_(stored_bytes) {
    window_ = buffer_;
  }

  // Bytes not yet consumed that are at hand now.
  std::span<const uint8_t> available() const noexcept { return window_; }

  void consume(size_t count) noexcept {
    window_ = window_.subspan(count);
    consumed_ += count;
  }

  // Makes at least `count` bytes available, reading more of the file if it
  // must; false when the input ends with fewer.
  bool ensure(size_t count) {
    while (window_.size() < count && fd_ >= 0 && !end_of_file_) {
      // Keep the unconsumed bytes, then read a chunk after them.
      std::vector<uint8_t> refilled(window_.size() + kReadChunkBytes);
      std::copy(window_.begin(), window_.end(), refilled.begin());
      size_t filled = window_.size();
      for (;;) {
        const ssize_t got = ::read(fd_, refilled.data() + filled, refilled.size() - filled);
        if (got < 0 && errno == EINTR) continue;
        if (got < 0) throw DataError("cannot read: " + os_reason(errno), *path_);
        if (got == 0) end_of_file_ = true;
        filled += static_cast<size_t>(got);
        break;
      }
      refilled.resize(filled);
      buffer_ = std::move(refilled);
      window_ = buffer_;
    }
    return window_.size() >= count;
  }

  uint64_t consumed() const noexcept { return consumed_; }
  // The whole input's size as far as it is known (a file may grow).
  uint64_t total_bytes() const noexcept {
    return std::max<uint64_t>(total_bytes_, consumed_ + window_.size());
  }

  // The compressed bytes a size hint is measured against: all of them in
  // memory; of a file, those the file system stores (at least
  // kHintBasisBytes, for one that reports no blocks). fstat's size may be
  // mostly a sparse hole, never read, and the trailer's hint is the file's
  // last four bytes, whatever they say: trusted against the whole size, a
  // sparse tail of 16 MiB ending in 0xFFFFFF3F cost 1 GiB up front.
  uint64_t hint_basis() const noexcept {
    if (fd_ < 0) return total_bytes_;
    return std::min<uint64_t>(total_bytes_, std::max<uint64_t>(stored_bytes_, kHintBasisBytes));
  }

  // The last four bytes (asked before anything is consumed): the ISIZE field
  // of the last member's trailer.
  std::optional<uint32_t> trailer_isize() const {
    if (total_bytes_ < kGzipTrailerBytes) return std::nullopt;
    uint8_t isize[4];
    if (fd_ < 0) {
      std::copy(window_.end() - 4, window_.end(), isize);
    } else if (::pread(fd_, isize, 4, static_cast<off_t>(total_bytes_ - 4)) != 4) {
      return std::nullopt;  // only a hint: the output grows instead
    }
    return static_cast<uint32_t>(isize[0]) | static_cast<uint32_t>(isize[1]) << 8 |
           static_cast<uint32_t>(isize[2]) << 16 | static_cast<uint32_t>(isize[3]) << 24;
  }

 private:
  static constexpr size_t kReadChunkBytes = size_t{1} << 20;
  // Believed of any file: a first output of up to 32 MiB (kMaxTrustedRatio
  // times this); more grows it by doubling as the data really comes.
  static constexpr uint64_t kHintBasisBytes = uint64_t{512} << 10;

  int fd_ = -1;  // not owned; -1 for bytes in memory
  const std::string* path_ = nullptr;
  std::vector<uint8_t> buffer_;
  std::span<const uint8_t> window_;
  uint64_t total_bytes_ = 0;
  uint64_t stored_bytes_ = 0;
  uint64_t consumed_ = 0;
  bool end_of_file_ = false;
};

// Inflates a gzip file a piece at a time, so that the caller can stop at the
// size the data should have: the output grows with what really decompresses
// (from the trailer's hint, doubling), never past the limit asked for, and
// the compressed bytes after that are never inflated. Concatenated gzip
// members (what `cat a.gz b.gz` makes) are joined, as gzip(1) and Python's
// gzip module read them; anything else after a member, even zero padding, is
// rejected as trailing garbage.
class GzipReader {
 public:
  GzipReader(CompressedInput& input, const std::string& name)
      : input_(input),
        name_(name),
        first_output_size_(initial_output_size(input.hint_basis(), input.trailer_isize())) {
    // 16 + MAX_WBITS: a gzip wrapper only; zlib then checks each member's
    // CRC32 and ISIZE itself ("incorrect data check", "incorrect length check").
    if (inflateInit2(&stream_, 16 + MAX_WBITS) != Z_OK) {
      throw DataError("cannot start gzip decompression (zlib: out of memory)", name);
    }
  }
  ~GzipReader() { inflateEnd(&stream_); }
  GzipReader(const GzipReader&) = delete;
  GzipReader& operator=(const GzipReader&) = delete;

  // Inflates until `limit` bytes are out in all or the last member has ended
  // (with every member's CRC32 and length checked). Throws DataError for a
  // corrupt or truncated stream and for trailing garbage.
  void inflate_to(size_t limit) {
    // z_stream counts in uInt (32 bits): feed and drain in chunks at most that big.
    constexpr size_t kMaxChunk = std::numeric_limits<uInt>::max();
    while (!ended_ && produced_ < limit) {
      input_.ensure(1);
      const std::span<const uint8_t> available = input_.available();
      // zlib does not write through next_in.
      stream_.next_in = const_cast<Bytef*>(available.data());
      stream_.avail_in = static_cast<uInt>(std::min(available.size(), kMaxChunk));
      const uInt fed = stream_.avail_in;
      if (produced_ == output_.size()) grow(limit);
      // Never more room than `limit` leaves: produced_ stays <= limit, and
      // avail_out == 0 below means exactly "the limit is reached".
      const size_t room = std::min({output_.size() - produced_, limit - produced_, kMaxChunk});
      stream_.next_out = output_.data() + produced_;
      stream_.avail_out = static_cast<uInt>(room);

      const int status = inflate(&stream_, Z_NO_FLUSH);
      produced_ += room - stream_.avail_out;
      input_.consume(fed - stream_.avail_in);

      if (status == Z_STREAM_END) {
        if (!input_.ensure(1)) {
          ended_ = true;
          break;
        }
        if (input_.ensure(2) && input_.available()[0] == kGzipMagic0 &&
            input_.available()[1] == kGzipMagic1) {
          inflateReset(&stream_);  // another member
          continue;
        }
        throw DataError("corrupt gzip stream: " +
                            std::to_string(input_.total_bytes() - input_.consumed()) +
                            " bytes of trailing garbage after the end of the compressed data",
                        name_);
      }
      if (status == Z_DATA_ERROR || status == Z_NEED_DICT) {
        const std::string reason = stream_.msg != nullptr ? stream_.msg : "invalid deflate data";
        throw DataError("corrupt gzip stream (zlib: " + reason + ") after " +
                            std::to_string(input_.consumed()) + " of " +
                            std::to_string(input_.total_bytes()) + " compressed bytes",
                        name_);
      }
      if (status == Z_MEM_ERROR) throw DataError("gzip decompression ran out of memory", name_);
      // Z_OK or Z_BUF_ERROR: inflate stopped because it ran out of input or
      // of room. Out of room is the loop's condition or a grow; out of
      // input, with all of it fed, means the stream ends early.
      if (stream_.avail_out != 0 && !input_.ensure(1)) {
        throw DataError("truncated gzip stream: the compressed data ends after " +
                            std::to_string(produced_) +
                            " decompressed bytes, before the end of the gzip member",
                        name_);
      }
    }
  }

  size_t produced() const noexcept { return produced_; }
  std::span<const uint8_t> output() const noexcept { return {output_.data(), produced_}; }

  // The decompressed bytes, without spare room.
  std::vector<uint8_t> take() {
    output_.resize(produced_);
    // A wrong size hint can leave much spare room; give a large excess back.
    if (output_.capacity() - output_.size() > output_.size() / 4) output_.shrink_to_fit();
    return std::move(output_);
  }

 private:
  // Room for more output: the trailer's hint at first, then doubling, capped
  // at `limit`, so a header that declares terabytes over a small stream
  // costs only what the stream really holds.
  void grow(size_t limit) {
    const size_t doubled = output_.size() > limit / 2 ? limit : output_.size() * 2;
    const size_t size = std::min(limit, std::max(doubled, first_output_size_));
    output_.reserve(size);  // exactly: resize alone may take up to twice the old size
    output_.resize(size);
  }

  CompressedInput& input_;
  const std::string& name_;
  size_t first_output_size_;
  z_stream stream_{};
  std::vector<uint8_t> output_;
  size_t produced_ = 0;  // output bytes written so far
  bool ended_ = false;
};

// Closes the descriptor however the reading ends.
struct FileDescriptor {
  int fd;
  ~FileDescriptor() {
    if (fd >= 0) ::close(fd);
  }
};

// Reads from `file` onto the end of `contents` until the end of the file, or
// until `contents` holds `limit` bytes. Room is made for the `expected`
// bytes in all (fstat's size, or `limit` when smaller) and a spare byte, so
// the end of the file is seen without growing; a file that grows meanwhile
// still reads whole.
void read_more(const FileDescriptor& file, size_t expected, size_t limit,
               std::vector<uint8_t>& contents, const std::string& path) {
  size_t filled = contents.size();
  const size_t room = std::min(std::max<size_t>(expected + 1, kMinimumOutputBytes), limit);
  contents.resize(std::max(room, filled));
  while (filled < limit) {
    if (filled == contents.size()) contents.resize(std::min(contents.size() * 2, limit));
    const ssize_t count = ::read(file.fd, contents.data() + filled, contents.size() - filled);
    if (count == 0) break;
    if (count < 0) {
      if (errno == EINTR) continue;
      throw DataError("cannot read: " + os_reason(errno), path);
    }
    filled += static_cast<size_t>(count);
  }
  contents.resize(filled);
}

uint32_t read_big_endian_u32(const uint8_t* bytes) {
  return static_cast<uint32_t>(bytes[0]) << 24 | static_cast<uint32_t>(bytes[1]) << 16 |
         static_cast<uint32_t>(bytes[2]) << 8 | static_cast<uint32_t>(bytes[3]);
}

// What an IDX header says.
struct IdxHeader {
  uint8_t type_code = 0;
  std::vector<int64_t> dims;
  size_t header_bytes = 0;  // the magic and the dimensions
  size_t item_bytes = 0;
  size_t data_bytes = 0;  // all items; header_bytes + data_bytes + 1 fits in size_t

  // "dimensions [3, 2, 4] of unsigned byte (0x08) need 24 data bytes"
  std::string data_needed() const {
    return "IDX dimensions " + shape_string(dims) + " of " + type_name(type_code) + " need " +
           std::to_string(data_bytes) + " data bytes";
  }
};

// Validates the header at the start of `bytes` (which may hold more, or
// only the header) and returns it. Throws DataError naming `name` for a
// short, wrong or unsupported header, and for dimensions whose size
// overflows.
IdxHeader read_idx_header(std::span<const uint8_t> bytes, const std::string& name) {
  if (bytes.size() < kIdxMagicBytes) {
    throw DataError("not an IDX file: " + std::to_string(bytes.size()) +
                        " bytes, too short for the 4-byte IDX magic",
                    name);
  }
  if (bytes[0] != 0 || bytes[1] != 0) {
    throw DataError("not an IDX file: the magic starts with " + hex_byte(bytes[0]) + " " +
                        hex_byte(bytes[1]) + ", expected 0x00 0x00",
                    name);
  }
  IdxHeader header;
  header.type_code = bytes[2];
  const size_t element_bytes = element_size(header.type_code);
  if (element_bytes == 0) {
    throw DataError("unsupported IDX element type " + hex_byte(header.type_code) +
                        " (known: 0x08 unsigned byte, 0x09 signed byte, 0x0B int16, "
                        "0x0C int32, 0x0D float32, 0x0E float64)",
                    name);
  }
  const size_t dimension_count = bytes[3];
  if (dimension_count == 0) {
    throw DataError("IDX header declares 0 dimensions; an IDX file needs at least one", name);
  }
  header.header_bytes = kIdxMagicBytes + dimension_count * kDimensionBytes;
  if (bytes.size() < header.header_bytes) {
    throw DataError("truncated IDX header: " + std::to_string(dimension_count) +
                        " dimensions need a " + std::to_string(header.header_bytes) +
                        "-byte header, but the file has " + std::to_string(bytes.size()) + " bytes",
                    name);
  }

  header.dims.resize(dimension_count);
  for (size_t d = 0; d < dimension_count; ++d) {
    header.dims[d] = read_big_endian_u32(bytes.data() + kIdxMagicBytes + d * kDimensionBytes);
  }
  // Products of up to 255 32-bit extents overflow easily; check each step.
  // The whole file's size plus the one byte a gzip reader reads past it
  // must fit too.
  // An extent of 0 after the first makes every item empty, however large
  // the others: its size is 0, not an overflow.
  const bool items_are_empty =
      std::find(header.dims.begin() + 1, header.dims.end(), 0) != header.dims.end();
  size_t item_bytes = items_are_empty ? 0 : element_bytes;
  size_t data_bytes = 0;
  bool overflow = false;
  for (size_t d = 1; d < dimension_count && !overflow && !items_are_empty; ++d) {
    overflow = __builtin_mul_overflow(item_bytes, static_cast<size_t>(header.dims[d]), &item_bytes);
  }
  if (!overflow) {
    overflow =
        __builtin_mul_overflow(item_bytes, static_cast<size_t>(header.dims[0]), &data_bytes) ||
        data_bytes > std::numeric_limits<size_t>::max() - header.header_bytes - 1;
  }
  if (overflow) {
    throw DataError("IDX dimensions " + shape_string(header.dims) + " of " +
                        type_name(header.type_code) + " describe more bytes than can be addressed",
                    name);
  }
  header.item_bytes = item_bytes;
  header.data_bytes = data_bytes;
  return header;
}

// Throws DataError unless `found_bytes` after the header are exactly the
// data the header declares.
void check_data_size(const IdxHeader& header, size_t found_bytes, const std::string& name) {
  if (found_bytes < header.data_bytes) {
    throw DataError("truncated IDX data: " + header.data_needed() + ", but the file has only " +
                        std::to_string(found_bytes),
                    name);
  }
  if (found_bytes > header.data_bytes) {
    throw DataError(header.data_needed() + ", but the file has " +
                        std::to_string(found_bytes - header.data_bytes) + " more (trailing data)",
                    name);
  }
}

// Decompresses a gzip'd IDX file, inflating no more than its header
// declares: the header first, then the size it gives plus one byte, which
// tells a longer stream (trailing data, or a gzip bomb of gigabytes behind
// a small header) from a complete one without inflating the rest. A stream
// that ends sooner is returned as it is, and from_buffer reports it short.
std::vector<uint8_t> gunzip_idx(CompressedInput& compressed, const std::string& name) {
  GzipReader gzip(compressed, name);
  gzip.inflate_to(kIdxMagicBytes);
  if (gzip.produced() == kIdxMagicBytes) {
    const size_t dimension_count = gzip.output()[3];
    gzip.inflate_to(kIdxMagicBytes + dimension_count * kDimensionBytes);
  }
  const IdxHeader header = read_idx_header(gzip.output(), name);
  const size_t declared_bytes = header.header_bytes + header.data_bytes;  // cannot overflow
  gzip.inflate_to(declared_bytes + 1);
  if (gzip.produced() > declared_bytes) {
    throw DataError(header.data_needed() + ", " + std::to_string(declared_bytes) +
                        " bytes with the header, but the gzip stream decompresses to more "
                        "(trailing data, or a decompression bomb); stopped after " +
                        std::to_string(gzip.produced()) + " bytes",
                    name);
  }
  return gzip.take();
}

}  // namespace

// Validates the header of the decompressed file in `buffer` and takes it over.
IdxFile IdxFile::from_buffer(std::shared_ptr<std::vector<uint8_t>> buffer,
                             const std::string& name) {
  IdxHeader header = read_idx_header(*buffer, name);
  check_data_size(header, buffer->size() - header.header_bytes, name);

  IdxFile file;
  file.name_ = name;
  file.type_code_ = header.type_code;
  file.dims_ = std::move(header.dims);
  file.item_bytes_ = header.item_bytes;
  file.buffer_ = std::move(buffer);
  file.data_offset_ = header.header_bytes;
  return file;
}

IdxFile IdxFile::open(const std::string& path) {
  try {
    OpenedFile opened = open_regular_file(path);
    if (!opened.problem.empty()) throw DataError(opened.problem, path);
    FileDescriptor file{opened.fd};
    const size_t file_bytes = static_cast<size_t>(opened.size);
    std::vector<uint8_t> contents;
    read_more(file, file_bytes, kMaxIdxHeaderBytes, contents, path);
    if (!is_gzip(contents)) {
      // A raw file's size is checked against its header before the data is
      // read: a few bytes declaring little, in a file of gigabytes (sparse,
      // or not), must not cost gigabytes.
      const IdxHeader header = read_idx_header(contents, path);
      const size_t found_bytes = std::max(file_bytes, contents.size()) - header.header_bytes;
      check_data_size(header, found_bytes, path);
    }
    if (is_gzip(contents)) {
      // Streamed from the descriptor: inflated only as far as the header
      // declares, and the compressed bytes after that never read whole.
      CompressedInput compressed(file.fd, std::move(contents), opened.size, opened.stored, path);
      contents = gunzip_idx(compressed, path);
    } else {
      read_more(file, file_bytes, std::numeric_limits<size_t>::max(), contents, path);
    }
    return from_buffer(std::make_shared<std::vector<uint8_t>>(std::move(contents)), path);
  } catch (const std::bad_alloc&) {
    // A file that really is bigger than memory: still an error naming it.
    throw DataError("out of memory reading the file (std::bad_alloc)", path);
  } catch (const std::length_error&) {
    // Bigger than a vector can be (a sparse file of 2^63 bytes whose header
    // declares them all): the same error in the end.
    throw DataError(
        "out of memory reading the file (std::length_error: more bytes than one buffer can hold)",
        path);
  }
}

IdxFile IdxFile::parse(std::span<const uint8_t> bytes, const std::string& name) {
  try {
    std::shared_ptr<std::vector<uint8_t>> buffer;
    if (is_gzip(bytes)) {
      CompressedInput compressed(bytes);
      buffer = std::make_shared<std::vector<uint8_t>>(gunzip_idx(compressed, name));
    } else {
      buffer = std::make_shared<std::vector<uint8_t>>(bytes.begin(), bytes.end());
    }
    return from_buffer(std::move(buffer), name);
  } catch (const std::bad_alloc&) {
    throw DataError("out of memory reading the file (std::bad_alloc)", name);
  }
}

std::span<const uint8_t> IdxFile::item(size_t index) const {
  if (index >= size()) {
    throw IndexError("index " + std::to_string(index) + " is out of range for IDX file '" + name_ +
                     "' of " + std::to_string(size()) + " items");
  }
  return {buffer_->data() + data_offset_ + index * item_bytes_, item_bytes_};
}

Array<uint8_t> IdxFile::item_array(size_t index) const {
  if (type_code_ != kUnsignedByteType) {
    throw TypeError("item_array needs an IDX file of unsigned bytes (0x08), but '" + name_ +
                    "' holds " + type_name(type_code_) + "; use item() for its raw bytes");
  }
  std::span<const uint8_t> bytes = item(index);
  // Array views mutable memory; the buffer is never written after parsing,
  // and the shared owner keeps it alive as long as any view.
  return Array<uint8_t>(std::vector<int64_t>(dims_.begin() + 1, dims_.end()),
                        const_cast<uint8_t*>(bytes.data()), buffer_);
}

IdxImageDataset::IdxImageDataset(const std::string& images_path, const std::string& labels_path)
    : IdxImageDataset(IdxFile::open(images_path), IdxFile::open(labels_path)) {}

IdxImageDataset::IdxImageDataset(IdxFile images, IdxFile labels)
    : images_(std::move(images)), labels_(std::move(labels)) {
  if (images_.type_code() != kUnsignedByteType || images_.dims().size() != 3) {
    throw DataError("expected images of shape [N, H, W] of unsigned byte (0x08), found " +
                        shape_string(images_.dims()) + " of " + type_name(images_.type_code()),
                    images_.name());
  }
  if (labels_.type_code() != kUnsignedByteType || labels_.dims().size() != 1) {
    throw DataError("expected labels of shape [N] of unsigned byte (0x08), found " +
                        shape_string(labels_.dims()) + " of " + type_name(labels_.type_code()),
                    labels_.name());
  }
  if (images_.size() != labels_.size()) {
    throw DataError(std::to_string(images_.size()) + " images, but the labels file '" +
                        labels_.name() + "' holds " + std::to_string(labels_.size()) +
                        " labels; the two files must have one label per image",
                    images_.name());
  }
}

IdxImageDataset IdxImageDataset::from_directory(const std::string& directory, bool train) {
  const std::filesystem::path root(directory);
  const std::string prefix = train ? "train" : "t10k";
  return IdxImageDataset((root / (prefix + "-images-idx3-ubyte.gz")).string(),
                         (root / (prefix + "-labels-idx1-ubyte.gz")).string());
}

LabeledImage IdxImageDataset::get(size_t index) {
  const Array<uint8_t> pixels = images_.item_array(index);  // [H, W]; IndexError past the end
  const std::vector<int64_t>& dims = images_.dims();
  LabeledImage sample;
  // One channel in front, as torchvision's ToTensor gives for MNIST.
  sample.image =
      Array<uint8_t>({1, dims[1], dims[2]}, const_cast<uint8_t*>(pixels.data()), pixels.owner());
  sample.label = labels_.item(index)[0];
  return sample;
}

}  // namespace conveyor
