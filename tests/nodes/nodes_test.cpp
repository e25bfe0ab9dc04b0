// The pipeline nodes, each run standalone: what each yields, in which
// order, per pass; sharding; seeds; errors that name the node and go on.
#include <gtest/gtest.h>

#include <conveyor/conveyor.h>
#include <conveyor/nodes.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <functional>
#include <limits>
#include <map>
#include <numeric>
#include <optional>
#include <ranges>
#include <set>
#include <span>
#include <stdexcept>
#include <sstream>
#include <string>
#include <vector>

#include "support/datasets.h"
#include "support/pipelines.h"
#include "support/sync.h"

namespace {

namespace nodes = conveyor::nodes;
using conveyor::Pipeline;
using conveyor::Poll;
using conveyor::ShardSpec;
using conveyor::State;

using conveyor::testing::one_pass;

// A source that cannot take a shard, as a file lister: every rank gets all
// of it.
class Unshardable final : public nodes::MeteredNode<int64_t> {
 public:
  explicit Unshardable(std::vector<int64_t> items) : items_(std::move(items)) {}
  using Node<int64_t>::reset;
  void reset(const conveyor::PassContext& pass, conveyor::detail::ResetWalk& walk) override {
    next_ = 0;
    start_metering(pass, walk.next_id++);
  }
  std::string name() const override { return "unshardable"; }

 private:
  std::optional<int64_t> produce() override {
    if (next_ == items_.size()) return std::nullopt;
    return items_[next_++];
  }
  std::vector<int64_t> items_;
  size_t next_ = 0;
};

Pipeline<int64_t> unshardable(std::vector<int64_t> items) {
  return Pipeline<int64_t>(std::make_unique<Unshardable>(std::move(items)));
}

// A source that is not ready until opened: try_next() says "not yet";
// next() while closed would wait for ever, so it fails the test instead.
class Gate final : public nodes::MeteredNode<int64_t> {
 public:
  Gate(int64_t n, bool& open) : n_(n), open_(open) {}
  using Node<int64_t>::reset;
  void reset(const conveyor::PassContext& pass, conveyor::detail::ResetWalk& walk) override {
    next_ = 0;
    start_metering(pass, walk.next_id++);
  }
  Poll try_next(std::optional<int64_t>& out) override {
    if (!open_) return Poll::pending;
    return counted((out = next()) ? Poll::ready : Poll::end);
  }
  std::string name() const override { return "gate"; }

 private:
  std::optional<int64_t> produce() override {
    if (!open_) ADD_FAILURE() << "a try_next() waited on the closed gate";
    if (next_ == n_) return std::nullopt;
    return next_++;
  }
  int64_t n_;
  bool& open_;
  int64_t next_ = 0;
};

// Three sources of 10, 10 and 3 items, each shardable.
std::vector<Pipeline<int64_t>> make_sources() {
  std::vector<Pipeline<int64_t>> sources;
  sources.push_back(nodes::from_range(0, 10));
  sources.push_back(nodes::from_range(100, 110) | nodes::map([](int64_t x) { return x; }));
  sources.push_back(nodes::from_vector(std::vector<int64_t>{200, 201, 202}));
  return sources;
}

std::vector<int64_t> iota(int64_t n) {
  std::vector<int64_t> v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) v[static_cast<size_t>(i)] = i;
  return v;
}

// A new pass() resets the nodes an older Pass still reads: that Pass
// throws on its next use (both passes pulled from one stream, each losing
// items to the other, and state() counted only the new one's).
TEST(PipelineContract, APassReplacedByALaterOneThrowsInsteadOfSharingItsStream) {
  auto pipeline = nodes::from_vector(std::vector<int>{0, 1, 2, 3, 4, 5});
  auto first = pipeline.pass();
  EXPECT_EQ(first.next(), 0);
  auto second = pipeline.pass();
  EXPECT_EQ(second.next(), 0);
  EXPECT_THROW((void)first.next(), conveyor::ValueError);
  std::optional<int> out;
  EXPECT_THROW((void)first.try_next(out), conveyor::ValueError);
  EXPECT_THROW((void)first.begin(), conveyor::ValueError);
  std::vector<int> rest;
  while (auto item = second.next()) rest.push_back(*item);
  EXPECT_EQ(rest, (std::vector<int>{1, 2, 3, 4, 5}));

  // So after load_state: the pass it resumes replaces the one alive.
  auto third = pipeline.pass();
  EXPECT_EQ(third.next(), 0);
  EXPECT_EQ(third.next(), 1);
  const State saved = pipeline.state();
  pipeline.load_state(saved);
  auto resumed = pipeline.pass();
  EXPECT_THROW((void)third.next(), conveyor::ValueError);
  EXPECT_EQ(resumed.next(), 2);
}

// A pipeline moved into `| adaptor` is empty: using it is a clear error
// (it was a null dereference).
TEST(PipelineContract, AMovedFromPipelineSaysSoInsteadOfCrashing) {
  auto source = nodes::from_vector(std::vector<int>{0, 1, 2});
  auto longer = std::move(source) | nodes::map([](int x) { return x; });
  for (const auto& use : std::vector<std::function<void()>>{[&] { (void)source.pass(); },
                                                            [&] { (void)source.state(); },
                                                            [&] { (void)source.metrics(); },
                                                            [&] { source.load_state(longer.state()); }}) {
    try {
      use();
      ADD_FAILURE() << "a moved-from pipeline was used";
    } catch (const conveyor::ValueError& e) {
      EXPECT_NE(std::string(e.what()).find("moved from"), std::string::npos) << e.what();
    }
  }
  EXPECT_EQ(one_pass(longer), (std::vector<int>{0, 1, 2}));
}

// Five items; `fail` 1: iter() throws, 2: the iterator's skip() throws.
struct FailingOnResume final : conveyor::IterableDataset<int64_t> {
  struct Iterator final : conveyor::SampleIterator<int64_t> {
    explicit Iterator(const FailingOnResume& owner) : owner(owner) {}
    std::optional<int64_t> next() override { return next_value < 5 ? std::optional<int64_t>(next_value++) : std::nullopt; }
    uint64_t skip(uint64_t count) override {
      if (owner.fail == 2) throw std::runtime_error("read failed");
      return conveyor::SampleIterator<int64_t>::skip(count);
    }
    const FailingOnResume& owner;
    int64_t next_value = 0;
  };
  std::unique_ptr<conveyor::SampleIterator<int64_t>> iter(const conveyor::WorkerInfo*) override {
    if (fail == 1) throw std::runtime_error("open failed");
    return std::make_unique<Iterator>(*this);
  }
  int fail = 0;
};

// A resumed from_iterable's replay fails as its passes do: a NodeError
// naming the node and the item (it was the dataset's bare exception).
TEST(Sources, AnIterableSourceFailingAsItResumesNamesItselfAndTheItem) {
  auto dataset = std::make_shared<FailingOnResume>();
  auto pipeline = nodes::from_iterable(dataset);
  State saved;
  {
    auto pass = pipeline.pass();
    (void)pass.next();
    (void)pass.next();
    saved = pipeline.state();
  }
  for (const int fail : {1, 2}) {
    dataset->fail = fail;
    auto resumed = nodes::from_iterable(dataset);
    resumed.load_state(saved);
    try {
      (void)resumed.pass();
      ADD_FAILURE() << "the resume did not fail (mode " << fail << ")";
    } catch (const conveyor::NodeError& e) {
      EXPECT_NE(std::string(e.what()).find("'from_iterable' at item 0"), std::string::npos) << e.what();
    } catch (const std::exception& e) {
      ADD_FAILURE() << "mode " << fail << ": not a NodeError: " << e.what();
    }
  }
}

TEST(Sources, VectorAndRangeGiveTheirItemsEveryPass) {
  auto vector = nodes::from_vector(std::vector<std::string>{"a", "b", "c"});
  EXPECT_EQ(one_pass(vector), (std::vector<std::string>{"a", "b", "c"}));
  EXPECT_EQ(one_pass(vector), (std::vector<std::string>{"a", "b", "c"}));
  auto range = nodes::from_range(3, 7);
  EXPECT_EQ(one_pass(range), (std::vector<int64_t>{3, 4, 5, 6}));
}

// A range may span int64_t's edges: its end, its shards' steps and a
// resumed pass's skip do not overflow.
TEST(Sources, ARangeAtTheEdgesOfInt64) {
  constexpr int64_t kMax = std::numeric_limits<int64_t>::max();
  constexpr int64_t kMin = std::numeric_limits<int64_t>::min();
  auto top = nodes::from_range(kMax - 3, kMax);
  EXPECT_EQ(one_pass(top), (std::vector<int64_t>{kMax - 3, kMax - 2, kMax - 1}));
  auto sharded = nodes::from_range(kMax - 5, kMax);
  sharded.shard({.rank = 1, .world_size = 2});
  EXPECT_EQ(one_pass(sharded), (std::vector<int64_t>{kMax - 4, kMax - 2}));
  auto past = nodes::from_range(kMax - 1, kMax);
  past.shard({.rank = 3, .world_size = 4});
  EXPECT_TRUE(one_pass(past).empty());
  // All of int64_t, sharded in two: skip to near the end, then read it.
  auto whole = nodes::from_range(kMin, kMax);
  whole.shard({.rank = 0, .world_size = 2});
  auto saver = nodes::from_range(kMin, kMax);
  saver.shard({.rank = 0, .world_size = 2});
  State state = saver.state();
  state.set("received", (uint64_t{1} << 63) - 2);  // the shard holds 2^63 items: kMin, kMin + 2, ..., kMax - 1
  state.set("epoch", uint64_t{0});
  whole.load_state(state);
  auto pass = whole.pass();
  EXPECT_EQ(pass.next(), std::optional<int64_t>(kMax - 3));
  EXPECT_EQ(pass.next(), std::optional<int64_t>(kMax - 1));
  EXPECT_EQ(pass.next(), std::nullopt);
}

TEST(Sources, AMapDatasetThroughItsSamplerAndItsSizeAtEachPass) {
  conveyor::testing::RangeDataset dataset(6);
  auto sequential = nodes::from_map_dataset(dataset);
  EXPECT_EQ(one_pass(sequential), iota(6));
  dataset.n = 3;
  EXPECT_EQ(one_pass(sequential), iota(3));
  auto shuffled = nodes::from_map_dataset(
      dataset, std::make_shared<conveyor::RandomSampler>(3, false, std::nullopt, conveyor::Generator(5)));
  std::vector<int64_t> items = one_pass(shuffled);
  std::sort(items.begin(), items.end());
  EXPECT_EQ(items, iota(3));
}

