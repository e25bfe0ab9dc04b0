// W6's work on one object, shared by the C++ peers: a Fashion-MNIST test
// JPEG fetched over HTTP, decoded to one channel, scaled to [0, 1] and
// normalised (W5's mean and standard deviation). No random augmentation:
// what W6 measures is the fetching.
#pragma once

#include <conveyor/image.h>
#include <conveyor/transforms.h>

#include <cstdint>
#include <span>
#include <string>

#include "workloads.h"

namespace perf {

inline conveyor::Array<float> w6_image(std::span<const uint8_t> jpeg, const std::string& url) {
  static const auto transform = conveyor::compose(conveyor::ToFloat{}, conveyor::Normalize{{kW5Mean}, {kW5Std}});
  return transform(conveyor::decode_image(jpeg, url, 1));
}

}  // namespace perf
