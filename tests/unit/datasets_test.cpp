#include <gtest/gtest.h>

#include <conveyor/datasets.h>
#include <conveyor/warnings.h>

#include <memory>
#include <set>

#include "support/datasets.h"

namespace {

using conveyor::testing::RangeDataset;
using conveyor::testing::StridedStream;

TEST(Subset, MapsIndicesAndBatches) {
  auto base = std::make_shared<RangeDataset>(10);
  conveyor::Subset<int64_t> subset(base, {7, 2, 5});
  EXPECT_EQ(subset.size(), 3u);
  EXPECT_EQ(subset.get(0), 7);
  const std::vector<size_t> wanted{2, 0};
  EXPECT_EQ(subset.get_batch(wanted), (std::vector<int64_t>{5, 7}));
  EXPECT_THROW(subset.get(3), conveyor::IndexError);
}

TEST(ConcatDataset, IndexesAcrossParts) {
  auto a = std::make_shared<RangeDataset>(3);
  auto b = std::make_shared<RangeDataset>(0);
  auto c = std::make_shared<RangeDataset>(2);
  conveyor::ConcatDataset<int64_t> concat({a, b, c});
  EXPECT_EQ(concat.size(), 5u);
  std::vector<int64_t> all;
  for (size_t i = 0; i < concat.size(); ++i) all.push_back(concat.get(i));
  EXPECT_EQ(all, (std::vector<int64_t>{0, 1, 2, 0, 1}));
  EXPECT_EQ(concat.cumulative_sizes(), (std::vector<size_t>{3, 3, 5}));
  EXPECT_THROW(concat.get(5), conveyor::IndexError);
  EXPECT_THROW(conveyor::ConcatDataset<int64_t>({}), conveyor::ValueError);
}

TEST(ChainDataset, ChainsReplicasAndSizes) {
  auto a = std::make_shared<StridedStream>(3, 3);
  auto b = std::make_shared<StridedStream>(2, 2);
  conveyor::ChainDataset<int64_t> chain({a, b});
  auto it = chain.iter(nullptr);
  std::vector<int64_t> all;
  while (auto v = it->next()) all.push_back(*v);
  EXPECT_EQ(all, (std::vector<int64_t>{0, 1, 2, 0, 1}));
  EXPECT_EQ(chain.size(), std::optional<size_t>(5));
  auto unsized = std::make_shared<StridedStream>(2);
  EXPECT_EQ(conveyor::ChainDataset<int64_t>({a, unsized}).size(), std::nullopt);
}

// One sample: the epoch it was last told of (a part that orders its data by
// epoch, as TarShardDataset's shuffle_shards does).
struct EpochStream final : conveyor::IterableDataset<int64_t> {
  std::unique_ptr<conveyor::SampleIterator<int64_t>> iter(const conveyor::WorkerInfo*) override {
    return conveyor::make_sample_iterator<int64_t>(
        [epoch = epoch, done = false]() mutable -> std::optional<int64_t> {
          if (done) return std::nullopt;
          done = true;
          return static_cast<int64_t>(epoch);
        });
  }
  void set_epoch(uint64_t e) override { epoch = e; }
  uint64_t epoch = 0;
};

TEST(ChainDataset, PassesTheEpochOnToEveryPart) {
  auto a = std::make_shared<EpochStream>();
  auto b = std::make_shared<EpochStream>();
  conveyor::ChainDataset<int64_t> chain({a, b});
  chain.set_epoch(5);
  auto it = chain.iter(nullptr);
  std::vector<int64_t> all;
  while (auto v = it->next()) all.push_back(*v);
  EXPECT_EQ(all, (std::vector<int64_t>{5, 5}));
}

TEST(StackDataset, TuplesOfEqualSizedDatasets) {
  auto ints = std::make_shared<RangeDataset>(4);
  auto strings = std::make_shared<conveyor::VectorDataset<std::string>>(
      std::vector<std::string>{"a", "b", "c", "d"});
  conveyor::StackDataset<int64_t, std::string> stack(ints, strings);
  EXPECT_EQ(stack.size(), 4u);
  EXPECT_EQ(stack.get(2), (std::tuple<int64_t, std::string>{2, "c"}));
  auto short_one = std::make_shared<RangeDataset>(3);
  EXPECT_THROW((conveyor::StackDataset<int64_t, int64_t>(ints, short_one)), conveyor::ValueError);
}

TEST(RandomSplit, PartsAreDisjointAndCoverTheDataset) {
  auto base = std::make_shared<RangeDataset>(30);
  conveyor::Generator g(42);
  const auto parts = conveyor::random_split<int64_t>(base, {0.3, 0.3, 0.4}, g);
  ASSERT_EQ(parts.size(), 3u);
  std::set<size_t> seen;
  for (const auto& part : parts) {
    EXPECT_EQ(part->size(), part == parts[2] ? 12u : 9u);
    for (size_t i : part->indices()) EXPECT_TRUE(seen.insert(i).second);
  }
  EXPECT_EQ(seen.size(), 30u);
}

TEST(RandomSplit, WarnsAboutEmptySplits) {
  std::vector<std::string> warnings;
  auto previous = conveyor::set_warning_handler([&](const std::string& m) { warnings.push_back(m); });
  auto base = std::make_shared<RangeDataset>(2);
  conveyor::Generator g(0);
  conveyor::random_split<int64_t>(base, {0.1, 0.1, 0.8}, g);
  conveyor::set_warning_handler(previous);
  ASSERT_EQ(warnings.size(), 1u);
  EXPECT_EQ(warnings[0], "Length of split at index 1 is 0. This might result in an empty dataset.");
}

TEST(RandomSplit, RejectsNegativeAndFractionalCounts) {
  auto base = std::make_shared<RangeDataset>(10);
  conveyor::Generator g(0);
  EXPECT_THROW(conveyor::random_split<int64_t>(base, {-1.0, 11.0}, g), conveyor::ValueError);
  EXPECT_THROW(conveyor::random_split<int64_t>(base, {2.5, 7.5}, g), conveyor::ValueError);
}

}  // namespace
