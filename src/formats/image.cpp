// JPEG through libturbojpeg, PNG through libpng's simplified API. Both
// decoders produce interleaved HWC pixels; conveyor's images are planar
// [C, H, W]. A grey plane is decoded straight into the caller's memory (and
// copied to planes 1 and 2 for grey -> RGB); interleaved colour, and pixels
// with alpha, go through a scratch buffer.
#include "conveyor/image.h"

#include <png.h>
#include <turbojpeg.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <climits>
#include <cmath>
#include <cstring>
#include <exception>
#include <iterator>
#include <memory>
#include <new>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "conveyor/data_error.h"
#include "conveyor/errors.h"

namespace conveyor {

namespace {

constexpr uint8_t kJpegMagic[] = {0xFF, 0xD8, 0xFF};
constexpr uint8_t kPngMagic[] = {0x89, 'P', 'N', 'G', '\r', '\n', 0x1A, '\n'};

template <size_t N>
bool starts_with(std::span<const uint8_t> bytes, const uint8_t (&magic)[N]) {
  return bytes.size() >= N && std::equal(magic, magic + N, bytes.begin());
}

// Width and height are positive ints: their product fits 62 bits.
size_t pixel_count(const ImageInfo& info) {
  return static_cast<size_t>(info.width) * static_cast<size_t>(info.height);
}

// The process-wide limit behind max_image_pixels(). Relaxed is enough: it is
// one value on its own, publishing nothing else, and a decode that starts
// while another thread changes it may see either value.
std::atomic<uint64_t> g_max_image_pixels{kDefaultMaxImagePixels};

// Where an image comes from, for errors: a file, and the member inside it
// when the image is one part of a container (a tar shard's sample key).
struct ImageSource {
  const std::string& file;
  const std::string& member;

