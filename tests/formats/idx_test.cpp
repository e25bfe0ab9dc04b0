// The IDX reader: small files built here (raw and gzip'd) for round trips and
// every error path, then the real Fashion-MNIST files, alone and through the
// loader.
#include <gtest/gtest.h>
#include <stdlib.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include <conveyor/conveyor.h>
#include <conveyor/idx.h>

#include <array>
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <limits>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "support/memory_cap.h"

namespace {

using conveyor::DataError;
using conveyor::IdxFile;
using conveyor::IdxImageDataset;

// ---- helpers ---------------------------------------------------------------

// An IDX file's bytes: the magic, big-endian dimensions, then `data` as is.
std::vector<uint8_t> idx_bytes(uint8_t type_code, const std::vector<uint32_t>& dims,
                               const std::vector<uint8_t>& data) {
  std::vector<uint8_t> bytes = {0, 0, type_code, static_cast<uint8_t>(dims.size())};
  for (uint32_t extent : dims) {
    for (int shift = 24; shift >= 0; shift -= 8) bytes.push_back(uint8_t(extent >> shift));
  }
  bytes.insert(bytes.end(), data.begin(), data.end());
  return bytes;
}

// 0, 1, 2, ... (mod 256): every byte of a file differs from its neighbours.
std::vector<uint8_t> counting_bytes(size_t count) {
  std::vector<uint8_t> bytes(count);
  for (size_t i = 0; i < count; ++i) bytes[i] = static_cast<uint8_t>(i * 7 + i / 256);
  return bytes;
}

// A gzip member of `bytes`, made by zlib (windowBits 31: the gzip wrapper).
std::vector<uint8_t> gzip(const std::vector<uint8_t>& bytes) {
  z_stream stream{};
  EXPECT_EQ(
      deflateInit2(&stream, Z_BEST_COMPRESSION, Z_DEFLATED, 16 + MAX_WBITS, 8, Z_DEFAULT_STRATEGY),
      Z_OK);
  std::vector<uint8_t> out(deflateBound(&stream, bytes.size()) + 32);
  stream.next_in = const_cast<Bytef*>(bytes.data());
  stream.avail_in = static_cast<uInt>(bytes.size());
  stream.next_out = out.data();
  stream.avail_out = static_cast<uInt>(out.size());
  EXPECT_EQ(deflate(&stream, Z_FINISH), Z_STREAM_END);
  out.resize(stream.total_out);
  deflateEnd(&stream);
  return out;
}

std::vector<uint8_t> read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

testing::AssertionResult Contains(const std::string& text, const std::string& part) {
  if (text.find(part) != std::string::npos) return testing::AssertionSuccess();
  return testing::AssertionFailure() << "'" << text << "' does not contain '" << part << "'";
}

// Runs `action`, which must throw DataError, and returns that error.
template <class Action>
std::optional<DataError> data_error_from(Action&& action) {
  try {
    action();
  } catch (const DataError& error) {
    return error;
  }
  return std::nullopt;
}

using conveyor::testing::exit_zero_if_under_cap;
using conveyor::testing::exit_zero_on_data_error_under_cap;

// A gzip'd IDX file of `header` followed by `zero_mib` MiB of zeros: a
// decompression bomb (1 GiB in about 1 MB), built without ever holding its
// inflated size. After a full flush deflate never refers back past it, so
// one compressed, flushed MiB of zeros is repeated; zlib's crc32_combine
// gives the trailer's CRC without the data.
std::vector<uint8_t> gzip_bomb(const std::vector<uint8_t>& header, size_t zero_mib) {
  constexpr size_t kMiB = size_t{1} << 20;
  z_stream stream{};
  // windowBits < 0: raw deflate; the gzip wrapper is written here.
  EXPECT_EQ(
      deflateInit2(&stream, Z_BEST_COMPRESSION, Z_DEFLATED, -MAX_WBITS, 9, Z_DEFAULT_STRATEGY),
      Z_OK);
  const auto deflate_all = [&](const std::vector<uint8_t>& input, int flush) {
    std::vector<uint8_t> out(deflateBound(&stream, input.size()) + 64);
    stream.next_in = const_cast<Bytef*>(input.data());
    stream.avail_in = static_cast<uInt>(input.size());
    stream.next_out = out.data();
    stream.avail_out = static_cast<uInt>(out.size());
    EXPECT_NE(deflate(&stream, flush), Z_STREAM_ERROR);
    EXPECT_EQ(stream.avail_in, 0u);
    EXPECT_GT(stream.avail_out, 0u);  // all of it came out
    out.resize(out.size() - stream.avail_out);
    return out;
  };
  const std::vector<uint8_t> zeros(kMiB, 0);
  const std::vector<uint8_t> head = deflate_all(header, Z_FULL_FLUSH);
  const std::vector<uint8_t> mebibyte = deflate_all(zeros, Z_FULL_FLUSH);
  const std::vector<uint8_t> tail = deflate_all({}, Z_FINISH);
  deflateEnd(&stream);

  std::vector<uint8_t> bomb = {0x1f, 0x8b, 8, 0, 0, 0, 0, 0, 0, 3};  // deflate, no name, Unix
  bomb.insert(bomb.end(), head.begin(), head.end());
  uLong crc = crc32(0, header.data(), static_cast<uInt>(header.size()));
  const uLong zeros_crc = crc32(0, zeros.data(), static_cast<uInt>(zeros.size()));
  for (size_t i = 0; i < zero_mib; ++i) {
    bomb.insert(bomb.end(), mebibyte.begin(), mebibyte.end());
    crc = crc32_combine(crc, zeros_crc, static_cast<z_off_t>(kMiB));
  }
  bomb.insert(bomb.end(), tail.begin(), tail.end());
  const uint64_t inflated = header.size() + zero_mib * kMiB;
  for (int shift = 0; shift < 32; shift += 8) bomb.push_back(uint8_t(crc >> shift));
  for (int shift = 0; shift < 32; shift += 8) bomb.push_back(uint8_t(inflated >> shift));  // ISIZE
  return bomb;
}

// A fresh directory under /tmp per test, removed afterwards.
class IdxTempDirTest : public testing::Test {
 protected:
  void SetUp() override {
    char pattern[] = "/tmp/conveyor-idx-test-XXXXXX";
    ASSERT_NE(mkdtemp(pattern), nullptr);
    directory_ = pattern;
  }
  void TearDown() override {
    std::error_code ignored;
    std::filesystem::remove_all(directory_, ignored);
  }

  std::string write(const std::string& name, const std::vector<uint8_t>& bytes) {
    const std::string path = directory_ + "/" + name;
    std::ofstream out(path, std::ios::binary);
    out.write(reinterpret_cast<const char*>(bytes.data()), std::streamsize(bytes.size()));
    EXPECT_TRUE(out.good()) << path;
    return path;
  }

