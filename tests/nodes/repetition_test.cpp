// The pipeline's repetition nodes: defects found by audit, each pinned by a test.
#include <gtest/gtest.h>

#include <conveyor/conveyor.h>
#include <conveyor/nodes.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "support/datasets.h"
#include "support/pipelines.h"
#include "support/sync.h"

namespace {

namespace nodes = conveyor::nodes;
using conveyor::Pipeline;
using conveyor::ShardSpec;
using conveyor::State;
using conveyor::testing::one_pass;

using conveyor::testing::Outcomes;
using conveyor::testing::take_one;

// The rest of `pass`'s outcomes, after `out`'s.
template <class Pass>
Outcomes rest_of(Pass& pass, Outcomes out = {}) {
  while (take_one(pass, out)) {
  }
  return out;
}

Outcomes whole_pass(Pipeline<int64_t>& pipeline) {
  auto pass = pipeline.pass();
  return rest_of(pass);
}

// A source whose items depend on the pass's epoch (repeat's round): epoch e
// gives rounds[e % rounds.size()], which may be empty (a per-epoch file
// list, a sampler over a subset, a filter on a small shard).
class ByEpoch final : public nodes::MeteredNode<int64_t> {
 public:
  explicit ByEpoch(std::vector<std::vector<int64_t>> rounds) : rounds_(std::move(rounds)) {}
  using Node<int64_t>::reset;
  void reset(const conveyor::PassContext& pass, conveyor::detail::ResetWalk& walk) override {
    items_ = &rounds_[pass.epoch % rounds_.size()];
    next_ = 0;
    start_metering(pass, walk.next_id++);
  }
  std::string name() const override { return "by_epoch"; }

 private:
  std::optional<int64_t> produce() override {
    if (next_ == items_->size()) return std::nullopt;
    return (*items_)[next_++];
  }
  std::vector<std::vector<int64_t>> rounds_;
  const std::vector<int64_t>* items_ = nullptr;
  size_t next_ = 0;
};

Pipeline<int64_t> by_epoch(std::vector<std::vector<int64_t>> rounds) {
  return Pipeline<int64_t>(std::make_unique<ByEpoch>(std::move(rounds)));
}

// Fails on negative items.
auto failing_on_negatives() {
  return nodes::map([](int64_t x) {
    if (x < 0) throw std::runtime_error("bad " + std::to_string(x));
    return x;
  });
}

// Every cut point of `make`'s first pass: the outcomes before it, the
// state there, and a new pipeline resumed from it give the whole pass.
void expect_resumes_at_every_cut(const std::function<Pipeline<int64_t>()>& make, const Outcomes& whole,
                                 const std::string& what) {
  for (size_t stop = 0; stop <= whole.size(); ++stop) {
    Outcomes before;
    std::string saved;
    {
      auto pipeline = make();
      auto pass = pipeline.pass();
      for (size_t i = 0; i < stop; ++i) ASSERT_TRUE(take_one(pass, before)) << what << ", stop " << stop;
      saved = pipeline.state().to_json();
    }
    auto pipeline = make();
    pipeline.load_state(State::from_json(saved));
    auto pass = pipeline.pass();
    EXPECT_EQ(rest_of(pass, before), whole) << what << ", stopped after " << stop;
  }
}

}  // namespace

