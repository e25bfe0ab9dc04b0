// Image augmentations drawing what torchvision 0.14 draws, in its order, from
// default_generator(), so a seeded run augments like the PyTorch one.
#include "conveyor/transforms.h"

#include <algorithm>
#include <cstdint>
#include <limits>
#include <new>
#include <span>
#include <string>
#include <vector>

#include "conveyor/errors.h"
#include "conveyor/generator.h"

namespace conveyor {

namespace {

struct ImageExtent {
  int64_t channels;
  int64_t height;
  int64_t width;
};

template <class T>
ImageExtent image_extent(const Array<T>& image, const char* transform) {
  const std::vector<int64_t>& shape = image.shape();
  if (shape.size() != 3) {
    throw ValueError(std::string(transform) + ": expected an image of shape [C, H, W], got " +
                     shape_string(shape));
  }
  return {shape[0], shape[1], shape[2]};
}

// torch.randint(0, high, (1,)).item() from the task's generator.
int64_t draw_offset(int64_t high) {
  int64_t offset = 0;
  randint(0, high, std::span<int64_t>(&offset, 1), default_generator());
  return offset;
}

// The crop's output, allocated before anything is drawn: torchvision pads
// (allocates) before it draws, so a crop too big for memory fails there
// without consuming a draw, and so it does here, as a conveyor error naming
// the sizes rather than a std::bad_alloc.
template <class T>
Array<T> allocate_crop(const RandomCrop& crop, const Array<T>& image) {
  const std::vector<int64_t> shape = {image.shape()[0], crop.size, crop.size};
  const auto too_big = [&] {
    return ValueError("RandomCrop: size " + std::to_string(crop.size) + " with padding " +
                      std::to_string(crop.padding) + " makes a " + shape_string(shape) +
                      " crop of the " + shape_string(image.shape()) +
                      " image, more than memory can hold");
  };
  size_t bytes = sizeof(T);
  for (int64_t extent : shape) {
    if (__builtin_mul_overflow(bytes, static_cast<size_t>(extent), &bytes)) throw too_big();
  }
  try {
    return Array<T>(shape);
  } catch (const std::bad_alloc&) {
    throw too_big();
  }
}

template <class T>
Array<T> random_crop(const RandomCrop& crop, const Array<T>& image) {
  const ImageExtent in = image_extent(image, "RandomCrop");
  if (crop.size <= 0) {
    throw ValueError("RandomCrop: size must be positive, got " + std::to_string(crop.size));
  }
  if (crop.padding < 0) {
    throw ValueError("RandomCrop: padding must be non-negative, got " +
                     std::to_string(crop.padding));
  }
  if (crop.padding > (std::numeric_limits<int64_t>::max() - std::max(in.height, in.width)) / 2) {
    throw ValueError("RandomCrop: padding " + std::to_string(crop.padding) + " is too large");
  }
  const int64_t padded_height = in.height + 2 * crop.padding;
  const int64_t padded_width = in.width + 2 * crop.padding;
  if (padded_height < crop.size || padded_width < crop.size) {
    // torchvision's message.
    throw ValueError("Required crop size (" + std::to_string(crop.size) + ", " +
                     std::to_string(crop.size) + ") is larger than input image size (" +
                     std::to_string(padded_height) + ", " + std::to_string(padded_width) + ")");
  }
  Array<T> out = allocate_crop(crop, image);
  // RandomCrop.get_params: no draw when the crop is the whole padded image;
  // otherwise the row offset first, then the column offset.
  int64_t top = 0;
  int64_t left = 0;
  if (padded_height != crop.size || padded_width != crop.size) {
    top = draw_offset(padded_height - crop.size + 1);
    left = draw_offset(padded_width - crop.size + 1);
  }

  // Window (top, left) of the padded image, in source coordinates: it starts
  // `padding` before the source, so rows and columns outside [0, extent) are
  // the zero padding.
  const int64_t first_row = top - crop.padding;
  const int64_t first_col = left - crop.padding;
  const int64_t copy_begin = std::clamp<int64_t>(-first_col, 0, crop.size);
  const int64_t copy_end = std::clamp<int64_t>(in.width - first_col, copy_begin, crop.size);
  const T* source = image.data();
  T* target = out.data();
  for (int64_t c = 0; c < in.channels; ++c) {
    for (int64_t y = 0; y < crop.size; ++y) {
      T* row = target + (c * crop.size + y) * crop.size;
      const int64_t source_row = first_row + y;
      if (source_row < 0 || source_row >= in.height) {
        std::fill(row, row + crop.size, T{0});
        continue;
      }
      const T* source_line = source + (c * in.height + source_row) * in.width + first_col;
      std::fill(row, row + copy_begin, T{0});
      std::copy(source_line + copy_begin, source_line + copy_end, row + copy_begin);
      std::fill(row + copy_end, row + crop.size, T{0});
    }
  }
  return out;
}

template <class T>
Array<T> random_horizontal_flip(const RandomHorizontalFlip& flip, const Array<T>& image) {
  const ImageExtent in = image_extent(image, "RandomHorizontalFlip");
  // torch.rand(1) < p compares in float32, so p is rounded to float first.
  if (!(uniform_float(default_generator()) < static_cast<float>(flip.p))) {
    return image;  // as torchvision, the input itself when not flipped
  }
  Array<T> out({in.channels, in.height, in.width});
  // No pixels: no rows to walk (channels x height may not even fit int64).
  if (out.numel() == 0) return out;
  const T* source = image.data();
  T* target = out.data();
  for (int64_t row = 0; row < in.channels * in.height; ++row) {
    const T* line = source + row * in.width;
    std::reverse_copy(line, line + in.width, target + row * in.width);
  }
  return out;
}

// mean/std of one value apply to every channel; otherwise one per channel.
float per_channel(const std::vector<float>& values, int64_t channel) {
  return values.size() == 1 ? values[0] : values[static_cast<size_t>(channel)];
}

}  // namespace

Array<uint8_t> RandomCrop::operator()(const Array<uint8_t>& image) const {
  return random_crop(*this, image);
}
Array<float> RandomCrop::operator()(const Array<float>& image) const {
  return random_crop(*this, image);
}

Array<uint8_t> RandomHorizontalFlip::operator()(const Array<uint8_t>& image) const {
  return random_horizontal_flip(*this, image);
}
Array<float> RandomHorizontalFlip::operator()(const Array<float>& image) const {
  return random_horizontal_flip(*this, image);
}

Array<float> ToFloat::operator()(const Array<uint8_t>& image) const {
  // An empty Array() has shape [] too, which is a scalar's: it stays empty.
  if (image.numel() == 0 && image.dim() == 0) return Array<float>();
  Array<float> out(image.shape());
  const uint8_t* source = image.data();
  float* target = out.data();
  const size_t count = image.numel();
  // Divide (not multiply by 1/255): the same float as torch's div(255).
  for (size_t i = 0; i < count; ++i) target[i] = static_cast<float>(source[i]) / 255.0f;
  return out;
}

Array<float> Normalize::operator()(const Array<float>& image) const {
  const ImageExtent in = image_extent(image, "Normalize");
  const auto check_count = [&](const std::vector<float>& values, const char* what) {
    if (values.size() != 1 && values.size() != static_cast<size_t>(in.channels)) {
      throw ValueError("Normalize: " + std::string(what) + " has " + std::to_string(values.size()) +
                       " values but the image has " + std::to_string(in.channels) +
                       " channels (give 1 or " + std::to_string(in.channels) + ")");
    }
  };
  check_count(mean, "mean");
  check_count(std, "std");
  if (std::any_of(std.begin(), std.end(), [](float value) { return value == 0.0f; })) {
    throw ValueError(
        "std evaluated to zero after conversion to torch.float32, leading to division by zero.");
  }
  Array<float> out(image.shape());
  if (out.numel() == 0) return out;  // no planes to walk, however many channels
  const size_t plane = static_cast<size_t>(in.height) * static_cast<size_t>(in.width);
  for (int64_t c = 0; c < in.channels; ++c) {
    const float channel_mean = per_channel(mean, c);
    const float channel_std = per_channel(std, c);
    const float* source = image.data() + static_cast<size_t>(c) * plane;
    float* target = out.data() + static_cast<size_t>(c) * plane;
    // sub_ then div_, each rounded to float, as torchvision's normalize.
    for (size_t i = 0; i < plane; ++i) target[i] = (source[i] - channel_mean) / channel_std;
  }
  return out;
}

}  // namespace conveyor