  // open() of `bytes` written to `name` must fail with a DataError naming
  // the file and saying `reason`.
  void expect_open_fails(const std::string& name, const std::vector<uint8_t>& bytes,
                         const std::string& reason) {
    const std::string path = write(name, bytes);
    std::optional<DataError> error = data_error_from([&] { IdxFile::open(path); });
    ASSERT_TRUE(error) << name << ": no DataError";
    EXPECT_EQ(error->file(), path);
    EXPECT_TRUE(Contains(error->what(), path));
    EXPECT_TRUE(Contains(error->what(), reason));
    // parse() of the same bytes fails the same way, under the given name.
    std::optional<DataError> parsed = data_error_from([&] { IdxFile::parse(bytes, "in-memory"); });
    ASSERT_TRUE(parsed) << name << ": parse() threw no DataError";
    EXPECT_EQ(parsed->file(), "in-memory");
    EXPECT_TRUE(Contains(parsed->what(), reason));
  }

  std::string directory_;
};

// ---- round trips -----------------------------------------------------------

using IdxFileTest = IdxTempDirTest;

void expect_three_items_of_two_by_four(const IdxFile& file, const std::vector<uint8_t>& data) {
  EXPECT_EQ(file.type_code(), 0x08);
  EXPECT_EQ(file.dims(), (std::vector<int64_t>{3, 2, 4}));
  EXPECT_EQ(file.size(), 3u);
  EXPECT_EQ(file.item_bytes(), 8u);
  for (size_t i = 0; i < 3; ++i) {
    std::span<const uint8_t> item = file.item(i);
    EXPECT_EQ(std::vector<uint8_t>(item.begin(), item.end()),
              std::vector<uint8_t>(data.begin() + i * 8, data.begin() + i * 8 + 8));
    conveyor::Array<uint8_t> array = file.item_array(i);
    EXPECT_EQ(array.shape(), (std::vector<int64_t>{2, 4}));
    ASSERT_EQ(array.numel(), 8u);
    for (size_t k = 0; k < 8; ++k) EXPECT_EQ(array[k], data[i * 8 + k]) << i << "," << k;
  }
}

TEST_F(IdxFileTest, RawAndGzipRoundTrip) {
  const std::vector<uint8_t> data = counting_bytes(24);
  const std::vector<uint8_t> raw = idx_bytes(0x08, {3, 2, 4}, data);
  const std::vector<uint8_t> zipped = gzip(raw);
  ASSERT_EQ(zipped[0], 0x1f);
  ASSERT_EQ(zipped[1], 0x8b);

  const std::string raw_path = write("raw-idx3-ubyte", raw);
  const std::string gzip_path = write("zipped-idx3-ubyte.gz", zipped);
  IdxFile from_raw = IdxFile::open(raw_path);
  IdxFile from_gzip = IdxFile::open(gzip_path);
  EXPECT_EQ(from_raw.name(), raw_path);
  EXPECT_EQ(from_gzip.name(), gzip_path);
  expect_three_items_of_two_by_four(from_raw, data);
  expect_three_items_of_two_by_four(from_gzip, data);

  IdxFile parsed_raw = IdxFile::parse(raw, "raw bytes");
  IdxFile parsed_gzip = IdxFile::parse(zipped, "gzip bytes");
  EXPECT_EQ(parsed_gzip.name(), "gzip bytes");
  expect_three_items_of_two_by_four(parsed_raw, data);
  expect_three_items_of_two_by_four(parsed_gzip, data);
}

TEST_F(IdxFileTest, LargerGzipThanItsFirstGuessDecompressesWhole) {
  // 1 MiB of one value compresses about 1000:1; the file is read exactly.
  std::vector<uint8_t> data(1 << 20, 42);
  data[12345] = 7;
  IdxFile file = IdxFile::parse(gzip(idx_bytes(0x08, {1024, 1024}, data)), "big");
  EXPECT_EQ(file.size(), 1024u);
  EXPECT_EQ(file.item(12)[57], 7);  // 12345 = 12 * 1024 + 57
  EXPECT_EQ(file.item(1023)[1023], 42);
}

TEST_F(IdxFileTest, GzipWithALyingSizeTrailerStillDecompresses) {
  // ISIZE is only a hint: with a wrong one, zlib's own length check fails,
  // but the buffer must never be overrun. Rewrite ISIZE *and* check that the
  // error is the length check, not a crash.
  const std::vector<uint8_t> raw = idx_bytes(0x08, {100, 10}, counting_bytes(1000));
  std::vector<uint8_t> zipped = gzip(raw);
  const size_t isize = zipped.size() - 4;
  for (uint8_t fake : std::array<uint8_t, 3>{0, 1, 255}) {
    std::vector<uint8_t> lying = zipped;
    for (size_t k = 0; k < 4; ++k) lying[isize + k] = fake;
    std::optional<DataError> error = data_error_from([&] { IdxFile::parse(lying, "lying"); });
    ASSERT_TRUE(error);
    EXPECT_TRUE(Contains(error->what(), "incorrect length check"));
  }
}

TEST_F(IdxFileTest, ConcatenatedGzipMembersAreJoined) {
  // `cat a.gz b.gz` is one valid gzip file; gzip(1) and Python read it whole.
  const std::vector<uint8_t> data = counting_bytes(24);
  const std::vector<uint8_t> raw = idx_bytes(0x08, {3, 2, 4}, data);
  std::vector<uint8_t> joined = gzip({raw.begin(), raw.begin() + 10});
  const std::vector<uint8_t> rest = gzip({raw.begin() + 10, raw.end()});
  joined.insert(joined.end(), rest.begin(), rest.end());
  expect_three_items_of_two_by_four(IdxFile::parse(joined, "two members"), data);
}

TEST_F(IdxFileTest, EveryElementTypeHasItsSize) {
  struct Case {
    uint8_t type_code;
    size_t element_bytes;
  };
  for (Case c :
       {Case{0x08, 1}, Case{0x09, 1}, Case{0x0B, 2}, Case{0x0C, 4}, Case{0x0D, 4}, Case{0x0E, 8}}) {
    SCOPED_TRACE(static_cast<int>(c.type_code));
    const std::vector<uint8_t> data = counting_bytes(2 * 3 * c.element_bytes);
    IdxFile file = IdxFile::parse(idx_bytes(c.type_code, {2, 3}, data), "typed");
    EXPECT_EQ(file.type_code(), c.type_code);
    EXPECT_EQ(file.item_bytes(), 3 * c.element_bytes);
    std::span<const uint8_t> second = file.item(1);
    // Stored bytes, big-endian as in the file, not converted.
    EXPECT_EQ(std::vector<uint8_t>(second.begin(), second.end()),
              std::vector<uint8_t>(data.begin() + 3 * c.element_bytes, data.end()));
  }
}

TEST_F(IdxFileTest, OneDimensionalFileHasOneElementItems) {
  IdxFile labels = IdxFile::parse(idx_bytes(0x08, {4}, {3, 1, 4, 1}), "labels");
  EXPECT_EQ(labels.size(), 4u);
  EXPECT_EQ(labels.item_bytes(), 1u);
  EXPECT_EQ(labels.item(2)[0], 4);
  conveyor::Array<uint8_t> scalar = labels.item_array(2);
  EXPECT_TRUE(scalar.shape().empty());
  EXPECT_EQ(scalar.numel(), 1u);
  EXPECT_EQ(scalar[0], 4);
}

TEST_F(IdxFileTest, ZeroItemsIsAValidEmptyFile) {
  IdxFile file = IdxFile::parse(idx_bytes(0x08, {0, 28, 28}, {}), "empty");
  EXPECT_EQ(file.size(), 0u);
  EXPECT_EQ(file.item_bytes(), 28u * 28u);
  EXPECT_THROW(file.item(0), conveyor::IndexError);
}

TEST_F(IdxFileTest, ItemsAreViewsIntoOneSharedBuffer) {
  const std::vector<uint8_t> data = counting_bytes(24);
  const std::string path = write("views.gz", gzip(idx_bytes(0x08, {3, 2, 4}, data)));
  conveyor::Array<uint8_t> last;
  {
    IdxFile file = IdxFile::open(path);
    std::span<const uint8_t> first = file.item(0);
    // Items tile one buffer: item i+1 starts where item i ends.
    EXPECT_EQ(file.item(1).data(), first.data() + 8);
    EXPECT_EQ(file.item(2).data(), first.data() + 16);
    conveyor::Array<uint8_t> a0 = file.item_array(0);
    conveyor::Array<uint8_t> a2 = file.item_array(2);
    EXPECT_EQ(a0.data(), first.data());  // no copy
    EXPECT_EQ(a2.data(), file.item(2).data());
    ASSERT_NE(a0.owner(), nullptr);
    EXPECT_EQ(a0.owner(), a2.owner());  // one owner for every item
    // Copies of the file share the buffer too.
    IdxFile copy = file;
    EXPECT_EQ(copy.item(1).data(), file.item(1).data());
    last = std::move(a2);
  }
  // The view keeps the buffer alive after every IdxFile is gone (ASan
  // builds would report a use after free here otherwise).
  EXPECT_EQ(last.shape(), (std::vector<int64_t>{2, 4}));
  for (size_t k = 0; k < 8; ++k) EXPECT_EQ(last[k], data[16 + k]);
}

TEST_F(IdxFileTest, IndexPastTheEndIsAnIndexError) {
  IdxFile file = IdxFile::parse(idx_bytes(0x08, {3, 2}, counting_bytes(6)), "three");
  EXPECT_NO_THROW(file.item(2));
  EXPECT_THROW(file.item(3), conveyor::IndexError);
  EXPECT_THROW(file.item(size_t(-1)), conveyor::IndexError);
  EXPECT_THROW(file.item_array(3), conveyor::IndexError);
  try {
    file.item(7);
    FAIL() << "no IndexError";
  } catch (const conveyor::IndexError& error) {
    EXPECT_TRUE(Contains(error.what(), "index 7"));
    EXPECT_TRUE(Contains(error.what(), "three"));
  }
}

TEST_F(IdxFileTest, ItemArrayOfAnotherTypeIsATypeError) {
  IdxFile ints = IdxFile::parse(idx_bytes(0x0C, {2, 1}, counting_bytes(8)), "ints");
  EXPECT_EQ(ints.item(1).size(), 4u);
  try {
    ints.item_array(0);
    FAIL() << "no TypeError";
  } catch (const conveyor::TypeError& error) {
    EXPECT_TRUE(Contains(error.what(), "int32"));
    EXPECT_TRUE(Contains(error.what(), "ints"));
  }
  IdxFile signed_bytes = IdxFile::parse(idx_bytes(0x09, {2, 1}, {1, 2}), "signed");
  EXPECT_THROW(signed_bytes.item_array(0), conveyor::TypeError);
}

// ---- errors ----------------------------------------------------------------

using IdxErrorTest = IdxTempDirTest;

TEST_F(IdxErrorTest, MissingFileNamesTheFileAndTheOsReason) {
  const std::string path = directory_ + "/no-such-file-idx3-ubyte.gz";
  std::optional<DataError> error = data_error_from([&] { IdxFile::open(path); });
  ASSERT_TRUE(error);
  EXPECT_EQ(error->file(), path);
  EXPECT_TRUE(Contains(error->what(), path));
  EXPECT_TRUE(Contains(error->what(), "No such file or directory"));
}

TEST_F(IdxErrorTest, DirectoryIsNotAFile) {
  std::optional<DataError> error = data_error_from([&] { IdxFile::open(directory_); });
  ASSERT_TRUE(error);
  EXPECT_EQ(error->file(), directory_);
  EXPECT_TRUE(Contains(error->what(), "not a regular file (a directory)"));
}

TEST_F(IdxErrorTest, TruncatedGzip) {
  const std::vector<uint8_t> zipped = gzip(idx_bytes(0x08, {50, 20}, counting_bytes(1000)));
  // Cut in the deflate data, in the trailer, and after the header only.
  for (size_t keep :
       {zipped.size() / 2, zipped.size() - 1, zipped.size() - 5, size_t{10}, size_t{2}}) {
    SCOPED_TRACE(keep);
    expect_open_fails("truncated.gz", {zipped.begin(), zipped.begin() + keep},
                      "truncated gzip stream");
  }
}

TEST_F(IdxErrorTest, GarbledGzip) {
  const std::vector<uint8_t> zipped = gzip(idx_bytes(0x08, {50, 20}, counting_bytes(1000)));
  // A flipped byte in the deflate data, then in the CRC32 of the trailer.
  std::vector<uint8_t> garbled = zipped;
  for (size_t k = 0; k < 4; ++k) garbled[zipped.size() / 2 + k] ^= 0xFF;
  expect_open_fails("garbled.gz", garbled, "gzip stream");
  std::vector<uint8_t> bad_crc = zipped;
  bad_crc[zipped.size() - 8] ^= 0x01;
  expect_open_fails("bad-crc.gz", bad_crc, "incorrect data check");
  // A flipped byte in the gzip header's compression method.
  std::vector<uint8_t> bad_method = zipped;
  bad_method[2] = 7;
  expect_open_fails("bad-method.gz", bad_method, "corrupt gzip stream");
}

TEST_F(IdxErrorTest, GarbledRealFashionMnistGzip) {
  // Real compressed data (the 5125-byte t10k labels): flip bytes in the middle.
  std::vector<uint8_t> real =
      read_bytes(std::string(conveyor::kFashionMnistDirectory) + "/t10k-labels-idx1-ubyte.gz");
  ASSERT_GT(real.size(), 1000u) << "dataset-fashion-mnist is not installed";
  EXPECT_NO_THROW(IdxFile::parse(real, "intact"));
  for (size_t k = 0; k < 3; ++k) real[real.size() / 2 + k] ^= 0x5A;
  expect_open_fails("garbled-labels.gz", real, "gzip stream");
}

TEST_F(IdxErrorTest, TrailingGarbageAfterGzip) {
  std::vector<uint8_t> zipped = gzip(idx_bytes(0x08, {2, 2}, {1, 2, 3, 4}));
  for (char c : std::string("junk")) zipped.push_back(static_cast<uint8_t>(c));
  expect_open_fails("trailing.gz", zipped, "4 bytes of trailing garbage");
  // A lone gzip magic byte after the member is garbage too.
  std::vector<uint8_t> half_magic = gzip(idx_bytes(0x08, {1}, {1}));
  half_magic.push_back(0x1f);
  expect_open_fails("half-magic.gz", half_magic, "trailing garbage");
}

TEST_F(IdxErrorTest, WrongMagic) {
  std::vector<uint8_t> bytes = idx_bytes(0x08, {2, 2}, {1, 2, 3, 4});
  bytes[0] = 0x01;
  expect_open_fails("wrong-magic", bytes, "not an IDX file: the magic starts with 0x01 0x00");
  bytes[0] = 0x00;
  bytes[1] = 0x08;  // either zero byte wrong is enough
  expect_open_fails("wrong-second-magic", bytes, "the magic starts with 0x00 0x08");
  bytes[1] = 0x01;
  const std::string text = "hello, world\n";
  expect_open_fails("text.txt", {text.begin(), text.end()}, "expected 0x00 0x00");
  // The same check after decompression, still naming the .gz file.
  expect_open_fails("wrong-magic.gz", gzip(bytes), "not an IDX file");
}

TEST_F(IdxErrorTest, TooShortForTheMagic) {
  expect_open_fails("empty", {}, "0 bytes, too short for the 4-byte IDX magic");
  expect_open_fails("three-bytes", {0, 0, 8}, "too short");
}

TEST_F(IdxErrorTest, UnsupportedElementType) {
  expect_open_fails("type-07", idx_bytes(0x07, {2}, {1, 2}), "unsupported IDX element type 0x07");
  expect_open_fails("type-ff.gz", gzip(idx_bytes(0xFF, {2}, {1, 2})),
                    "unsupported IDX element type 0xFF");
}

TEST_F(IdxErrorTest, ZeroDimensions) {
  expect_open_fails("zero-dims", {0, 0, 0x08, 0}, "0 dimensions");
  expect_open_fails("zero-dims-with-data", {0, 0, 0x08, 0, 1, 2, 3}, "at least one");
}

TEST_F(IdxErrorTest, TruncatedHeader) {
  std::vector<uint8_t> bytes = {0, 0, 0x08, 3, 0, 0, 0, 1, 0, 0};  // 3 dims, 1.5 present
  expect_open_fails("short-header", bytes, "truncated IDX header: 3 dimensions need a 16-byte");
}

TEST_F(IdxErrorTest, DataShorterOrLongerThanTheDimensions) {
  const std::vector<uint8_t> data = counting_bytes(24);
  expect_open_fails("too-short", idx_bytes(0x08, {3, 2, 4}, {data.begin(), data.end() - 1}),
                    "truncated IDX data: IDX dimensions [3, 2, 4] of unsigned byte (0x08) need "
                    "24 data bytes, but the file has only 23");
  std::vector<uint8_t> longer = data;
  longer.push_back(0);
  expect_open_fails("too-long", idx_bytes(0x08, {3, 2, 4}, longer),
                    "need 24 data bytes, but the file has 1 more (trailing data)");
  // Gzip'd, inflating stops one byte past the declared size.
  expect_open_fails("too-long.gz", gzip(idx_bytes(0x08, {3, 2, 4}, longer)),
                    "need 24 data bytes, 40 bytes with the header, but the gzip stream "
                    "decompresses to more");
  // Element size counts: 3 int16 need 6 bytes.
  expect_open_fails("int16", idx_bytes(0x0B, {3}, {1, 2, 3}), "need 6 data bytes");
}

TEST_F(IdxErrorTest, DimensionsWhoseProductOverflows) {
  // 4 x 2^32-1 float64s: no size_t holds the product; must not wrap around
  // into a small number that some short input could match.
  const uint32_t huge = 0xFFFFFFFFu;
  expect_open_fails("overflow", idx_bytes(0x0E, {huge, huge, huge, huge}, {}),
                    "more bytes than can be addressed");
  // A product that wraps to exactly 0 (2^32 * 2^32 * 1 = 2^64).
  expect_open_fails("wraps-to-zero",
                    idx_bytes(0x08, {1, 0x10000u, 0x10000u, 0x10000u, 0x10000u}, {}),
                    "more bytes than can be addressed");
}

// An extent of 0 makes the data empty wherever it stands: after three
// extents of 2^32 - 1 it is no overflow (before the fix it was refused as
// one, while the same extents with the 0 first were accepted).
TEST_F(IdxFileTest, AZeroExtentAnywhereMakesEmptyItems) {
  const uint32_t huge = 0xFFFFFFFFu;
  for (const std::vector<uint32_t>& dims :
       std::vector<std::vector<uint32_t>>{{2, huge, huge, huge, 0}, {2, 0, huge, huge, huge}}) {
    SCOPED_TRACE(testing::PrintToString(dims));
    const std::vector<uint8_t> bytes = idx_bytes(0x0E, dims, {});
    for (const IdxFile& file : {IdxFile::parse(bytes, "raw"), IdxFile::parse(gzip(bytes), "gzip"),
                                IdxFile::open(write("empty-items", bytes))}) {
      EXPECT_EQ(file.size(), 2u);
      EXPECT_EQ(file.item_bytes(), 0u);
      EXPECT_TRUE(file.item(1).empty());
    }
  }
  // One byte of data is then trailing data.
  expect_open_fails("one-byte-too-many", idx_bytes(0x08, {2, huge, 0}, {1}),
                    "need 0 data bytes, but the file has 1 more (trailing data)");
}

// 12a: a valid 1-item [1, 28, 28] header, then 1 GiB of zeros in ~1 MB of
// gzip. Before the fix the reader inflated all of it (a GiB and more, 9.4 GB
// for a 3 GiB bomb) before finding it too long; under the cap that was
// std::bad_alloc, so the child exited 2.
TEST_F(IdxErrorTest, GzipBombStopsAtTheSizeTheHeaderDeclares) {
  const std::vector<uint8_t> bomb = gzip_bomb(idx_bytes(0x08, {1, 28, 28}, {}), 1024);
  ASSERT_LT(bomb.size(), 2u << 20);
  const std::string path = write("bomb-idx3-ubyte.gz", bomb);
  const std::string declared =
      "need 784 data bytes, 800 bytes with the header, but the gzip stream decompresses to more";
  // Only ever read in the capped child: unfixed, it would take gigabytes.
  EXPECT_EXIT(exit_zero_on_data_error_under_cap(
                  [&] { IdxFile::open(path); },
                  {path + ": IDX dimensions [1, 28, 28]", declared, "stopped after 801 bytes"}),
              testing::ExitedWithCode(0), "");
  EXPECT_EXIT(exit_zero_on_data_error_under_cap([&] { IdxFile::parse(bomb, "bomb"); },
                                                {"bomb: ", declared}),
              testing::ExitedWithCode(0), "");
}

// In a death test, under the memory cap: exits 0 when open() of `path`
// throws a DataError holding every one of `parts` and raises the peak
// resident size by less than 64 MiB (a file of gigabytes whose header
// declares a few bytes must cost what the header declares).
[[noreturn]] void exit_zero_if_open_fails_cheaply(const std::string& path,
                                                  const std::vector<std::string>& parts) {
  exit_zero_if_under_cap([&] {
    rusage usage{};
    getrusage(RUSAGE_SELF, &usage);
    const long peak_before_kib = usage.ru_maxrss;
    std::string complaint =
        conveyor::testing::data_error_mismatch([&] { IdxFile::open(path); }, parts);
    getrusage(RUSAGE_SELF, &usage);
    const long growth_mib = (usage.ru_maxrss - peak_before_kib) >> 10;
    if (complaint.empty() && growth_mib >= 64) {
      complaint = "open() raised the peak resident size by " + std::to_string(growth_mib) + " MiB";
    }
    return complaint;
  });
}

// A raw file of 9 bytes that declare one byte of data, then 512 MiB of
// nothing (sparse: no disk, reads as zeros). Before the fix open() read it
// all before comparing sizes: 512 MiB allocated and filled (under the cap,
// std::bad_alloc: an "out of memory" DataError instead of "trailing data").
TEST_F(IdxErrorTest, RawFileLongerThanItsHeaderDeclaresIsRefusedUnread) {
  const std::string path = write("sparse-idx1-ubyte", idx_bytes(0x08, {1}, {7}));
  constexpr off_t kFileBytes = off_t{512} << 20;
  ASSERT_EQ(truncate(path.c_str(), kFileBytes), 0);
  const std::string trailing = std::to_string(kFileBytes - 9) + " more (trailing data)";
  EXPECT_EXIT(exit_zero_if_open_fails_cheaply(
                  path, {path + ": IDX dimensions [1] of unsigned byte (0x08) need 1 data bytes",
                         trailing}),
              testing::ExitedWithCode(0), "");
}

// A complete gzip member declaring one byte, then a sparse GiB (no disk,
// reads as zeros). Before the fix open() read the whole file into memory
// before inflating a byte of it: the GiB was allocated and filled (under the
// cap, an "out of memory" DataError instead of the trailing garbage).
TEST_F(IdxErrorTest, SparseTailAfterAGzipMemberIsNotReadWhole) {
  const std::string path = write("sparse-idx1-ubyte.gz", gzip(idx_bytes(0x08, {1}, {7})));
  const off_t member_bytes = static_cast<off_t>(std::filesystem::file_size(path));
  constexpr off_t kFileBytes = off_t{1} << 30;
  ASSERT_EQ(truncate(path.c_str(), kFileBytes), 0);
  const std::string garbage =
      std::to_string(kFileBytes - member_bytes) + " bytes of trailing garbage";
  EXPECT_EXIT(exit_zero_if_open_fails_cheaply(path, {path + ": corrupt gzip stream: ", garbage}),
              testing::ExitedWithCode(0), "");
}

// A gzip member of a 2^30-byte IDX truncated after 4 KiB, then a sparse
// tail to 16 MiB whose last four bytes, the trailer's size hint, say about
// 1 GiB. The hint was trusted up to 64 times fstat's 16 MiB: before the fix
// open() allocated the whole GiB (zero-filled) before finding the garbage.
TEST_F(IdxErrorTest, ASparseTailsLastFourBytesDoNotSizeTheOutput) {
  std::vector<uint8_t> declared_gib = idx_bytes(0x08, {1u << 30}, {});
  declared_gib.resize(declared_gib.size() + 4096, 7);
  const std::string path = write("hinted-idx1-ubyte.gz", gzip(declared_gib));
  const off_t member_bytes = static_cast<off_t>(std::filesystem::file_size(path));
  constexpr off_t kFileBytes = off_t{16} << 20;
  ASSERT_EQ(truncate(path.c_str(), kFileBytes), 0);
  {
    std::fstream out(path, std::ios::binary | std::ios::in | std::ios::out);
    out.seekp(kFileBytes - 4);
    const char isize[4] = {'\xff', '\xff', '\xff', '\x3f'};
    out.write(isize, 4);
    ASSERT_TRUE(out.good());
  }
  const std::string garbage = std::to_string(kFileBytes - member_bytes) + " bytes of trailing garbage";
  EXPECT_EXIT(exit_zero_if_open_fails_cheaply(path, {path + ": corrupt gzip stream: ", garbage}),
              testing::ExitedWithCode(0), "");
}

// A raw file of 2^63 - 1 bytes (sparse, on tmpfs) whose header declares all
// of them: more than any buffer can be. Before the fix the vector's
// std::length_error escaped instead of a DataError naming the file.
TEST_F(IdxErrorTest, FileBiggerThanAnyBufferIsADataErrorNamingIt) {
  // 16 header bytes + 129368331 * 4837853 * 14737 data bytes = 2^63 - 1.
  const std::vector<uint8_t> header = idx_bytes(0x08, {129368331u, 4837853u, 14737u}, {});
  const std::string path =
      "/dev/shm/conveyor-idx-test-huge-" + std::to_string(getpid()) + "-idx3-ubyte";
  {
    std::ofstream out(path, std::ios::binary);
    out.write(reinterpret_cast<const char*>(header.data()), std::streamsize(header.size()));
    if (!out.good()) GTEST_SKIP() << "cannot write " << path;
  }
  const bool sparse = truncate(path.c_str(), std::numeric_limits<off_t>::max()) == 0;
  const int truncate_error = errno;
  if (!sparse) {
    std::remove(path.c_str());
    GTEST_SKIP() << "/dev/shm holds no sparse file of 2^63 - 1 bytes: "
                 << std::strerror(truncate_error);
  }
  EXPECT_EXIT(exit_zero_on_data_error_under_cap([&] { IdxFile::open(path); },
                                                {path + ": out of memory reading the file"}),
              testing::ExitedWithCode(0), "");
  std::remove(path.c_str());
}

// A file that really holds what its header declares, 1 GiB, with less
// memory than that left: a DataError naming it, not a std::bad_alloc (which
// is what escaped before the fix: the child exited 2).
TEST_F(IdxErrorTest, OutOfMemoryIsADataErrorNamingTheFile) {
#if defined(__SANITIZE_ADDRESS__)
  GTEST_SKIP() << "AddressSanitizer ends the process on a failed allocation instead of "
                  "throwing std::bad_alloc";
#endif
  const std::string path =
      write("gibibyte-idx3-ubyte.gz", gzip_bomb(idx_bytes(0x08, {1024, 1024, 1024}, {}), 1024));
  EXPECT_EXIT(exit_zero_on_data_error_under_cap(
                  [&] { IdxFile::open(path); },
                  {path + ": out of memory reading the file (std::bad_alloc)"}),
              testing::ExitedWithCode(0), "");
}

// What a header declares is only a ceiling: 2^63 bytes of float64 over a
// stream of ten must cost what the ten cost, not a reservation of the
// declared size (a fix that reserved it would fail here under the cap).
TEST_F(IdxErrorTest, AbsurdDeclaredSizeOverATinyStreamCostsNothing) {
  const std::vector<uint8_t> zipped =
      gzip(idx_bytes(0x0E, {1u << 30, 1u << 30}, counting_bytes(10)));
  const std::vector<std::string> parts = {
      "truncated IDX data", "need 9223372036854775808 data bytes", "the file has only 10"};
  EXPECT_EXIT(exit_zero_on_data_error_under_cap([&] { IdxFile::parse(zipped, "absurd"); }, parts),
              testing::ExitedWithCode(0), "");
}

// A gzip file whose data ends exactly where the header says, followed by an
// empty member, is complete: the byte looked for past the end is not there.
TEST_F(IdxErrorTest, DeclaredSizeIsExactAcrossMembers) {
  const std::vector<uint8_t> data = counting_bytes(24);
  std::vector<uint8_t> joined = gzip(idx_bytes(0x08, {3, 2, 4}, data));
  const std::vector<uint8_t> empty = gzip({});
  joined.insert(joined.end(), empty.begin(), empty.end());
  expect_three_items_of_two_by_four(IdxFile::parse(joined, "with an empty member"), data);
  // One byte more in a second member is trailing data all the same.
  const std::vector<uint8_t> one_more = gzip({0});
  joined.insert(joined.end(), one_more.begin(), one_more.end());
  const std::string path = write("one-more.gz", joined);
  std::optional<DataError> error = data_error_from([&] { IdxFile::open(path); });
  ASSERT_TRUE(error);
  EXPECT_TRUE(Contains(error->what(), "decompresses to more"));
}

// 12b: a path that is not a regular file. Before the fix /dev/zero and
// /dev/urandom were read until memory ran out (std::bad_alloc under the
// cap: the child exited 2), and the directory's error came from read().
TEST_F(IdxErrorTest, DevicesAndDirectoriesAreNotRegularFiles) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"/dev/zero", "a character device"},
      {"/dev/urandom", "a character device"},
      {directory_, "a directory"}};
  for (const auto& [path, kind] : cases) {
    SCOPED_TRACE(path);
    const std::vector<std::string> parts = {path + ": not a regular file (" + kind + ")"};
    EXPECT_EXIT(exit_zero_on_data_error_under_cap([&] { IdxFile::open(path); }, parts),
                testing::ExitedWithCode(0), "");
  }
}

