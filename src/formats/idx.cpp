// The IDX reader: one read, one decompression into one buffer, items as views.
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
#include <system_error>
#include <utility>

#include "conveyor/data_error.h"
#include "conveyor/errors.h"

namespace conveyor {
namespace {

constexpr uint8_t kGzipMagic0 = 0x1f;
constexpr uint8_t kGzipMagic1 = 0x8b;
constexpr uint8_t kUnsignedByteType = 0x08;
constexpr size_t kIdxMagicBytes = 4;  // 0x00 0x00 <type> <dimension count>
constexpr size_t kDimensionBytes = 4;
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
// a hint; the output grows when it is wrong.
size_t initial_output_size(std::span<const uint8_t> compressed) {
  const uint64_t ceiling = static_cast<uint64_t>(compressed.size()) * kMaxTrustedRatio;
  uint64_t hint = static_cast<uint64_t>(compressed.size()) * 4;
  if (compressed.size() >= kGzipTrailerBytes) {
    const uint8_t* isize = compressed.data() + compressed.size() - 4;
    hint = static_cast<uint64_t>(isize[0]) | static_cast<uint64_t>(isize[1]) << 8 |
           static_cast<uint64_t>(isize[2]) << 16 | static_cast<uint64_t>(isize[3]) << 24;
  }
  hint = std::min(hint, ceiling);
  // One spare byte: with room left after the last byte, inflate goes on to
  // read the trailer and reports Z_STREAM_END instead of asking for more room.
  return static_cast<size_t>(std::max<uint64_t>(hint + 1, kMinimumOutputBytes));
}

// Frees the inflate state however the function below leaves.
struct InflateGuard {
  z_stream* stream;
  ~InflateGuard() { inflateEnd(stream); }
};

// Decompresses a whole gzip file at once. Concatenated gzip members (what
// `cat a.gz b.gz` makes) are supported, as gzip(1) and Python's gzip module
// read them: their contents are joined. Anything else after a member, even
// zero padding, is rejected as trailing garbage.
std::vector<uint8_t> gunzip(std::span<const uint8_t> compressed, const std::string& name) {
  z_stream stream{};
  // 16 + MAX_WBITS: a gzip wrapper only; zlib then checks each member's CRC32
  // and ISIZE itself ("incorrect data check", "incorrect length check").
  if (inflateInit2(&stream, 16 + MAX_WBITS) != Z_OK) {
    throw DataError("cannot start gzip decompression (zlib: out of memory)", name);
  }
  InflateGuard guard{&stream};

  std::vector<uint8_t> output(initial_output_size(compressed));
  size_t consumed = 0;  // input bytes handed to zlib so far
  size_t produced = 0;  // output bytes written so far
  // z_stream counts in uInt (32 bits): feed and drain in chunks at most that big.
  constexpr size_t kMaxChunk = std::numeric_limits<uInt>::max();
  for (;;) {
    if (stream.avail_in == 0 && consumed < compressed.size()) {
      const size_t chunk = std::min(compressed.size() - consumed, kMaxChunk);
      stream.next_in = const_cast<Bytef*>(compressed.data() + consumed);  // zlib does not write it
      stream.avail_in = static_cast<uInt>(chunk);
      consumed += chunk;
    }
    if (produced == output.size()) output.resize(output.size() * 2);
    const size_t room = std::min(output.size() - produced, kMaxChunk);
    stream.next_out = output.data() + produced;
    stream.avail_out = static_cast<uInt>(room);

    const int status = inflate(&stream, Z_NO_FLUSH);
    produced += room - stream.avail_out;
    const size_t input_left = stream.avail_in + (compressed.size() - consumed);

    if (status == Z_STREAM_END) {
      if (input_left == 0) break;
      const uint8_t* next = stream.next_in;
      if (stream.avail_in == 0) next = compressed.data() + consumed;  // at a chunk boundary
      if (input_left >= 2 && next[0] == kGzipMagic0 && next[1] == kGzipMagic1) {
        inflateReset(&stream);  // another member: keeps next_in/avail_in
        continue;
      }
      throw DataError("corrupt gzip stream: " + std::to_string(input_left) +
                          " bytes of trailing garbage after the end of the compressed data",
                      name);
    }
    if (status == Z_DATA_ERROR || status == Z_NEED_DICT) {
      const std::string reason = stream.msg != nullptr ? stream.msg : "invalid deflate data";
      throw DataError("corrupt gzip stream (zlib: " + reason + ") after " +
                          std::to_string(compressed.size() - input_left) + " of " +
                          std::to_string(compressed.size()) + " compressed bytes",
                      name);
    }
    if (status == Z_MEM_ERROR) {
      throw DataError("gzip decompression ran out of memory", name);
    }
    // Z_OK or Z_BUF_ERROR: inflate stopped because it ran out of input or of
    // room. Out of room is handled at the top of the loop; out of input,
    // with all of it fed, means the stream ends early.
    if (stream.avail_out != 0 && input_left == 0) {
      throw DataError("truncated gzip stream: the compressed data ends after " +
                          std::to_string(produced) +
                          " decompressed bytes, before the end of the gzip member",
                      name);
    }
  }
  output.resize(produced);
  // A wrong ISIZE hint (corrupt, or only the last of several members) or the
  // last doubling can leave much spare room; give a large excess back.
  if (output.capacity() - output.size() > output.size() / 4) output.shrink_to_fit();
  return output;
}

// strerror's text, without strerror's shared buffer.
std::string os_reason(int error_number) { return std::generic_category().message(error_number); }

// Closes the descriptor however read_file leaves.
struct FileDescriptor {
  int fd;
  ~FileDescriptor() {
    if (fd >= 0) ::close(fd);
  }
};

std::vector<uint8_t> read_file(const std::string& path) {
  FileDescriptor file{::open(path.c_str(), O_RDONLY | O_CLOEXEC)};
  if (file.fd < 0) throw DataError("cannot open: " + os_reason(errno), path);
  struct stat status {};
  if (::fstat(file.fd, &status) != 0) throw DataError("cannot stat: " + os_reason(errno), path);
  if (S_ISDIR(status.st_mode)) throw DataError("cannot read: " + os_reason(EISDIR), path);
  // Sized from fstat with a spare byte, so the end of a regular file is seen
  // without growing; pipes and files that grow meanwhile still read whole.
  const size_t expected = S_ISREG(status.st_mode) ? static_cast<size_t>(status.st_size) : 0;
  std::vector<uint8_t> contents(std::max<size_t>(expected + 1, kMinimumOutputBytes));
  size_t filled = 0;
  for (;;) {
    if (filled == contents.size()) contents.resize(contents.size() * 2);
    const ssize_t count = ::read(file.fd, contents.data() + filled, contents.size() - filled);
    if (count == 0) break;
    if (count < 0) {
      if (errno == EINTR) continue;
      throw DataError("cannot read: " + os_reason(errno), path);
    }
    filled += static_cast<size_t>(count);
  }
  contents.resize(filled);
  return contents;
}

uint32_t read_big_endian_u32(const uint8_t* bytes) {
  return static_cast<uint32_t>(bytes[0]) << 24 | static_cast<uint32_t>(bytes[1]) << 16 |
         static_cast<uint32_t>(bytes[2]) << 8 | static_cast<uint32_t>(bytes[3]);
}

}  // namespace

// Validates the header of the decompressed file in `buffer` and takes it over.
IdxFile IdxFile::from_buffer(std::shared_ptr<std::vector<uint8_t>> buffer,
                             const std::string& name) {
  const std::vector<uint8_t>& bytes = *buffer;
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
  const uint8_t type_code = bytes[2];
  const size_t element_bytes = element_size(type_code);
  if (element_bytes == 0) {
    throw DataError("unsupported IDX element type " + hex_byte(type_code) +
                        " (known: 0x08 unsigned byte, 0x09 signed byte, 0x0B int16, "
                        "0x0C int32, 0x0D float32, 0x0E float64)",
                    name);
  }
  const size_t dimension_count = bytes[3];
  if (dimension_count == 0) {
    throw DataError("IDX header declares 0 dimensions; an IDX file needs at least one", name);
  }
  const size_t header_bytes = kIdxMagicBytes + dimension_count * kDimensionBytes;
  if (bytes.size() < header_bytes) {
    throw DataError("truncated IDX header: " + std::to_string(dimension_count) +
                        " dimensions need a " + std::to_string(header_bytes) +
                        "-byte header, but the file has " + std::to_string(bytes.size()) + " bytes",
                    name);
  }

  std::vector<int64_t> dims(dimension_count);
  for (size_t d = 0; d < dimension_count; ++d) {
    dims[d] = read_big_endian_u32(bytes.data() + kIdxMagicBytes + d * kDimensionBytes);
  }
  // Products of up to 255 32-bit extents overflow easily; check each step.
  size_t item_bytes = element_bytes;
  size_t data_bytes = 0;
  bool overflow = false;
  for (size_t d = 1; d < dimension_count && !overflow; ++d) {
    overflow = __builtin_mul_overflow(item_bytes, static_cast<size_t>(dims[d]), &item_bytes);
  }
  if (!overflow) {
    overflow = __builtin_mul_overflow(item_bytes, static_cast<size_t>(dims[0]), &data_bytes);
  }
  if (overflow) {
    throw DataError("IDX dimensions " + shape_string(dims) + " of " + type_name(type_code) +
                        " describe more bytes than can be addressed",
                    name);
  }
  const size_t found_bytes = bytes.size() - header_bytes;
  if (found_bytes != data_bytes) {
    const std::string need = "IDX dimensions " + shape_string(dims) + " of " +
                             type_name(type_code) + " need " + std::to_string(data_bytes) +
                             " data bytes";
    if (found_bytes < data_bytes) {
      throw DataError(
          "truncated IDX data: " + need + ", but the file has only " + std::to_string(found_bytes),
          name);
    }
    throw DataError(need + ", but the file has " + std::to_string(found_bytes - data_bytes) +
                        " more (trailing data)",
                    name);
  }

  IdxFile file;
  file.name_ = name;
  file.type_code_ = type_code;
  file.dims_ = std::move(dims);
  file.item_bytes_ = item_bytes;
  file.buffer_ = std::move(buffer);
  file.data_offset_ = header_bytes;
  return file;
}

IdxFile IdxFile::open(const std::string& path) {
  std::vector<uint8_t> contents = read_file(path);
  if (is_gzip(contents)) contents = gunzip(contents, path);
  return from_buffer(std::make_shared<std::vector<uint8_t>>(std::move(contents)), path);
}

IdxFile IdxFile::parse(std::span<const uint8_t> bytes, const std::string& name) {
  auto buffer = is_gzip(bytes) ? std::make_shared<std::vector<uint8_t>>(gunzip(bytes, name))
                               : std::make_shared<std::vector<uint8_t>>(bytes.begin(), bytes.end());
  return from_buffer(std::move(buffer), name);
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
