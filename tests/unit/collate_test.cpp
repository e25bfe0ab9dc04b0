#include <gtest/gtest.h>

#include <conveyor/buffer.h>
#include <conveyor/collate.h>

#include <array>
#include <map>
#include <string>
#include <tuple>
#include <type_traits>
#include <unordered_map>
#include <vector>

namespace {

using conveyor::Array;
using conveyor::default_collate;

template <class T>
std::vector<T> values(const Array<T>& a) {
  return {a.values().begin(), a.values().end()};
}

TEST(DefaultCollate, NumbersBecomeAContiguousArray) {
  Array<float> batch = default_collate(std::vector<float>{1.5f, 2.5f, 3.5f});
  EXPECT_EQ(batch.shape(), (std::vector<int64_t>{3}));
  EXPECT_EQ(values(batch), (std::vector<float>{1.5f, 2.5f, 3.5f}));
  EXPECT_EQ(reinterpret_cast<uintptr_t>(batch.data()) % 64, 0u);  // aligned for SIMD
  Array<bool> flags = default_collate(std::vector<bool>{true, false});
  EXPECT_EQ(values(flags), (std::vector<bool>{true, false}));
}

TEST(DefaultCollate, ArraysStackAlongANewFirstDimension) {
  std::vector<Array<int>> samples;
  for (int s = 0; s < 3; ++s) {
    Array<int> a({2, 2});
    for (int i = 0; i < 4; ++i) a[static_cast<size_t>(i)] = s * 10 + i;
    samples.push_back(a);
  }
  Array<int> batch = default_collate(std::move(samples));
  EXPECT_EQ(batch.shape(), (std::vector<int64_t>{3, 2, 2}));
  EXPECT_EQ(values(batch), (std::vector<int>{0, 1, 2, 3, 10, 11, 12, 13, 20, 21, 22, 23}));
}

TEST(DefaultCollate, UnequalArraysGiveTorchsStackMessage) {
  std::vector<Array<float>> samples{Array<float>({3}), Array<float>({4})};
  try {
    default_collate(std::move(samples));
    FAIL() << "no exception";
  } catch (const conveyor::RuntimeError& e) {
    EXPECT_STREQ(e.what(),
                 "stack expects each tensor to be equal size, but got [3] at entry 0 and [4] at entry 1");
  }
}

// A default Array() has shape [] like a scalar, but no element: the shapes
// match, the sizes do not.
TEST(DefaultCollate, EmptyArraysDoNotPassForScalars) {
  Array<float> scalar(std::vector<int64_t>{});
  scalar[0] = 1.5f;
  const auto error = [](std::vector<Array<float>> samples) {
    try {
      default_collate(std::move(samples));
    } catch (const conveyor::RuntimeError& e) {
      return std::string("RuntimeError: ") + e.what();
    } catch (const conveyor::ValueError& e) {
      return std::string("ValueError: ") + e.what();
    }
    return std::string("no exception");
  };
  EXPECT_EQ(error({scalar, Array<float>()}),
            "RuntimeError: stack expects each tensor to be equal size, but got [] at entry 0 and "
            "[] (an empty Array()) at entry 1");
  EXPECT_EQ(error({Array<float>(), scalar, scalar}),
            "RuntimeError: stack expects each tensor to be equal size, but got "
            "[] (an empty Array()) at entry 0 and [] at entry 1");
  EXPECT_EQ(error({Array<float>(), Array<float>()}),
            "ValueError: default_collate: cannot stack empty Array()s (default constructed: "
            "shape [] but no element), at entries 0 to 1");
  EXPECT_EQ(error({Array<float>()}),
            "ValueError: default_collate: cannot stack empty Array()s (default constructed: "
            "shape [] but no element), at entry 0");
  Array<float> scalars = default_collate(std::vector<Array<float>>{scalar, scalar});  // still fine
  EXPECT_EQ(scalars.shape(), (std::vector<int64_t>{2}));
  EXPECT_EQ(values(scalars), (std::vector<float>{1.5f, 1.5f}));
}

TEST(DefaultCollate, StdArraysOfNumbersStack) {
  auto batch = default_collate(std::vector<std::array<double, 3>>{{1, 2, 3}, {4, 5, 6}});
  static_assert(std::is_same_v<decltype(batch), Array<double>>);
  EXPECT_EQ(batch.shape(), (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(values(batch), (std::vector<double>{1, 2, 3, 4, 5, 6}));
}

TEST(DefaultCollate, StringsStayAList) {
  auto batch = default_collate(std::vector<std::string>{"a", "bc"});
  static_assert(std::is_same_v<decltype(batch), std::vector<std::string>>);
  EXPECT_EQ(batch, (std::vector<std::string>{"a", "bc"}));
}

TEST(DefaultCollate, TuplesAndPairsTranspose) {
  std::vector<std::tuple<int, std::string, float>> samples{{1, "x", 0.5f}, {2, "y", 1.5f}};
  auto [ints, strings, floats] = default_collate(std::move(samples));
  EXPECT_EQ(values(ints), (std::vector<int>{1, 2}));
  EXPECT_EQ(strings, (std::vector<std::string>{"x", "y"}));
  EXPECT_EQ(values(floats), (std::vector<float>{0.5f, 1.5f}));
  auto pair = default_collate(std::vector<std::pair<int64_t, double>>{{1, 2.0}, {3, 4.0}});
  EXPECT_EQ(values(pair.first), (std::vector<int64_t>{1, 3}));
  EXPECT_EQ(values(pair.second), (std::vector<double>{2.0, 4.0}));
}

TEST(DefaultCollate, VectorsTransposeAndMustBeEqualLength) {
  auto batch = default_collate(std::vector<std::vector<int>>{{1, 2}, {3, 4}, {5, 6}});
  ASSERT_EQ(batch.size(), 2u);
  EXPECT_EQ(values(batch[0]), (std::vector<int>{1, 3, 5}));
  EXPECT_EQ(values(batch[1]), (std::vector<int>{2, 4, 6}));
  try {
    default_collate(std::vector<std::vector<int>>{{1, 2}, {1}});
    FAIL() << "no exception";
  } catch (const conveyor::RuntimeError& e) {
    EXPECT_STREQ(e.what(), "each element in list of batch should be of equal size");
  }
}

TEST(DefaultCollate, StdArraysOfStructuresTranspose) {
  auto batch = default_collate(std::vector<std::array<std::string, 2>>{{"a", "b"}, {"c", "d"}});
  EXPECT_EQ(batch[0], (std::vector<std::string>{"a", "c"}));
  EXPECT_EQ(batch[1], (std::vector<std::string>{"b", "d"}));
}

TEST(DefaultCollate, MapsCollateEachKey) {
  std::vector<std::map<std::string, int>> samples{{{"a", 1}, {"b", 2}}, {{"a", 3}, {"b", 4}}};
  auto batch = default_collate(std::move(samples));
  EXPECT_EQ(values(batch.at("a")), (std::vector<int>{1, 3}));
  EXPECT_EQ(values(batch.at("b")), (std::vector<int>{2, 4}));
  std::vector<std::unordered_map<std::string, int>> missing{{{"a", 1}}, {{"b", 2}}};
  try {
    default_collate(std::move(missing));
    FAIL() << "no exception";
  } catch (const conveyor::KeyError& e) {
    EXPECT_STREQ(e.what(), "'a'");
  }
}

struct Sample {
  std::array<float, 4> pixels;
  int64_t label;
  std::string name;
};

TEST(DefaultCollate, AggregatesBecomeTuplesOfTheirFields) {
  std::vector<Sample> samples{{{1, 2, 3, 4}, 7, "p"}, {{5, 6, 7, 8}, 9, "q"}};
  auto [pixels, labels, names] = default_collate(std::move(samples));
  EXPECT_EQ(pixels.shape(), (std::vector<int64_t>{2, 4}));
  EXPECT_EQ(values(pixels), (std::vector<float>{1, 2, 3, 4, 5, 6, 7, 8}));
  EXPECT_EQ(values(labels), (std::vector<int64_t>{7, 9}));
  EXPECT_EQ(names, (std::vector<std::string>{"p", "q"}));
}

struct Custom {
  int value;
};
struct CustomBatch {
  int sum;
};

}  // namespace

template <>
struct conveyor::collate_traits<Custom> {
  static CustomBatch collate(std::vector<Custom>&& samples) {
    int sum = 0;
    for (const Custom& c : samples) sum += c.value;
    return {sum};
  }
};

namespace {

TEST(DefaultCollate, UserRulesWinOverTheAggregateRule) {
  const CustomBatch batch = default_collate(std::vector<Custom>{{1}, {2}, {39}});
  EXPECT_EQ(batch.sum, 42);
  // And nest: a tuple of customs collates each position with the user rule.
  auto [customs, ints] = default_collate(std::vector<std::tuple<Custom, int>>{{{1}, 5}, {{2}, 6}});
  EXPECT_EQ(customs.sum, 3);
  EXPECT_EQ(values(ints), (std::vector<int>{5, 6}));
}

TEST(DefaultCollate, EmptyStructuredBatchesAreRejected) {
  EXPECT_THROW(default_collate(std::vector<std::vector<int>>{}), conveyor::ValueError);
  // Every sample type, as torch's default_collate([]) raises for each.
  // Before the fix numbers, std::arrays, pairs, tuples and aggregates gave
  // an empty batch of shape [0] without a word.
  struct Pair {
    int64_t a;
    float b;
  };
  EXPECT_THROW(default_collate(std::vector<int64_t>{}), conveyor::ValueError);
  EXPECT_THROW(default_collate(std::vector<std::array<float, 3>>{}), conveyor::ValueError);
  EXPECT_THROW((default_collate(std::vector<std::pair<int, float>>{})), conveyor::ValueError);
  EXPECT_THROW((default_collate(std::vector<std::tuple<int, Array<float>>>{})), conveyor::ValueError);
  EXPECT_THROW(default_collate(std::vector<Pair>{}), conveyor::ValueError);
  EXPECT_THROW(default_collate(std::vector<std::string>{}), conveyor::ValueError);
}

TEST(DefaultConvert, PassesSamplesThrough) {
  const conveyor::DefaultConvert convert;
  EXPECT_EQ(convert(std::string("x")), "x");
  EXPECT_EQ(conveyor::default_convert(5), 5);
}

// Sizes no allocation can hold are refused, naming the size: above
// SIZE_MAX - 63, libstdc++'s aligned new rounded the size up past zero and
// returned a block of a few bytes (an Array of INT64_MAX x 2 bytes got 24).
TEST(ArrayShape, ASizeBeyondAnyAllocationIsRefused) {
  for (const size_t bytes : {SIZE_MAX, SIZE_MAX - 1, SIZE_MAX - 63, static_cast<size_t>(PTRDIFF_MAX) + 1}) {
    try {
      (void)conveyor::allocate_batch_buffer(bytes);
      ADD_FAILURE() << bytes << " bytes were allocated";
    } catch (const conveyor::ValueError& e) {
      EXPECT_NE(std::string(e.what()).find(std::to_string(bytes) + " bytes is more than one allocation can hold"),
                std::string::npos)
          << e.what();
    }
  }
  EXPECT_THROW(conveyor::Array<uint8_t>(std::vector<int64_t>{INT64_MAX, 2}), conveyor::ValueError);
  EXPECT_THROW(conveyor::Array<uint8_t>(std::vector<int64_t>{INT64_MAX, 1, 2}), conveyor::ValueError);
}

TEST(ArrayShape, AScalarHasOneElementAndRoomForIt) {
  // A 0-d array used to allocate for numel() before it had memory, i.e. for
  // none: writing its element overflowed the heap (ASan build).
  Array<double> scalar(std::vector<int64_t>{});
  EXPECT_EQ(scalar.numel(), 1u);
  EXPECT_EQ(scalar.dim(), 0);
  scalar[0] = 2.5;
  EXPECT_EQ(scalar.values().size(), 1u);
  Array<double> stacked = default_collate(std::vector<Array<double>>{scalar, scalar, scalar});
  EXPECT_EQ(stacked.shape(), (std::vector<int64_t>{3}));
  EXPECT_EQ(values(stacked), (std::vector<double>{2.5, 2.5, 2.5}));
  EXPECT_EQ(Array<double>().numel(), 0u);  // default constructed: nothing
  EXPECT_EQ(Array<double>(std::vector<int64_t>{0, 4}).numel(), 0u);
  EXPECT_THROW(Array<double>(std::vector<int64_t>{2, -1}), conveyor::ValueError);
  EXPECT_THROW(Array<double>(std::vector<int64_t>{int64_t{1} << 40, int64_t{1} << 40}), conveyor::ValueError);
}

struct Record {
  Array<float> image;
  int64_t label;
  std::string name;
};
struct RecordBatch {
  Array<float> image;
  Array<int64_t> label;
  std::vector<std::string> name;
};

TEST(CollateInto, ABatchOfStructsKeepsItsFieldNames) {
  std::vector<Record> records;
  for (int i = 0; i < 3; ++i) {
    Array<float> image({2});
    image[0] = static_cast<float>(i);
    image[1] = 0.5f;
    records.push_back({image, 10 + i, "s" + std::to_string(i)});
  }
  RecordBatch batch = conveyor::CollateInto<RecordBatch>{}(std::move(records));
  EXPECT_EQ(batch.image.shape(), (std::vector<int64_t>{3, 2}));
  EXPECT_EQ(values(batch.image), (std::vector<float>{0, 0.5f, 1, 0.5f, 2, 0.5f}));
  EXPECT_EQ(values(batch.label), (std::vector<int64_t>{10, 11, 12}));
  EXPECT_EQ(batch.name, (std::vector<std::string>{"s0", "s1", "s2"}));
  // Tuples and pairs name their positions the same way.
  struct Pair {
    Array<int> first;
    Array<double> second;
  };
  Pair pair = conveyor::CollateInto<Pair>{}(std::vector<std::pair<int, double>>{{1, 0.5}, {2, 1.5}});
  EXPECT_EQ(values(pair.first), (std::vector<int>{1, 2}));
  EXPECT_EQ(values(pair.second), (std::vector<double>{0.5, 1.5}));
}

}  // namespace
