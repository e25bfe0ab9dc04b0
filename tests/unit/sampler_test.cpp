#include <gtest/gtest.h>

#include <conveyor/errors.h>
#include <conveyor/sampler.h>

#include <algorithm>
#include <numeric>
#include <set>

namespace {

using conveyor::collect;

TEST(SequentialSampler, CountsUp) {
  conveyor::SequentialSampler sampler(5);
  EXPECT_EQ(collect(sampler), (std::vector<size_t>{0, 1, 2, 3, 4}));
  EXPECT_EQ(sampler.size(), 5u);
}

TEST(RandomSampler, EachPassIsAPermutationAndPassesDiffer) {
  conveyor::RandomSampler sampler(100, false, std::nullopt, conveyor::Generator(1));
  auto first = collect(sampler);
  auto second = collect(sampler);
  EXPECT_NE(first, second);
  std::sort(first.begin(), first.end());
  std::vector<size_t> all(100);
  std::iota(all.begin(), all.end(), 0);
  EXPECT_EQ(first, all);
}

TEST(RandomSampler, NumSamplesBeyondTheDatasetCoversItWholeThenTheRemainder) {
  conveyor::RandomSampler sampler(10, false, 25, conveyor::Generator(2));
  const auto drawn = collect(sampler);
  ASSERT_EQ(drawn.size(), 25u);
  for (size_t pass = 0; pass < 2; ++pass) {
    std::set<size_t> seen(drawn.begin() + static_cast<long>(pass * 10),
                          drawn.begin() + static_cast<long>(pass * 10 + 10));
    EXPECT_EQ(seen.size(), 10u);
  }
}

TEST(RandomSampler, ReplacementStaysInRange) {
  conveyor::RandomSampler sampler(7, true, 100, conveyor::Generator(3));
  const auto drawn = collect(sampler);
  ASSERT_EQ(drawn.size(), 100u);
  for (size_t v : drawn) EXPECT_LT(v, 7u);
}

TEST(RandomSampler, RejectsNonPositiveNumSamples) {
  EXPECT_THROW(conveyor::RandomSampler(10, false, 0), conveyor::ValueError);
  EXPECT_THROW(conveyor::RandomSampler(0), conveyor::ValueError);
  conveyor::RandomSampler empty_with_replacement(0, true, 3);
  EXPECT_THROW(collect(empty_with_replacement), conveyor::RuntimeError);
  conveyor::RandomSampler empty_without(0, false, 3);
  EXPECT_THROW(collect(empty_without), conveyor::ValueError);
}

TEST(RandomSampler, DrawsOnlyWhenIterated) {
  conveyor::Generator g(4), reference(4);
  conveyor::RandomSampler sampler(10, false, std::nullopt, g);
  auto it = sampler.iter();  // creating the iterator draws nothing
  EXPECT_EQ(g.random(), reference.random());
}

TEST(BatchSampler, GroupsAndDropsTheTail) {
  auto inner = std::make_shared<conveyor::SequentialSampler>(10);
  conveyor::BatchSampler keep(inner, 3, false), drop(inner, 3, true);
  EXPECT_EQ(collect(keep), (std::vector<conveyor::BatchIndices>{{0, 1, 2}, {3, 4, 5}, {6, 7, 8}, {9}}));
  EXPECT_EQ(collect(drop), (std::vector<conveyor::BatchIndices>{{0, 1, 2}, {3, 4, 5}, {6, 7, 8}}));
  EXPECT_EQ(keep.size(), 4u);
  EXPECT_EQ(drop.size(), 3u);
  EXPECT_THROW(conveyor::BatchSampler(inner, 0, false), conveyor::ValueError);
}

TEST(DistributedSampler, RanksPartitionThePaddedPermutation) {
  const size_t n = 11;
  std::multiset<size_t> all;
  for (int rank = 0; rank < 4; ++rank) {
    conveyor::DistributedSampler sampler(n, 4, rank, true, 5);
    sampler.set_epoch(2);
    const auto mine = collect(sampler);
    EXPECT_EQ(mine.size(), 3u);
    all.insert(mine.begin(), mine.end());
  }
  EXPECT_EQ(all.size(), 12u);  // 11 + 1 padded
  for (size_t i = 0; i < n; ++i) EXPECT_GE(all.count(i), 1u);
}

TEST(DistributedSampler, SetEpochChangesTheOrder) {
  conveyor::DistributedSampler sampler(50, 2, 0);
  const auto epoch0 = collect(sampler);
  EXPECT_EQ(collect(sampler), epoch0);
  sampler.set_epoch(1);
  EXPECT_NE(collect(sampler), epoch0);
}

TEST(DistributedSampler, RejectsBadRanks) {
  EXPECT_THROW(conveyor::DistributedSampler(10, 2, 2), conveyor::ValueError);
  EXPECT_THROW(conveyor::DistributedSampler(10, 0, 0), conveyor::ValueError);
}

}  // namespace