  DataError error(const std::string& what) const { return DataError(what, file, member); }
};

// Refuses, from the header alone, an image over max_image_pixels(): nothing
// of its size has been allocated yet.
void check_pixel_limit(const ImageInfo& info, const ImageSource& source) {
  const uint64_t limit = g_max_image_pixels.load(std::memory_order_relaxed);
  const uint64_t pixels = pixel_count(info);
  if (limit != 0 && pixels > limit) {
    throw source.error("image of " + std::to_string(info.width) + " x " +
                       std::to_string(info.height) + " = " + std::to_string(pixels) +
                       " pixels is over the limit of " + std::to_string(limit) +
                       " pixels (a decompression bomb?); conveyor::set_max_image_pixels() "
                       "raises it, 0 lifts it");
  }
}

// Scratch memory for interleaved pixels, allocated per call rather than kept
// per thread: a thread-local buffer would pin the largest image each worker
// ever saw, and glibc's malloc already recycles blocks of a recurring size.
// new[] without () leaves it uninitialised; the decoder writes all of it.
std::unique_ptr<uint8_t[]> scratch(size_t bytes) {
  return std::unique_ptr<uint8_t[]>(new uint8_t[bytes]);
}

// ITU-R 601 luma with the fixed-point constants libjpeg uses for RGB -> grey
// (and PIL for convert("L")), so every grey conversion agrees with both.
uint8_t luma(uint8_t red, uint8_t green, uint8_t blue) {
  return static_cast<uint8_t>((red * 19595u + green * 38470u + blue * 7471u + 0x8000u) >> 16);
}

// Interleaved pixels of `stride` samples, RGB first (RGB, RGBA), -> planar
// [3, H, W]; a fourth sample (alpha) is dropped.
void rgb_to_planar(const uint8_t* interleaved, size_t stride, size_t pixels, uint8_t* planar) {
  uint8_t* red = planar;
  uint8_t* green = planar + pixels;
  uint8_t* blue = planar + 2 * pixels;
  for (size_t i = 0; i < pixels; ++i) {
    red[i] = interleaved[stride * i];
    green[i] = interleaved[stride * i + 1];
    blue[i] = interleaved[stride * i + 2];
  }
}

void rgb_to_grey(const uint8_t* interleaved, size_t stride, size_t pixels, uint8_t* grey) {
  for (size_t i = 0; i < pixels; ++i) {
    const uint8_t* pixel = interleaved + stride * i;
    grey[i] = luma(pixel[0], pixel[1], pixel[2]);
  }
}

// Grey + alpha (GA) -> the grey plane.
void drop_alpha(const uint8_t* grey_alpha, size_t pixels, uint8_t* grey) {
  for (size_t i = 0; i < pixels; ++i) grey[i] = grey_alpha[2 * i];
}

// The grey plane already sits in plane 0 of a [3, H, W] buffer: copy it to
// planes 1 and 2 (grey -> RGB, as libjpeg and PIL convert).
void replicate_grey_plane(uint8_t* planar, size_t pixels) {
  std::memcpy(planar + pixels, planar, pixels);
  std::memcpy(planar + 2 * pixels, planar, pixels);
}

// round(a * b / 255) in integers, PIL's MULDIV255.
unsigned muldiv255(unsigned a, unsigned b) {
  const unsigned product = a * b + 128;
  return ((product >> 8) + product) >> 8;
}

// Interleaved CMYK as libjpeg returns it for Adobe (Photoshop) files, whose
// samples are stored inverted -> interleaved RGB. PIL's formula, so a CMYK
// JPEG decodes to what Image.open(...).convert("RGB") gives. In place: the
// RGB of pixel i lands on bytes 3i..3i+2, none of them after a byte of pixel
// i still unread (4i+c for c > the channel written), nor on a later pixel.
void inverted_cmyk_to_rgb_in_place(uint8_t* pixels_cmyk, size_t pixels) {
  for (size_t i = 0; i < pixels; ++i) {
    const unsigned black = pixels_cmyk[4 * i + 3];
    for (size_t c = 0; c < 3; ++c) {
      pixels_cmyk[3 * i + c] = static_cast<uint8_t>(black - muldiv255(255u - pixels_cmyk[4 * i + c], black));
    }
  }
}

// ---- JPEG ---------------------------------------------------------------------

struct TurboJpegDeleter {
  void operator()(void* handle) const noexcept { tjDestroy(handle); }
};
using TurboJpegHandle = std::unique_ptr<void, TurboJpegDeleter>;

enum class TurboJpegRole { decompress, compress };

TurboJpegHandle new_handle(TurboJpegRole role) {
  TurboJpegHandle handle(role == TurboJpegRole::decompress ? tjInitDecompress() : tjInitCompress());
  if (!handle) {
    throw RuntimeError(std::string("TurboJPEG: cannot create a handle: ") + tjGetErrorStr2(nullptr));
  }
  return handle;
}

// One TurboJPEG handle per thread and role, created lazily and destroyed when
// the thread exits. Handles are not thread-safe (each holds a libjpeg
// decompressor's state), so they cannot be shared; making one per call costs
// a malloc and libjpeg's setup on every image, which a thread-local avoids.
// A decompressor keeps the quantization and Huffman tables of the images it
// has read, though: see uses_only_its_own_tables.
TurboJpegHandle& thread_slot(TurboJpegRole role) {
  thread_local TurboJpegHandle decompressor;
  thread_local TurboJpegHandle compressor;
  return role == TurboJpegRole::decompress ? decompressor : compressor;
}

tjhandle thread_handle(TurboJpegRole role) {
  TurboJpegHandle& slot = thread_slot(role);
  if (!slot) slot = new_handle(role);
  return slot.get();
}

// Reads the error of the last call on this thread's handle for `role`, then
// throws the handle away: after libjpeg longjmps out of tjDecompressHeader3
// the decompressor is left mid-header and would reject the next image, so a
// failed handle is never reused. The message is copied first because it may
// live in the handle.
std::string take_error_and_discard(TurboJpegRole role) {
  TurboJpegHandle& slot = thread_slot(role);
  std::string message = tjGetErrorStr2(slot.get());
  slot.reset();
  return message;
}

// libjpeg reports damaged entropy-coded data ("Premature end of JPEG file",
// "Corrupt JPEG data: premature end of data segment", bad Huffman codes) as
// warnings and fills what is missing with grey. Every warning is therefore
// treated as an error, with one exception: stray bytes just before the EOI
// marker. By then every scan has been decoded; real-world files carry such
// padding (ImageNet's among them) and PIL and torchvision read them.
bool harmless_warning(const std::string& message) {
  return message.find("extraneous bytes before marker 0xd9") != std::string::npos;
}

// Whether every table the decode of `jpeg` uses is defined in `jpeg` itself.
// libjpeg keeps DQT and DHT tables in the decompressor from one image to the
// next (SOI resets only the restart interval and arithmetic conditioning),
// so on a reused handle a file without its own tables decodes with the last
// image's, and the result would depend on which worker read what before.
// What libjpeg looks up: the quantization table of each component when the
// first scan holding it starts; for Huffman coding, each scan's DC and AC
// tables (progressive: DC for a first DC scan, AC for an AC scan). Walks the
// marker segments, skipping entropy-coded data (up to a 0xFF that is not a
// stuffed 0x00, a restart marker or fill). False also for a malformed marker
// structure, which a fresh handle then reports.
bool uses_only_its_own_tables(std::span<const uint8_t> jpeg) {
  constexpr size_t kTableSlots = 4;
  bool quantization_defined[kTableSlots] = {};
  bool dc_defined[kTableSlots] = {};
  bool ac_defined[kTableSlots] = {};
  struct Component {
    uint8_t id;
    uint8_t quantization_table;
    bool scanned;
  };
  // The frame's; libjpeg takes at most 10 (MAX_COMPONENTS). No heap: this
  // runs before every decode.
  std::array<Component, 10> components{};
  size_t component_count = 0;
  bool have_frame = false;
  bool huffman = false;
  bool progressive = false;
  const size_t size = jpeg.size();
  size_t at = 2;  // after SOI
  for (;;) {
    if (at >= size) return true;  // cut short: nothing more is decoded
    if (jpeg[at] != 0xFF) return false;
    while (at < size && jpeg[at] == 0xFF) ++at;  // fill bytes
    if (at >= size) return true;
    const uint8_t marker = jpeg[at++];
    if (marker == 0xD9) return true;  // EOI
    if (marker == 0xD8 || marker == 0x00) return false;
    if ((marker >= 0xD0 && marker <= 0xD7) || marker == 0x01) continue;  // RSTn, TEM: no length
    if (size - at < 2) return false;
    const size_t length = size_t{jpeg[at]} << 8 | jpeg[at + 1];
    if (length < 2 || length > size - at) return false;
    const uint8_t* data = jpeg.data() + at + 2;
    const size_t data_length = length - 2;
    at += length;

    if (marker == 0xDB) {  // DQT: Pq/Tq, then 64 samples of 8 (Pq 0) or 16 bits (Pq 1)
      for (size_t i = 0; i < data_length;) {
        const unsigned precision = data[i] >> 4;
        const unsigned slot = data[i] & 0x0F;
        const size_t table_length = 1 + (precision == 0 ? 64 : 128);
        if (precision > 1 || slot >= kTableSlots || table_length > data_length - i) return false;
        quantization_defined[slot] = true;
        i += table_length;
      }
    } else if (marker == 0xC4) {  // DHT: Tc/Th, 16 code counts, the symbols
      for (size_t i = 0; i < data_length;) {
        if (data_length - i < 17) return false;
        const unsigned table_class = data[i] >> 4;
        const unsigned slot = data[i] & 0x0F;
        size_t symbols = 0;
        for (size_t k = 1; k <= 16; ++k) symbols += data[i + k];
        if (table_class > 1 || slot >= kTableSlots || symbols > data_length - i - 17) return false;
        (table_class == 0 ? dc_defined : ac_defined)[slot] = true;
        i += 17 + symbols;
      }
    } else if ((marker >= 0xC0 && marker <= 0xCF) && marker != 0xC4 && marker != 0xC8 &&
               marker != 0xCC) {  // SOFn: P, Y, X, Nf, then Ci, Hi/Vi, Tqi per component
      if (have_frame || data_length < 6) return false;
      const size_t count = data[5];
      if (count == 0 || count > components.size() || data_length != 6 + 3 * count) return false;
      for (size_t c = 0; c < count; ++c) {
        const uint8_t slot = data[6 + 3 * c + 2];
        if (slot >= kTableSlots) return false;
        components[component_count++] = {data[6 + 3 * c], slot, false};
      }
      have_frame = true;
      huffman = marker <= 0xC7;
      progressive = marker == 0xC2 || marker == 0xC6;
    } else if (marker == 0xDA) {  // SOS: Ns, Cs and Td/Ta per component, Ss, Se, Ah/Al
      if (!have_frame || data_length < 1) return false;
      const size_t count = data[0];
      if (count == 0 || data_length != 1 + 2 * count + 3) return false;
      const unsigned spectral_start = data[1 + 2 * count];
      const unsigned successive_high = data[3 + 2 * count] >> 4;
      const bool needs_dc = !progressive || (spectral_start == 0 && successive_high == 0);
      const bool needs_ac = !progressive || spectral_start > 0;
      for (size_t k = 0; k < count; ++k) {
        const uint8_t id = data[1 + 2 * k];
        const unsigned dc_slot = data[2 + 2 * k] >> 4;
        const unsigned ac_slot = data[2 + 2 * k] & 0x0F;
        const auto end = components.begin() + static_cast<std::ptrdiff_t>(component_count);
        const auto component =
            std::find_if(components.begin(), end, [id](const Component& c) { return c.id == id; });
        if (component == end) return false;
        if (!component->scanned && !quantization_defined[component->quantization_table]) {
          return false;
        }
        component->scanned = true;
        if (huffman && needs_dc && (dc_slot >= kTableSlots || !dc_defined[dc_slot])) return false;
        if (huffman && needs_ac && (ac_slot >= kTableSlots || !ac_defined[ac_slot])) return false;
      }
      // The entropy-coded data runs to the next marker.
      for (;;) {
        const void* found = std::memchr(jpeg.data() + at, 0xFF, size - at);
        if (found == nullptr) return true;
        at = static_cast<size_t>(static_cast<const uint8_t*>(found) - jpeg.data());
        if (at + 1 >= size) return true;
        const uint8_t next = jpeg[at + 1];
        if (next == 0xFF) {
          at += 1;  // fill: the marker comes after
        } else if (next == 0x00 || (next >= 0xD0 && next <= 0xD7)) {
          at += 2;  // a stuffed 0xFF data byte, or a restart marker
        } else {
          break;
        }
      }
    }
  }
}

class JpegDecoder {
 public:
  JpegDecoder(std::span<const uint8_t> bytes, const ImageSource& source)
      : bytes_(bytes), source_(source), reuse_thread_handle_(uses_only_its_own_tables(bytes)) {
    tjhandle handle = this->handle();
    int width = 0;
    int height = 0;
    int subsampling = -2;  // tjDecompressHeader3 stores -1 when it cannot classify it
    int colorspace = -1;
    if (tjDecompressHeader3(handle, bytes.data(), bytes.size(), &width, &height, &subsampling,
                            &colorspace) != 0) {
      // TurboJPEG rejects chroma subsampling it has no name for (e.g. 3x1),
      // though libjpeg decodes it fine: accept that one complaint when the
      // rest of the header was read.
      const bool only_unnamed_subsampling = subsampling == -1 && width > 0 && height > 0 &&
                                            colorspace >= 0 &&
                                            tjGetErrorCode(handle) == TJERR_FATAL;
      std::string reason = take_error();
      if (!only_unnamed_subsampling) throw source.error("unreadable JPEG header: " + reason);
    } else if (width < 1 || height < 1 || colorspace < 0) {
      // TurboJPEG 2.1 returns success, filling in nothing, for a stream
      // with tables but no image, which is also what a header cut short
      // looks like once libjpeg has warned and inserted an end marker.
      const bool warned = tjGetErrorCode(handle) == TJERR_WARNING;
      std::string reason = take_error();
      throw source.error("unreadable JPEG header: " +
                         (warned ? reason : std::string("no image in the data (tables only)")));
    }
    colorspace_ = colorspace;
    info_.width = width;
    info_.height = height;
    info_.channels = colorspace == TJCS_GRAY ? 1 : 3;
  }