// from_sampler: a sampler's pass as items, the node a DataLoader starts
// from. Each pass tells the sampler its epoch; shards take every count-th
// index; a pass resumed in a new process (the process generator reseeded)
// gives the rest of the saved permutation; with get() after it, it is
// from_map_dataset.
TEST(Sources, ASamplersIndicesAreANodeOfTheirOwn) {
  using Indices = std::vector<size_t>;
  auto sampler_pass = [](conveyor::Sampler<size_t>& sampler) {
    Indices out;
    auto it = sampler.iter();
    for (size_t i = 0; it->next(i);) out.push_back(i);
    return out;
  };
  auto random = std::make_shared<conveyor::RandomSampler>(size_t{20});
  conveyor::manual_seed(3);
  const Indices expected = sampler_pass(*random);
  conveyor::manual_seed(3);
  auto source = nodes::from_sampler(random);
  EXPECT_EQ(one_pass(source), expected);

  // The pass's epoch reaches the sampler: DistributedSampler reshuffles.
  auto distributed = std::make_shared<conveyor::DistributedSampler>(size_t{20}, 1, 0, true, 7);
  auto by_epoch = nodes::from_sampler(distributed);
  by_epoch.set_epoch(4);
  const Indices epoch4 = one_pass(by_epoch);
  distributed->set_epoch(4);
  EXPECT_EQ(epoch4, sampler_pass(*distributed));
  distributed->set_epoch(5);
  EXPECT_NE(epoch4, sampler_pass(*distributed));

  // Shards: the k-th index goes to shard k % count.
  auto sharded = nodes::from_sampler(std::make_shared<conveyor::SequentialSampler>(size_t{7}));
  sharded.shard(ShardSpec{1, 3, 0, 1});
  EXPECT_EQ(one_pass(sharded), (Indices{1, 4}));

  // Resumed after 6 indices, with the process generator reseeded between.
  conveyor::manual_seed(8);
  auto saver = nodes::from_sampler(random);
  Indices whole;
  std::string saved;
  {
    auto pass = saver.pass();
    for (int i = 0; i < 6; ++i) whole.push_back(*pass.next());
    saved = saver.state().to_json();
    while (auto i = pass.next()) whole.push_back(*i);
  }
  conveyor::manual_seed(999);
  auto resumed = nodes::from_sampler(std::make_shared<conveyor::RandomSampler>(size_t{20}));
  resumed.load_state(State::from_json(saved));
  Indices rest = one_pass(resumed);
  EXPECT_EQ(rest, Indices(whole.begin() + 6, whole.end()));

  // from_sampler | map(get) is from_map_dataset through the same sampler.
  conveyor::testing::RangeDataset dataset(20);
  conveyor::manual_seed(5);
  auto fetched = nodes::from_map_dataset(dataset, random);
  const std::vector<int64_t> direct = one_pass(fetched);
  conveyor::manual_seed(5);
  auto composed = nodes::from_sampler(random) |
                  nodes::map([&dataset](size_t i) { return dataset.get(i); });
  EXPECT_EQ(one_pass(composed), direct);

  EXPECT_THROW(nodes::from_sampler(std::shared_ptr<conveyor::Sampler<size_t>>()), conveyor::ValueError);
}

// A sampler whose 4th draw throws, once a pass; the pass goes on after it.
struct SamplerFailingOnce final : conveyor::Sampler<size_t> {
  size_t size() const override { return 8; }
  std::string name() const override { return "SamplerFailingOnce"; }
  std::unique_ptr<conveyor::SamplerIterator<size_t>> iter() override {
    struct Iterator final : conveyor::SamplerIterator<size_t> {
      size_t calls = 0, next_index = 0;
      bool next(size_t& out) override {
        if (++calls == 4) throw std::runtime_error("draw 4 fails");
        if (next_index == 8) return false;
        out = next_index++;
        return true;
      }
    };
    return std::make_unique<Iterator>();
  }
};

// The failed draw is an output where it happened, live and resumed: a
// pass resumed after it (or before it) hands out exactly the rest.
TEST(Sources, ASamplersFailedDrawKeepsItsPlaceWhenAPassResumes) {
  // Up to `stop_after` outcomes of a pass; `state`: the pipeline's, taken
  // there, in the pass.
  auto outcomes = [](auto& pipeline, size_t stop_after, State* state = nullptr) {
    std::vector<std::string> out;
    auto pass = pipeline.pass();
    while (out.size() < stop_after) {
      try {
        std::optional<size_t> index = pass.next();
        if (!index) break;
        out.push_back(std::to_string(*index));
      } catch (const conveyor::NodeError& error) {
        out.push_back(error.node() + "@" + std::to_string(error.position()));
        EXPECT_NE(std::string(error.what()).find("draw 4 fails"), std::string::npos) << error.what();
      }
    }
    if (state) *state = pipeline.state();
    return out;
  };
  auto live = nodes::from_sampler(std::make_shared<SamplerFailingOnce>());
  const std::vector<std::string> whole = outcomes(live, 100);
  ASSERT_EQ(whole, (std::vector<std::string>{"0", "1", "2", "from_sampler@3", "3", "4", "5", "6", "7"}));
  for (size_t stop = 1; stop < whole.size(); ++stop) {
    auto first = nodes::from_sampler(std::make_shared<SamplerFailingOnce>());
    State saved;
    std::vector<std::string> got = outcomes(first, stop, &saved);
    auto resumed = nodes::from_sampler(std::make_shared<SamplerFailingOnce>());
    resumed.load_state(saved);
    const std::vector<std::string> rest = outcomes(resumed, 100);
    got.insert(got.end(), rest.begin(), rest.end());
    EXPECT_EQ(got, whole) << "stopped after " << stop;
  }
  // Under from_map_dataset the failed draw is named there, at its place
  // in the sampler's pass.
  struct Identity final : conveyor::Dataset<int64_t> {
    size_t size() const override { return 8; }
    int64_t get(size_t index) override { return static_cast<int64_t>(index); }
  };
  auto fetched = nodes::from_map_dataset(std::make_shared<Identity>(), std::make_shared<SamplerFailingOnce>());
  EXPECT_EQ(outcomes(fetched, 100),
            (std::vector<std::string>{"0", "1", "2", "from_map_dataset@3", "3", "4", "5", "6", "7"}));
}

// A dataset that fetches a batch at once: get_batch() is what a batch
// sampler's source calls, never get() index by index.
struct BatchFetchingDataset final : conveyor::Dataset<int64_t> {
  explicit BatchFetchingDataset(size_t n) : n(n) {}
  size_t size() const override { return n; }
  int64_t get(size_t) override {
    ADD_FAILURE() << "get() called where get_batch() fetches the batch";
    return -1;
  }
  std::vector<int64_t> get_batch(std::span<const size_t> indices) override {
    ++batches_fetched;
    if (indices.size() == 1 && indices[0] == 4) throw std::runtime_error("batch [4] is bad");
    std::vector<int64_t> out;
    for (size_t i : indices) out.push_back(static_cast<int64_t>(i) * 10);
    return out;
  }
  size_t n;
  int batches_fetched = 0;
};

TEST(Sources, AMapDatasetThroughABatchSamplerFetchesEachBatchAtOnceShardsBatchesAndResumes) {
  auto dataset = std::make_shared<BatchFetchingDataset>(10);
  auto batches = [&](bool drop_last) {
    return std::make_shared<conveyor::BatchSampler>(std::make_shared<conveyor::SequentialSampler>(size_t{10}), 3,
                                                    drop_last);
  };
  using Batches = std::vector<std::vector<int64_t>>;
  auto whole = nodes::from_map_dataset(dataset, batches(false));
  EXPECT_EQ(one_pass(whole), (Batches{{0, 10, 20}, {30, 40, 50}, {60, 70, 80}, {90}}));
  EXPECT_EQ(dataset->batches_fetched, 4);
  auto dropped = nodes::from_map_dataset(dataset, batches(true));
  EXPECT_EQ(one_pass(dropped).size(), 3u);

  // Shards take whole batches: batch k goes to shard k % count.
  auto rank1 = nodes::from_map_dataset(dataset, batches(false));
  rank1.shard(ShardSpec{1, 2, 0, 1});
  EXPECT_EQ(one_pass(rank1), (Batches{{30, 40, 50}, {90}}));

  // Resumed after two batches: the rest, without fetching the first two again.
  auto saver = nodes::from_map_dataset(dataset, batches(false));
  auto pass = saver.pass();
  ASSERT_TRUE(pass.next());
  ASSERT_TRUE(pass.next());
  const State state = saver.state();
  auto resumed = nodes::from_map_dataset(dataset, batches(false));
  resumed.load_state(state);
  dataset->batches_fetched = 0;
  EXPECT_EQ(one_pass(resumed), (Batches{{60, 70, 80}, {90}}));
  EXPECT_EQ(dataset->batches_fetched, 2);

  // A failed batch is a NodeError at its place, numbered by its batch.
  auto failing = nodes::from_map_dataset(
      dataset, std::make_shared<conveyor::BatchSampler>(std::make_shared<conveyor::SequentialSampler>(size_t{6}), 1,
                                                        false));
  auto failing_pass = failing.pass();
  std::vector<std::string> events;
  while (true) {
    try {
      std::optional<std::vector<int64_t>> batch = failing_pass.next();
      if (!batch) break;
      events.push_back(std::to_string(batch->at(0)));
    } catch (const conveyor::NodeError& e) {
      events.push_back(e.node() + " at " + std::to_string(e.position()));
    }
  }
  EXPECT_EQ(events, (std::vector<std::string>{"0", "10", "20", "30", "from_map_dataset(batches) at 4", "50"}));
  EXPECT_THROW(nodes::from_map_dataset(dataset, std::shared_ptr<conveyor::Sampler<conveyor::BatchIndices>>()),
               conveyor::ValueError);
}