// Nobody ever writes to the FIFO: before the fix open() waited for a writer
// forever (the test hung until ctest's timeout); now it is refused at once.
TEST_F(IdxErrorTest, FifoIsRefusedWithoutWaitingForAWriter) {
  const std::string fifo = directory_ + "/fifo-idx3-ubyte";
  ASSERT_EQ(mkfifo(fifo.c_str(), 0600), 0);
  const std::vector<std::string> parts = {fifo + ": not a regular file (a FIFO (named pipe))"};
  EXPECT_EXIT(exit_zero_on_data_error_under_cap([&] { IdxFile::open(fifo); }, parts),
              testing::ExitedWithCode(0), "");
}

// ---- the image dataset -----------------------------------------------------

using IdxImageDatasetTest = IdxTempDirTest;

TEST_F(IdxImageDatasetTest, GetReturnsAViewAndItsLabel) {
  const std::vector<uint8_t> pixels = counting_bytes(4 * 2 * 3);
  const std::string images = write("images.gz", gzip(idx_bytes(0x08, {4, 2, 3}, pixels)));
  const std::string labels = write("labels", idx_bytes(0x08, {4}, {9, 0, 3, 250}));
  IdxImageDataset dataset(images, labels);
  ASSERT_EQ(dataset.size(), 4u);
  EXPECT_EQ(dataset.images().name(), images);
  EXPECT_EQ(dataset.labels().name(), labels);
  const std::array<int64_t, 4> expected_labels = {9, 0, 3, 250};
  for (size_t i = 0; i < 4; ++i) {
    conveyor::LabeledImage sample = dataset.get(i);
    EXPECT_EQ(sample.label, expected_labels[i]);
    EXPECT_EQ(sample.image.shape(), (std::vector<int64_t>{1, 2, 3}));
    EXPECT_EQ(sample.image.data(), dataset.images().item(i).data());  // a view, no copy
    EXPECT_EQ(sample.image.owner(), dataset.images().item_array(i).owner());
    for (size_t k = 0; k < 6; ++k) EXPECT_EQ(sample.image[k], pixels[i * 6 + k]);
  }
  EXPECT_THROW(dataset.get(4), conveyor::IndexError);
}

