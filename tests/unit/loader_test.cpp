// The loader in the consumer's thread (num_workers = 0).
#include <gtest/gtest.h>

#include <conveyor/conveyor.h>

#include <numeric>
#include <set>
#include <string>
#include <vector>

#include "support/datasets.h"

namespace {

using conveyor::testing::RangeDataset;
using conveyor::testing::StridedStream;
using conveyor::testing::ThrowingDataset;

template <class Loader>
std::vector<std::vector<int64_t>> all_batches(Loader& loader) {
  std::vector<std::vector<int64_t>> out;
  for (auto& batch : loader) out.emplace_back(batch.values().begin(), batch.values().end());
  return out;
}

TEST(Loader, SequentialBatchesWithAndWithoutTheTail) {
  RangeDataset ds(7);
  conveyor::DataLoader keep(ds, {.batch_size = 3});
  conveyor::DataLoader drop(ds, {.batch_size = 3, .drop_last = true});
  EXPECT_EQ(all_batches(keep), (std::vector<std::vector<int64_t>>{{0, 1, 2}, {3, 4, 5}, {6}}));
  EXPECT_EQ(all_batches(drop), (std::vector<std::vector<int64_t>>{{0, 1, 2}, {3, 4, 5}}));
  EXPECT_EQ(keep.size(), 3u);
  EXPECT_EQ(drop.size(), 2u);
}

TEST(Loader, ShuffleIsReproducibleBySeedAndDiffersByEpoch) {
  RangeDataset ds(50);
  conveyor::DataLoader a(ds, {.batch_size = 5, .shuffle = true, .seed = 3});
  conveyor::DataLoader b(ds, {.batch_size = 5, .shuffle = true, .seed = 3});
  const auto a0 = all_batches(a), a1 = all_batches(a);
  EXPECT_EQ(all_batches(b), a0);
  EXPECT_NE(a0, a1);
  std::vector<int64_t> flat;
  for (const auto& batch : a0) flat.insert(flat.end(), batch.begin(), batch.end());
  std::sort(flat.begin(), flat.end());
  std::vector<int64_t> expected(50);
  std::iota(expected.begin(), expected.end(), 0);
  EXPECT_EQ(flat, expected);
}

TEST(Loader, SharedPointerKeepsTheDatasetAlive) {
  auto ds = std::make_shared<RangeDataset>(4);
  std::weak_ptr<RangeDataset> watch = ds;
  conveyor::DataLoader loader(std::move(ds), {.batch_size = 2});
  auto epoch = loader.iter();
  EXPECT_FALSE(watch.expired());
  EXPECT_EQ(epoch.next()->values()[0], 0);
}

TEST(Loader, NoAutoBatchingHandsOutSamples) {
  RangeDataset ds(3);
  conveyor::DataLoader<RangeDataset, conveyor::DefaultConvert> loader(ds, {.batch_size = std::nullopt});
  std::vector<int64_t> got;
  for (int64_t sample : loader) got.push_back(sample);
  EXPECT_EQ(got, (std::vector<int64_t>{0, 1, 2}));
  EXPECT_EQ(loader.size(), 3u);
}

TEST(Loader, CustomBatchSamplerAndCollate) {
  RangeDataset ds(6);
  auto batches = std::make_shared<conveyor::BatchSampler>(
      std::make_shared<conveyor::SequentialSampler>(6), 4, false);
  auto sum = [](std::vector<int64_t>&& samples) { return std::accumulate(samples.begin(), samples.end(), int64_t{0}); };
  conveyor::DataLoader loader(ds, {.batch_sampler = batches}, sum);
  std::vector<int64_t> sums;
  for (int64_t s : loader) sums.push_back(s);
  EXPECT_EQ(sums, (std::vector<int64_t>{0 + 1 + 2 + 3, 4 + 5}));
}

TEST(Loader, GetBatchIsUsedWhenTheDatasetHasIt) {
  struct Batched final : conveyor::Dataset<int> {
    size_t size() const override { return 8; }
    int get(size_t) override { throw std::logic_error("get_batch should be used"); }
    std::vector<int> get_batch(std::span<const size_t> indices) override {
      ++calls;
      return std::vector<int>(indices.begin(), indices.end());
    }
    int calls = 0;
  } ds;
  conveyor::DataLoader loader(ds, {.batch_size = 4});
  size_t batches = 0;
  for (auto& batch : loader) batches += batch.shape()[0] == 4 ? 1 : 0;
  EXPECT_EQ(batches, 2u);
  EXPECT_EQ(ds.calls, 2);
}

TEST(Loader, ErrorsArriveAtTheirBatchWithContextAndTheEpochGoesOn) {
  ThrowingDataset ds(10, {4});
  conveyor::DataLoader loader(ds, {.batch_size = 3});
  auto epoch = loader.iter();
  EXPECT_TRUE(epoch.next().has_value());  // 0 1 2
  try {
    epoch.next();  // 3 4 5
    FAIL() << "no exception";
  } catch (const conveyor::WorkerError& e) {
    EXPECT_EQ(e.context().batch_seq, 1u);
    EXPECT_EQ(e.context().indices, (std::vector<size_t>{3, 4, 5}));
    EXPECT_EQ(e.context().stage, "fetch");
    EXPECT_EQ(e.context().worker_id, -1);
    EXPECT_NE(std::string(e.what()).find("bad sample 4"), std::string::npos) << e.what();
    try {
      std::rethrow_exception(e.original());
    } catch (const std::runtime_error& original) {
      EXPECT_STREQ(original.what(), "bad sample 4");
    }
  }
  auto next = epoch.next();  // 6 7 8
  ASSERT_TRUE(next.has_value());
  EXPECT_EQ((*next)[0], 6);
  EXPECT_TRUE(epoch.next().has_value());  // 9
  EXPECT_FALSE(epoch.next().has_value());
}

TEST(Loader, CollateErrorsNameTheCollateStage) {
  RangeDataset ds(4);
  auto failing = [](std::vector<int64_t>&&) -> int { throw std::invalid_argument("nope"); };
  conveyor::DataLoader loader(ds, {.batch_size = 2}, failing);
  auto epoch = loader.iter();
  try {
    epoch.next();
    FAIL();
  } catch (const conveyor::WorkerError& e) {
    EXPECT_EQ(e.context().stage, "collate");
  }
}

TEST(Loader, IterableDatasetBatchesAndDropLast) {
  StridedStream stream(7, 7);
  conveyor::DataLoader keep(stream, {.batch_size = 3});
  conveyor::DataLoader drop(stream, {.batch_size = 3, .drop_last = true});
  EXPECT_EQ(all_batches(keep), (std::vector<std::vector<int64_t>>{{0, 1, 2}, {3, 4, 5}, {6}}));
  EXPECT_EQ(all_batches(drop), (std::vector<std::vector<int64_t>>{{0, 1, 2}, {3, 4, 5}}));
  EXPECT_EQ(keep.size(), 3u);
  EXPECT_EQ(drop.size(), 2u);
}

TEST(Loader, IterableDatasetThatYieldsMoreThanItsLengthWarnsOnce) {
  StridedStream stream(10, 4);  // claims 4 samples, has 10
  std::vector<std::string> warnings;
  auto previous = conveyor::set_warning_handler([&](const std::string& m) { warnings.push_back(m); });
  conveyor::DataLoader loader(stream, {.batch_size = 2});
  EXPECT_EQ(loader.size(), 2u);
  EXPECT_EQ(all_batches(loader).size(), 5u);
  conveyor::set_warning_handler(previous);
  ASSERT_EQ(warnings.size(), 1u);
  EXPECT_NE(warnings[0].find("was reported to be 2"), std::string::npos) << warnings[0];
}

TEST(Loader, SetEpochReachesADistributedSampler) {
  RangeDataset ds(20);
  auto sampler = std::make_shared<conveyor::DistributedSampler>(20, 2, 1, true, 0);
  conveyor::DataLoader loader(ds, {.batch_size = 10, .sampler = sampler});
  loader.set_epoch(0);
  const auto epoch0 = all_batches(loader);
  EXPECT_EQ(all_batches(loader), epoch0);
  loader.set_epoch(1);
  EXPECT_NE(all_batches(loader), epoch0);
  sampler->set_epoch(0);
  EXPECT_EQ(all_batches(loader), epoch0);
}

TEST(Loader, EachEpochDrawsItsBaseSeedFromTheLoadersGenerator) {
  RangeDataset ds(4);
  conveyor::Generator g(17), reference(17);
  conveyor::DataLoader loader(ds, {.generator = g});
  EXPECT_EQ(loader.iter().base_seed(), conveyor::draw_seed(reference));
  EXPECT_EQ(loader.iter().base_seed(), conveyor::draw_seed(reference));
}

}  // namespace