TEST(Sharding, TheMostUpstreamShardableNodeTakesItsShardAndNoItemIsLostOrRepeated) {
  for (int64_t world : {1, 2, 3}) {
    for (int64_t workers : {1, 2, 4}) {
      std::multiset<int64_t> all;
      for (int64_t rank = 0; rank < world; ++rank) {
        for (int64_t worker = 0; worker < workers; ++worker) {
          // map and batch downstream are not shardable: the source shards once.
          auto pipeline = nodes::from_range(0, 101) | nodes::map([](int64_t x) { return x * 10; }) |
                          nodes::batch(3);
          pipeline.shard(ShardSpec{rank, world, worker, workers});
          for (auto& batch : pipeline.pass()) all.insert(batch.begin(), batch.end());
        }
      }
      std::multiset<int64_t> expected;
      for (int64_t i = 0; i < 101; ++i) expected.insert(i * 10);
      EXPECT_EQ(all, expected) << world << " ranks x " << workers << " workers";
    }
  }
  auto bad = nodes::from_range(0, 3);
  EXPECT_THROW(bad.shard(ShardSpec{2, 2, 0, 1}), conveyor::ValueError);
  EXPECT_THROW(bad.shard(ShardSpec{0, 1, 0, 0}), conveyor::ValueError);
}

// A shard count past int (a WorkerInfo's) is refused, naming both factors:
// 2^32 x 2^32 wrapped count() to 0 (a stride of 0, a division by zero).
TEST(Sharding, AShardCountPastIntIsRefused) {
  auto source = nodes::from_range(0, 3);
  try {
    source.shard(ShardSpec{0, int64_t{1} << 32, 0, int64_t{1} << 32});
    ADD_FAILURE() << "2^32 x 2^32 shards were taken";
  } catch (const conveyor::ValueError& error) {
    EXPECT_NE(std::string(error.what()).find("4294967296 x 4294967296"), std::string::npos) << error.what();
  }
  EXPECT_THROW(source.shard(ShardSpec{0, (int64_t{1} << 31) + 1, 0, 1}), conveyor::ValueError);
  source.shard(ShardSpec{0, 65536, 0, 32767});  // 2^31 - 2^16: fits
  EXPECT_EQ(source.pass().next(), std::optional<int64_t>(0));
}

// An iterable dataset split by WorkerInfo, as a PyTorch IterableDataset is.
TEST(Sharding, AnIterableDatasetIsToldItsShardAsItsWorker) {
  conveyor::testing::StridedStream stream(10);
  std::multiset<int64_t> all;
  for (int64_t worker = 0; worker < 3; ++worker) {
    auto pipeline = nodes::from_iterable(stream);
    pipeline.shard(ShardSpec{0, 1, worker, 3});
    for (int64_t x : pipeline.pass()) all.insert(x);
  }
  EXPECT_EQ(all, (std::multiset<int64_t>{0, 1, 2, 3, 4, 5, 6, 7, 8, 9}));
}

// Each input of a node with several takes the shard on its own: over every
// rank and worker, each source's items come out exactly once. (The first
// input's source used to take the shard for the whole graph; the others ran
// whole on every rank: 30 items of 20 from two ranks of a mux.)
TEST(Sharding, EachInputOfZipMuxWeightedMuxAndJoinTakesTheShardOnItsOwn) {
  using Make = std::function<Pipeline<int64_t>()>;
  const std::vector<std::pair<std::string, Make>> graphs = {
      {"mux", [] { return nodes::mux<int64_t>(make_sources()); }},
      {"weighted_mux", [] { return nodes::weighted_mux<int64_t>(make_sources(), {1.0, 2.0, 0.5}); }},
      {"join", [] { return nodes::join<int64_t>(make_sources()); }},
      {"zip",
       [] {
         auto b = nodes::from_range(100, 110) | nodes::filter([](int64_t) { return true; });
         return nodes::zip(nodes::from_range(0, 10), std::move(b)) |
                nodes::map([](std::pair<int64_t, int64_t> pair) {
                  // A pair is a's item and b's at the same place in each shard.
                  EXPECT_EQ(pair.second, pair.first + 100);
                  return pair.first;
                });
       }},
      // A merge inside a merge: every path still takes the shard once.
      {"mux of a mux",
       [] {
         std::vector<Pipeline<int64_t>> inner;
         inner.push_back(nodes::from_range(0, 10));
         inner.push_back(nodes::from_range(100, 110));
         std::vector<Pipeline<int64_t>> outer;
         outer.push_back(nodes::mux(std::move(inner)));
         outer.push_back(nodes::from_vector(std::vector<int64_t>{200, 201, 202, 203, 204, 205, 206}));
         return nodes::mux(std::move(outer));
       }},
  };
  for (const auto& [name, make] : graphs) {
    std::multiset<int64_t> expected;
    for (int64_t i = 0; i < 10; ++i) expected.insert(i);
    if (name != "zip") {
      for (int64_t i = 100; i < 110; ++i) expected.insert(i);
      for (int64_t i = 200; i < (name == "mux of a mux" ? 207 : 203); ++i) expected.insert(i);
    }
    for (auto [world, workers] : {std::pair<int64_t, int64_t>{1, 1}, {2, 1}, {3, 2}}) {
      std::multiset<int64_t> all;
      for (int64_t rank = 0; rank < world; ++rank) {
        for (int64_t worker = 0; worker < workers; ++worker) {
          auto pipeline = make();
          pipeline.shard(ShardSpec{rank, world, worker, workers});
          for (int64_t x : pipeline.pass()) all.insert(x);
        }
      }
      EXPECT_EQ(all, expected) << name << ", " << world << " ranks x " << workers << " workers";
    }
  }
}

// A shard no node can take is refused at the pass, not read whole by every
// rank: a graph with no shardable node, and a mux whose inputs disagree.
TEST(Sharding, AShardNoNodeCanTakeIsAValueErrorNamingWhatToDo) {
  auto whole = unshardable({1, 2}) | nodes::map([](int64_t x) { return x; });
  EXPECT_EQ(one_pass(whole).size(), 2u);  // one shard: nothing to take
  whole.shard(ShardSpec{1, 2, 0, 1});
  try {
    (void)whole.pass();
    ADD_FAILURE() << "a shard nothing takes passed";
  } catch (const conveyor::ValueError& error) {
    EXPECT_NE(std::string(error.what()).find("rank 1 of 2, worker 0 of 1, but no node takes the shard"),
              std::string::npos)
        << error.what();
    EXPECT_NE(std::string(error.what()).find("add shard() after the source"), std::string::npos) << error.what();
  }
  // With shard() after it, each rank reads all of it and keeps its part.
  std::multiset<int64_t> kept;
  for (int64_t rank = 0; rank < 2; ++rank) {
    auto sharded = unshardable({1, 2, 3}) | nodes::shard();
    sharded.shard(ShardSpec{rank, 2, 0, 1});
    for (int64_t x : sharded.pass()) kept.insert(x);
  }
  EXPECT_EQ(kept, (std::multiset<int64_t>{1, 2, 3}));

  std::vector<Pipeline<int64_t>> inputs;
  inputs.push_back(nodes::from_range(0, 2));
  inputs.push_back(unshardable({7, 8}));
  inputs.push_back(unshardable({9}));
  auto mixed = nodes::mux(std::move(inputs));
  EXPECT_EQ(one_pass(mixed).size(), 5u);  // one shard: fine as it is
  mixed.shard(ShardSpec{0, 2, 0, 1});
  try {
    (void)mixed.pass();
    ADD_FAILURE() << "a mux of a sharded and a whole input passed";
  } catch (const conveyor::ValueError& error) {
    EXPECT_NE(std::string(error.what())
                  .find("mux: input 0 takes the pass's shard (rank 0 of 2, worker 0 of 1), but inputs 1 and 2 "
                        "have no shardable node"),
              std::string::npos)
        << error.what();
  }
}

// A failed input takes its place among shard()'s inputs as an item does:
// it is the error of the one rank whose item it would have been. Before,
// every rank handed out every failure (14 outcomes over 3 ranks for 10
// inputs), and a failure on one rank alone shifted that rank's split: of
// 0..11, items 6 and 9 were lost and 7 and 10 read twice.
TEST(Sharding, AFailedInputIsTheErrorOfTheOneRankWhoseItemItWouldHaveBeen) {
  using conveyor::testing::Outcomes;
  using conveyor::testing::take_one;
  const auto fails_at = [](int64_t failing) {
    return nodes::map([failing](int64_t x) {
      if (x % 5 == failing) throw std::runtime_error("fails");
      return x;
    });
  };
  std::multiset<std::string> every_rank;
  for (int64_t rank = 0; rank < 3; ++rank) {
    auto pipeline = unshardable({0, 1, 2, 3, 4, 5, 6, 7, 8, 9}) | fails_at(2) | nodes::shard();
    pipeline.shard(ShardSpec{rank, 3, 0, 1});
    auto pass = pipeline.pass();
    Outcomes got;
    while (take_one(pass, got)) {
    }
    every_rank.insert(got.begin(), got.end());
  }
  EXPECT_EQ(every_rank, (std::multiset<std::string>{"0", "1", "error in map at 2", "3", "4", "5", "6",
                                                    "error in map at 7", "8", "9"}));

  std::multiset<std::string> flaky;
  for (int64_t rank = 0; rank < 3; ++rank) {
    std::vector<int64_t> items(12);
    std::iota(items.begin(), items.end(), 0);
    auto pipeline = unshardable(items) | nodes::map([rank](int64_t x) {
                      if (rank == 0 && x == 4) throw std::runtime_error("a read only rank 0 fails");
                      return x;
                    }) |
                    nodes::shard();
    pipeline.shard(ShardSpec{rank, 3, 0, 1});
    auto pass = pipeline.pass();
    Outcomes got;
    while (take_one(pass, got)) {
    }
    flaky.insert(got.begin(), got.end());
  }
  EXPECT_EQ(flaky, (std::multiset<std::string>{"0", "1", "2", "3", "4", "5", "6", "7", "8", "9", "10", "11"}));

  // Resumed at every point: another rank's failure before a batch shifts
  // the batch's count, so the skip may not go by arithmetic on this rank's
  // clean outputs alone.
  for (int64_t rank = 0; rank < 2; ++rank) {
    const auto make = [&] {
      std::vector<int64_t> items(21);
      std::iota(items.begin(), items.end(), 0);
      auto pipeline = unshardable(items) | nodes::map([](int64_t x) {
                        if (x == 3) throw std::runtime_error("fails");
                        return x;
                      }) |
                      nodes::batch(2) |
                      nodes::map([](std::vector<int64_t> batch) {
                        return std::accumulate(batch.begin(), batch.end(), int64_t{0}) * 100 +
                               static_cast<int64_t>(batch.size());
                      }) |
                      nodes::shard();
      pipeline.shard(ShardSpec{rank, 2, 0, 1});
      return pipeline;
    };
    Outcomes reference;
    {
      auto pipeline = make();
      auto pass = pipeline.pass();
      while (take_one(pass, reference)) {
      }
    }
    for (size_t stop = 0; stop <= reference.size(); ++stop) {
      EXPECT_EQ(conveyor::testing::stopped_and_resumed(make, stop), reference)
          << "rank " << rank << ", stopped after " << stop;
    }
  }
}