TEST_F(IdxImageDatasetTest, MismatchedCountsNameBothFiles) {
  const std::string images = write("images", idx_bytes(0x08, {3, 2, 2}, counting_bytes(12)));
  const std::string labels = write("labels.gz", gzip(idx_bytes(0x08, {2}, {1, 2})));
  std::optional<DataError> error =
      data_error_from([&] { IdxImageDataset dataset(images, labels); });
  ASSERT_TRUE(error);
  EXPECT_TRUE(Contains(error->what(), images));
  EXPECT_TRUE(Contains(error->what(), labels));
  EXPECT_TRUE(Contains(error->what(), "3 images"));
  EXPECT_TRUE(Contains(error->what(), "2 labels"));
}

// 12b through the dataset: either path may be the bad one, and is named.
TEST_F(IdxImageDatasetTest, NonRegularImagesOrLabelsPathIsRefused) {
  const std::string images = write("images", idx_bytes(0x08, {2, 1, 1}, {1, 2}));
  const std::string labels = write("labels", idx_bytes(0x08, {2}, {3, 4}));
  const std::string fifo = directory_ + "/fifo";
  ASSERT_EQ(mkfifo(fifo.c_str(), 0600), 0);
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"/dev/zero", "a character device"},
      {"/dev/urandom", "a character device"},
      {fifo, "a FIFO (named pipe)"},
      {directory_, "a directory"}};
  for (const auto& [path, kind] : cases) {
    SCOPED_TRACE(path);
    const std::vector<std::string> parts = {path + ": not a regular file (" + kind + ")"};
    EXPECT_EXIT(
        exit_zero_on_data_error_under_cap([&] { IdxImageDataset dataset(path, labels); }, parts),
        testing::ExitedWithCode(0), "");
    EXPECT_EXIT(
        exit_zero_on_data_error_under_cap([&] { IdxImageDataset dataset(images, path); }, parts),
        testing::ExitedWithCode(0), "");
  }
  EXPECT_EQ(IdxImageDataset(images, labels).size(), 2u);
}