// A load_state() into a pipeline whose cache() is already complete resumes
// the pass the state was taken in, as a new pipeline does: a state of the
// pass that filled the cache (B: its failed items were outputs there, the
// cache holds none of them), or of a pass whose cache another pass filled
// later (C: a shuffle's pass 0, abandoned; pass 1 filled it), fills it
// again as that pass did.
TEST(Repetition, LoadStateIntoAPipelineWhoseCacheIsCompleteResumesTheSavedPass) {
  // B: the state is taken in the filling pass, which then completes.
  auto failing = [] {
    return nodes::from_range(0, 8) | nodes::map([](int64_t x) {
             if (x == 2) throw std::runtime_error("bad");
             return x;
           }) |
           nodes::cache();
  };
  Outcomes uninterrupted;
  {
    auto pipeline = failing();
    uninterrupted = whole_pass(pipeline);
  }
  ASSERT_EQ(uninterrupted, (Outcomes{"0", "1", "error in map at 2", "3", "4", "5", "6", "7"}));
  for (size_t stop = 0; stop <= uninterrupted.size(); ++stop) {
    auto pipeline = failing();
    Outcomes before;
    std::string saved;
    {
      auto pass = pipeline.pass();
      for (size_t i = 0; i < stop; ++i) ASSERT_TRUE(take_one(pass, before));
      saved = pipeline.state().to_json();
      (void)rest_of(pass);  // the cache is complete
    }
    pipeline.load_state(State::from_json(saved));
    auto pass = pipeline.pass();
    EXPECT_EQ(rest_of(pass, before), uninterrupted) << "B, stopped after " << stop;
  }

  // C: the state is taken in pass 0, abandoned; pass 1 fills the cache.
  auto shuffled = [] {
    auto pipeline = nodes::from_range(0, 8) | nodes::shuffle(8) | nodes::cache();
    pipeline.seed(3);
    return pipeline;
  };
  Outcomes first;
  {
    auto pipeline = shuffled();
    first = whole_pass(pipeline);
  }
  for (size_t stop = 0; stop <= first.size(); ++stop) {
    auto pipeline = shuffled();
    Outcomes before;
    std::string saved;
    {
      auto pass = pipeline.pass();
      for (size_t i = 0; i < stop; ++i) ASSERT_TRUE(take_one(pass, before));
      saved = pipeline.state().to_json();
    }
    const Outcomes second = whole_pass(pipeline);  // fills the cache
    ASSERT_NE(second, first) << "pass 1 should shuffle otherwise";
    pipeline.load_state(State::from_json(saved));
    {
      auto pass = pipeline.pass();
      EXPECT_EQ(rest_of(pass, before), first) << "C, stopped after " << stop;
    }
    // And the pass after it replays what the resumed pass filled.
    EXPECT_EQ(whole_pass(pipeline), first) << "C, stopped after " << stop;
  }
}

// A state of a pass that replayed the cache, loaded into the pipeline
// holding that same cache, replays it without reading upstream again.
TEST(Repetition, LoadStateMatchingTheCacheReplaysItWithoutUpstream) {
  int calls = 0;
  auto pipeline = nodes::from_range(0, 6) | nodes::map([&calls](int64_t x) {
                    ++calls;
                    return x;
                  }) |
                  nodes::cache();
  EXPECT_EQ(whole_pass(pipeline), (Outcomes{"0", "1", "2", "3", "4", "5"}));
  Outcomes before;
  std::string saved;
  {
    auto pass = pipeline.pass();  // a replay
    for (int i = 0; i < 2; ++i) ASSERT_TRUE(take_one(pass, before));
    saved = pipeline.state().to_json();
    (void)rest_of(pass);
  }
  pipeline.load_state(State::from_json(saved));
  auto pass = pipeline.pass();
  EXPECT_EQ(rest_of(pass, before), (Outcomes{"0", "1", "2", "3", "4", "5"}));
  EXPECT_EQ(calls, 6);
}

// A finite repeat(k) goes through all its k rounds: a round with no item
// (or only errors) is just empty, live and resumed. repeat() for ever
// still ends its pass at such a round, or it would spin.
TEST(Repetition, AFiniteRepeatGoesOnPastAnEmptyRound) {
  using Rounds = std::vector<std::vector<int64_t>>;
  struct Case {
    std::string what;
    std::function<Pipeline<int64_t>()> make;
    Outcomes whole;
  };
  const std::vector<Case> cases = {
      {"round 1 empty, repeat(3)", [] { return by_epoch(Rounds{{0, 1}, {}, {20, 21}}) | nodes::repeat(3); },
       {"0", "1", "20", "21"}},
      {"round 0 empty, repeat(3)", [] { return by_epoch(Rounds{{}, {10, 11}, {}}) | nodes::repeat(3); },
       {"10", "11"}},
      {"rounds 1 and 2 empty, repeat(4)",
       [] { return by_epoch(Rounds{{0}, {}, {}, {30, 31}}) | nodes::repeat(4); }, {"0", "30", "31"}},
      {"round 1 of errors alone, repeat(3)",
       [] { return by_epoch(Rounds{{0, 1}, {-1, -2}, {20}}) | failing_on_negatives() | nodes::repeat(3); },
       {"0", "1", "error in map at 0", "error in map at 1", "20"}},
      {"every round of errors alone, repeat(2)",
       [] { return nodes::from_range(0, 3) | nodes::map([](int64_t x) -> int64_t {
                     throw std::runtime_error("bad " + std::to_string(x));
                   }) | nodes::repeat(2); },
       {"error in map at 0", "error in map at 1", "error in map at 2", "error in map at 0", "error in map at 1",
        "error in map at 2"}},
      {"round 1 empty, repeat(3), behind a prefetch",
       [] { return by_epoch(Rounds{{0, 1}, {}, {20, 21}}) | nodes::repeat(3) | nodes::prefetch(4); },
       {"0", "1", "20", "21"}},
      // For ever: the pass ends at the first round with no item in it.
      {"round 1 empty, repeat()", [] { return by_epoch(Rounds{{0, 1}, {}, {20, 21}}) | nodes::repeat(); },
       {"0", "1"}},
      {"round 1 of errors alone, repeat()",
       [] { return by_epoch(Rounds{{0, 1}, {-1}, {20}}) | failing_on_negatives() | nodes::repeat(); },
       {"0", "1", "error in map at 0"}},
  };
  for (const Case& c : cases) {
    {
      auto pipeline = c.make();
      EXPECT_EQ(whole_pass(pipeline), c.whole) << c.what;
    }
    expect_resumes_at_every_cut(c.make, c.whole, c.what);
  }
}