// try_next() through serial nodes asks upstream's try_next(): behind a
// source that is not ready, a chain of them says "not yet" instead of
// waiting, keeps what it gathered, and gives the items once it is ready.
TEST(TryNext, SerialNodesSayNotYetWhenTheirUpstreamDoesAndLoseNothing) {
  bool open = true;
  auto pipeline = Pipeline<int64_t>(std::make_unique<Gate>(7, open)) |
                  nodes::filter([](int64_t x) { return x != 3; }) | nodes::map([](int64_t x) { return x * 10; }) |
                  nodes::shard() | nodes::batch(2) | nodes::collate();
  auto pass = pipeline.pass();
  std::optional<conveyor::Array<int64_t>> batch;
  std::vector<std::vector<int64_t>> got;
  auto take = [&] {
    got.emplace_back(batch->values().begin(), batch->values().end());
    batch.reset();
  };
  ASSERT_EQ(pass.try_next(batch), Poll::ready);  // 0, 10
  take();
  open = false;
  EXPECT_EQ(pass.try_next(batch), Poll::pending);
  EXPECT_EQ(pass.try_next(batch), Poll::pending);
  open = true;
  ASSERT_EQ(pass.try_next(batch), Poll::ready);  // 20, 40 (3 filtered out)
  take();
  ASSERT_EQ(pass.try_next(batch), Poll::ready);  // 50, 60
  take();
  EXPECT_EQ(pass.try_next(batch), Poll::end);
  EXPECT_EQ(got, (std::vector<std::vector<int64_t>>{{0, 10}, {20, 40}, {50, 60}}));

  // A batch half gathered when the source stops keeps its first item.
  open = true;
  auto halves = Pipeline<int64_t>(std::make_unique<Gate>(3, open)) | nodes::batch(2);
  auto half_pass = halves.pass();
  std::optional<std::vector<int64_t>> items;
  ASSERT_EQ(half_pass.try_next(items), Poll::ready);  // 0, 1
  EXPECT_EQ(*items, (std::vector<int64_t>{0, 1}));
  open = false;
  EXPECT_EQ(half_pass.try_next(items), Poll::pending);
  open = true;
  ASSERT_EQ(half_pass.try_next(items), Poll::ready);
  EXPECT_EQ(*items, (std::vector<int64_t>{2}));
  EXPECT_EQ(half_pass.try_next(items), Poll::end);
}

// A mux whose next source is not ready says "not yet" and keeps its turn;
// a zip keeps the item it took from its first input.
TEST(TryNext, MuxKeepsItsRotationAndZipItsFirstItemThroughNotYet) {
  bool open = true;
  std::vector<Pipeline<int64_t>> sources;
  sources.push_back(nodes::from_range(100, 103));
  sources.push_back(Pipeline<int64_t>(std::make_unique<Gate>(3, open)));
  auto mux = nodes::mux(std::move(sources));
  auto pass = mux.pass();
  std::optional<int64_t> item;
  std::vector<int64_t> got;
  ASSERT_EQ(pass.try_next(item), Poll::ready);
  got.push_back(*item);
  open = false;
  EXPECT_EQ(pass.try_next(item), Poll::pending);  // the gate's turn: not the range's next
  open = true;
  while (pass.try_next(item) == Poll::ready) got.push_back(*item);
  EXPECT_EQ(got, (std::vector<int64_t>{100, 0, 101, 1, 102, 2}));

  bool zip_open = false;
  auto zipped = nodes::zip(nodes::from_range(0, 2), Pipeline<int64_t>(std::make_unique<Gate>(2, zip_open)));
  auto zip_pass = zipped.pass();
  std::optional<std::pair<int64_t, int64_t>> pair;
  EXPECT_EQ(zip_pass.try_next(pair), Poll::pending);
  zip_open = true;
  ASSERT_EQ(zip_pass.try_next(pair), Poll::ready);
  EXPECT_EQ(*pair, (std::pair<int64_t, int64_t>{0, 0}));
  ASSERT_EQ(zip_pass.try_next(pair), Poll::ready);
  EXPECT_EQ(*pair, (std::pair<int64_t, int64_t>{1, 1}));
  EXPECT_EQ(zip_pass.try_next(pair), Poll::end);
}

TEST(Transforms, MapFilterFlatMapAndUnbatch) {
  auto pipeline = nodes::from_range(0, 10) | nodes::filter([](int64_t x) { return x % 3 != 0; }) |
                  nodes::map([](int64_t x) { return std::to_string(x); });
  EXPECT_EQ(one_pass(pipeline), (std::vector<std::string>{"1", "2", "4", "5", "7", "8"}));
  auto flat = nodes::from_range(1, 4) |
              nodes::flat_map([](int64_t n) { return std::vector<int64_t>(static_cast<size_t>(n), n); });
  EXPECT_EQ(one_pass(flat), (std::vector<int64_t>{1, 2, 2, 3, 3, 3}));
  auto round_trip = nodes::from_range(0, 7) | nodes::batch(3) | nodes::unbatch();
  EXPECT_EQ(one_pass(round_trip), iota(7));
}

// A range that views the item it was made from (the usual way to write
// one) is read after f returns: the item lives as long as its range. Under
// ASan the old code read a destroyed vector (stack-use-after-scope).
TEST(Transforms, FlatMapOfAViewOfItsItemReadsTheItem) {
  std::vector<std::vector<std::string>> items;
  for (int i = 0; i < 4; ++i) items.emplace_back(50, std::string(40, static_cast<char>('a' + i)));
  auto views = nodes::from_vector(items) | nodes::flat_map([](const std::vector<std::string>& strings) {
                 return strings | std::views::transform([](const std::string& s) { return s.substr(0, 2); });
               });
  std::vector<std::string> expected;
  for (int i = 0; i < 4; ++i) expected.insert(expected.end(), 50, std::string(2, static_cast<char>('a' + i)));
  EXPECT_EQ(one_pass(views), expected);
  EXPECT_EQ(one_pass(views), expected);  // a second pass, after the first's last range
}

TEST(Transforms, BatchDropLastAndCollate) {
  auto keep = nodes::from_range(0, 7) | nodes::batch(3);
  EXPECT_EQ(one_pass(keep), (std::vector<std::vector<int64_t>>{{0, 1, 2}, {3, 4, 5}, {6}}));
  auto drop = nodes::from_range(0, 7) | nodes::batch(3, /*drop_last=*/true);
  EXPECT_EQ(one_pass(drop).size(), 2u);
  auto collated = nodes::from_range(0, 6) | nodes::batch(4) | nodes::collate();
  std::vector<std::vector<int64_t>> values;
  for (auto& array : collated.pass()) values.emplace_back(array.values().begin(), array.values().end());
  EXPECT_EQ(values, (std::vector<std::vector<int64_t>>{{0, 1, 2, 3}, {4, 5}}));
  EXPECT_THROW(nodes::from_range(0, 1) | nodes::batch(0), conveyor::ValueError);
}

TEST(Transforms, PaddedBatchPadsEveryDimensionToTheLargest) {
  std::vector<conveyor::Array<int>> items;
  for (int64_t length : {2, 3}) {
    conveyor::Array<int> a({length, 1});
    for (int64_t i = 0; i < length; ++i) a[static_cast<size_t>(i)] = static_cast<int>(10 * length + i);
    items.push_back(a);
  }
  auto pipeline = nodes::from_vector(items) | nodes::padded_batch<int>(2, -1);
  std::vector<conveyor::Array<int>> batches = one_pass(pipeline);
  ASSERT_EQ(batches.size(), 1u);
  EXPECT_EQ(batches[0].shape(), (std::vector<int64_t>{2, 3, 1}));
  EXPECT_EQ(std::vector<int>(batches[0].values().begin(), batches[0].values().end()),
            (std::vector<int>{20, 21, -1, 30, 31, 32}));
}

// A default Array() (shape [] without an element) is refused, naming it,
// as collate's stacking refuses it. Before the fix its slot silently held
// the pad value: a batch [7, -1] with an element that never existed.
TEST(Transforms, PaddedBatchRefusesAnEmptyArrayItWouldInventAnElementFor) {
  conveyor::Array<int> scalar(std::vector<int64_t>{});
  scalar[0] = 7;
  auto pipeline = nodes::from_vector(std::vector<conveyor::Array<int>>{scalar, conveyor::Array<int>()}) |
                  nodes::padded_batch<int>(2, -1);
  auto pass = pipeline.pass();
  try {
    const auto batch = pass.next();
    FAIL() << "no error; batch of shape " << conveyor::shape_string(batch->shape());
  } catch (const conveyor::NodeError& e) {
    EXPECT_EQ(e.node(), "collate");
    EXPECT_NE(std::string(e.what()).find("item 1 is an empty Array()"), std::string::npos) << e.what();
  }
}

// drop_last decides which items come out: a state of batch(4) does not
// load into batch(4, drop_last=true). Before the fix both were "batch(4)".
TEST(Transforms, DropLastIsPartOfABatchsFingerprint) {
  auto saver = nodes::from_range(0, 10) | nodes::batch(4);
  conveyor::State state;
  {
    auto pass = saver.pass();
    ASSERT_TRUE(pass.next());
    state = saver.state();
  }
  auto dropping = nodes::from_range(0, 10) | nodes::batch(4, /*drop_last=*/true);
  EXPECT_EQ(dropping.metrics().back().name, "batch(4, drop_last=true)");
  EXPECT_THROW(dropping.load_state(state), conveyor::StateError);
  auto same = nodes::from_range(0, 10) | nodes::batch(4);
  same.load_state(state);
  EXPECT_EQ(one_pass(same), (std::vector<std::vector<int64_t>>{{4, 5, 6, 7}, {8, 9}}));
}