TEST_F(IdxImageDatasetTest, WrongShapesOrTypesAreDataErrors) {
  const IdxFile images = IdxFile::parse(idx_bytes(0x08, {2, 2, 2}, counting_bytes(8)), "img");
  const IdxFile labels = IdxFile::parse(idx_bytes(0x08, {2}, {1, 2}), "lab");
  EXPECT_NO_THROW(IdxImageDataset(images, labels).size());
  const IdxFile flat = IdxFile::parse(idx_bytes(0x08, {2, 4}, counting_bytes(8)), "flat");
  std::optional<DataError> error = data_error_from([&] { IdxImageDataset dataset(flat, labels); });
  ASSERT_TRUE(error);
  EXPECT_EQ(error->file(), "flat");
  EXPECT_TRUE(Contains(error->what(), "[N, H, W]"));
  const IdxFile int_labels = IdxFile::parse(idx_bytes(0x0C, {2}, counting_bytes(8)), "ints");
  error = data_error_from([&] { IdxImageDataset dataset(images, int_labels); });
  ASSERT_TRUE(error);
  EXPECT_EQ(error->file(), "ints");
  EXPECT_TRUE(Contains(error->what(), "int32"));
  // A bad file inside the path constructor is reported with its own name.
  const std::string broken = write("broken.gz", {0x1f, 0x8b, 8});
  error = data_error_from([&] { IdxImageDataset dataset(broken, broken); });
  ASSERT_TRUE(error);
  EXPECT_EQ(error->file(), broken);
}