  const ImageInfo& info() const noexcept { return info_; }

  void decode_into(std::span<uint8_t> out, int out_channels) {
    const size_t pixels = pixel_count(info_);
    const bool cmyk = colorspace_ == TJCS_CMYK || colorspace_ == TJCS_YCCK;
    if (cmyk) {
      // libjpeg cannot convert CMYK to RGB or grey itself.
      // One scratch buffer, converted in place: 4 bytes a pixel beside the
      // output, not 7.
      std::unique_ptr<uint8_t[]> rgb = scratch(4 * pixels);
      decompress(rgb.get(), TJPF_CMYK);
      inverted_cmyk_to_rgb_in_place(rgb.get(), pixels);
      if (out_channels == 1) {
        rgb_to_grey(rgb.get(), 3, pixels, out.data());
      } else {
        rgb_to_planar(rgb.get(), 3, pixels, out.data());
      }
    } else if (out_channels == 1) {
      decompress(out.data(), TJPF_GRAY);  // libjpeg keeps Y, or computes it from RGB
    } else if (info_.channels == 1) {
      decompress(out.data(), TJPF_GRAY);
      replicate_grey_plane(out.data(), pixels);
    } else {
      std::unique_ptr<uint8_t[]> rgb = scratch(3 * pixels);
      decompress(rgb.get(), TJPF_RGB);
      rgb_to_planar(rgb.get(), 3, pixels, out.data());
    }
  }