// A cache() filled under one shard is that shard's: after
// Pipeline::shard() names another, the next pass fills it again, and a new
// pipeline resuming from a state taken in between gives the same pass.
TEST(Repetition, ACacheFilledUnderOneShardIsNotReplayedUnderAnother) {
  auto pipeline = nodes::from_range(0, 8) | nodes::cache();
  pipeline.shard({.rank = 0, .world_size = 2});
  EXPECT_EQ(one_pass(pipeline), (std::vector<int64_t>{0, 2, 4, 6}));
  EXPECT_EQ(one_pass(pipeline), (std::vector<int64_t>{0, 2, 4, 6}));  // a replay
  pipeline.shard({.rank = 1, .world_size = 2});
  EXPECT_EQ(one_pass(pipeline), (std::vector<int64_t>{1, 3, 5, 7}));
  EXPECT_EQ(one_pass(pipeline), (std::vector<int64_t>{1, 3, 5, 7}));
  pipeline.shard({.rank = 0, .world_size = 1});
  EXPECT_EQ(one_pass(pipeline), (std::vector<int64_t>{0, 1, 2, 3, 4, 5, 6, 7}));

  // Upstream depending on the epoch: the state, taken after the re-shard
  // and before the next pass, resumes as the live pipeline goes on.
  auto shuffled = [] {
    auto p = nodes::from_range(0, 16) | nodes::shuffle(16) | nodes::cache();
    p.seed(7);
    return p;
  };
  auto live = shuffled();
  live.shard({.rank = 0, .world_size = 2});
  (void)one_pass(live);
  live.shard({.rank = 1, .world_size = 2});
  const std::string saved = live.state().to_json();
  const std::vector<int64_t> next = one_pass(live);
  for (const int64_t x : next) EXPECT_EQ(x % 2, 1) << "rank 1's items are odd";
  auto resumed = shuffled();
  resumed.shard({.rank = 1, .world_size = 2});
  resumed.load_state(State::from_json(saved));
  EXPECT_EQ(one_pass(resumed), next);
  EXPECT_EQ(one_pass(resumed), one_pass(live));
}

// The metrics of the nodes upstream of a repeat count every round of the
// pass, not only the last (each round's reset starts their meters over).
TEST(Repetition, UpstreamMetricsCountEveryRound) {
  auto pipeline = nodes::from_range(0, 4) | nodes::map([](int64_t x) {
                    if (x == 1) throw std::runtime_error("bad");
                    return x;
                  }, conveyor::OnError::skip) |
                  nodes::repeat(3);
  EXPECT_EQ(one_pass(pipeline).size(), 9u);
  const std::vector<conveyor::NodeMetrics> metrics = pipeline.metrics();
  ASSERT_EQ(metrics.size(), 3u);
  EXPECT_EQ(metrics[0].items_out, 12u) << metrics[0].name;
  EXPECT_EQ(metrics[1].items_in, 12u) << metrics[1].name;
  EXPECT_EQ(metrics[1].items_out, 9u) << metrics[1].name;
  EXPECT_EQ(metrics[1].skipped, 3u) << metrics[1].name;
  EXPECT_EQ(metrics[2].items_in, 9u) << metrics[2].name;
  EXPECT_EQ(metrics[2].items_out, 9u) << metrics[2].name;
  // A new pass starts them over.
  EXPECT_EQ(one_pass(pipeline).size(), 9u);
  EXPECT_EQ(pipeline.metrics()[0].items_out, 12u);
}