TEST_F(IdxImageDatasetTest, FromDirectoryUsesDebianNames) {
  write("train-images-idx3-ubyte.gz", gzip(idx_bytes(0x08, {3, 1, 2}, counting_bytes(6))));
  write("train-labels-idx1-ubyte.gz", gzip(idx_bytes(0x08, {3}, {5, 6, 7})));
  write("t10k-images-idx3-ubyte.gz", gzip(idx_bytes(0x08, {1, 1, 2}, {40, 41})));
  write("t10k-labels-idx1-ubyte.gz", gzip(idx_bytes(0x08, {1}, {8})));
  IdxImageDataset train = IdxImageDataset::from_directory(directory_, true);
  IdxImageDataset test = IdxImageDataset::from_directory(directory_ + "/", false);
  EXPECT_EQ(train.size(), 3u);
  EXPECT_EQ(train.get(2).label, 7);
  ASSERT_EQ(test.size(), 1u);
  EXPECT_EQ(test.get(0).label, 8);
  EXPECT_EQ(test.get(0).image[1], 41);
  EXPECT_EQ(test.images().name(), directory_ + "/t10k-images-idx3-ubyte.gz");

  std::filesystem::remove(directory_ + "/t10k-labels-idx1-ubyte.gz");
  std::optional<DataError> error =
      data_error_from([&] { IdxImageDataset::from_directory(directory_, false); });
  ASSERT_TRUE(error);
  EXPECT_TRUE(Contains(error->what(), "t10k-labels-idx1-ubyte.gz"));
}