// batch(SIZE_MAX), everything in one batch, resumes after that batch.
// Before the fix the skip's arithmetic wrapped round: "pass 0 ended after 0
// items, but the state's consumer had received 1".
TEST(Transforms, AllInOneBatchResumesPastIt) {
  constexpr size_t kAll = std::numeric_limits<size_t>::max();
  for (const int received : {0, 1}) {
    SCOPED_TRACE(std::to_string(received) + " batches received");
    auto saver = nodes::from_range(0, 5) | nodes::batch(kAll);
    conveyor::State state;
    {
      auto pass = saver.pass();
      if (received) {
        ASSERT_EQ(pass.next()->size(), 5u);
      }
      state = saver.state();
    }
    auto resumed = nodes::from_range(0, 5) | nodes::batch(kAll);
    resumed.load_state(conveyor::State::from_json(state.to_json()));
    EXPECT_EQ(one_pass(resumed).size(), received ? 0u : 1u);
  }
}

TEST(Shuffle, ASeededBufferGivesEveryItemOnceInAnOrderFixedBySeedAndEpoch) {
  auto make = [](uint64_t seed) {
    auto p = nodes::from_range(0, 50) | nodes::shuffle(8);
    p.seed(seed);
    return p;
  };
  auto a = make(1), b = make(1), c = make(2);
  const auto a0 = one_pass(a), a1 = one_pass(a);
  EXPECT_EQ(a0, one_pass(b));
  EXPECT_NE(a0, a1);               // another epoch, another order
  EXPECT_NE(a0, one_pass(c));      // another seed
  auto sorted = a0;
  std::sort(sorted.begin(), sorted.end());
  EXPECT_EQ(sorted, iota(50));
  EXPECT_NE(a0, iota(50));
}

TEST(Randomness, MapDrawsDependOnTheItemNotOnWhatRanBefore) {
  // default_generator() inside map is the item's own, seeded from its position.
  auto draw = [](int64_t) { return conveyor::uniform(conveyor::default_generator()); };
  auto all = nodes::from_range(0, 20) | nodes::map(draw);
  all.seed(9);
  const std::vector<double> every = one_pass(all);
  auto again = nodes::from_range(0, 20) | nodes::map(draw);
  again.seed(9);
  EXPECT_EQ(one_pass(again), every);
  EXPECT_NE(every[0], every[1]);
}

double draw() { return conveyor::uniform(conveyor::default_generator()); }

// A dataset whose get() augments: it draws.
struct DrawingDataset final : conveyor::Dataset<double> {
  size_t size() const override { return 12; }
  double get(size_t) override { return draw(); }
};
// An iterable dataset whose iter() draws (a shuffle's seed would) and
// whose next() draws; its shards' seeds, as iter() saw them.
struct DrawingStream final : conveyor::IterableDataset<double> {
  std::unique_ptr<conveyor::SampleIterator<double>> iter(const conveyor::WorkerInfo* worker) override {
    seeds.push_back(worker ? worker->seed : 0);
    return conveyor::make_sample_iterator<double>([left = 12, start = draw()]() mutable -> std::optional<double> {
      if (left-- == 0) return std::nullopt;
      return start + draw();
    });
  }
  std::optional<size_t> size() const override { return 12; }
  std::vector<uint64_t> seeds;
};

// User code in every node that runs it (filter's predicate, flat_map's and
// collate's functions, a dataset's get() and an iterable's next()) draws
// from the item's seed, as map's does: not from the process generator, so
// the same whatever that holds and whichever thread runs the node.
TEST(Randomness, EveryNodesUserCodeDrawsFromTheItemsSeed) {
  using Make = std::function<Pipeline<double>()>;
  const std::vector<std::pair<std::string, Make>> graphs = {
      {"filter",
       [] {
         return nodes::from_range(0, 40) | nodes::filter([](int64_t) { return draw() < 0.5; }) |
                nodes::map([](int64_t x) { return static_cast<double>(x); });
       }},
      {"flat_map",
       [] { return nodes::from_range(0, 10) | nodes::flat_map([](int64_t) { return std::vector<double>{draw(), draw()}; }); }},
      {"flat_map, a lazy range",  // draws as it is read, after f returned
       [] {
         return nodes::from_range(0, 10) | nodes::flat_map([](int64_t) {
                  return std::views::iota(0, 2) | std::views::transform([](int) { return draw(); });
                });
       }},
      {"collate",
       [] { return nodes::from_range(0, 20) | nodes::batch(4) | nodes::collate([](std::vector<int64_t>) { return draw(); }); }},
      {"from_map_dataset", [] { return nodes::from_map_dataset(std::make_shared<DrawingDataset>()); }},
      {"from_iterable", [] { return nodes::from_iterable(std::make_shared<DrawingStream>()); }},
  };
  for (const auto& [name, make] : graphs) {
    conveyor::manual_seed(1);
    auto serial = make();
    serial.seed(9);
    const std::vector<double> first = one_pass(serial);
    ASSERT_GE(first.size(), 2u) << name;
    EXPECT_NE(first[0], first[1]) << name << ": each item draws from a seed of its own";
    conveyor::manual_seed(2);
    auto threaded = make() | nodes::prefetch(3);  // the node runs on the prefetch's thread
    threaded.seed(9);
    EXPECT_EQ(one_pass(threaded), first) << name;
  }
  // Each shard of an iterable dataset is told a seed of its own (PyTorch's
  // base seed + worker id), and its items draw apart from the other's.
  auto stream = std::make_shared<DrawingStream>();
  std::vector<std::vector<double>> shards;
  for (int64_t worker = 0; worker < 2; ++worker) {
    auto pipeline = nodes::from_iterable(stream);
    pipeline.seed(9);
    pipeline.shard(ShardSpec{0, 1, worker, 2});
    shards.push_back(one_pass(pipeline));
  }
  ASSERT_EQ(stream->seeds.size(), 2u);
  EXPECT_EQ(stream->seeds[1], stream->seeds[0] + 1);
  EXPECT_NE(shards[0], shards[1]);
}

// A source that runs whole on every shard, as list_files does: shard()
// downstream of it is where the pass's shard applies.
class WholeRange final : public nodes::Source<int64_t> {
 public:
  explicit WholeRange(int64_t n) : n_(n) {}
  using conveyor::Node<int64_t>::reset;
  void reset(const conveyor::PassContext& pass, conveyor::detail::ResetWalk& walk) override {
    next_ = 0;
    this->start_metering(pass, walk.next_id++);
  }
  std::string name() const override { return "whole_range"; }

 private:
  std::optional<int64_t> produce() override {
    if (next_ >= n_) return std::nullopt;
    return next_++;
  }
  int64_t n_, next_ = 0;
};
Pipeline<int64_t> whole_range(int64_t n) { return Pipeline<int64_t>(std::make_unique<WholeRange>(n)); }

// Past the shard point a node counts its own shard's items, so item k of
// every shard would share a seed: the same crop on every rank. Those nodes
// fold the shard's index into their seeds. Upstream of it every shard sees
// the same stream and draws the same, or the shards would overlap.
TEST(Randomness, NodesPastTheShardPointDrawApartOnEachShardAndAlikeBeforeIt) {
  constexpr int64_t kShards = 2;
  const auto on_each_shard = [](const auto& make) {
    using Items = decltype(one_pass(std::declval<decltype(make())&>()));
    std::vector<Items> out;
    for (int64_t rank = 0; rank < kShards; ++rank) {
      auto pipeline = make();
      pipeline.seed(9);
      pipeline.shard(ShardSpec{rank, kShards, 0, 1});
      out.push_back(one_pass(pipeline));
    }
    return out;
  };
  const auto no_place_alike = [](const std::vector<double>& a, const std::vector<double>& b) {
    if (a.size() != b.size() || a.empty()) return false;
    for (size_t k = 0; k < a.size(); ++k) {
      if (a[k] == b[k]) return false;
    }
    return true;
  };
  const auto drawn = [](int64_t) { return draw(); };

  // map, serial and parallel, and collate after shard(): apart.
  const auto serial = on_each_shard([&] { return nodes::from_range(0, 40) | nodes::shard() | nodes::map(drawn); });
  EXPECT_TRUE(no_place_alike(serial[0], serial[1]));
  const auto after_shard = on_each_shard([&] { return whole_range(40) | nodes::shard() | nodes::map(drawn); });
  EXPECT_TRUE(no_place_alike(after_shard[0], after_shard[1])) << "shard() is the shard point";
  const auto parallel = on_each_shard(
      [&] { return nodes::from_range(0, 40) | nodes::shard() | nodes::map(drawn, {.workers = 2}); });
  EXPECT_EQ(parallel, serial) << "a parallel map draws as a serial one";
  const auto collated = on_each_shard([] {
    return nodes::from_range(0, 40) | nodes::shard() | nodes::batch(4) |
           nodes::collate([](std::vector<int64_t>) { return draw(); });
  });
  EXPECT_TRUE(no_place_alike(collated[0], collated[1]));

  // A shuffle after shard(): each shard's order is its own, not one pattern
  // over two halves.
  const auto shuffled = on_each_shard([] { return nodes::from_range(0, 40) | nodes::shard() | nodes::shuffle(20); });
  std::vector<std::vector<int64_t>> places(kShards);
  for (int64_t rank = 0; rank < kShards; ++rank) {
    ASSERT_EQ(shuffled[rank].size(), 20u);
    for (const int64_t x : shuffled[rank]) places[rank].push_back(x / kShards);
  }
  EXPECT_NE(places[0], places[1]);

  // weighted_mux over sharded sources: its picks differ by shard.
  const auto picks = on_each_shard([] {
    std::vector<Pipeline<int64_t>> sources;
    sources.push_back(nodes::from_range(0, 1000) | nodes::shard());
    sources.push_back(nodes::from_range(100000, 101000) | nodes::shard());
    return nodes::weighted_mux(std::move(sources), {1.0, 1.0}) |
           nodes::map([](int64_t x) { return x < 100000; }) | nodes::take(64);
  });
  EXPECT_NE(picks[0], picks[1]);

  // Before shard(): the same draws on every shard, so the shards split one
  // stream. A shuffle there too: the shards are disjoint and cover it.
  auto whole = whole_range(40) | nodes::map([](int64_t x) { return x + draw(); });
  whole.seed(9);
  std::vector<double> expected = one_pass(whole);
  const auto split =
      on_each_shard([] { return whole_range(40) | nodes::map([](int64_t x) { return x + draw(); }) | nodes::shard(); });
  std::vector<double> joined = split[0];
  joined.insert(joined.end(), split[1].begin(), split[1].end());
  std::sort(joined.begin(), joined.end());
  EXPECT_EQ(joined, expected);
  const auto dealt = on_each_shard([] { return whole_range(40) | nodes::shuffle(40) | nodes::shard(); });
  std::vector<int64_t> dealt_all = dealt[0];
  dealt_all.insert(dealt_all.end(), dealt[1].begin(), dealt[1].end());
  std::sort(dealt_all.begin(), dealt_all.end());
  EXPECT_EQ(dealt_all, iota(40));

  // One shard: nothing folded, the draws of an unsharded pass.
  auto one = nodes::from_range(0, 40) | nodes::map(drawn);
  one.seed(9);
  one.shard(ShardSpec{0, 1, 0, 1});
  auto unsharded = nodes::from_range(0, 40) | nodes::map(drawn);
  unsharded.seed(9);
  EXPECT_EQ(one_pass(one), one_pass(unsharded));
}

