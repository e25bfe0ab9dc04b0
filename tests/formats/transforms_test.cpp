// Tests of the image transforms (conveyor/transforms.h): they must draw what
// torchvision 0.14 draws, in its order, from default_generator(), and compute
// what it computes. Draws are checked against a second Generator with the same
// seed, drawing as torchvision's get_params would.
#include "conveyor/transforms.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "conveyor/detail/worker_scope.h"
#include "conveyor/errors.h"
#include "conveyor/generator.h"

namespace conveyor {
namespace {

// An [C, H, W] image whose values encode their coordinates, never 0, so a
// crop shows where it came from and padding stands out.
template <class T>
Array<T> coordinate_image(int64_t channels, int64_t height, int64_t width) {
  Array<T> image({channels, height, width});
  for (int64_t c = 0; c < channels; ++c) {
    for (int64_t y = 0; y < height; ++y) {
      for (int64_t x = 0; x < width; ++x) {
        image[static_cast<size_t>((c * height + y) * width + x)] =
            static_cast<T>(1 + c * height * width + y * width + x);
      }
    }
  }
  return image;
}

template <class T>
T at(const Array<T>& image, int64_t c, int64_t y, int64_t x) {
  const std::vector<int64_t>& shape = image.shape();
  return image[static_cast<size_t>((c * shape[1] + y) * shape[2] + x)];
}

// The image zero-padded by `padding` on every side, read at (c, y, x).
template <class T>
T padded_at(const Array<T>& image, int64_t padding, int64_t c, int64_t y, int64_t x) {
  y -= padding;
  x -= padding;
  if (y < 0 || x < 0 || y >= image.shape()[1] || x >= image.shape()[2]) return T{0};
  return at(image, c, y, x);
}

// torch.randint(0, high, (1,), generator=g).item()
int64_t reference_randint(int64_t high, Generator& generator) {
  int64_t value = -1;
  randint(0, high, std::span<int64_t>(&value, 1), generator);
  return value;
}

// Checks that `crop` of `image` is the padded image's size x size window at
// (top, left).
template <class T>
void expect_window(const Array<T>& crop, const Array<T>& image, int64_t padding, int64_t size,
                   int64_t top, int64_t left) {
  ASSERT_EQ(crop.shape(), (std::vector<int64_t>{image.shape()[0], size, size}));
  for (int64_t c = 0; c < image.shape()[0]; ++c) {
    for (int64_t y = 0; y < size; ++y) {
      for (int64_t x = 0; x < size; ++x) {
        ASSERT_EQ(at(crop, c, y, x), padded_at(image, padding, c, top + y, left + x))
            << "c=" << c << " y=" << y << " x=" << x << " window at (" << top << ", " << left
            << ")";
      }
    }
  }
}

template <class T>
void check_crop_matches_reference_draws() {
  const Array<T> image = coordinate_image<T>(3, 5, 6);
  const RandomCrop crop{4, 2};  // padded 9 x 10: rows 0..5, columns 0..6
  std::set<std::pair<int64_t, int64_t>> windows;
  for (uint64_t seed = 0; seed < 60; ++seed) {
    Generator worker(seed);
    Array<T> out;
    {
      detail::WorkerScope scope(nullptr, &worker);
      out = crop(image);
    }
    Generator reference(seed);
    const int64_t top = reference_randint(9 - 4 + 1, reference);  // the row first
    const int64_t left = reference_randint(10 - 4 + 1, reference);
    expect_window(out, image, crop.padding, crop.size, top, left);
    EXPECT_EQ(worker.get_state(), reference.get_state()) << "seed " << seed;  // two draws, no more
    windows.emplace(top, left);
  }
  // The seeds reach windows overlapping the padding and windows inside the
  // image (source rows 2..6, columns 2..7 of the padded image).
  EXPECT_GT(windows.size(), 20u);
  const auto inside = [](const std::pair<int64_t, int64_t>& w) {
    return w.first >= 2 && w.first + 4 <= 7 && w.second >= 2 && w.second + 4 <= 8;
  };
  EXPECT_TRUE(std::any_of(windows.begin(), windows.end(), inside));
  EXPECT_FALSE(std::all_of(windows.begin(), windows.end(), inside));
}

TEST(TransformRandomCrop, OffsetsAreTorchvisionsDrawsUint8) {
  check_crop_matches_reference_draws<uint8_t>();
}

TEST(TransformRandomCrop, OffsetsAreTorchvisionsDrawsFloat) {
  check_crop_matches_reference_draws<float>();
}

TEST(TransformRandomCrop, PaddingIsZeros) {
  // Crop the whole padded image: a 3 x 3 image padded by 2 is 7 x 7.
  const Array<uint8_t> image = coordinate_image<uint8_t>(2, 3, 3);
  Generator worker(5);
  const std::vector<uint8_t> state = worker.get_state();
  detail::WorkerScope scope(nullptr, &worker);
  const Array<uint8_t> out = RandomCrop{7, 2}(image);
  ASSERT_EQ(out.shape(), (std::vector<int64_t>{2, 7, 7}));
  for (int64_t c = 0; c < 2; ++c) {
    for (int64_t y = 0; y < 7; ++y) {
      for (int64_t x = 0; x < 7; ++x) {
        const bool inside = y >= 2 && y < 5 && x >= 2 && x < 5;
        EXPECT_EQ(at(out, c, y, x), inside ? at(image, c, y - 2, x - 2) : 0)
            << "c=" << c << " y=" << y << " x=" << x;
      }
    }
  }
  EXPECT_EQ(worker.get_state(), state);  // no draw: nothing to choose
}

TEST(TransformRandomCrop, NoDrawWhenNothingToChoose) {
  const Array<float> image = coordinate_image<float>(3, 8, 8);
  Generator worker(11);
  const std::vector<uint8_t> state = worker.get_state();
  detail::WorkerScope scope(nullptr, &worker);
  const Array<float> out = RandomCrop{8, 0}(image);
  expect_window(out, image, 0, 8, 0, 0);
  EXPECT_NE(out.data(), image.data());  // a new image all the same
  EXPECT_EQ(worker.get_state(), state);
}

TEST(TransformRandomCrop, DrawsBothOffsetsWhenOnlyOneAxisHasRoom) {
  // Height 4 == size: torchvision still draws randint(0, 1) for the row.
  const Array<uint8_t> image = coordinate_image<uint8_t>(1, 4, 9);
  for (uint64_t seed = 0; seed < 10; ++seed) {
    Generator worker(seed);
    Array<uint8_t> out;
    {
      detail::WorkerScope scope(nullptr, &worker);
      out = RandomCrop{4, 0}(image);
    }
    Generator reference(seed);
    const int64_t top = reference_randint(1, reference);
    const int64_t left = reference_randint(6, reference);
    EXPECT_EQ(top, 0);
    expect_window(out, image, 0, 4, top, left);
    EXPECT_EQ(worker.get_state(), reference.get_state());
  }
}

TEST(TransformRandomCrop, UsesTheProcessGeneratorOutsideWorkers) {
  const Array<uint8_t> image = coordinate_image<uint8_t>(1, 10, 10);
  manual_seed(1234);
  const Array<uint8_t> out = RandomCrop{5, 0}(image);
  Generator reference(1234);
  const int64_t top = reference_randint(6, reference);
  const int64_t left = reference_randint(6, reference);
  expect_window(out, image, 0, 5, top, left);
}

TEST(TransformRandomCrop, RejectsBadArguments) {
  const Array<uint8_t> image = coordinate_image<uint8_t>(3, 5, 6);
  try {
    RandomCrop{10, 2}(image);  // padded 9 x 10
    ADD_FAILURE() << "no ValueError";
  } catch (const ValueError& error) {
    EXPECT_EQ(std::string(error.what()),
              "Required crop size (10, 10) is larger than input image size (9, 10)");
  }
  EXPECT_THROW((RandomCrop{0, 0}(image)), ValueError);
  EXPECT_THROW((RandomCrop{2, -1}(image)), ValueError);
  EXPECT_THROW((RandomCrop{2, 0}(Array<uint8_t>({5, 6}))), ValueError);
}

// Padding makes a crop far larger than the image legitimate, and then the
// output itself may not fit in memory. Before the fix both offsets were drawn
// first, then Array threw (std::bad_alloc, not a conveyor error, for the
// 9 * 10^18 bytes of the first case).
TEST(TransformRandomCrop, CropTooBigForMemoryIsAValueErrorBeforeAnyDraw) {
  Generator worker(3);
  const std::vector<uint8_t> state = worker.get_state();
  detail::WorkerScope scope(nullptr, &worker);
  const RandomCrop crop{3'000'000'000, 1'500'000'000};  // padded 3000000001 x 3000000001
#if !defined(__SANITIZE_ADDRESS__)  // AddressSanitizer aborts on the allocation instead
  try {
    crop(coordinate_image<uint8_t>(1, 1, 1));
    ADD_FAILURE() << "no ValueError";
  } catch (const ValueError& error) {
    EXPECT_EQ(std::string(error.what()),
              "RandomCrop: size 3000000000 with padding 1500000000 makes a "
              "[1, 3000000000, 3000000000] crop of the [1, 1, 1] image, more than memory can "
              "hold");
  }
#endif
  // Three float channels: more bytes than a size_t counts, refused unallocated.
  try {
    crop(coordinate_image<float>(3, 1, 1));
    ADD_FAILURE() << "no ValueError";
  } catch (const ValueError& error) {
    EXPECT_NE(std::string(error.what()).find("RandomCrop: size 3000000000 with padding "
                                             "1500000000 makes a [3, 3000000000, 3000000000]"),
              std::string::npos)
        << error.what();
  }
  EXPECT_EQ(worker.get_state(), state);
}

template <class T>
void check_flip_matches_reference_draws() {
  const Array<T> image = coordinate_image<T>(2, 3, 5);
  int flips = 0;
  for (uint64_t seed = 0; seed < 40; ++seed) {
    Generator worker(seed);
    Array<T> out;
    {
      detail::WorkerScope scope(nullptr, &worker);
      out = RandomHorizontalFlip{0.5}(image);
    }
    Generator reference(seed);
    const bool flipped = uniform_float(reference) < 0.5f;
    flips += flipped;
    ASSERT_EQ(out.shape(), image.shape());
    for (int64_t c = 0; c < 2; ++c) {
      for (int64_t y = 0; y < 3; ++y) {
        for (int64_t x = 0; x < 5; ++x) {
          ASSERT_EQ(at(out, c, y, x), at(image, c, y, flipped ? 4 - x : x)) << "seed " << seed;
        }
      }
    }
    // Not flipped: the input itself, as torchvision returns it.
    EXPECT_EQ(out.data() == image.data(), !flipped);
    EXPECT_EQ(worker.get_state(), reference.get_state());
  }
  EXPECT_GT(flips, 5);
  EXPECT_LT(flips, 35);
}

TEST(TransformRandomHorizontalFlip, FlipsOnTorchvisionsDrawsUint8) {
  check_flip_matches_reference_draws<uint8_t>();
}

TEST(TransformRandomHorizontalFlip, FlipsOnTorchvisionsDrawsFloat) {
  check_flip_matches_reference_draws<float>();
}

TEST(TransformRandomHorizontalFlip, AlwaysDrawsOnce) {
  const Array<uint8_t> image = coordinate_image<uint8_t>(1, 2, 3);
  for (double p : {0.0, 1.0}) {
    Generator worker(3);
    Array<uint8_t> out;
    {
      detail::WorkerScope scope(nullptr, &worker);
      out = RandomHorizontalFlip{p}(image);
    }
    Generator reference(3);
    uniform_float(reference);
    EXPECT_EQ(worker.get_state(), reference.get_state()) << "p = " << p;
    EXPECT_EQ(at(out, 0, 1, 0), p == 1.0 ? at(image, 0, 1, 2) : at(image, 0, 1, 0));
  }
  EXPECT_THROW((RandomHorizontalFlip{0.5}(Array<uint8_t>({3, 3}))), ValueError);
}

// Images with no pixels: no rows or planes are walked. The old loops ran
// channels x height times (2^40 here) for nothing, and that product may
// not fit int64 at all.
TEST(TransformRandomHorizontalFlip, AnImageWithNoPixelsHasNoRowsToWalk) {
  const Array<uint8_t> empty({1, int64_t{1} << 40, 0});
  const Array<uint8_t> out = RandomHorizontalFlip{1.0}(empty);
  EXPECT_EQ(out.shape(), empty.shape());
  EXPECT_EQ(out.numel(), 0u);
}

TEST(TransformNormalize, AnImageWithNoPixelsHasNoPlanesToWalk) {
  const Array<float> empty({int64_t{1} << 40, 1, 0});
  const Array<float> out = Normalize{{0.5f}, {0.25f}}(empty);
  EXPECT_EQ(out.shape(), empty.shape());
  EXPECT_EQ(out.numel(), 0u);
}

// An empty Array() (shape [], as a scalar's) stays empty: not a scalar
// holding an unwritten value.
TEST(TransformToFloat, AnEmptyArrayStaysEmpty) {
  const Array<float> out = ToFloat{}(Array<uint8_t>());
  EXPECT_EQ(out.numel(), 0u);
  EXPECT_EQ(out.dim(), 0);
  const Array<float> rows = ToFloat{}(Array<uint8_t>({0, 3}));
  EXPECT_EQ(rows.shape(), (std::vector<int64_t>{0, 3}));
}

TEST(TransformToFloat, DividesBy255) {
  Array<uint8_t> image({1, 16, 16});
  for (size_t i = 0; i < 256; ++i) image[i] = static_cast<uint8_t>(i);
  const Array<float> out = ToFloat{}(image);
  ASSERT_EQ(out.shape(), image.shape());
  EXPECT_EQ(out[0], 0.0f);
  EXPECT_EQ(out[255], 1.0f);
  EXPECT_EQ(out[51], 0.2f);  // 51 / 255 rounds to the float nearest 0.2
  for (size_t i = 0; i < 256; ++i) {
    EXPECT_EQ(out[i], static_cast<float>(i) / 255.0f) << i;
    EXPECT_NEAR(out[i], static_cast<double>(i) / 255.0, 1e-7);
  }
}

TEST(TransformNormalize, PerChannel) {
  Array<float> image({3, 1, 2});
  const float values[] = {1.5f, 0.5f, 0.25f, 2.25f, 4.125f, 0.125f};
  std::copy(std::begin(values), std::end(values), image.data());
  const Array<float> out = Normalize{{0.5f, 0.25f, 0.125f}, {0.5f, 2.0f, 4.0f}}(image);
  ASSERT_EQ(out.shape(), image.shape());
  const float expected[] = {2.0f, 0.0f, 0.0f, 1.0f, 1.0f, 0.0f};
  for (size_t i = 0; i < 6; ++i) EXPECT_EQ(out[i], expected[i]) << i;
  // One value applies to every channel.
  const Array<float> same = Normalize{{0.5f}, {0.25f}}(image);
  for (size_t i = 0; i < 6; ++i) EXPECT_EQ(same[i], (values[i] - 0.5f) / 0.25f) << i;
  // Fashion-MNIST's statistics, as float32 arithmetic gives them.
  Array<float> pixel({1, 1, 1});
  pixel[0] = 1.0f;
  const Normalize fashion_mnist{{0.2860f}, {0.3530f}};
  EXPECT_EQ(fashion_mnist(pixel)[0], (1.0f - 0.2860f) / 0.3530f);
  EXPECT_NEAR(fashion_mnist(pixel)[0], 2.0226629, 1e-6);
}

TEST(TransformNormalize, RejectsMismatchedChannels) {
  const Array<float> image = coordinate_image<float>(3, 2, 2);
  try {
    Normalize{{0.1f, 0.2f}, {1.0f}}(image);
    ADD_FAILURE() << "no ValueError";
  } catch (const ValueError& error) {
    const std::string message = error.what();
    EXPECT_NE(message.find("mean has 2 values"), std::string::npos) << message;
    EXPECT_NE(message.find("3 channels"), std::string::npos) << message;
  }
  try {
    Normalize{{0.1f}, {1.0f, 2.0f, 3.0f, 4.0f}}(image);
    ADD_FAILURE() << "no ValueError";
  } catch (const ValueError& error) {
    EXPECT_NE(std::string(error.what()).find("std has 4 values"), std::string::npos);
  }
  EXPECT_THROW((Normalize{{}, {1.0f}}(image)), ValueError);
  EXPECT_THROW((Normalize{{0.0f}, {1.0f, 0.0f, 1.0f}}(image)), ValueError);  // division by zero
  EXPECT_THROW((Normalize{{0.0f}, {1.0f}}(Array<float>({4}))), ValueError);
}

TEST(TransformCompose, AppliesInOrder) {
  const auto add_one_then_double =
      compose([](int x) { return x + 1; }, [](int x) { return x * 2; });
  EXPECT_EQ(add_one_then_double(3), 8);  // not 3 * 2 + 1
  EXPECT_EQ(compose()(5), 5);

  // The augmentation pipeline equals its steps applied one by one, drawing
  // the same numbers from the same generator.
  const Array<uint8_t> image = coordinate_image<uint8_t>(1, 28, 28);
  const auto pipeline = compose(RandomCrop{28, 4}, RandomHorizontalFlip{0.5}, ToFloat{},
                                Normalize{{0.2860f}, {0.3530f}});
  for (uint64_t seed = 0; seed < 8; ++seed) {
    Generator composed_generator(seed);
    Generator manual_generator(seed);
    Array<float> composed;
    Array<float> manual;
    {
      detail::WorkerScope scope(nullptr, &composed_generator);
      composed = pipeline(image);
    }
    {
      detail::WorkerScope scope(nullptr, &manual_generator);
      const Array<uint8_t> cropped = RandomCrop{28, 4}(image);
      const Array<uint8_t> flipped = RandomHorizontalFlip{0.5}(cropped);
      manual = Normalize{{0.2860f}, {0.3530f}}(ToFloat{}(flipped));
    }
    ASSERT_EQ(composed.shape(), (std::vector<int64_t>{1, 28, 28}));
    EXPECT_TRUE(
        std::equal(composed.values().begin(), composed.values().end(), manual.values().begin()))
        << "seed " << seed;
    EXPECT_EQ(composed_generator.get_state(), manual_generator.get_state());
  }
}

}  // namespace
}  // namespace conveyor
