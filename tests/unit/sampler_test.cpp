#include <gtest/gtest.h>

#include <conveyor/conveyor.h>
#include <conveyor/errors.h>
#include <conveyor/sampler.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <new>
#include <numeric>
#include <set>
#include <string>
#include <vector>

#include "support/allocations.h"
#include "support/datasets.h"

namespace {

using conveyor::collect;

// The rest of a pass already started (or not).
template <class Index>
std::vector<Index> collect_rest(conveyor::SamplerIterator<Index>& it) {
  std::vector<Index> out;
  Index index{};
  while (it.next(index)) out.push_back(index);
  return out;
}

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

// What `calls` next()s on a pass give: "index", "end" (then no more calls),
// or the exception's text after a "!".
template <class Index>
std::vector<std::string> pass_of(conveyor::SamplerIterator<Index>& it, size_t calls) {
  std::vector<std::string> out;
  Index index{};
  for (size_t i = 0; i < calls; ++i) {
    try {
      if (!it.next(index)) {
        out.push_back("end");
        break;
      }
      out.push_back("index");
    } catch (const std::exception& e) {
      out.push_back(std::string("!") + e.what());
    }
  }
  return out;
}

// A Python generator that raised is finished: the next next() is
// StopIteration. RandomSampler([], num_samples=3) fails with
// ZeroDivisionError, then ends.
TEST(RandomSampler, APassThatThrewIsOver) {
  conveyor::RandomSampler without(size_t{0}, false, 3, conveyor::Generator(0));
  auto it = without.iter();
  EXPECT_EQ(pass_of(*it, 3),
            (std::vector<std::string>{"!RandomSampler: cannot draw num_samples=3 without "
                                      "replacement from an empty dataset",
                                      "end"}));
  conveyor::RandomSampler with(size_t{0}, true, 3, conveyor::Generator(0));
  it = with.iter();
  EXPECT_EQ(pass_of(*it, 3),
            (std::vector<std::string>{
                "!random_ expects 'from' to be less than 'to', but got from=0 >= to=0", "end"}));
}

TEST(WeightedRandomSampler, APassThatThrewIsOver) {
  conveyor::WeightedRandomSampler sampler({0.0, 0.0}, 3, true, conveyor::Generator(0));
  auto it = sampler.iter();
  EXPECT_EQ(pass_of(*it, 3),
            (std::vector<std::string>{
                "!invalid multinomial distribution (sum of probabilities <= 0)", "end"}));
}

// A sampler of the user's whose iterator throws at every call: the batch
// sampler's pass still ends after the first throw, as Python's does.
struct AlwaysThrowing final : conveyor::Sampler<size_t> {
  size_t size() const override { return 4; }
  std::unique_ptr<conveyor::SamplerIterator<size_t>> iter() override {
    struct It final : conveyor::SamplerIterator<size_t> {
      bool next(size_t&) override { throw conveyor::ValueError("no index"); }
    };
    return std::make_unique<It>();
  }
  std::string name() const override { return "AlwaysThrowing"; }
};

TEST(BatchSampler, APassThatThrewIsOver) {
  conveyor::BatchSampler sampler(std::make_shared<AlwaysThrowing>(), 2, false);
  auto it = sampler.iter();
  EXPECT_EQ(pass_of(*it, 3), (std::vector<std::string>{"!no index", "end"}));
}

// PyTorch's DataLoader asks the sampler again after its error, gets
// StopIteration, and the epoch ends; so do conveyor's, with and without
// workers.
TEST(SamplerErrors, EndTheLoadersEpoch) {
  for (int workers : {0, 2}) {
    SCOPED_TRACE("num_workers=" + std::to_string(workers));
    conveyor::testing::RangeDataset empty(0), two(2);
    const auto run = [](conveyor::testing::RangeDataset& ds,
                        std::shared_ptr<conveyor::Sampler<size_t>> sampler, int num_workers) {
      conveyor::DataLoader loader(
          ds, {.batch_size = 2, .sampler = std::move(sampler), .num_workers = num_workers});
      auto epoch = loader.iter();
      std::vector<std::string> out;
      for (int i = 0; i < 4; ++i) {
        try {
          if (!epoch.next()) {
            out.push_back("end");
            break;
          }
          out.push_back("batch");
        } catch (const std::exception& e) {
          out.push_back(std::string("!") + e.what());
        }
      }
      return out;
    };
    EXPECT_EQ(run(empty,
                  std::make_shared<conveyor::RandomSampler>(size_t{0}, false, 3,
                                                            conveyor::Generator(0)),
                  workers),
              (std::vector<std::string>{"!RandomSampler: cannot draw num_samples=3 without "
                                        "replacement from an empty dataset",
                                        "end"}));
    EXPECT_EQ(run(two,
                  std::make_shared<conveyor::WeightedRandomSampler>(
                      std::vector<double>{0.0, 0.0}, 3, true, conveyor::Generator(0)),
                  workers),
              (std::vector<std::string>{
                  "!invalid multinomial distribution (sum of probabilities <= 0)", "end"}));
  }
}

// Takes back the memory of an object of `bytes` just freed (malloc hands a
// block of the same size straight back) and zeroes it, so a pass still
// reading its destroyed sampler reads nothing instead of the old values.
std::vector<std::unique_ptr<std::byte[]>> reuse_freed(size_t bytes) {
  std::vector<std::unique_ptr<std::byte[]>> blocks;
  for (int i = 0; i < 8; ++i) {
    blocks.emplace_back(new std::byte[bytes]);
    std::memset(blocks.back().get(), 0, bytes);
  }
  return blocks;
}

// Python's generator keeps its sampler alive; a pass here may outlive its
// sampler, drawing from the generator it shares with it.
TEST(RandomSampler, APassOutlivesItsSampler) {
  conveyor::Generator g(5);
  conveyor::RandomSampler twin(size_t{10}, false, 15, conveyor::Generator(5));
  auto sampler = std::make_unique<conveyor::RandomSampler>(size_t{10}, false, 15, g);
  auto it = sampler->iter();
  sampler.reset();
  const auto scribbled = reuse_freed(sizeof(conveyor::RandomSampler));
  EXPECT_EQ(collect_rest(*it), collect(twin));
  // It drew from the sampler's generator itself, not a copy of it.
  conveyor::Generator reference(5);
  // 15 of 10: a whole pass's randperm, then the remainder's.
  for (int i = 0; i < 2; ++i) (void)randperm(10, reference);
  EXPECT_EQ(g.random(), reference.random());
}

TEST(SubsetRandomSampler, APassOutlivesItsSampler) {
  conveyor::SubsetRandomSampler twin({3, 5, 7, 9}, conveyor::Generator(6));
  auto sampler = std::make_unique<conveyor::SubsetRandomSampler>(std::vector<size_t>{3, 5, 7, 9},
                                                                 conveyor::Generator(6));
  auto it = sampler->iter();
  sampler.reset();
  const auto scribbled = reuse_freed(sizeof(conveyor::SubsetRandomSampler));
  EXPECT_EQ(collect_rest(*it), collect(twin));
}

TEST(WeightedRandomSampler, APassOutlivesItsSampler) {
  conveyor::WeightedRandomSampler twin({1.0, 2.0, 3.0}, 6, true, conveyor::Generator(7));
  auto sampler = std::make_unique<conveyor::WeightedRandomSampler>(
      std::vector<double>{1.0, 2.0, 3.0}, 6, true, conveyor::Generator(7));
  auto it = sampler->iter();
  sampler.reset();
  const auto scribbled = reuse_freed(sizeof(conveyor::WeightedRandomSampler));
  EXPECT_EQ(collect_rest(*it), collect(twin));
}

// iter(BatchSampler(RandomSampler(range(10)), 4, False)): both samplers are
// gone before the first next().
TEST(BatchSampler, APassOutlivesItsSampler) {
  conveyor::BatchSampler twin(std::make_shared<conveyor::RandomSampler>(
                                  size_t{10}, false, std::nullopt, conveyor::Generator(8)),
                              4, false);
  // Its own allocation (not make_shared's), for reuse_freed to take back.
  std::shared_ptr<conveyor::RandomSampler> inner(
      new conveyor::RandomSampler(size_t{10}, false, std::nullopt, conveyor::Generator(8)));
  auto it = conveyor::BatchSampler(std::move(inner), 4, false).iter();
  const auto scribbled = reuse_freed(sizeof(conveyor::RandomSampler));
  EXPECT_EQ(collect_rest(*it), collect(twin));
}

// total_size() is num_samples × num_replicas: a pass builds only this rank's
// share, so a huge num_replicas costs nothing (PyTorch's list of total_size
// is a MemoryError there).
TEST(DistributedSampler, BuildsOnlyThisRanksShare) {
  conveyor::DistributedSampler sampler(10, int64_t{1} << 20, 3, false);
  EXPECT_EQ(sampler.total_size(), size_t{1} << 20);
  const size_t before = conveyor::testing::allocations_so_far();
  const auto mine = collect(sampler);
  // The share, the iterator and collect()'s vector; not a list of 2^20.
  EXPECT_LE(conveyor::testing::allocations_so_far() - before, 4u);
  EXPECT_EQ(mine, (std::vector<size_t>{3}));
  conveyor::DistributedSampler shuffled(10, int64_t{1} << 20, (int64_t{1} << 20) - 1, true, 4);
  EXPECT_EQ(collect(shuffled).size(), 1u);
}

// PyTorch 1.13 checks the rank alone, so num_replicas < 1 fails that check.
TEST(DistributedSampler, NonPositiveReplicasFailTheRankCheckAsInPyTorch) {
  const auto message = [](int64_t replicas, int64_t rank) {
    try {
      conveyor::DistributedSampler(10, replicas, rank);
    } catch (const conveyor::ValueError& e) {
      return std::string(e.what());
    }
    return std::string("no exception");
  };
  EXPECT_EQ(message(0, 0), "Invalid rank 0, rank should be in the interval [0, -1]");
  EXPECT_EQ(message(-1, 0), "Invalid rank 0, rank should be in the interval [0, -2]");
  EXPECT_EQ(message(0, -1), "Invalid rank -1, rank should be in the interval [0, -1]");
}

}  // namespace