// A shard taken after a node whose order timing decides (a map out of
// order, join) would split another order on each rank: some items read
// twice, others lost. The pass refuses it, naming the node.
TEST(Sharding, AShardAfterATimingOrderedNodeIsRefused) {
  const auto identity = [](int64_t x) { return x; };
  const auto refused = [](auto pipeline, const std::string& names) {
    pipeline.shard(ShardSpec{1, 2, 0, 1});
    try {
      (void)one_pass(pipeline);
      ADD_FAILURE() << "a shard after " << names << " was taken";
    } catch (const conveyor::ValueError& error) {
      const std::string what = error.what();
      EXPECT_NE(what.find("shard: the pass runs as shard 1 of 2, taken after " + names + ", which hands"),
                std::string::npos)
          << what;
    }
  };
  refused(whole_range(40) | nodes::map(identity, {.workers = 2, .in_order = false}) | nodes::shard(),
          "map(workers=2, in_order=false)");
  refused(whole_range(40) | nodes::map(identity, {.workers = 1, .in_order = false}) | nodes::batch(4) |
              nodes::shard(),
          "map(workers=1, in_order=false)");
  std::vector<Pipeline<int64_t>> joined;
  joined.push_back(whole_range(10));
  joined.push_back(whole_range(10));
  refused(nodes::join(std::move(joined)) | nodes::shard(), "join");
  // A cache replays the order its filling pass had; each fork consumer sees
  // its upstream's order whichever consumer reset it.
  auto cached =
      whole_range(40) | nodes::map(identity, {.workers = 2, .in_order = false}) | nodes::cache() | nodes::shard();
  refused(std::move(cached), "map(workers=2, in_order=false)");
  auto outputs = nodes::fork(whole_range(40) | nodes::map(identity, {.workers = 2, .in_order = false}), 2, 8);
  auto second = std::move(outputs[1]) | nodes::shard();
  auto first = std::move(outputs[0]) | nodes::shard();
  first.shard(ShardSpec{1, 2, 0, 1});
  EXPECT_THROW((void)first.pass(), conveyor::ValueError);
  refused(std::move(second), "map(workers=2, in_order=false)");

  // Taken before such a node, or on another input than the one it is on,
  // or with one shard: the pass runs.
  auto before = whole_range(40) | nodes::shard() | nodes::map(identity, {.workers = 2, .in_order = false});
  before.shard(ShardSpec{1, 2, 0, 1});
  std::vector<int64_t> odd = one_pass(before);
  std::sort(odd.begin(), odd.end());
  EXPECT_EQ(odd.size(), 20u);
  EXPECT_EQ(odd.front(), 1);
  std::vector<Pipeline<int64_t>> inputs;
  inputs.push_back(nodes::from_range(0, 10) | nodes::map(identity, {.workers = 2, .in_order = false}));
  inputs.push_back(whole_range(10) | nodes::shard());
  auto muxed = nodes::mux(std::move(inputs));
  muxed.shard(ShardSpec{1, 2, 0, 1});
  EXPECT_EQ(one_pass(muxed).size(), 10u);
  auto alone = whole_range(40) | nodes::map(identity, {.workers = 2, .in_order = false}) | nodes::shard();
  alone.shard(ShardSpec{0, 1, 0, 1});
  EXPECT_EQ(one_pass(alone).size(), 40u);
}

TEST(Repetition, TakeRepeatAndCache) {
  auto taken = nodes::from_range(0, 100) | nodes::take(3);
  EXPECT_EQ(one_pass(taken), iota(3));
  auto twice = nodes::from_range(0, 3) | nodes::repeat(2);
  EXPECT_EQ(one_pass(twice), (std::vector<int64_t>{0, 1, 2, 0, 1, 2}));
  auto forever = nodes::from_range(0, 2) | nodes::repeat() | nodes::take(5);
  EXPECT_EQ(one_pass(forever), (std::vector<int64_t>{0, 1, 0, 1, 0}));
  auto nothing = nodes::from_range(0, 0) | nodes::repeat();  // would spin for ever
  EXPECT_TRUE(one_pass(nothing).empty());
  // Each round of a repeat is a pass of its own: shuffles differ.
  auto rounds = nodes::from_range(0, 30) | nodes::shuffle(30) | nodes::repeat(2);
  const auto both = one_pass(rounds);
  EXPECT_NE(std::vector<int64_t>(both.begin(), both.begin() + 30), std::vector<int64_t>(both.begin() + 30, both.end()));

  int calls = 0;
  auto cached = nodes::from_range(0, 4) | nodes::map([&calls](int64_t x) {
                  ++calls;
                  return x;
                }) |
                nodes::cache();
  EXPECT_EQ(one_pass(cached), iota(4));
  EXPECT_EQ(one_pass(cached), iota(4));
  EXPECT_EQ(calls, 4);  // the second pass came from memory
}

TEST(Combine, ZipMuxAndWeightedMux) {
  auto zipped = nodes::zip(nodes::from_range(0, 3), nodes::from_vector(std::vector<char>{'a', 'b', 'c', 'd'}));
  EXPECT_EQ(one_pass(zipped), (std::vector<std::pair<int64_t, char>>{{0, 'a'}, {1, 'b'}, {2, 'c'}}));
  std::vector<Pipeline<int64_t>> sources;
  sources.push_back(nodes::from_range(0, 2));
  sources.push_back(nodes::from_range(10, 14));
  auto muxed = nodes::mux(std::move(sources));
  EXPECT_EQ(one_pass(muxed), (std::vector<int64_t>{0, 10, 1, 11, 12, 13}));

  auto weighted = [](uint64_t seed) {
    std::vector<Pipeline<int64_t>> s;
    s.push_back(nodes::from_range(0, 3000));
    s.push_back(nodes::from_range(100000, 103000));
    auto p = nodes::weighted_mux(std::move(s), {3.0, 1.0}) | nodes::take(2000);
    p.seed(seed);
    return p;
  };
  auto w1 = weighted(4), w2 = weighted(4);
  const auto items = one_pass(w1);
  EXPECT_EQ(items, one_pass(w2));
  const auto from_first = std::count_if(items.begin(), items.end(), [](int64_t x) { return x < 100000; });
  EXPECT_NEAR(static_cast<double>(from_first) / 2000.0, 0.75, 0.05);
  std::vector<Pipeline<int64_t>> bad;
  bad.push_back(nodes::from_range(0, 1));
  EXPECT_THROW(nodes::weighted_mux(std::move(bad), {0.0}), conveyor::ValueError);
}

TEST(Combine, JoinTakesFromWhicheverIsReadyAndLosesNothing) {
  std::vector<Pipeline<int64_t>> sources;
  sources.push_back(nodes::from_range(0, 5));
  sources.push_back(nodes::from_range(100, 102));
  auto joined = nodes::join(std::move(sources));
  auto items = one_pass(joined);
  std::sort(items.begin(), items.end());
  EXPECT_EQ(items, (std::vector<int64_t>{0, 1, 2, 3, 4, 100, 101}));
}

// An upstream error is an item of the fork: each consumer meets it in its
// place, whichever consumer's pull met it first, and goes on past it.
// A pass's outcomes as text: items by `show`, errors as "error at P".
template <class T, class Show>
std::vector<std::string> outcomes_as_text(Pipeline<T>& pipeline, Show show) {
  std::vector<std::string> got;
  auto pass = pipeline.pass();
  for (int guard = 0; guard < 1000; ++guard) {  // a node that never ends fails here, not by hanging
    try {
      std::optional<T> item = pass.next();
      if (!item) return got;
      got.push_back(show(*item));
    } catch (const conveyor::NodeError& e) {
      got.push_back("error at " + std::to_string(e.position()));
    }
  }
  ADD_FAILURE() << "the pass did not end after 1000 outcomes";
  return got;
}

// A failed item of either input of zip is the pair's error, in its place;
// the other input's item there goes with it, and every later pair is
// still a's item k with b's item k (both polled and waited for).
TEST(Combine, AZipInputsFailedItemKeepsThePairsAligned) {
  const auto failing_at = [](int64_t first, int64_t bad) {
    return nodes::from_range(first, first + 5) | nodes::map([bad](int64_t x) {
             if (x == bad) throw std::runtime_error("fails on " + std::to_string(x));
             return x;
           });
  };
  const auto show = [](const std::pair<int64_t, int64_t>& pair) {
    return std::to_string(pair.first) + "," + std::to_string(pair.second);
  };
  auto a_fails = nodes::zip(failing_at(0, 1), nodes::from_range(100, 105));
  EXPECT_EQ(outcomes_as_text(a_fails, show),
            (std::vector<std::string>{"0,100", "error at 1", "2,102", "3,103", "4,104"}));
  auto b_fails = nodes::zip(nodes::from_range(0, 5), failing_at(100, 101));
  EXPECT_EQ(outcomes_as_text(b_fails, show),
            (std::vector<std::string>{"0,100", "error at 1", "2,102", "3,103", "4,104"}));
  auto both_fail = nodes::zip(failing_at(0, 3), failing_at(100, 103));
  EXPECT_EQ(outcomes_as_text(both_fail, show),
            (std::vector<std::string>{"0,100", "1,101", "2,102", "error at 3", "4,104"}));
  // Polled: the same pairs, "not yet" in between.
  auto polled = nodes::zip(failing_at(0, 1), nodes::from_range(100, 105) | nodes::prefetch(2));
  std::vector<std::string> got;
  {
    auto pass = polled.pass();
    while (true) {
      std::optional<std::pair<int64_t, int64_t>> pair;
      try {
        const conveyor::Poll poll = pass.try_next(pair);
        if (poll == conveyor::Poll::end) break;
        if (poll == conveyor::Poll::pending) continue;
        got.push_back(show(*pair));
      } catch (const conveyor::NodeError& e) {
        got.push_back("error at " + std::to_string(e.position()));
      }
    }
  }
  EXPECT_EQ(got, (std::vector<std::string>{"0,100", "error at 1", "2,102", "3,103", "4,104"}));
}