 private:
  // This thread's handle, or for a file that would read tables left in it by
  // other images, one of its own, made for this call only: such a file then
  // decodes (or fails) the same on every worker.
  tjhandle handle() {
    if (reuse_thread_handle_) return thread_handle(TurboJpegRole::decompress);
    if (!own_handle_) own_handle_ = new_handle(TurboJpegRole::decompress);
    return own_handle_.get();
  }

  // The last call's error; the handle that failed is not used again (see
  // take_error_and_discard).
  std::string take_error() {
    if (reuse_thread_handle_) return take_error_and_discard(TurboJpegRole::decompress);
    std::string message = tjGetErrorStr2(own_handle_.get());
    own_handle_.reset();
    return message;
  }

  void decompress(uint8_t* destination, int pixel_format) {
    tjhandle handle = this->handle();
    // LIMITSCANS: a progressive file with thousands of tiny scans is a known
    // way to make libjpeg spin for minutes; it becomes an error instead.
    if (tjDecompress2(handle, bytes_.data(), bytes_.size(), destination, info_.width,
                      /*pitch=*/0, info_.height, pixel_format, TJFLAG_LIMITSCANS) == 0) {
      return;
    }
    const bool warning = tjGetErrorCode(handle) == TJERR_WARNING;
    std::string reason = take_error();
    if (warning && harmless_warning(reason)) return;
    throw source_.error((warning ? "truncated or corrupt JPEG: " : "cannot decode JPEG: ") +
                        reason);
  }

  std::span<const uint8_t> bytes_;
  const ImageSource& source_;
  bool reuse_thread_handle_;
  TurboJpegHandle own_handle_;
  ImageInfo info_;
  int colorspace_ = -1;
};

// ---- PNG ----------------------------------------------------------------------

// Frees libpng's state on every exit; png_image_free is a no-op once libpng
// has freed it itself (it does after errors and after finish_read).
class PngImage {
 public:
  PngImage() {
    std::memset(&image_, 0, sizeof(image_));
    image_.version = PNG_IMAGE_VERSION;
  }
  ~PngImage() { png_image_free(&image_); }
  PngImage(const PngImage&) = delete;
  PngImage& operator=(const PngImage&) = delete;
  png_image* get() noexcept { return &image_; }
  png_image* operator->() noexcept { return &image_; }