TEST_F(IdxImageDatasetTest, ConcurrentGetsSeeTheSameData) {
  constexpr size_t kCount = 500;
  std::vector<uint8_t> pixels(kCount * 4);
  std::vector<uint8_t> labels(kCount);
  for (size_t i = 0; i < kCount; ++i) {
    for (size_t k = 0; k < 4; ++k) pixels[i * 4 + k] = static_cast<uint8_t>(i + k);
    labels[i] = static_cast<uint8_t>(i % 10);
  }
  IdxImageDataset dataset(IdxFile::parse(gzip(idx_bytes(0x08, {kCount, 2, 2}, pixels)), "img"),
                          IdxFile::parse(idx_bytes(0x08, {kCount}, labels), "lab"));
  std::atomic<size_t> mismatches{0};
  std::vector<std::thread> threads;
  for (size_t t = 0; t < 8; ++t) {
    threads.emplace_back([&, t] {
      for (size_t round = 0; round < 20; ++round) {
        for (size_t j = 0; j < kCount; ++j) {
          const size_t i = (j * 7 + t * 61 + round) % kCount;
          conveyor::LabeledImage sample = dataset.get(i);
          if (sample.label != int64_t(i % 10) || sample.image[3] != uint8_t(i + 3)) ++mismatches;
        }
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
  EXPECT_EQ(mismatches.load(), 0u);
}

TEST_F(IdxImageDatasetTest, LoaderVisitsEverySampleOnce) {
  // Image i holds i in its first two pixels and its label is i % 10, so the
  // batches say exactly which samples came out, and with which label.
  constexpr size_t kCount = 300;
  std::vector<uint8_t> pixels(kCount * 28 * 28, 0);
  std::vector<uint8_t> labels(kCount);
  for (size_t i = 0; i < kCount; ++i) {
    pixels[i * 784] = static_cast<uint8_t>(i >> 8);
    pixels[i * 784 + 1] = static_cast<uint8_t>(i & 0xFF);
    labels[i] = static_cast<uint8_t>(i % 10);
  }
  IdxImageDataset dataset(IdxFile::parse(idx_bytes(0x08, {kCount, 28, 28}, pixels), "img"),
                          IdxFile::parse(gzip(idx_bytes(0x08, {kCount}, labels)), "lab"));
  conveyor::DataLoader loader(dataset,
                              {.batch_size = 64, .shuffle = true, .num_workers = 2, .seed = 1});
  std::vector<int> seen(kCount, 0);
  std::vector<size_t> order;
  for (auto& [images, batch_labels] : loader) {
    const int64_t batch = batch_labels.shape()[0];
    ASSERT_EQ(images.shape(), (std::vector<int64_t>{batch, 1, 28, 28}));
    for (int64_t b = 0; b < batch; ++b) {
      const size_t index = size_t(images[b * 784]) << 8 | images[b * 784 + 1];
      ASSERT_LT(index, kCount);
      ++seen[index];
      order.push_back(index);
      EXPECT_EQ(batch_labels[b], int64_t(index % 10));
    }
  }
  for (size_t i = 0; i < kCount; ++i) EXPECT_EQ(seen[i], 1) << "sample " << i;
  ASSERT_EQ(order.size(), kCount);
  bool shuffled = false;
  for (size_t i = 0; i < kCount; ++i) shuffled = shuffled || order[i] != i;
  EXPECT_TRUE(shuffled);
}

// ---- the real Fashion-MNIST files --------------------------------------------

// The expected numbers below were computed independently with Python's gzip
// module, e.g. for the train images:
//   /usr/bin/python3 -c 'import gzip; b = gzip.open("/usr/share/datasets/
//     fashion-mnist/train-images-idx3-ubyte.gz").read()[16:];
//     print(list(b[10*28:11*28]), sum(b))'
// (labels: gzip.open(...labels...).read()[8:]; image i is b[i*784:(i+1)*784]).
class IdxFashionMnist : public testing::Test {
 protected:
  // Decompressed once for the suite: 47 MB of train images.
  static void SetUpTestSuite() {
    train_ = std::make_unique<IdxImageDataset>(
        IdxImageDataset::from_directory(conveyor::kFashionMnistDirectory, true));
    test_ = std::make_unique<IdxImageDataset>(
        IdxImageDataset::from_directory(conveyor::kFashionMnistDirectory, false));
  }
  static void TearDownTestSuite() {
    train_.reset();
    test_.reset();
  }
  void SetUp() override {
    ASSERT_NE(train_, nullptr);
    ASSERT_NE(test_, nullptr);
  }

  static uint64_t pixel_sum(const conveyor::Array<uint8_t>& image) {
    uint64_t sum = 0;
    for (uint8_t value : image.values()) sum += value;
    return sum;
  }

  static inline std::unique_ptr<IdxImageDataset> train_;
  static inline std::unique_ptr<IdxImageDataset> test_;
};

TEST_F(IdxFashionMnist, SizesAndDimensions) {
  EXPECT_EQ(train_->size(), 60000u);
  EXPECT_EQ(test_->size(), 10000u);
  EXPECT_EQ(train_->images().dims(), (std::vector<int64_t>{60000, 28, 28}));
  EXPECT_EQ(train_->labels().dims(), (std::vector<int64_t>{60000}));
  EXPECT_EQ(test_->images().dims(), (std::vector<int64_t>{10000, 28, 28}));
  EXPECT_EQ(test_->labels().dims(), (std::vector<int64_t>{10000}));
  EXPECT_EQ(train_->images().type_code(), 0x08);
  EXPECT_EQ(train_->labels().type_code(), 0x08);
  EXPECT_EQ(train_->images().item_bytes(), 784u);
  EXPECT_EQ(train_->images().name(),
            std::string(conveyor::kFashionMnistDirectory) + "/train-images-idx3-ubyte.gz");
}

TEST_F(IdxFashionMnist, LabelsAreClassesZeroToNineSixThousandEach) {
  // Python: collections.Counter(labels) gives 6000 (train) / 1000 (t10k) per class.
  for (auto [dataset, per_class] : {std::pair{train_.get(), 6000}, std::pair{test_.get(), 1000}}) {
    std::array<int, 10> histogram{};
    for (size_t i = 0; i < dataset->size(); ++i) {
      const uint8_t label = dataset->labels().item(i)[0];
      ASSERT_LE(label, 9) << "label of sample " << i;
      ++histogram[label];
    }
    for (int count : histogram) EXPECT_EQ(count, per_class);
  }
}

TEST_F(IdxFashionMnist, PixelsAndLabelsMatchPython) {
  // labels[0:10] and labels[-1], from Python.
  const std::vector<int64_t> train_first = {9, 0, 0, 3, 0, 2, 7, 2, 5, 5};
  const std::vector<int64_t> test_first = {9, 2, 1, 1, 6, 1, 4, 6, 5, 7};
  for (size_t i = 0; i < 10; ++i) {
    EXPECT_EQ(train_->get(i).label, train_first[i]) << i;
    EXPECT_EQ(test_->get(i).label, test_first[i]) << i;
  }
  EXPECT_EQ(train_->get(59999).label, 5);
  EXPECT_EQ(train_->get(12345).label, 8);
  EXPECT_EQ(test_->get(9999).label, 5);

  // Row 10 of train image 0, and row 14 of train image 12345.
  const std::array<uint8_t, 28> train0_row10 = {0,   0,   0,   0,   0,   0,   0,   0,   0,   0,
                                                0,   0,   0,   193, 228, 218, 213, 198, 180, 212,
                                                210, 211, 213, 223, 220, 243, 202, 0};
  const std::array<uint8_t, 28> train12345_row14 = {
      0,   19,  207, 201, 196, 192, 188, 188, 191, 185, 187, 193, 190, 191,
      193, 196, 197, 199, 202, 205, 207, 211, 208, 206, 206, 227, 167, 0};
  const conveyor::Array<uint8_t> image0 = train_->get(0).image;
  const conveyor::Array<uint8_t> image12345 = train_->get(12345).image;
  ASSERT_EQ(image0.shape(), (std::vector<int64_t>{1, 28, 28}));
  for (size_t x = 0; x < 28; ++x) {
    EXPECT_EQ(image0[10 * 28 + x], train0_row10[x]) << x;
    EXPECT_EQ(image12345[14 * 28 + x], train12345_row14[x]) << x;
  }
  // Per-image sums and single pixels (row 14, column 14).
  EXPECT_EQ(pixel_sum(image0), 76247u);
  EXPECT_EQ(pixel_sum(train_->get(1).image), 84598u);
  EXPECT_EQ(pixel_sum(train_->get(59999).image), 16684u);
  EXPECT_EQ(train_->get(1).image[14 * 28 + 14], 204);
  EXPECT_EQ(pixel_sum(test_->get(0).image), 33456u);
  EXPECT_EQ(pixel_sum(test_->get(9999).image), 24390u);
  EXPECT_EQ(test_->get(0).image[14 * 28 + 14], 110);
  EXPECT_EQ(test_->get(9999).image[20 * 28 + 10], 57);

  // Every pixel of both files: sum(b) in Python.
  uint64_t train_sum = 0;
  for (size_t i = 0; i < train_->size(); ++i) {
    train_sum += pixel_sum(train_->images().item_array(i));
  }
  uint64_t test_sum = 0;
  for (size_t i = 0; i < test_->size(); ++i) test_sum += pixel_sum(test_->images().item_array(i));
  EXPECT_EQ(train_sum, 3431114169u);
  EXPECT_EQ(test_sum, 573469082u);
}

TEST_F(IdxFashionMnist, LoaderBatchesAWholeShuffledEpoch) {
  conveyor::DataLoader loader(*train_,
                              {.batch_size = 64, .shuffle = true, .num_workers = 2, .seed = 1});
  EXPECT_EQ(loader.size(), 938u);  // ceil(60000 / 64)
  std::array<int64_t, 10> histogram{};
  uint64_t pixels = 0;
  // sum over samples of label * pixel sum: pairs each image with its label
  // (Python: sum(lab[i] * sum(img[i*784:(i+1)*784]) for i in range(60000))).
  uint64_t label_weighted_pixels = 0;
  size_t batches = 0;
  size_t samples = 0;
  bool first_batch_in_file_order = true;
  for (auto& [images, labels] : loader) {
    const int64_t batch = batches + 1 < 938 ? 64 : 60000 - 937 * 64;  // the last holds 32
    ASSERT_EQ(images.shape(), (std::vector<int64_t>{batch, 1, 28, 28})) << "batch " << batches;
    ASSERT_EQ(labels.shape(), (std::vector<int64_t>{batch}));
    for (int64_t b = 0; b < batch; ++b) {
      const int64_t label = labels[b];
      ASSERT_GE(label, 0);
      ASSERT_LE(label, 9);
      ++histogram[label];
      uint64_t image_sum = 0;
      for (int64_t k = 0; k < 784; ++k) image_sum += images[b * 784 + k];
      pixels += image_sum;
      label_weighted_pixels += uint64_t(label) * image_sum;
      if (batches == 0 && label != train_->get(b).label) first_batch_in_file_order = false;
    }
    ++batches;
    samples += batch;
  }
  EXPECT_EQ(batches, 938u);
  EXPECT_EQ(samples, 60000u);
  for (int64_t count : histogram) EXPECT_EQ(count, 6000);
  EXPECT_EQ(pixels, 3431114169u);
  EXPECT_EQ(label_weighted_pixels, 15212046275u);
  EXPECT_FALSE(first_batch_in_file_order);  // shuffle = true
}

}  // namespace