// A lazy range that throws as flat_map reads it is the item's NodeError,
// naming flat_map; the rest of that range is dropped and the pass goes on.
TEST(Transforms, AFlatMapsLazyRangeThatThrowsIsANodeErrorAndThePassGoesOn) {
  auto pipeline = nodes::from_range(0, 3) | nodes::flat_map([](int64_t x) {
                    return std::views::iota(x * 10, x * 10 + 3) | std::views::transform([](int64_t v) {
                             if (v == 11) throw std::runtime_error("element 11 fails");
                             return v;
                           });
                  });
  const auto show = [](int64_t v) { return std::to_string(v); };
  EXPECT_EQ(outcomes_as_text(pipeline, show), (std::vector<std::string>{"0", "1", "2", "10", "error at 1", "20", "21", "22"}));
  try {
    auto pass = pipeline.pass();
    while (pass.next()) {
    }
    ADD_FAILURE() << "no error";
  } catch (const conveyor::NodeError& e) {
    EXPECT_NE(std::string(e.what()).find("flat_map"), std::string::npos) << e.what();
  }
}

// A range whose advance throws (a filter view runs its predicate on ++):
// the element read before the advance is still handed out. Before the fix
// the element was moved out, ++ threw, and the element was lost ("11").
TEST(Transforms, AFlatMapsRangeThatThrowsAsItAdvancesLosesNoElement) {
  auto pipeline = nodes::from_range(0, 3) | nodes::flat_map([](int64_t x) {
                    return std::views::iota(x * 10, x * 10 + 3) | std::views::filter([](int64_t v) {
                             if (v == 12) throw std::runtime_error("element 12 fails");
                             return true;
                           });
                  });
  const auto show = [](int64_t v) { return std::to_string(v); };
  EXPECT_EQ(outcomes_as_text(pipeline, show),
            (std::vector<std::string>{"0", "1", "2", "10", "11", "error at 1", "20", "21", "22"}));
}

// A NodeError thrown by user code (f runs a pipeline of its own) is this
// node's error, nesting the inner one. Before the fix it passed through
// unchanged, naming the inner pipeline's filter and its item 7.
TEST(Transforms, ANodeErrorFromUserCodeIsNamedByTheNodeThatRanIt) {
  auto outer = nodes::from_range(0, 5) | nodes::map([](int64_t x) {
                 if (x != 3) return x;
                 auto inner = nodes::from_range(0, 10) | nodes::filter([](int64_t v) {
                                if (v == 7) throw std::runtime_error("inner filter fails on 7");
                                return true;
                              });
                 int64_t sum = 0;
                 for (int64_t v : inner.pass()) sum += v;
                 return sum;
               });
  auto pass = outer.pass();
  for (int i = 0; i < 3; ++i) ASSERT_TRUE(pass.next());
  try {
    pass.next();
    FAIL() << "no error";
  } catch (const conveyor::NodeError& e) {
    EXPECT_EQ(e.node(), "map");
    EXPECT_EQ(e.position(), 3u);
    const std::string what = e.what();
    EXPECT_NE(what.find("'map' at item 3: "), std::string::npos) << what;
    EXPECT_NE(what.find("'filter' at item 7: inner filter fails on 7"), std::string::npos) << what;
    try {
      std::rethrow_exception(e.original());
    } catch (const conveyor::NodeError& inner) {
      EXPECT_EQ(inner.node(), "filter");
      EXPECT_EQ(inner.position(), 7u);
    }
  }
  EXPECT_EQ(pass.next(), std::optional<int64_t>(4));  // the pass goes on
}

TEST(Combine, ForkGivesEveryConsumerEveryErrorInItsPlace) {
  for (const bool b_first : {false, true}) {
    auto outputs = nodes::fork(nodes::from_range(0, 6) | nodes::map([](int64_t x) {
                                 if (x == 2 || x == 3) throw std::runtime_error("fails on " + std::to_string(x));
                                 return x;
                               }),
                               2, /*buffer=*/8);
    auto a = outputs[0].pass();
    auto b = outputs[1].pass();
    const auto take_all = [](auto& pass) {
      std::vector<std::string> got;
      while (true) {
        try {
          std::optional<int64_t> x = pass.next();
          if (!x) return got;
          got.push_back(std::to_string(*x));
        } catch (const conveyor::NodeError& e) {
          got.push_back("error at " + std::to_string(e.position()));
        }
      }
    };
    const std::vector<std::string> expected = {"0", "1", "error at 2", "error at 3", "4", "5"};
    if (b_first) {
      EXPECT_EQ(take_all(b), expected);
    }
    EXPECT_EQ(take_all(a), expected) << (b_first ? "b first" : "a first");
    if (!b_first) {
      EXPECT_EQ(take_all(b), expected);
    }
  }
}

// Each consumer behind its own prefetch: two threads take turns at the
// fork. The zip of both is the serial run's, pass after pass, passes left
// early included (a prefetch still finishing the last pass takes nothing
// from the next). Under ThreadSanitizer in CI.
TEST(Combine, ForkConsumersEachBehindAPrefetchShareUpstreamSafely) {
  const auto make = [](bool prefetched) {
    std::vector<Pipeline<int64_t>> outputs =
        nodes::fork(nodes::from_range(0, 300) | nodes::map([](int64_t x) {
                      // A little work: the prefetches are still pulling
                      // when a pass left early is followed by the next.
                      const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(20);
                      while (std::chrono::steady_clock::now() < until) {
                      }
                      if (x % 37 == 5) throw std::runtime_error("fails on " + std::to_string(x));
                      return x;
                    }) | nodes::shuffle(20),
                    2, /*buffer=*/64);
    outputs[1] = std::move(outputs[1]) | nodes::map([](int64_t x) { return -x; });
    if (prefetched) {
      outputs[0] = std::move(outputs[0]) | nodes::prefetch(4);
      outputs[1] = std::move(outputs[1]) | nodes::prefetch(8);
    }
    auto zipped = nodes::zip(std::move(outputs[0]), std::move(outputs[1]));
    zipped.seed(11);
    return zipped;
  };
  const auto run = [](auto& pipeline, size_t limit) {
    std::vector<std::string> got;
    auto pass = pipeline.pass();
    while (got.size() < limit) {
      try {
        std::optional<std::pair<int64_t, int64_t>> pair = pass.next();
        if (!pair) break;
        got.push_back(std::to_string(pair->first) + "," + std::to_string(pair->second));
      } catch (const conveyor::NodeError& e) {
        got.push_back("error in " + e.node() + " at " + std::to_string(e.position()));
      }
    }
    return got;
  };
  // Every third pass is left after a few outputs, the prefetches ahead,
  // and the next begins at once.
  const auto limit_of = [](int pass) {
    return pass % 3 == 2 ? static_cast<size_t>(pass) : std::numeric_limits<size_t>::max();
  };
  constexpr int kPasses = 40;
  std::vector<std::vector<std::string>> want;
  auto serial = make(false);
  for (int pass = 0; pass < kPasses; ++pass) {
    want.push_back(run(serial, limit_of(pass)));
    if (limit_of(pass) > 300) {
      ASSERT_GE(want.back().size(), 300u);  // 292 pairs, and each consumer's 8 errors
    }
  }
  auto threaded = make(true);
  for (int pass = 0; pass < kPasses; ++pass) {
    EXPECT_EQ(run(threaded, limit_of(pass)), want[static_cast<size_t>(pass)]) << "pass " << pass;
  }
}

// Behind prefetch(n) on each branch of a zip, one branch's strand runs at
// most n + 1 items ahead of the other's, however the threads are scheduled:
// a buffer of n + 2 never overflows (the sizing rule in combine.h). Uneven
// work on one branch lets the other's strand race ahead, each way in turn.
TEST(Combine, ForkBranchesBehindPrefetchesInAZipStayWithinTheirDepthPlusTwo) {
  constexpr int kDepth = 4;
  constexpr int64_t kItems = 200;
  for (int round = 0; round < 30; ++round) {
    SCOPED_TRACE("round " + std::to_string(round));
    auto spin = [](int64_t x) {
      const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(5);
      while (std::chrono::steady_clock::now() < until) {
      }
      return x;
    };
    auto outputs = nodes::fork(nodes::from_range(0, kItems), 2, /*buffer=*/kDepth + 2);
    const size_t slow = static_cast<size_t>(round % 2);
    outputs[slow] = std::move(outputs[slow]) | nodes::map(spin);
    outputs[0] = std::move(outputs[0]) | nodes::prefetch(kDepth);
    outputs[1] = std::move(outputs[1]) | nodes::prefetch(kDepth);
    auto zipped = nodes::zip(std::move(outputs[0]), std::move(outputs[1]));
    int64_t expected = 0;
    for (const auto& [x, y] : zipped.pass()) {
      ASSERT_EQ(x, expected);
      ASSERT_EQ(y, expected);
      ++expected;
    }
    EXPECT_EQ(expected, kItems);
  }
}

TEST(Combine, ForkGivesEveryConsumerEveryItemWithinItsBuffer) {
  auto outputs = nodes::fork(nodes::from_range(0, 6), 2, /*buffer=*/3);
  auto a = outputs[0].pass();
  auto b = outputs[1].pass();
  std::vector<int64_t> got_a, got_b;
  for (int i = 0; i < 3; ++i) got_a.push_back(*a.next());
  EXPECT_THROW(a.next(), conveyor::ValueError);  // a fourth would leave b 4 behind
  for (int i = 0; i < 3; ++i) got_b.push_back(*b.next());  // b catches up; the buffer drains
  while (true) {  // in step to the end
    std::optional<int64_t> x = a.next(), y = b.next();
    if (!x || !y) {
      EXPECT_EQ(x.has_value(), y.has_value());
      break;
    }
    got_a.push_back(*x);
    got_b.push_back(*y);
  }
  EXPECT_EQ(got_a, iota(6));
  EXPECT_EQ(got_b, iota(6));
  try {
    (void)nodes::fork(nodes::from_range(0, 6), 2, /*buffer=*/0);
    ADD_FAILURE() << "a buffer of 0 was accepted";
  } catch (const conveyor::ValueError& e) {
    EXPECT_STREQ(e.what(), "fork: buffer should be at least 1, but got 0");
  }
}