 private:
  png_image image_;
};

constexpr int kGamma1Over2_2 = 45455;  // gAMA stores gamma * 100000

// The ancillary chunks libpng's simplified API reads for the pixels: the
// list png_image_skip_unused_chunks (pngread.c) keeps for the chunks after
// IDAT. Those before IDAT it reads all, and keeps every zTXt and iTXt
// inflated (up to 8 MB each, 1000 chunks): a small file of text chunks
// would cost gigabytes.
constexpr const char* kPixelChunks[] = {"tRNS", "bKGD", "cHRM", "gAMA", "iCCP",
                                        "sBIT", "sRGB", "cICP", "mDCV"};

bool is_pixel_chunk(const uint8_t* type) {
  return std::any_of(std::begin(kPixelChunks), std::end(kPixelChunks),
                     [type](const char* kept) { return std::memcmp(type, kept, 4) == 0; });
}

// Returns the file without the chunks before IDAT that the decode must not
// read, or nothing when it has none (then it costs no copy).
// Critical chunks (an upper-case first letter) stay, known or not, for
// libpng to check. Of the ancillary ones, only kPixelChunks stay (text,
// EXIF, pHYs, tIME, private chunks... go), and gAMA only when it is the
// usual 1/2.2, which libpng takes for sRGB: libpng gamma-corrects to sRGB by
// any other gAMA (a gamma 1.0 file comes out much brighter), whereas PIL and
// torchvision ignore gAMA and return the stored samples.
std::vector<uint8_t> without_unused_chunks(std::span<const uint8_t> png) {
  std::vector<std::pair<size_t, size_t>> dropped;  // [begin, end) offsets
  // Chunks until IDAT: 4-byte big-endian length, 4-byte type, data, 4-byte
  // CRC. Stops at anything malformed, which libpng then reports.
  constexpr size_t kMaxChunkLength = 0x7FFFFFFF;  // PNG's limit
  size_t at = sizeof kPngMagic;
  while (at + 12 <= png.size()) {
    const uint8_t* chunk = png.data() + at;
    const uint8_t* type = chunk + 4;
    const size_t length =
        size_t{chunk[0]} << 24 | size_t{chunk[1]} << 16 | size_t{chunk[2]} << 8 | size_t{chunk[3]};
    if (length > kMaxChunkLength || length > png.size() - at - 12 ||
        std::memcmp(type, "IDAT", 4) == 0) {
      break;
    }
    const bool critical = (type[0] & 0x20) == 0;
    const bool srgb_gamma = length == 4 && chunk[8] == 0 && chunk[9] == 0 &&
                            (chunk[10] << 8 | chunk[11]) == kGamma1Over2_2;
    const bool keep = critical || (std::memcmp(type, "gAMA", 4) == 0 ? srgb_gamma
                                                                      : is_pixel_chunk(type));
    if (!keep) dropped.emplace_back(at, at + 12 + length);
    at += 12 + length;
  }
  if (dropped.empty()) return {};
  std::vector<uint8_t> stripped;
  stripped.reserve(png.size());
  size_t kept_from = 0;
  for (const auto& [begin, end] : dropped) {
    stripped.insert(stripped.end(), png.begin() + static_cast<std::ptrdiff_t>(kept_from),
                    png.begin() + static_cast<std::ptrdiff_t>(begin));
    kept_from = end;
  }
  stripped.insert(stripped.end(), png.begin() + static_cast<std::ptrdiff_t>(kept_from), png.end());
  return stripped;
}

uint64_t big_endian_32(const uint8_t* bytes) {
  return uint64_t{bytes[0]} << 24 | uint64_t{bytes[1]} << 16 | uint64_t{bytes[2]} << 8 | bytes[3];
}

// The most IDAT bytes an encoder writes for the image its IHDR describes
// (the file's first chunk, which libpng has checked): its filtered rows
// (those of every Adam7 pass when interlaced) stored uncompressed in
// blocks of 320 bytes or more, a flush after every row, and 4 KiB to
// spare. More is compressed data past the image's end, which libpng's
// simplified API inflates to its end only to warn of it: 1 GiB of zeros
// behind a 1x1 image, 1 MB of file, took 4 s. In double: at the pixel
// limit's largest settings the counts pass 2^64.
double max_idat_bytes(std::span<const uint8_t> png) {
  const uint8_t* ihdr = png.data() + sizeof kPngMagic + 8;
  const double width = static_cast<double>(big_endian_32(ihdr));
  const double height = static_cast<double>(big_endian_32(ihdr + 4));
  const unsigned depth = ihdr[8], color_type = ihdr[9];
  const bool interlaced = ihdr[12] != 0;
  const unsigned channels = color_type == 2 ? 3 : color_type == 4 ? 2 : color_type == 6 ? 4 : 1;
  const double bits_per_pixel = channels * depth;
  double raw = 0, rows = 0;
  const auto add_pass = [&](double columns, double pass_rows) {
    if (columns <= 0 || pass_rows <= 0) return;
    raw += pass_rows * (1 + std::ceil(columns * bits_per_pixel / 8));
    rows += pass_rows;
  };
  if (!interlaced) {
    add_pass(width, height);
  } else {
    // Adam7: each pass's first column and row, and its steps.
    constexpr int kX0[] = {0, 4, 0, 2, 0, 1, 0}, kDx[] = {8, 8, 4, 4, 2, 2, 1};
    constexpr int kY0[] = {0, 0, 4, 0, 2, 0, 1}, kDy[] = {8, 8, 8, 4, 4, 2, 2};
    for (int pass = 0; pass < 7; ++pass) {
      add_pass(std::ceil((width - kX0[pass]) / kDx[pass]), std::ceil((height - kY0[pass]) / kDy[pass]));
    }
  }
  return raw + raw / 64 + 16 * rows + 4096;
}

// The IDAT chunks' bytes together, up to IEND or the first malformed chunk
// (libpng reports that one).
uint64_t idat_bytes(std::span<const uint8_t> png) {
  uint64_t total = 0;
  size_t at = sizeof kPngMagic;
  while (at + 12 <= png.size()) {
    const uint64_t length = big_endian_32(png.data() + at);
    if (length > png.size() - at - 12) break;
    const uint8_t* type = png.data() + at + 4;
    if (std::memcmp(type, "IEND", 4) == 0) break;
    if (std::memcmp(type, "IDAT", 4) == 0) total += length;
    at += 12 + static_cast<size_t>(length);
  }
  return total;
}

class PngDecoder {
 public:
  PngDecoder(std::span<const uint8_t> bytes, const ImageSource& source)
      : bytes_(bytes), stripped_(without_unused_chunks(bytes)), source_(source) {
    // libpng reads the pixels from this memory again in finish_read.
    const std::span<const uint8_t> file = stripped_.empty() ? bytes : stripped_;
    if (png_image_begin_read_from_memory(png_.get(), file.data(), file.size()) == 0) {
      throw source.error(std::string("unreadable PNG header: ") + png_->message);
    }
    // Without gAMA/sRGB, libpng would take 16-bit samples for linear light and
    // gamma-encode them on the way to 8 bits; PIL and torchvision just scale.
    png_->flags |= PNG_IMAGE_FLAG_16BIT_sRGB;
    has_alpha_ = (png_->format & PNG_FORMAT_FLAG_ALPHA) != 0;
    info_.width = static_cast<int>(png_->width);
    info_.height = static_cast<int>(png_->height);
    info_.channels = (png_->format & PNG_FORMAT_FLAG_COLOR) != 0 ? 3 : 1;
  }

