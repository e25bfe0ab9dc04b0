// Tiny images whose headers claim huge sizes (formats tests only).
#pragma once

#include <conveyor/array.h>
#include <conveyor/image.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

namespace conveyor::testing {

// A real JPEG of 16 x 16 pixels whose SOF0 header is patched to claim
// width x height: a few hundred bytes that a trusting decoder sizes by the
// claim (40000 x 40000 RGB: 4.8 GB).
inline std::vector<uint8_t> jpeg_claiming(uint16_t width, uint16_t height) {
  Array<uint8_t> image({3, 16, 16});
  for (size_t i = 0; i < image.numel(); ++i) image.data()[i] = static_cast<uint8_t>(i * 5);
  std::vector<uint8_t> jpeg = encode_jpeg(image, 90);
  for (size_t i = 2; i + 8 < jpeg.size(); ++i) {
    if (jpeg[i] == 0xFF && jpeg[i + 1] == 0xC0) {  // SOF0: length, precision, height, width
      jpeg[i + 5] = static_cast<uint8_t>(height >> 8);
      jpeg[i + 6] = static_cast<uint8_t>(height);
      jpeg[i + 7] = static_cast<uint8_t>(width >> 8);
      jpeg[i + 8] = static_cast<uint8_t>(width);
      return jpeg;
    }
  }
  ADD_FAILURE() << "no SOF0 marker";
  return jpeg;
}

}  // namespace conveyor::testing