TEST(Errors, AFailedItemNamesItsNodeAndPositionAndThePassGoesOn) {
  auto pipeline = nodes::from_range(0, 6) | nodes::map([](int64_t x) {
                    if (x == 2 || x == 4) throw std::runtime_error("bad item " + std::to_string(x));
                    return x;
                  }) |
                  nodes::batch(2);
  auto pass = pipeline.pass();
  std::vector<std::string> events;
  while (true) {
    try {
      auto batch = pass.next();
      if (!batch) break;
      std::string text;
      for (int64_t x : *batch) text += std::to_string(x);
      events.push_back(text);
    } catch (const conveyor::NodeError& e) {
      EXPECT_EQ(e.node(), "map");
      EXPECT_NE(std::string(e.what()).find("bad item " + std::to_string(e.position())), std::string::npos);
      events.push_back("error@" + std::to_string(e.position()));
    }
  }
  // The batch gathered before an error keeps its items: nothing is lost.
  EXPECT_EQ(events, (std::vector<std::string>{"01", "error@2", "error@4", "35"}));
  auto skipping = nodes::from_range(0, 6) | nodes::map(
                                                [](int64_t x) {
                                                  if (x % 2 == 0) throw std::runtime_error("even");
                                                  return x;
                                                },
                                                conveyor::OnError::skip);
  EXPECT_EQ(one_pass(skipping), (std::vector<int64_t>{1, 3, 5}));
}

TEST(Metrics, EveryNodeCountsItsItemsInAndOutSourcesFirst) {
  auto pipeline = nodes::from_range(0, 100) |
                  nodes::map(
                      [](int64_t x) {
                        if (x % 25 == 7) throw std::runtime_error("bad");
                        return x;
                      },
                      conveyor::OnError::skip) |
                  nodes::filter([](int64_t x) { return x % 2 == 0; }) | nodes::batch(10);
  EXPECT_EQ(one_pass(pipeline).size(), 5u);
  const auto metrics = pipeline.metrics();
  std::vector<std::string> names;
  for (const auto& m : metrics) names.push_back(m.name);
  EXPECT_EQ(names, (std::vector<std::string>{"from_range", "map(on_error=skip)", "filter", "batch(10)"}));
  EXPECT_EQ(metrics[0].items_out, 100u);
  EXPECT_EQ(metrics[1].items_in, 100u);
  EXPECT_EQ(metrics[1].skipped, 4u);  // 7, 32, 57, 82
  EXPECT_EQ(metrics[1].items_out, 96u);
  EXPECT_EQ(metrics[2].items_in, 96u);
  EXPECT_EQ(metrics[2].items_out, 48u);  // the odd 7, 57 were dropped already
  EXPECT_EQ(metrics[3].items_in, 48u);
  EXPECT_EQ(metrics[3].items_out, 5u);
  for (const auto& m : metrics) EXPECT_EQ(m.busy_seconds, 0.0) << m.name << ": an untimed pass reads no clock";
  // Each pass counts afresh; ids follow the graph.
  EXPECT_EQ(one_pass(pipeline).size(), 5u);
  EXPECT_EQ(pipeline.metrics()[0].items_out, 100u);
  for (size_t i = 0; i < metrics.size(); ++i) EXPECT_EQ(metrics[i].id, i);

  const std::string table = conveyor::metrics_table(metrics);
  EXPECT_NE(table.find("items in"), std::string::npos) << table;
  EXPECT_NE(table.find("batch(10)"), std::string::npos) << table;
  EXPECT_EQ(std::count(table.begin(), table.end(), '\n'), 5) << table;
}

// A long name (a map of a long lambda's type, say) widens its column; no row
// is cut, and every row's columns line up after it.
TEST(Metrics, TheTableKeepsEveryRowWholeForALongName) {
  conveyor::NodeMetrics long_named;
  long_named.name = std::string(600, 'x');
  long_named.items_in = 7;
  long_named.items_out = 6;
  long_named.window = 3;
  conveyor::NodeMetrics short_named;
  short_named.name = "batch(10)";
  short_named.items_in = 12345;
  const std::string table = conveyor::metrics_table({long_named, short_named});
  std::vector<std::string> rows;
  std::istringstream lines(table);
  for (std::string row; std::getline(lines, row);) rows.push_back(row);
  ASSERT_EQ(rows.size(), 3u) << table;
  EXPECT_EQ(rows[0].find("items in"), 600u + 1 + 12 - std::string("items in").size()) << rows[0];
  EXPECT_EQ(rows[1].substr(0, 600), long_named.name);
  EXPECT_EQ(rows[1].substr(600, 26), "            7            6") << rows[1];
  EXPECT_NE(rows[1].find("       3"), std::string::npos) << rows[1];
  EXPECT_EQ(rows[2].substr(0, 9), "batch(10)");
  EXPECT_EQ(rows[2].substr(600, 13), "        12345") << rows[2];
}

// A combining node counts as in every item it takes from its sources,
// whether its pull went through the meter or asked a source's try_next().
TEST(Metrics, CombiningNodesCountEveryItemTheyTake) {
  const auto metrics_of = [](auto& pipeline, const std::string& name) {
    for (const auto& m : pipeline.metrics()) {
      if (m.name == name) return m;
    }
    ADD_FAILURE() << "no node " << name;
    return conveyor::NodeMetrics{};
  };
  {
    std::vector<Pipeline<int64_t>> sources;
    sources.push_back(nodes::from_range(0, 5));
    sources.push_back(nodes::from_range(100, 102));
    auto joined = nodes::join(std::move(sources));
    EXPECT_EQ(one_pass(joined).size(), 7u);
    const auto join = metrics_of(joined, "join");
    EXPECT_EQ(join.items_in, 7u);
    EXPECT_EQ(join.items_out, 7u);
  }
  {
    std::vector<Pipeline<int64_t>> sources;
    sources.push_back(nodes::from_range(0, 2));
    sources.push_back(nodes::from_range(10, 14));
    auto muxed = nodes::mux(std::move(sources));
    EXPECT_EQ(one_pass(muxed).size(), 6u);
    EXPECT_EQ(metrics_of(muxed, "mux").items_in, 6u);
  }
  {
    auto outputs = nodes::fork(nodes::from_range(0, 6), 2, /*buffer=*/8);
    EXPECT_EQ(one_pass(outputs[0]).size(), 6u);
    EXPECT_EQ(one_pass(outputs[1]).size(), 6u);
    for (size_t consumer = 0; consumer < 2; ++consumer) {
      const auto fork = metrics_of(outputs[consumer], "fork[" + std::to_string(consumer) + "]");
      EXPECT_EQ(fork.items_in, 6u) << consumer;
      EXPECT_EQ(fork.items_out, 6u) << consumer;
    }
  }
}

TEST(Metrics, ATimedPassPutsTheTimeInTheNodeThatSpentIt) {
  constexpr int64_t kItems = 20;
  constexpr uint64_t kSpinNs = 2'000'000;
  auto pipeline = nodes::from_range(0, kItems) | nodes::map([](int64_t x) {
                    conveyor::testing::spin_delay(kSpinNs);
                    return x;
                  }) |
                  nodes::map([](int64_t x) { return x + 1; });
  pipeline.timed();
  EXPECT_EQ(one_pass(pipeline).size(), static_cast<size_t>(kItems));
  const auto metrics = pipeline.metrics();
  ASSERT_EQ(metrics.size(), 3u);
  const double spun = static_cast<double>(kItems * kSpinNs) * 1e-9;
  // The slow map spent at least the spins; the one after it waited for them
  // and did almost nothing itself.
  EXPECT_GE(metrics[1].busy_seconds, spun);
  EXPECT_GE(metrics[2].upstream_wait_seconds, spun);
  EXPECT_LT(metrics[2].busy_seconds, metrics[1].busy_seconds);
  EXPECT_GE(metrics[1].upstream_wait_seconds, 0.0);
}

TEST(Metrics, ATimedPassPutsTheConsumersTimeInEachNodesDownstreamWait) {
  // The consumer spins between items: the last node waited at least that
  // long for it to ask, and serially so did every node before it (each
  // asks only when asked). A prefetch is the last node in the second run.
  constexpr int64_t kItems = 20;
  constexpr uint64_t kSpinNs = 2'000'000;
  for (const bool prefetched : {false, true}) {
    SCOPED_TRACE(prefetched ? "behind a prefetch" : "serial");
    auto serial = nodes::from_range(0, kItems) | nodes::map([](int64_t x) { return x + 1; });
    auto pipeline = prefetched ? std::move(serial) | nodes::prefetch(4) : std::move(serial);
    pipeline.timed();
    auto pass = pipeline.pass();
    int64_t items = 0;
    while (pass.next()) {
      ++items;
      conveyor::testing::spin_delay(kSpinNs);
    }
    ASSERT_EQ(items, kItems);
    const auto metrics = pipeline.metrics();
    ASSERT_EQ(metrics.size(), prefetched ? 3u : 2u);
    // One spin after each item, before the next call (the last call ends
    // the pass).
    const double spun = static_cast<double>(kItems * kSpinNs) * 1e-9;
    EXPECT_GE(metrics.back().downstream_wait_seconds, spun) << conveyor::metrics_table(metrics);
    if (!prefetched) {
      // Serially the whole chain idles while the consumer works.
      EXPECT_GE(metrics[0].downstream_wait_seconds, spun) << conveyor::metrics_table(metrics);
    }
  }
  // An untimed pass reads no clock.
  auto untimed = nodes::from_range(0, 5) | nodes::prefetch(2);
  EXPECT_EQ(one_pass(untimed).size(), 5u);
  for (const auto& m : untimed.metrics()) EXPECT_EQ(m.downstream_wait_seconds, 0.0) << m.name;
}

}  // namespace
