// conveyor/transforms.h: image augmentations as plain callables, composable
// (target conveyor::formats).
//
// Images are Array [C, H, W]. Randomness comes only from
// default_generator(): on a loader's worker that is the generator the engine
// hands the task (round_robin: the worker's, seeded like PyTorch's;
// work_stealing: the batch's), so augmentations are reproducible. Each draws
// what the torchvision transform of the same name draws, in the same order.
// Outputs are allocated with allocate_batch_buffer() (recycled on a worker).
#pragma once

#include <cstdint>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "conveyor/array.h"

namespace conveyor {

// torchvision.transforms.RandomCrop(size, padding): zero-pad every side by
// `padding`, then crop size x size at a random offset (randint for the row,
// then for the column; no draw when the padded image is already that size).
// Throws ValueError if the padded image is smaller than `size`, or if the
// crop is more than memory can hold (before anything is drawn).
struct RandomCrop {
  int64_t size = 0;
  int64_t padding = 0;
  Array<uint8_t> operator()(const Array<uint8_t>& image) const;
  Array<float> operator()(const Array<float>& image) const;
};

// torchvision.transforms.RandomHorizontalFlip(p): one float draw; flips the
// width axis when it is < p (compared in float32, as torch compares). When
// it does not flip it returns `image` itself (sharing its elements), as
// torchvision does.
struct RandomHorizontalFlip {
  double p = 0.5;
  Array<uint8_t> operator()(const Array<uint8_t>& image) const;
  Array<float> operator()(const Array<float>& image) const;
};

// uint8 [0, 255] -> float [0, 1], as torchvision's ToTensor scales.
struct ToFloat {
  Array<float> operator()(const Array<uint8_t>& image) const;
};

// (x - mean[c]) / std[c] per channel. Throws ValueError when the channel
// count does not match (one value applies to every channel).
struct Normalize {
  std::vector<float> mean;
  std::vector<float> std;
  Array<float> operator()(const Array<float>& image) const;
};

namespace detail {
template <class T>
std::remove_cvref_t<T> chain(T&& value) {
  return std::forward<T>(value);
}
template <class T, class F, class... Rest>
auto chain(T&& value, const F& first, const Rest&... rest) {
  return chain(first(std::forward<T>(value)), rest...);
}
}  // namespace detail

// compose(f, g, h)(x) == h(g(f(x))).
template <class... Fs>
auto compose(Fs... fs) {
  return [steps = std::make_tuple(std::move(fs)...)](auto&& input) {
    return std::apply(
        [&input](const auto&... step) {
          return detail::chain(std::forward<decltype(input)>(input), step...);
        },
        steps);
  };
}

}  // namespace conveyor
