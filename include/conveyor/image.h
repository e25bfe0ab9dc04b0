// conveyor/image.h: JPEG (libturbojpeg) and PNG (libpng) decode and encode
// (target conveyor::formats).
//
// Images are Array<uint8_t> of shape [C, H, W], channels first like
// torchvision tensors, C = 1 (grey) or 3 (RGB). Decoding can write straight
// into memory the caller owns (decode_*_into), e.g. a slot of a batch.
//
// What decoding does with the less common cases, matching PIL's
// Image.open(...).convert("RGB" / "L") and torchvision's decode_png:
// - PNG alpha (an alpha channel or tRNS transparency) is dropped, not
//   composited: the stored colour comes back, even under alpha 0. 16-bit
//   samples are scaled to 8 bits (round(v / 257); PIL truncates, v >> 8).
//   Palette PNGs are expanded to RGB. A gAMA chunk is ignored (libpng alone
//   would gamma-correct by it).
// - CMYK/YCCK JPEGs are converted to RGB as PIL converts them (Adobe,
//   inverted CMYK).
// - RGB -> grey is ITU-R 601 luma with libjpeg's (and PIL's) fixed-point
//   constants; a colour JPEG read as grey is libjpeg's Y channel, as
//   torchvision's decode_jpeg(mode=GRAY) gives it. Grey -> RGB repeats the
//   plane.
// - A JPEG whose entropy-coded data is damaged (truncated, bad Huffman code,
//   stray restart marker) is a DataError, although libjpeg only warns and
//   fills the gap with grey. Extra bytes just before the end marker are
//   tolerated: the image is complete, and PIL and torchvision read such files.
// - An image whose header declares more than max_image_pixels() pixels is a
//   DataError, raised before any of its memory is allocated (see below).
// - Decoding throws only conveyor errors: running out of memory (or any other
//   failure inside a decoder) is a DataError naming the image too, so that
//   OnError::skip skips it.
// All functions are thread-safe.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "conveyor/array.h"

namespace conveyor {

enum class ImageFormat { jpeg, png, unknown };

// By magic bytes.
ImageFormat sniff_image_format(std::span<const uint8_t> bytes) noexcept;

struct ImageInfo {
  int width = 0;
  int height = 0;
  int channels = 0;  // as stored: 1 or 3 (PNG alpha is dropped when decoding)
};

// The decompression-bomb guard, like Pillow's Image.MAX_IMAGE_PIXELS: a few
// hundred bytes of JPEG or PNG can declare 40000 x 40000 pixels (4.8 GB as
// RGB) or more. decode_image and decode_image_into refuse an image whose
// header declares more than max_image_pixels() pixels (width * height) with
// a DataError naming the image, before allocating anything for its pixels.
// The limit is process-wide, as Pillow's is; set_max_image_pixels() changes
// it for every thread (decodes already past their header keep the old one);
// 0 means no limit. Thread-safe.
//
// The default is Pillow's: Pillow warns above 89,478,485 pixels (a quarter
// GiB of RGB) and raises DecompressionBombError above twice that,
// 178,956,970, so conveyor decodes what Pillow opens and refuses what it
// refuses. Decoding at the limit costs 512 MiB of RGB output (and as much
// again of scratch memory for colour conversion, a third more for a CMYK or
// YCCK JPEG). A progressive JPEG also holds the whole image's DCT
// coefficients while it decodes, 2 bytes a sample of each component (6 a
// pixel for full-resolution colour, 8 for CMYK): about 1 GiB more at the
// limit, taken as soon as the header is read, so a small file claiming a
// large progressive image costs that much before it fails. Lower the limit
// where that is too much.
inline constexpr uint64_t kDefaultMaxImagePixels = 178'956'970;
void set_max_image_pixels(uint64_t pixels) noexcept;
uint64_t max_image_pixels() noexcept;

// Reads the header only, allocating nothing for the pixels, so it reports
// images over max_image_pixels() too (their decode is what is refused).
// Throws DataError naming `name` for anything that is not a readable JPEG or
// PNG.
ImageInfo read_image_info(std::span<const uint8_t> bytes, const std::string& name);

// Decodes into `out`, which must hold channels * height * width bytes, laid
// out [C, H, W]. `channels` 0 keeps the stored count; 1 or 3 converts.
// Throws DataError naming `name` for corrupt or truncated data or an image
// over max_image_pixels(), and ValueError if `out` has the wrong size or
// `channels` is not 0, 1 or 3.
// Returns what was decoded: the size, and the channel count written to `out`.
ImageInfo decode_image_into(std::span<const uint8_t> bytes, std::span<uint8_t> out,
                            const std::string& name, int channels = 0);

// Decodes into a new Array [C, H, W] (memory from allocate_batch_buffer()).
Array<uint8_t> decode_image(std::span<const uint8_t> bytes, const std::string& name,
                            int channels = 0);
// The same for an image that is one member of a container, e.g. a tar
// shard's sample: errors name `file` (DataError::file()) and `member`
// (DataError::member()) apart.
Array<uint8_t> decode_image(std::span<const uint8_t> bytes, const std::string& file,
                            const std::string& member, int channels);

// Throws ValueError unless `channels` is 0 (as stored), 1 or 3: the check
// each decode above makes first, for a caller that takes the argument long
// before any bytes (the decode_image node).
void check_image_channels(int channels);

// Encodes an [C, H, W] image (C = 1 or 3). Throws ValueError for other shapes
// (and for a quality outside [1, 100]). JPEG uses 4:2:0 chroma subsampling
// and the accurate DCT, libjpeg's defaults.
std::vector<uint8_t> encode_jpeg(const Array<uint8_t>& image, int quality = 90);
std::vector<uint8_t> encode_png(const Array<uint8_t>& image);

}  // namespace conveyor
