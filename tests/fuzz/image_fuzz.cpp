// libFuzzer target for the JPEG/PNG decoders (conveyor/image.h). Malformed
// input must end in a conveyor::Error (DataError); any other exception, a
// crash, a sanitizer report or a decoded shape that disagrees with the header
// is a bug.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <span>
#include <vector>

#include "conveyor/data_error.h"
#include "conveyor/errors.h"
#include "conveyor/image.h"

namespace {

// A 40-byte JPEG header may claim 65500 x 65500 pixels. The decoders refuse
// images over max_image_pixels() from their header; the fuzzer lowers that
// limit to this bound (libjpeg-turbo's own fuzzers use the same) so decoding
// stays fast, and checks that every image over it is refused.
constexpr uint64_t kMaxFuzzPixels = uint64_t{1} << 20;

void check(bool condition) {
  if (!condition) std::abort();
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int* /*argc*/, char*** /*argv*/) {
  conveyor::set_max_image_pixels(kMaxFuzzPixels);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::span<const uint8_t> bytes(data, size);
  conveyor::ImageInfo info;
  try {
    info = conveyor::read_image_info(bytes, "fuzz-input");
  } catch (const conveyor::Error&) {
    return 0;
  }
  check(info.width > 0 && info.height > 0 && (info.channels == 1 || info.channels == 3));
  if (static_cast<uint64_t>(info.width) * static_cast<uint64_t>(info.height) > kMaxFuzzPixels) {
    // Refused from the header, before any allocation: a DataError, never
    // std::bad_alloc or an out-of-memory report.
    try {
      (void)conveyor::decode_image(bytes, "fuzz-input");
      check(false);
    } catch (const conveyor::DataError&) {
    }
    return 0;
  }
  // Vary the requested channels with the input, so conversions get fuzzed
  // too without decoding every input three times.
  const int requested = size % 3 == 0 ? 0 : (size % 3 == 1 ? 1 : 3);
  const int64_t channels = requested == 0 ? info.channels : requested;
  try {
    const conveyor::Array<uint8_t> image = conveyor::decode_image(bytes, "fuzz-input", requested);
    check(image.shape() == std::vector<int64_t>{channels, info.height, info.width});
  } catch (const conveyor::Error&) {
  }
  // Into caller memory one byte short: always the size check's ValueError
  // (small images only, to keep the fuzzer fast).
  const int64_t expected_bytes = channels * info.height * info.width;
  if (expected_bytes <= 4096) {
    std::vector<uint8_t> short_slot(static_cast<size_t>(expected_bytes) - 1);
    try {
      conveyor::decode_image_into(bytes, short_slot, "fuzz-input", requested);
      check(false);
    } catch (const conveyor::ValueError&) {
    }
  }
  return 0;
}