  const ImageInfo& info() const noexcept { return info_; }

  // Alpha (an alpha channel, or tRNS transparency) is read and then dropped,
  // as PIL's convert("RGB") and torchvision's decode_png drop it; libpng
  // returns 8-bit colour with straight, not premultiplied, alpha.
  void decode_into(std::span<uint8_t> out, int out_channels) {
    const uint64_t image_data = idat_bytes(bytes_);
    const double most = max_idat_bytes(bytes_);
    if (static_cast<double>(image_data) > most) {
      throw source_.error("the PNG holds " + std::to_string(image_data) + " bytes of image data (IDAT), more than a " +
                          std::to_string(info_.width) + "x" + std::to_string(info_.height) +
                          " image needs (at most " + std::to_string(static_cast<uint64_t>(most)) +
                          "): compressed data past the image's end is refused, not inflated");
    }
    const size_t pixels = pixel_count(info_);
    if (info_.channels == 1 && !has_alpha_) {
      finish(out.data(), PNG_FORMAT_GRAY);
      if (out_channels == 3) replicate_grey_plane(out.data(), pixels);
      return;
    }
    if (info_.channels == 1) {
      std::unique_ptr<uint8_t[]> grey_alpha = scratch(2 * pixels);
      finish(grey_alpha.get(), PNG_FORMAT_GA);
      drop_alpha(grey_alpha.get(), pixels, out.data());
      if (out_channels == 3) replicate_grey_plane(out.data(), pixels);
      return;
    }
    const size_t stride = has_alpha_ ? 4 : 3;
    std::unique_ptr<uint8_t[]> rgb = scratch(stride * pixels);
    finish(rgb.get(), has_alpha_ ? PNG_FORMAT_RGBA : PNG_FORMAT_RGB);
    if (out_channels == 1) {
      rgb_to_grey(rgb.get(), stride, pixels, out.data());
    } else {
      rgb_to_planar(rgb.get(), stride, pixels, out.data());
    }
  }

 private:
  void finish(uint8_t* destination, png_uint_32 format) {
    png_->format = format;
    const png_int_32 row_stride = static_cast<png_int_32>(PNG_IMAGE_ROW_STRIDE(*png_.get()));
    // Warnings (a bad ancillary chunk, an odd iCCP profile) leave the pixels
    // intact; truncation, bad CRCs and zlib errors are errors and fail here.
    // No background colour: the formats asked for keep the alpha channel.
    if (png_image_finish_read(png_.get(), /*background=*/nullptr, destination, row_stride,
                              /*colormap=*/nullptr) == 0) {
      throw source_.error(std::string("corrupt PNG data: ") + png_->message);
    }
  }

  std::span<const uint8_t> bytes_;
  std::vector<uint8_t> stripped_;
  PngImage png_;
  const ImageSource& source_;
  ImageInfo info_;
  bool has_alpha_ = false;
};

// Runs `use(decoder)` with the decoder for the format of `bytes`, its header
// already read. Only conveyor errors leave: anything else (std::bad_alloc for
// an image too big for the memory left, a length_error) becomes a DataError
// naming the image, which OnError::skip can skip.
template <class Use>
decltype(auto) with_decoder(std::span<const uint8_t> bytes, const ImageSource& source, Use&& use) {
  try {
    switch (sniff_image_format(bytes)) {
      case ImageFormat::jpeg: {
        JpegDecoder decoder(bytes, source);
        return use(decoder);
      }
      case ImageFormat::png: {
        PngDecoder decoder(bytes, source);
        return use(decoder);
      }
      case ImageFormat::unknown:
        break;
    }
  } catch (const Error&) {
    throw;
  } catch (const std::bad_alloc&) {
    throw source.error("out of memory decoding the image (std::bad_alloc)");
  } catch (const std::exception& error) {
    throw source.error(std::string("cannot decode the image: ") + error.what());
  }
  if (bytes.empty()) throw source.error("empty image data (0 bytes)");
  throw source.error("not a JPEG or PNG image (unrecognised signature, " +
                     std::to_string(bytes.size()) + " bytes)");
}

int output_channels(int requested, const ImageInfo& stored) {
  return requested == 0 ? stored.channels : requested;
}

// Checks an image to encode: [C, H, W], C = 1 or 3, no empty extent.
void check_encodable(const Array<uint8_t>& image, const char* function, int64_t max_extent) {
  const std::vector<int64_t>& shape = image.shape();
  if (shape.size() != 3 || (shape[0] != 1 && shape[0] != 3)) {
    throw ValueError(std::string(function) +
                     ": expected an image of shape [C, H, W] with C = 1 or 3, got " +
                     shape_string(shape));
  }
  if (shape[1] < 1 || shape[2] < 1 || shape[1] > max_extent || shape[2] > max_extent) {
    throw ValueError(std::string(function) + ": height and width must be in [1, " +
                     std::to_string(max_extent) + "], got " + shape_string(shape));
  }
  if (image.data() == nullptr) throw ValueError(std::string(function) + ": the image has no data");
}

// [C, H, W] -> what the encoders take: the plane itself for grey, else
// interleaved RGB in `storage`.
const uint8_t* interleaved_pixels(const Array<uint8_t>& image,
                                  std::unique_ptr<uint8_t[]>& storage) {
  if (image.shape()[0] == 1) return image.data();
  const size_t pixels =
      static_cast<size_t>(image.shape()[1]) * static_cast<size_t>(image.shape()[2]);
  storage = scratch(3 * pixels);
  const uint8_t* planar = image.data();
  for (size_t i = 0; i < pixels; ++i) {
    storage[3 * i] = planar[i];
    storage[3 * i + 1] = planar[pixels + i];
    storage[3 * i + 2] = planar[2 * pixels + i];
  }
  return storage.get();
}

struct TurboJpegBufferDeleter {
  void operator()(unsigned char* buffer) const noexcept { tjFree(buffer); }
};

}  // namespace

// Validated before any parsing, so a bad argument is a ValueError whatever the
// bytes hold.
void check_image_channels(int channels) {
  if (channels != 0 && channels != 1 && channels != 3) {
    throw ValueError("decode_image: channels must be 0 (as stored), 1 or 3, got " + std::to_string(channels));
  }
}

ImageFormat sniff_image_format(std::span<const uint8_t> bytes) noexcept {
  if (starts_with(bytes, kJpegMagic)) return ImageFormat::jpeg;
  if (starts_with(bytes, kPngMagic)) return ImageFormat::png;
  return ImageFormat::unknown;
}

ImageInfo read_image_info(std::span<const uint8_t> bytes, const std::string& name) {
  const std::string no_member;
  return with_decoder(bytes, ImageSource{name, no_member},
                      [](auto& decoder) { return decoder.info(); });
}

ImageInfo decode_image_into(std::span<const uint8_t> bytes, std::span<uint8_t> out,
                            const std::string& name, int channels) {
  check_image_channels(channels);
  const std::string no_member;
  const ImageSource source{name, no_member};
  return with_decoder(bytes, source, [&](auto& decoder) {
    const ImageInfo& stored = decoder.info();
    // Before the size check: an image over the limit is bad data, whatever
    // `out` holds.
    check_pixel_limit(stored, source);
    const int out_channels = output_channels(channels, stored);
    const size_t expected = static_cast<size_t>(out_channels) * pixel_count(stored);
    if (out.size() != expected) {
      throw ValueError("decode_image_into: " + name + " decodes to " +
                       shape_string({out_channels, stored.height, stored.width}) + " = " +
                       std::to_string(expected) + " bytes, but out holds " +
                       std::to_string(out.size()) + " bytes");
    }
    decoder.decode_into(out, out_channels);
    return ImageInfo{stored.width, stored.height, out_channels};
  });
}

Array<uint8_t> decode_image(std::span<const uint8_t> bytes, const std::string& file,
                            const std::string& member, int channels) {
  check_image_channels(channels);
  const ImageSource source{file, member};
  return with_decoder(bytes, source, [&](auto& decoder) {
    const ImageInfo& stored = decoder.info();
    check_pixel_limit(stored, source);
    const int out_channels = output_channels(channels, stored);
    Array<uint8_t> image({out_channels, stored.height, stored.width});
    decoder.decode_into(image.values(), out_channels);
    return image;
  });
}

Array<uint8_t> decode_image(std::span<const uint8_t> bytes, const std::string& name, int channels) {
  return decode_image(bytes, name, std::string(), channels);
}

void set_max_image_pixels(uint64_t pixels) noexcept {
  g_max_image_pixels.store(pixels, std::memory_order_relaxed);
}

uint64_t max_image_pixels() noexcept { return g_max_image_pixels.load(std::memory_order_relaxed); }

std::vector<uint8_t> encode_jpeg(const Array<uint8_t>& image, int quality) {
  if (quality < 1 || quality > 100) {
    throw ValueError("encode_jpeg: quality must be in [1, 100], got " + std::to_string(quality));
  }
  check_encodable(image, "encode_jpeg", /*JPEG_MAX_DIMENSION=*/65500);
  const bool grey = image.shape()[0] == 1;
  const int height = static_cast<int>(image.shape()[1]);
  const int width = static_cast<int>(image.shape()[2]);
  std::unique_ptr<uint8_t[]> interleaved;
  const uint8_t* pixels = interleaved_pixels(image, interleaved);

  tjhandle handle = thread_handle(TurboJpegRole::compress);
  unsigned char* jpeg = nullptr;  // TurboJPEG allocates it
  unsigned long jpeg_size = 0;
  // 4:2:0 chroma like libjpeg's, PIL's and torchvision's defaults; the
  // accurate DCT as libjpeg uses by default (TurboJPEG would pick the fast one).
  const int status =
      tjCompress2(handle, pixels, width, /*pitch=*/0, height, grey ? TJPF_GRAY : TJPF_RGB, &jpeg,
                  &jpeg_size, grey ? TJSAMP_GRAY : TJSAMP_420, quality, TJFLAG_ACCURATEDCT);
  std::unique_ptr<unsigned char, TurboJpegBufferDeleter> owned(jpeg);
  if (status != 0) {
    throw RuntimeError("encode_jpeg: " + take_error_and_discard(TurboJpegRole::compress));
  }
  return std::vector<uint8_t>(jpeg, jpeg + jpeg_size);
}

std::vector<uint8_t> encode_png(const Array<uint8_t>& image) {
  // Rows are addressed with a png_int_32 stride of width * C bytes.
  check_encodable(image, "encode_png", INT_MAX / 3);
  const bool grey = image.shape()[0] == 1;
  std::unique_ptr<uint8_t[]> interleaved;
  const uint8_t* pixels = interleaved_pixels(image, interleaved);

  PngImage png;
  png->width = static_cast<png_uint_32>(image.shape()[2]);
  png->height = static_cast<png_uint_32>(image.shape()[1]);
  png->format = grey ? PNG_FORMAT_GRAY : PNG_FORMAT_RGB;
  // libpng's worst case (the data stored, not compressed), so one pass is
  // enough. Its PNG_IMAGE_DATA_SIZE computes in 32 bits; this is the same sum
  // (a filter byte per row) in 64, so a multi-GiB image cannot wrap it.
  const png_alloc_size_t data_size =
      png_alloc_size_t{png->height} * (png_alloc_size_t{png->width} * (grey ? 1 : 3) + 1);
  std::vector<uint8_t> encoded(PNG_IMAGE_PNG_SIZE_MAX_(*png.get(), PNG_ZLIB_MAX_SIZE(data_size)));
  png_alloc_size_t encoded_size = encoded.size();
  if (png_image_write_to_memory(png.get(), encoded.data(), &encoded_size, /*convert_to_8_bit=*/0,
                                pixels, /*row_stride=*/0, /*colormap=*/nullptr) == 0) {
    throw RuntimeError(std::string("encode_png: ") + png->message);
  }
  encoded.resize(encoded_size);
  return encoded;
}

}  // namespace conveyor
