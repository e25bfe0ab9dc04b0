// Pipeline::state / load_state: a pipeline stopped anywhere, saved, destroyed
// and built anew (with other worker counts, or none) hands out exactly what
// the uninterrupted run did after that point, then the passes after it.
//
// The property test draws random graphs (tests/support/random_pipeline.h:
// maps on workers or not, in order or not, failures skipped or raised,
// shuffle, batch, filter, flat_map, take, cache, mux, weighted_mux, zip,
// prefetch) and stops each at a random item of a random pass, twice in that
// pass. Its seed is printed; CONVEYOR_NODES_SEED=N replays it.
#include <gtest/gtest.h>

#include <conveyor/conveyor.h>
#include <conveyor/nodes.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <chrono>
#include <numeric>
#include <mutex>
#include <future>
#include <deque>
#include <cstdio>
#include <functional>
#include <optional>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include "support/pipelines.h"
#include "support/random_pipeline.h"
#include "support/sync.h"

namespace {

namespace nodes = conveyor::nodes;
using conveyor::Pipeline;
using conveyor::State;
using conveyor::StateError;
using conveyor::testing::one_pass;
using conveyor::testing::property_graphs;
using conveyor::testing::property_rng;
using conveyor::testing::random_pipeline;

using conveyor::testing::Outcomes;
using conveyor::testing::take_one;

Outcomes sorted(Outcomes outcomes) {
  std::sort(outcomes.begin(), outcomes.end());
  return outcomes;
}

TEST(PipelineResume, RandomGraphsResumeExactlyAnywhereWithAnyWorkerCount) {
  std::mt19937_64 rng = property_rng("pipeline resume");
  const int graphs = property_graphs(150, 40);
  constexpr int kPasses = 3;
  int unordered = 0, resumed_serially = 0;
  for (int g = 0; g < graphs; ++g) {
    const uint64_t graph_seed = rng();
    bool ordered = true;
    std::vector<Outcomes> reference;
    {
      auto pipeline = random_pipeline(std::mt19937_64(graph_seed), true, ordered);
      pipeline.seed(graph_seed);
      for (int e = 0; e < kPasses; ++e) {
        auto pass = pipeline.pass();
        Outcomes outcomes;
        while (take_one(pass, outcomes)) {
        }
        reference.push_back(outcomes);
      }
    }
    unordered += !ordered;
    const auto stop_pass = static_cast<size_t>(rng() % kPasses);
    const size_t length = reference[stop_pass].size();
    const size_t stop_after = rng() % (length + 1);
    const size_t second_stop = rng() % (length - stop_after + 1);
    // A map handing items out as they finish resumes on workers (its serial
    // form has no order of its own to replay); an ordered graph on any.
    const bool serial_resume = ordered && rng() % 2 == 0;
    resumed_serially += serial_resume;
    SCOPED_TRACE("graph " + std::to_string(g) + " (seed " + std::to_string(graph_seed) + "): stop in pass " +
                 std::to_string(stop_pass) + " after " + std::to_string(stop_after) + " of " +
                 std::to_string(length) + ", again " + std::to_string(second_stop) + " later" +
                 (serial_resume ? ", resumed without workers" : "") + (ordered ? "" : ", out of order"));

    Outcomes before;
    std::string saved;
    {
      auto pipeline = random_pipeline(std::mt19937_64(graph_seed), true, ordered);
      pipeline.seed(graph_seed);
      for (size_t e = 0; e < stop_pass; ++e) {
        auto pass = pipeline.pass();
        Outcomes ignored;
        while (take_one(pass, ignored)) {
        }
      }
      auto pass = pipeline.pass();
      while (before.size() < stop_after) ASSERT_TRUE(take_one(pass, before));
      saved = pipeline.state().to_json();
    }
    {
      auto pipeline = random_pipeline(std::mt19937_64(graph_seed), !serial_resume, ordered);
      pipeline.seed(graph_seed);
      pipeline.load_state(State::from_json(saved));
      auto pass = pipeline.pass();
      while (before.size() < stop_after + second_stop) ASSERT_TRUE(take_one(pass, before));
      saved = pipeline.state().to_json();
    }
    auto pipeline = random_pipeline(std::mt19937_64(graph_seed), !serial_resume, ordered);
    pipeline.seed(graph_seed);
    pipeline.load_state(State::from_json(saved));
    Outcomes whole = before;
    {
      auto pass = pipeline.pass();
      while (take_one(pass, whole)) {
      }
    }
    if (ordered) {
      ASSERT_EQ(whole, reference[stop_pass]) << "the resumed pass";
    } else {
      ASSERT_EQ(sorted(whole), sorted(reference[stop_pass])) << "the resumed pass, as a multiset";
    }
    for (size_t e = stop_pass + 1; e < kPasses; ++e) {
      auto pass = pipeline.pass();
      Outcomes outcomes;
      while (take_one(pass, outcomes)) {
      }
      if (ordered) {
        ASSERT_EQ(outcomes, reference[e]) << "pass " << e;
      } else {
        ASSERT_EQ(sorted(outcomes), sorted(reference[e])) << "pass " << e << ", as a multiset";
      }
    }
  }
  std::printf("%d graphs: %d out of order, %d resumed without workers\n", graphs, unordered, resumed_serially);
}

// Join's order is timing's: a resumed pass takes from each source what the
// saved pass had not, whatever order it takes it in now; behind a filter
// (which replays by pulling) it hands the saved order out again.
// A state saved again after load_state() and before the pass it resumes
// (a restore-then-checkpoint loop, a crash before the first item) is the
// loaded one, whether the pipeline is fresh or has a pass of its own going.
TEST(PipelineResume, AStateSavedBeforeTheLoadedPassBeginsIsTheLoadedOne) {
  auto make = [] {
    std::vector<int64_t> values(10);
    std::iota(values.begin(), values.end(), 0);
    return nodes::from_vector(values) | nodes::flat_map([](int64_t x) { return std::vector<int64_t>(2, x); });
  };
  Pipeline<int64_t> saved_from = make();
  auto pass = saved_from.pass();
  std::vector<int64_t> head;
  for (int i = 0; i < 5; ++i) head.push_back(*pass.next());
  const State saved = saved_from.state();

  Pipeline<int64_t> fresh = make();
  fresh.load_state(saved);
  const State again = fresh.state();
  EXPECT_EQ(again.uint_at("received"), 5u);
  Pipeline<int64_t> busy = make();
  auto busy_pass = busy.pass();
  for (int i = 0; i < 12; ++i) (void)busy_pass.next();
  busy.load_state(saved);
  EXPECT_EQ(busy.state().uint_at("received"), 5u);

  Pipeline<int64_t> resumed = make();
  resumed.load_state(again);
  std::vector<int64_t> all = head;
  for (int64_t value : resumed.pass()) all.push_back(value);
  std::vector<int64_t> expected;
  for (int64_t x = 0; x < 10; ++x) expected.insert(expected.end(), 2, x);
  EXPECT_EQ(all, expected);
}

// A state saved in a resumed pass before it hands an item out is the
// loaded one. The shuffle replays its part at its first item, so before then
// the graph described the pass's start: repeat's round 0 under 311 items
// received, which load_state refused ("goes past the end of that round").
// Found by the random-graph property test (CONVEYOR_NODES_SEED=3190516844).
TEST(PipelineResume, AStateSavedInAResumedPassBeforeItsFirstItemIsTheLoadedOne) {
  const auto make = [] {
    auto pipeline = nodes::from_range(0, 163) | nodes::repeat(2) | nodes::shuffle(64);
    pipeline.seed(7);
    return pipeline;
  };
  auto whole = make();
  const std::vector<int64_t> expected = one_pass(whole);
  ASSERT_EQ(expected.size(), 326u);
  for (const size_t stop : {size_t{0}, size_t{100}, size_t{163}, size_t{311}, size_t{326}}) {
    SCOPED_TRACE("stopped after " + std::to_string(stop));
    std::vector<int64_t> got;
    State saved;
    {
      auto first = make();
      auto pass = first.pass();
      while (got.size() < stop) got.push_back(*pass.next());
      saved = first.state();
    }
    {
      auto restarted = make();
      restarted.load_state(saved);
      auto pass = restarted.pass();
      saved = restarted.state();  // checkpointed again before the first item
    }
    auto resumed = make();
    resumed.load_state(saved);
    for (int64_t value : resumed.pass()) got.push_back(value);
    EXPECT_EQ(got, expected);
  }
}

TEST(PipelineResume, JoinResumesWithWhatEachSourceHadLeft) {
  for (const bool filtered : {false, true}) {
    auto make = [filtered] {
      std::vector<Pipeline<int64_t>> sources;
      sources.push_back(nodes::from_range(0, 200) | nodes::map([](int64_t x) {
                          conveyor::testing::spin_delay(x % 5 == 0 ? 20000 : 0);
                          return x;
                        }, {.workers = 2}));
      sources.push_back(nodes::from_range(1000, 1150) | nodes::prefetch(4));
      Pipeline<int64_t> joined = nodes::join(std::move(sources));
      if (filtered) joined = std::move(joined) | nodes::filter([](int64_t x) { return x % 3 != 0; });
      return joined;
    };
    Outcomes expected;
    for (int64_t x = 0; x < 200; ++x) {
      if (!filtered || x % 3 != 0) expected.push_back(std::to_string(x));
    }
    for (int64_t x = 1000; x < 1150; ++x) {
      if (!filtered || x % 3 != 0) expected.push_back(std::to_string(x));
    }
    for (int trial = 0; trial < 20; ++trial) {
      Outcomes before;
      std::string saved;
      {
        auto pipeline = make();
        auto pass = pipeline.pass();
        for (int i = 0; i < 5 + trial * 10; ++i) ASSERT_TRUE(take_one(pass, before));
        saved = pipeline.state().to_json();
      }
      auto pipeline = make();
      pipeline.load_state(State::from_json(saved));
      Outcomes whole = before;
      auto pass = pipeline.pass();
      while (take_one(pass, whole)) {
      }
      ASSERT_EQ(sorted(whole), sorted(expected)) << "trial " << trial << (filtered ? ", behind a filter" : "");
    }
  }
}

// A fork's consumers resume each from its own place; the first to resume
// buffers what the others have not taken again yet.
TEST(PipelineResume, ForkConsumersResumeFromTheirOwnPlaces) {
  auto make = [] { return nodes::fork(nodes::from_range(0, 100) | nodes::shuffle(16), 2, 8); };
  std::string saved_a, saved_b;
  Outcomes a_before, b_before;
  {
    auto outputs = make();
    outputs[0].seed(9);
    outputs[1].seed(9);
    auto a = outputs[0].pass();
    auto b = outputs[1].pass();
    for (int i = 0; i < 30; ++i) {
      ASSERT_TRUE(take_one(a, a_before));
      if (i < 25) {
        ASSERT_TRUE(take_one(b, b_before));
      }
    }
    saved_a = outputs[0].state().to_json();
    saved_b = outputs[1].state().to_json();
  }
  // What each consumer sees: the shuffled range (shuffle's id is the same
  // under a fork as alone, so its order is too).
  auto alone = nodes::from_range(0, 100) | nodes::shuffle(16);
  alone.seed(9);
  const Outcomes reference = conveyor::testing::outcomes(alone);
  auto outputs = make();
  outputs[0].seed(9);
  outputs[1].seed(9);
  outputs[0].load_state(State::from_json(saved_a));
  outputs[1].load_state(State::from_json(saved_b));
  auto a = outputs[0].pass();
  auto b = outputs[1].pass();
  Outcomes a_all = a_before, b_all = b_before;
  while (true) {
    const bool more_a = take_one(a, a_all);  // both every round: they stay within the buffer
    const bool more_b = take_one(b, b_all);
    if (!more_a && !more_b) break;
  }
  EXPECT_EQ(a_all, reference);
  EXPECT_EQ(b_all, reference);
}

// Each consumer's state holds its upstream's (here a RandomSampler's
// permutation, drawn from the process generator): the consumers resume
// alike in a new process whichever is asked for its pass first.
TEST(PipelineResume, ForkConsumersResumeWhicheverIsResetFirst) {
  auto make = [] { return nodes::fork(nodes::from_sampler(std::make_shared<conveyor::RandomSampler>(size_t{100})), 2, 8); };
  for (const bool b_first : {false, true}) {
    conveyor::manual_seed(21);
    auto alone = nodes::from_sampler(std::make_shared<conveyor::RandomSampler>(size_t{100}));
    Outcomes reference;
    {
      auto pass = alone.pass();
      while (auto index = pass.next()) reference.push_back(std::to_string(*index));
    }
    conveyor::manual_seed(21);
    std::string saved_a, saved_b;
    Outcomes a_all, b_all;
    {
      auto outputs = make();
      auto a = outputs[0].pass();
      auto b = outputs[1].pass();
      for (int i = 0; i < 30; ++i) {
        if (auto index = a.next()) a_all.push_back(std::to_string(*index));
        if (i < 25) {
          if (auto index = b.next()) b_all.push_back(std::to_string(*index));
        }
      }
      saved_a = outputs[0].state().to_json();
      saved_b = outputs[1].state().to_json();
    }
    conveyor::manual_seed(999);  // a new process's generator
    auto outputs = make();
    outputs[0].load_state(State::from_json(saved_a));
    outputs[1].load_state(State::from_json(saved_b));
    using PassOf = decltype(outputs[0].pass());
    std::optional<PassOf> a, b;
    if (b_first) b.emplace(outputs[1].pass());
    a.emplace(outputs[0].pass());
    if (!b_first) b.emplace(outputs[1].pass());
    while (true) {
      auto from_a = a->next();
      auto from_b = b->next();
      if (from_a) a_all.push_back(std::to_string(*from_a));
      if (from_b) b_all.push_back(std::to_string(*from_b));
      if (!from_a && !from_b) break;
    }
    EXPECT_EQ(a_all, reference) << (b_first ? "b reset first" : "a reset first");
    EXPECT_EQ(b_all, reference) << (b_first ? "b reset first" : "a reset first");
  }
}

TEST(PipelineResume, ACacheFilledInAnEarlierPassIsFilledTheSameWayInANewProcess) {
  // Upstream of the cache shuffles by pass: a cache refilled from another
  // pass would hold another order.
  auto make = [] { return nodes::from_range(0, 50) | nodes::shuffle(50) | nodes::cache(); };
  Outcomes first, second_before;
  std::string saved;
  {
    auto pipeline = make();
    pipeline.seed(4);
    first = conveyor::testing::outcomes(pipeline);
    auto pass = pipeline.pass();
    for (int i = 0; i < 20; ++i) ASSERT_TRUE(take_one(pass, second_before));
    saved = pipeline.state().to_json();
  }
  auto pipeline = make();
  pipeline.seed(4);
  pipeline.load_state(State::from_json(saved));
  Outcomes whole = second_before;
  auto pass = pipeline.pass();
  while (take_one(pass, whole)) {
  }
  EXPECT_EQ(whole, first);  // the cache replays the first pass
}

// The pass that filled a cache drew its order from the process generator
// (a RandomSampler) and handed items out as they finished (a map out of
// order): a new process, whose generator and timing differ, refills the
// cache with those items in that order, from a state taken between passes
// or in a later one.
TEST(PipelineResume, ACacheIsRefilledWithWhatItsFillingPassDrewAndDecided) {
  // `salt` moves each item's delay, as another process's timing would.
  auto make = [](uint64_t salt) {
    auto delayed = [salt](size_t i) {
      const uint64_t h = (static_cast<uint64_t>(i) * 0x9e3779b97f4a7c15ULL) ^ salt;
      conveyor::testing::spin_delay(h % 3 == 0 ? h % 200000 : 0);
      return static_cast<int64_t>(i);
    };
    return nodes::from_sampler(std::make_shared<conveyor::RandomSampler>(size_t{60})) |
           nodes::map(delayed, {.workers = 3, .in_order = false}) | nodes::cache();
  };
  for (const int taken_after : {0, 25}) {  // items of the second pass
    conveyor::manual_seed(21);
    auto first = make(1);
    const Outcomes filled = conveyor::testing::outcomes(first);
    Outcomes second_before;
    std::string saved;
    if (taken_after == 0) {
      saved = first.state().to_json();  // between the passes
    } else {
      auto pass = first.pass();
      for (int i = 0; i < taken_after; ++i) ASSERT_TRUE(take_one(pass, second_before));
      saved = first.state().to_json();
    }
    conveyor::manual_seed(999);  // a new process's generator
    auto resumed = make(2);
    resumed.load_state(State::from_json(saved));
    Outcomes whole = second_before;
    {
      auto pass = resumed.pass();
      while (take_one(pass, whole)) {
      }
    }
    EXPECT_EQ(whole, filled) << "state taken after " << taken_after << " items of the second pass";
    EXPECT_EQ(conveyor::testing::outcomes(resumed), filled) << "the pass after it replays the cache";
  }
}

TEST(PipelineResume, AMismatchNamesWhatDiffers) {
  auto saver = nodes::from_range(0, 10) | nodes::batch(4);
  saver.seed(1);
  const State state = saver.state();

  auto other_batch = nodes::from_range(0, 10) | nodes::batch(5);
  other_batch.seed(1);
  try {
    other_batch.load_state(state);
    FAIL() << "a batch(5) pipeline loaded a batch(4) state";
  } catch (const StateError& error) {
    EXPECT_NE(std::string(error.what()).find("batch(4)"), std::string::npos) << error.what();
  }
  auto other_seed = nodes::from_range(0, 10) | nodes::batch(4);
  other_seed.seed(2);
  EXPECT_THROW(other_seed.load_state(state), StateError);
  auto other_shard = nodes::from_range(0, 10) | nodes::batch(4);
  other_shard.seed(1).shard({.rank = 1, .world_size = 2});
  EXPECT_THROW(other_shard.load_state(state), StateError);

  // The saved pass must be the one asked for.
  auto resumed = nodes::from_range(0, 10) | nodes::batch(4);
  resumed.seed(1);
  resumed.load_state(state);
  resumed.set_epoch(3);
  EXPECT_THROW((void)resumed.pass(), StateError);
}

// Restore, then join the job: seed() and shard() after load_state() are
// checked by the pass, which would otherwise skip the saved count of
// another shard's items.
TEST(PipelineResume, ASeedOrShardSetAfterLoadingIsCheckedByThePass) {
  const auto make = [] { return nodes::from_range(0, 100) | nodes::shuffle(10); };
  auto saver = make();
  saver.seed(1);
  State state;
  {
    auto pass = saver.pass();
    for (int k = 0; k < 30; ++k) ASSERT_TRUE(pass.next());
    state = saver.state();
  }
  const auto refused = [&](const std::function<void(Pipeline<int64_t>&)>& after_load, const std::string& field) {
    auto resumed = make();
    resumed.seed(1);
    resumed.load_state(state);
    after_load(resumed);
    // Saved again before its pass, it is still the loaded state, under the
    // fingerprint it was taken with: a pipeline set the new way refuses it.
    auto other = make();
    other.seed(1);
    after_load(other);
    EXPECT_THROW(other.load_state(resumed.state()), StateError) << field << " changed after load_state";
    try {
      (void)resumed.pass();
      ADD_FAILURE() << field << " changed after load_state, and the pass resumed";
    } catch (const StateError& error) {
      const std::string what = error.what();
      EXPECT_NE(what.find("pass after load_state: '" + field + "' does not match"), std::string::npos) << what;
    }
  };
  refused([](Pipeline<int64_t>& p) { p.shard({.rank = 1, .world_size = 2}); }, "shard.rank");
  refused([](Pipeline<int64_t>& p) { p.seed(2); }, "seed");

  // Set again to what the state holds: the pass resumes.
  auto resumed = make();
  resumed.seed(1);
  resumed.load_state(state);
  resumed.seed(1).shard({});
  auto whole = make();
  whole.seed(1);
  const std::vector<int64_t> expected = one_pass(whole);
  EXPECT_EQ(one_pass(resumed), std::vector<int64_t>(expected.begin() + 30, expected.end()));
}

TEST(PipelineResume, AStateIsAFewCountsForAnOrderedGraph) {
  auto pipeline = nodes::from_range(0, 1000000) |
                  nodes::map([](int64_t x) { return x * 2; }, {.workers = 2}) | nodes::shuffle(1000) |
                  nodes::batch(64) | nodes::prefetch(4);
  pipeline.seed(3);
  auto pass = pipeline.pass();
  for (int i = 0; i < 100; ++i) ASSERT_TRUE(pass.next());
  const std::string text = pipeline.state().to_json();
  EXPECT_LT(text.size(), 1024u) << text;
}


// repeat() at pass 1, in a new pipeline: its rounds' seeds do not depend on
// which reset came first, so a shuffle upstream shuffles as it did.
TEST(PipelineResume, RepeatResumesInALaterPassAsANewPipeline) {
  auto make = [] { return nodes::from_range(0, 40) | nodes::shuffle(40) | nodes::repeat(3) | nodes::prefetch(4); };
  Outcomes second;
  {
    auto pipeline = make();
    pipeline.seed(5);
    (void)conveyor::testing::outcomes(pipeline);
    second = conveyor::testing::outcomes(pipeline);
  }
  for (const size_t stop : {size_t{0}, size_t{7}, size_t{40}, size_t{41}, size_t{95}}) {
    std::string saved;
    Outcomes before;
    {
      auto pipeline = make();
      pipeline.seed(5);
      (void)conveyor::testing::outcomes(pipeline);
      auto pass = pipeline.pass();
      for (size_t i = 0; i < stop; ++i) ASSERT_TRUE(take_one(pass, before));
      saved = pipeline.state().to_json();
    }
    auto pipeline = make();
    pipeline.seed(5);
    pipeline.load_state(State::from_json(saved));
    Outcomes whole = before;
    auto pass = pipeline.pass();
    while (take_one(pass, whole)) {
    }
    EXPECT_EQ(whole, second) << "stopped after " << stop;
  }
}

// A round of repeat() (for ever) that held only errors ends the pass as an
// empty round does, live or resumed: a resumed pass skips those errors as
// outputs, yet they are no items of the round (found by the property
// test, graph seed 1576199610773414557, where the resumed pass ran a second
// round the live one had not). A round with errors before its items goes
// on; take() counts items, so repeat() for ever over errors alone would
// otherwise never end. A finite repeat(k) goes through all its rounds
// (tests/nodes/repetition_test.cpp).
TEST(PipelineResume, ARepeatRoundOfOnlyErrorsEndsThePassLiveAndResumed) {
  auto failing_from = [](int64_t good_from) {
    return nodes::from_range(0, 5) | nodes::map([good_from](int64_t x) {
             if (x < good_from) throw std::runtime_error("bad " + std::to_string(x));
             return x;
           });
  };
  std::vector<std::function<Pipeline<int64_t>()>> makers = {
      [&] { return failing_from(5) | nodes::repeat(); },
      [&] { return failing_from(3) | nodes::repeat(2); },
      [&] { return failing_from(5) | nodes::repeat() | nodes::take(12); },
      [&] { return failing_from(0) | nodes::filter([](int64_t) { return false; }) | nodes::repeat(); },
  };
  const std::vector<size_t> lengths = {5, 10, 5, 0};
  for (size_t m = 0; m < makers.size(); ++m) {
    Outcomes live;
    {
      auto pipeline = makers[m]();
      auto pass = pipeline.pass();
      while (take_one(pass, live)) {
      }
    }
    ASSERT_EQ(live.size(), lengths[m]) << "pipeline " << m;
    for (size_t stop = 0; stop <= live.size(); ++stop) {
      std::string saved;
      Outcomes whole;
      {
        auto pipeline = makers[m]();
        auto pass = pipeline.pass();
        for (size_t i = 0; i < stop; ++i) ASSERT_TRUE(take_one(pass, whole));
        saved = pipeline.state().to_json();
      }
      auto pipeline = makers[m]();
      pipeline.load_state(State::from_json(saved));
      auto pass = pipeline.pass();
      while (take_one(pass, whole)) {
      }
      EXPECT_EQ(whole, live) << "pipeline " << m << ", stopped after " << stop;
    }
  }
}

// A join under repeat(): each round's decisions are the round's own; a
// state taken in round r (with repeat() running ahead into the next, behind
// a prefetch) resumes every item exactly once.
TEST(PipelineResume, ATimingDependentNodeUnderRepeatResumesInItsRound) {
  std::mt19937_64 rng = property_rng("repeat-join");
  auto make = [] {
    std::vector<Pipeline<int64_t>> sources;
    sources.push_back(nodes::from_range(0, 30) | nodes::map([](int64_t x) {
                        conveyor::testing::spin_delay(x % 4 == 0 ? 5000 : 0);
                        return x;
                      }, {.workers = 2, .in_order = false}));
    sources.push_back(nodes::from_range(100, 120) | nodes::prefetch(3));
    return nodes::join(std::move(sources)) | nodes::repeat(4) | nodes::prefetch(8);
  };
  Outcomes expected;
  for (int round = 0; round < 4; ++round) {
    for (int64_t x = 0; x < 30; ++x) expected.push_back(std::to_string(x));
    for (int64_t x = 100; x < 120; ++x) expected.push_back(std::to_string(x));
  }
  for (int trial = 0; trial < 30; ++trial) {
    const size_t stop = std::uniform_int_distribution<size_t>(0, 199)(rng);
    Outcomes before;
    std::string saved;
    {
      auto pipeline = make();
      auto pass = pipeline.pass();
      for (size_t i = 0; i < stop; ++i) ASSERT_TRUE(take_one(pass, before));
      saved = pipeline.state().to_json();
    }
    auto pipeline = make();
    pipeline.load_state(State::from_json(saved));
    Outcomes whole = before;
    auto pass = pipeline.pass();
    while (take_one(pass, whole)) {
    }
    // Round by round: each round hands out its 50 items once.
    ASSERT_EQ(whole.size(), expected.size()) << "stopped after " << stop;
    for (size_t round = 0; round < 4; ++round) {
      Outcomes mine(whole.begin() + static_cast<std::ptrdiff_t>(round * 50),
                    whole.begin() + static_cast<std::ptrdiff_t>(round * 50 + 50));
      Outcomes want(expected.begin() + static_cast<std::ptrdiff_t>(round * 50),
                    expected.begin() + static_cast<std::ptrdiff_t>(round * 50 + 50));
      ASSERT_EQ(sorted(mine), sorted(want)) << "round " << round << ", stopped after " << stop;
    }
  }
}

// A state taken between passes is the next pass's: what the finished pass
// decided by timing is not in it (a join whose sources change length by
// epoch would otherwise replay a pass that no longer fits).
TEST(PipelineResume, AStateBetweenPassesHoldsNoDecisionsOfTheLastPass) {
  auto make = [] {
    std::vector<Pipeline<int64_t>> sources;
    sources.push_back(nodes::from_range(0, 20) | nodes::map([](int64_t x) { return x; },
                                                            {.workers = 2, .in_order = false}));
    sources.push_back(nodes::from_range(100, 110));
    return nodes::join(std::move(sources));
  };
  std::string saved;
  {
    auto pipeline = make();
    (void)conveyor::testing::outcomes(pipeline);
    saved = pipeline.state().to_json();
  }
  const State state = State::from_json(saved);
  EXPECT_EQ(state.at("nodes").size(), 0u) << saved;
  auto pipeline = make();
  pipeline.load_state(state);
  EXPECT_EQ(sorted(conveyor::testing::outcomes(pipeline)).size(), 30u);
}

// A sampler's permutation comes from the state, not from this process's
// generator: from_map_dataset with a RandomSampler resumes exactly after
// the process generator was reseeded (as in a new process).
TEST(PipelineResume, AMapDatasetsRandomSamplerResumesWithTheSavedPermutation) {
  struct Squares {
    int64_t get(size_t i) const { return static_cast<int64_t>(i * i); }
    size_t size() const { return 50; }
  };
  for (const bool own_generator : {false, true}) {
    auto make = [own_generator] {
      std::shared_ptr<conveyor::Sampler<size_t>> sampler =
          own_generator ? std::make_shared<conveyor::RandomSampler>(size_t{50}, false, std::nullopt, conveyor::Generator(11))
                        : std::make_shared<conveyor::RandomSampler>(size_t{50});
      return nodes::from_map_dataset(std::make_shared<Squares>(), sampler) | nodes::batch(4);
    };
    conveyor::manual_seed(21);
    auto reference = make();
    auto reference_items = [&] {
      Outcomes out;
      auto pass = reference.pass();
      while (auto batch = pass.next()) out.push_back(std::to_string(batch->front()));
      return out;
    };
    (void)reference_items();
    const Outcomes second = reference_items();

    conveyor::manual_seed(21);
    auto first = make();
    Outcomes before;
    std::string saved;
    {
      auto pass = first.pass();
      while (pass.next()) {
      }
      auto second_pass = first.pass();
      for (int i = 0; i < 5; ++i) before.push_back(std::to_string(second_pass.next()->front()));
      saved = first.state().to_json();
    }
    conveyor::manual_seed(999);  // a new process's generator
    auto resumed = make();
    resumed.load_state(State::from_json(saved));
    Outcomes whole = before;
    auto pass = resumed.pass();
    while (auto batch = pass.next()) whole.push_back(std::to_string(batch->front()));
    EXPECT_EQ(whole, second) << (own_generator ? "own generator" : "process generator");

    // A sampler of another kind or size is named.
    auto other = nodes::from_map_dataset(std::make_shared<Squares>(), std::make_shared<conveyor::RandomSampler>(size_t{49})) |
                 nodes::batch(4);
    other.load_state(State::from_json(saved));
    try {
      (void)other.pass();
      FAIL() << "a RandomSampler of 49 resumed a state of 50";
    } catch (const StateError& error) {
      EXPECT_NE(std::string(error.what()).find("sampler"), std::string::npos) << error.what();
    }
  }
}

// in_order and on_error change what a map hands out: a state of one does
// not load into the other.
TEST(PipelineResume, AMapsOrderAndErrorPolicyAreInTheFingerprint) {
  auto in_order = nodes::from_range(0, 10) | nodes::map([](int64_t x) { return x; }, {.workers = 2});
  auto out_of_order =
      nodes::from_range(0, 10) | nodes::map([](int64_t x) { return x; }, {.workers = 2, .in_order = false});
  auto skipping = nodes::from_range(0, 10) |
                  nodes::map([](int64_t x) { return x; }, {.workers = 2, .on_error = conveyor::OnError::skip});
  auto serial = nodes::from_range(0, 10) | nodes::map([](int64_t x) { return x; });
  auto three_workers = nodes::from_range(0, 10) | nodes::map([](int64_t x) { return x; }, {.workers = 3});
  EXPECT_THROW(out_of_order.load_state(in_order.state()), StateError);
  EXPECT_THROW(skipping.load_state(in_order.state()), StateError);
  EXPECT_NO_THROW(serial.load_state(in_order.state()));         // how it runs is not
  EXPECT_NO_THROW(three_workers.load_state(in_order.state()));  // in the fingerprint
}

// A corrupt saved order is refused before it loses an item or buffers
// upstream without bound.
TEST(PipelineResume, ACorruptSavedOrderIsRefused) {
  auto make = [] {
    return nodes::from_range(0, 100) | nodes::map([](int64_t x) { return x; }, {.workers = 2, .in_order = false});
  };
  auto saver = make();
  auto pass = saver.pass();
  for (int i = 0; i < 10; ++i) ASSERT_TRUE(pass.next());
  const State state = saver.state();
  const std::string id = state.at("nodes").members().front().first;
  for (const char* inputs : {"[0,1,1]", "[0,1,4294967296]", "[0,1,2,99999999]"}) {
    State corrupt = state;
    State nodes_state = State::object();
    nodes_state.set(id, State::from_json(std::string("{\"inputs\":") + inputs + "}"));
    corrupt.set("nodes", std::move(nodes_state));
    auto loader = make();
    loader.load_state(corrupt);
    EXPECT_THROW((void)loader.pass(), StateError) << inputs;
  }
  // join's runs, too: a count past any log.
  auto make_join = [] {
    std::vector<Pipeline<int64_t>> sources;
    sources.push_back(nodes::from_range(0, 5));
    sources.push_back(nodes::from_range(5, 10));
    return nodes::join(std::move(sources));
  };
  auto join_saver = make_join();
  auto join_pass = join_saver.pass();
  ASSERT_TRUE(join_pass.next());
  State corrupt = join_saver.state();
  const std::string join_id = corrupt.at("nodes").members().front().first;
  State nodes_state = State::object();
  nodes_state.set(join_id, State::from_json("{\"sources\":[0,8589934592]}"));
  corrupt.set("nodes", std::move(nodes_state));
  auto join_loader = make_join();
  join_loader.load_state(corrupt);
  try {
    (void)join_loader.pass();
    FAIL() << "a join state taking 2^33 items loaded";
  } catch (const StateError& error) {
    EXPECT_NE(std::string(error.what()).find("8589934592"), std::string::npos) << error.what();
  }
}

// An item that counts how many of its kind are alive, and the most at once.
struct Counted {
  static inline int64_t alive = 0;
  static inline int64_t most = 0;
  int64_t value = 0;
  explicit Counted(int64_t v) : value(v) { born(); }
  Counted(const Counted& other) : value(other.value) { born(); }
  Counted& operator=(const Counted&) = default;
  ~Counted() { --alive; }
  static void born() { most = std::max(most, ++alive); }
};

// A zip of a fork's branches, resumed far into its pass, holds what the
// branches were apart when it was saved, not everything before its place:
// the first branch's skip waits for the second's, and upstream's items
// before both places are dropped as they are pulled. (Before, resuming at
// item 20,000 held 20,000 items: the first branch's skip buffered them all
// for the second.)
TEST(PipelineResume, AZipOfAForksBranchesResumedFarOnHoldsOnlyWhatTheyWereApart) {
  constexpr int64_t kItems = 30000;
  constexpr size_t kBuffer = 8;
  auto make = [] {
    auto outputs = nodes::fork(nodes::from_range(0, kItems) | nodes::map([](int64_t i) { return Counted(i); }), 2,
                               kBuffer);
    return nodes::zip(std::move(outputs[0]), std::move(outputs[1]));
  };
  std::string saved;
  {
    auto zipped = make();
    auto pass = zipped.pass();
    for (int64_t i = 0; i < 20000; ++i) ASSERT_TRUE(pass.next());
    saved = zipped.state().to_json();
  }
  ASSERT_EQ(Counted::alive, 0);
  Counted::most = 0;
  auto zipped = make();
  zipped.load_state(State::from_json(saved));
  int64_t expected = 20000;
  {
    auto pass = zipped.pass();
    EXPECT_LE(Counted::most, static_cast<int64_t>(kBuffer)) << "items alive at once while the zip resumed";
    while (auto pair = pass.next()) {
      ASSERT_EQ(pair->first.value, expected);
      ASSERT_EQ(pair->second.value, expected);
      ++expected;
    }
  }
  EXPECT_EQ(expected, kItems);
  EXPECT_LE(Counted::most, static_cast<int64_t>(kBuffer) + 4) << "items alive at once in the resumed pass";
}

// Branches saved apart (one behind a filter that dropped four items) resume
// apart: the items between their places are kept for the one behind, and
// an upstream failure among the skipped items counts in its place.
TEST(PipelineResume, AForksBranchesSavedApartResumeApartWithAFailureInTheirPrefix) {
  auto make = [] {
    auto outputs = nodes::fork(nodes::from_range(0, 200) | nodes::map([](int64_t i) {
                                 if (i == 37) throw std::runtime_error("item 37 is bad");
                                 return i;
                               }),
                               2, 16);
    // Four items fewer: this branch is four ahead of the other from item 10 on.
    auto ahead = std::move(outputs[1]) | nodes::filter([](int64_t i) { return i < 10 || i > 13; });
    return nodes::zip(std::move(outputs[0]), std::move(ahead)) |
           nodes::map([](const std::pair<int64_t, int64_t>& pair) { return pair.first * 1000 + pair.second; });
  };
  Outcomes whole;
  {
    auto pipeline = make();
    auto pass = pipeline.pass();
    while (take_one(pass, whole)) {
    }
  }
  ASSERT_GT(whole.size(), 60u);
  for (const size_t cut : {size_t{5}, size_t{18}, size_t{19}, size_t{40}, size_t{60}}) {
    EXPECT_EQ(conveyor::testing::stopped_and_resumed(make, cut), whole) << "saved after " << cut << " outputs";
  }
}

// Batched branches ask their fork to skip a whole batch's worth of items
// past the end (the last batch is short): the count the fork returns is
// what upstream holds, not what was asked, at every place the pass stops.
TEST(PipelineResume, AForksBatchedBranchesResumeAtEveryPlaceIncludingTheShortLastBatch) {
  for (const int64_t items : {int64_t{10}, int64_t{12}}) {
    auto make = [items] {
      auto outputs = nodes::fork(nodes::from_range(0, items), 2, 8);
      return nodes::zip(std::move(outputs[0]) | nodes::batch(4), std::move(outputs[1]) | nodes::batch(4)) |
             nodes::map([](const std::pair<std::vector<int64_t>, std::vector<int64_t>>& pair) {
               return static_cast<int64_t>(pair.first.size()) * 1000 + pair.second.front();
             });
    };
    Outcomes whole;
    {
      auto pipeline = make();
      auto pass = pipeline.pass();
      while (take_one(pass, whole)) {
      }
    }
    for (size_t cut = 0; cut <= whole.size(); ++cut) {
      EXPECT_EQ(conveyor::testing::stopped_and_resumed(make, cut), whole) << items << " items, stopped after " << cut;
    }
  }
}

// A fork fed by another fork's consumer: on resume the outer fork's skip
// leaves that consumer behind its saved place until an outer consumer
// takes, and the inner fork measured its buffer from there: fuller than in
// the saved pass, so its other consumer met an overflow error the saved
// pass had not, and every outcome after it moved. A state taken in that
// window saved the consumer's place as it stood, short of the saved one.
TEST(PipelineResume, AForkFedByAnotherForksConsumerResumesWithTheSavedPassesOverflowErrors) {
  auto take_or_overflow = [](auto& pass, Outcomes& out) {
    try {
      return take_one(pass, out);
    } catch (const nodes::ForkOverflowError& e) {
      out.push_back(std::string("overflow: ") + e.what());
      return true;
    }
  };
  for (const int64_t items : {int64_t{60}, int64_t{200}}) {
    auto make = [items] {
      auto inner = nodes::fork(nodes::from_range(0, items), 2, 8);
      auto outer = nodes::fork(std::move(inner[0]), 2, 11);
      std::vector<Pipeline<int64_t>> both;
      both.push_back(std::move(outer[0]));
      both.push_back(std::move(outer[1]));
      std::vector<Pipeline<int64_t>> all;
      all.push_back(nodes::weighted_mux(std::move(both), {1.0, 2.0}));
      all.push_back(std::move(inner[1]));
      auto pipeline = nodes::mux(std::move(all));
      pipeline.seed(8);
      return pipeline;
    };
    Outcomes whole;
    {
      auto pipeline = make();
      auto pass = pipeline.pass();
      while (take_or_overflow(pass, whole)) {
      }
    }
    // Stopped after `cut`, then again one and two outputs into the resumed
    // passes: states taken while a consumer is still short of the place
    // the last state gave it keep that place and the errors met there.
    for (const size_t steps : {size_t{1}, size_t{3}}) {
      for (size_t cut = 0; cut + steps <= whole.size(); ++cut) {  // every state taken mid-pass
        Outcomes got;
        std::string saved;
        for (size_t step = 0; step < steps; ++step) {
          auto pipeline = make();
          if (step > 0) pipeline.load_state(State::from_json(saved));
          auto pass = pipeline.pass();
          const size_t stop = step == 0 ? cut : got.size() + 1;
          while (got.size() < stop && take_or_overflow(pass, got)) {
          }
          saved = pipeline.state().to_json();
        }
        auto pipeline = make();
        pipeline.load_state(State::from_json(saved));
        auto pass = pipeline.pass();
        while (take_or_overflow(pass, got)) {
        }
        ASSERT_EQ(got, whole) << items << " items, stopped after " << cut << ", resumed " << steps << " times";
      }
    }
  }
}

// A state placing a fork's consumers past the end of what upstream now
// holds is refused, as a pass too short for its state is: by the pass's
// skip where a consumer pulls there (a zip: the second branch's skip), on
// the first take where none did (a mux: every consumer's skip waits on the
// other's, so the first pull comes after pass()).
TEST(PipelineResume, AForkResumedPastItsUpstreamsEndIsAStateError) {
  using Make = std::function<Pipeline<int64_t>(int64_t)>;
  const Make zipped = [](int64_t items) {
    auto outputs = nodes::fork(nodes::from_range(0, items), 2, 8);
    return nodes::zip(std::move(outputs[0]), std::move(outputs[1])) |
           nodes::map([](const std::pair<int64_t, int64_t>& pair) { return pair.first; });
  };
  const Make muxed = [](int64_t items) { return nodes::mux(nodes::fork(nodes::from_range(0, items), 2, 8)); };
  // Saved 60 items into a fork of 100 (the mux: 120 outputs, 60 each), resumed over 50.
  for (const auto& [what, make, outputs, message] : {std::tuple{"zip", zipped, 60, "ended after 50 items"},
                                                      std::tuple{"mux", muxed, 120, "upstream ended after 50"}}) {
    SCOPED_TRACE(what);
    std::string saved;
    {
      auto pipeline = make(100);
      auto pass = pipeline.pass();
      for (int i = 0; i < outputs; ++i) ASSERT_TRUE(pass.next());
      saved = pipeline.state().to_json();
    }
    auto pipeline = make(50);
    std::string error;
    try {
      pipeline.load_state(State::from_json(saved));
      auto pass = pipeline.pass();
      while (pass.next()) {
      }
    } catch (const StateError& e) {
      error = e.what();
    } catch (const conveyor::NodeError& e) {
      error = "a NodeError: " + std::string(e.what());
    }
    EXPECT_NE(error.find(message), std::string::npos) << error;
    EXPECT_EQ(error.find("NodeError"), std::string::npos) << error;
  }
}

// A shuffle resumes without starting its upstream over: the state says
// where upstream ended, if it had. Behind a fork, starting over would start
// the fork's shared pass anew, and the other branch would find it ended.
TEST(PipelineResume, AShuffledForkBranchResumesBesideTheOtherBranch) {
  for (const bool prefetched : {false, true}) {
    auto make = [prefetched] {
      auto branches = nodes::fork(nodes::from_range(0, 60), 2, 40);
      auto pairs = nodes::zip(std::move(branches[0]) | nodes::shuffle(16), std::move(branches[1])) |
                   nodes::map([](const std::pair<int64_t, int64_t>& pair) { return pair.first * 1000 + pair.second; });
      return prefetched ? std::move(pairs) | nodes::prefetch(6) : std::move(pairs);
    };
    auto uninterrupted = make();
    uninterrupted.seed(5);
    const std::vector<int64_t> reference = conveyor::testing::one_pass(uninterrupted);
    ASSERT_EQ(reference.size(), 60u);
    for (const size_t stop : {size_t{1}, size_t{20}, size_t{44}, size_t{45}, size_t{52}, size_t{59}}) {
      std::vector<int64_t> got;
      std::string saved;
      {
        auto pipeline = make();
        pipeline.seed(5);
        auto pass = pipeline.pass();
        for (size_t i = 0; i < stop; ++i) got.push_back(pass.next().value());
        saved = pipeline.state().to_json();
      }
      auto pipeline = make();
      pipeline.seed(5);
      pipeline.load_state(State::from_json(saved));
      auto pass = pipeline.pass();
      while (std::optional<int64_t> pair = pass.next()) got.push_back(*pair);
      EXPECT_EQ(got, reference) << "stopped after " << stop << (prefetched ? ", behind a prefetch" : "");
    }
  }
}

// Rounds of a repeat() that ran more than a round ahead of its consumer
// resume with nothing saved for their shuffle: the shuffle learns where its
// upstream ends by reaching it, and starts the round over if that is
// sooner than it assumed. With a buffer of SIZE_MAX (shuffle everything)
// the replay's count of positions wrapped to a small number, it never
// learned the end, and pushed positions until memory ran out (bad_alloc).
TEST(PipelineResume, AShuffleInARoundTheStateKeptNothingForResumesExactly) {
  for (const size_t buffer : {size_t{4}, std::numeric_limits<size_t>::max()}) {
    auto make = [buffer] {
      auto pipeline = nodes::from_range(0, 6) | nodes::shuffle(buffer) | nodes::repeat(8) | nodes::prefetch(16);
      pipeline.seed(3);
      return pipeline;
    };
    auto uninterrupted = make();
    const Outcomes reference = conveyor::testing::outcomes(uninterrupted);
    ASSERT_EQ(reference.size(), 48u);
    for (size_t stop = 0; stop <= reference.size(); ++stop) {
      ASSERT_EQ(conveyor::testing::stopped_and_resumed(make, stop), reference)
          << "shuffle(" << buffer << "), stopped after " << stop;
    }
  }
}

// The same with what the shuffle saved taken out of the state (as in a
// state of an older conveyor): alone it starts its upstream over where it
// must; behind a fork, whose other branch shares that pass, it cannot, and
// the pass says so instead of handing out less.
TEST(PipelineResume, AShuffleStateWithoutWhereUpstreamEndedStillResumes) {
  auto without_shuffle_entry = [](State state) {
    State kept = State::object();
    for (const auto& [id, saved] : state.at("nodes").members()) {
      if (!saved.contains("upstream_items")) kept.set(id, saved);
    }
    state.set("nodes", std::move(kept));
    return state;
  };
  auto alone = [] { return nodes::from_range(0, 30) | nodes::shuffle(8); };
  auto uninterrupted = alone();
  uninterrupted.seed(4);
  const Outcomes reference = conveyor::testing::outcomes(uninterrupted);
  for (const size_t stop : {size_t{3}, size_t{22}, size_t{23}, size_t{29}}) {
    Outcomes got;
    State saved;
    {
      auto pipeline = alone();
      pipeline.seed(4);
      auto pass = pipeline.pass();
      for (size_t i = 0; i < stop; ++i) ASSERT_TRUE(take_one(pass, got));
      saved = pipeline.state();
    }
    if (stop >= 23) {
      ASSERT_NE(saved.to_json().find("upstream_items"), std::string::npos) << "its upstream had ended";
    }
    auto pipeline = alone();
    pipeline.seed(4);
    pipeline.load_state(without_shuffle_entry(saved));
    auto pass = pipeline.pass();
    while (take_one(pass, got)) {
    }
    EXPECT_EQ(got, reference) << "stopped after " << stop;
  }

  auto forked = [] {
    auto branches = nodes::fork(nodes::from_range(0, 30), 2, 40);
    return nodes::zip(std::move(branches[0]) | nodes::shuffle(8), std::move(branches[1]));
  };
  State saved;
  {
    auto pipeline = forked();
    auto pass = pipeline.pass();
    for (int i = 0; i < 25; ++i) ASSERT_TRUE(pass.next());
    saved = pipeline.state();
  }
  auto pipeline = forked();
  pipeline.load_state(without_shuffle_entry(saved));
  auto pass = pipeline.pass();
  try {
    while (pass.next()) {
    }
    FAIL() << "a fork's branch started its pass over alone, and the pass went on";
  } catch (const StateError& error) {
    EXPECT_NE(std::string(error.what()).find("fork"), std::string::npos) << error.what();
  }
}

// A state's received count of 2^64 - 1 wrapped the shuffle's replay
// arithmetic to a small number: the replay spun for ever instead of
// refusing the state.
TEST(PipelineResume, AShuffleStateReceivingMoreThanUpstreamCouldHoldIsRefused) {
  auto small = [] { return nodes::from_range(0, 30) | nodes::shuffle(8); };
  State saved;
  {
    auto pipeline = small();
    auto pass = pipeline.pass();
    saved = pipeline.state();
  }
  saved.set("received", std::numeric_limits<uint64_t>::max());
  auto pipeline = small();
  pipeline.load_state(saved);
  EXPECT_THROW((void)pipeline.pass(), StateError);
}

TEST(PipelineResume, AShuffleStateSayingUpstreamEndedTooSoonIsRefused) {
  auto alone = [] { return nodes::from_range(0, 10) | nodes::shuffle(4); };
  State saved;
  {
    auto pipeline = alone();
    pipeline.seed(1);
    auto pass = pipeline.pass();
    for (int i = 0; i < 2; ++i) ASSERT_TRUE(pass.next());
    saved = pipeline.state();
  }
  State nodes_saved = State::object();
  bool edited = false;
  for (auto [id, entry] : saved.at("nodes").members()) {
    if (entry.contains("upstream_items")) {
      ASSERT_EQ(entry.uint_at("upstream_items"), 5u) << saved.to_json();
      entry.set("upstream_items", uint64_t{3});
      entry.set("ended", true);
      edited = true;
    }
    nodes_saved.set(id, std::move(entry));
  }
  ASSERT_TRUE(edited) << saved.to_json();
  saved.set("nodes", std::move(nodes_saved));
  auto pipeline = alone();
  pipeline.seed(1);
  pipeline.load_state(saved);
  auto pass = pipeline.pass();
  try {
    std::vector<int> got;
    while (auto item = pass.next()) got.push_back(*item);
    FAIL() << "resumed to " << ::testing::PrintToString(got);
  } catch (const StateError& error) {
    EXPECT_NE(std::string(error.what()).find("says upstream ended after 3 items, but it has more"),
              std::string::npos)
        << error.what();
  }
}

// A state whose count goes past the round repeat() was in: refused, not
// skipped round after round (for ever, with no end to the rounds), and the
// refused pass leaves the pipeline where it stood.
TEST(PipelineResume, AReceivedCountPastTheSavedRoundIsRefused) {
  auto endless = [] { return nodes::from_range(0, 10) | nodes::repeat(); };
  State saved;
  {
    auto pipeline = endless();
    auto pass = pipeline.pass();
    for (int i = 0; i < 12; ++i) ASSERT_TRUE(pass.next());  // into round 1
    saved = pipeline.state();
  }
  for (const uint64_t received : {uint64_t{25}, uint64_t{1} << 62}) {
    State edited = saved;
    edited.set("received", received);
    auto pipeline = endless();
    pipeline.load_state(edited);
    for (int attempt = 0; attempt < 2; ++attempt) {
      try {
        (void)pipeline.pass();
        FAIL() << "a pass resumed after " << received << " items";
      } catch (const StateError& error) {
        EXPECT_NE(std::string(error.what()).find("was in round 1 when the state was taken"),
                  std::string::npos)
            << error.what();
      }
      EXPECT_EQ(pipeline.state().uint_at("epoch"), 0u) << "attempt " << attempt;
    }
    pipeline.load_state(saved);
    auto pass = pipeline.pass();
    const std::optional<int> next = pass.next();
    ASSERT_TRUE(next.has_value());
    EXPECT_EQ(*next, 2);
  }
  State more_errors = saved;
  more_errors.set("errors", uint64_t{13});
  EXPECT_THROW(endless().load_state(more_errors), StateError);
}

// A map handing items out as they finish, resumed behind a filter and a
// prefetch (the filter takes the saved order again by pulling, beyond what
// the consumer had): an input whose f fails under OnError::skip as it is
// replayed is not logged as handed out, as a live pass does not log one,
// or a state taken later would count it among the outputs received, and
// the next resume would hand out an item twice.
TEST(PipelineResume, AnItemSkippedAsAnUnorderedMapReplaysIsNotCountedAsHandedOut) {
  std::atomic<int64_t> fails_once{-1};
  auto make = [&fails_once] {
    return nodes::from_range(0, 60) |
           nodes::map([&fails_once](int64_t x) {
                        int64_t failing = x;
                        if (fails_once.compare_exchange_strong(failing, -1)) throw std::runtime_error("transient");
                        conveyor::testing::spin_delay(x % 3 == 0 ? 3000 : 0);
                        return x;
                      },
                      {.workers = 2, .window = 4, .in_order = false, .on_error = conveyor::OnError::skip}) |
           nodes::filter([](int64_t x) { return x % 2 == 0; }) | nodes::prefetch(4);
  };
  auto logged_inputs = [](const State& state) {
    for (const auto& [id, saved] : state.at("nodes").members()) {
      if (saved.contains("inputs")) return saved.at("inputs").as_uint_list("inputs");
    }
    return std::vector<uint64_t>{};
  };
  for (int trial = 0; trial < 10; ++trial) {
    SCOPED_TRACE("trial " + std::to_string(trial));
    std::vector<int64_t> got;
    State first;
    int64_t failing = -1;
    {
      auto pipeline = make();
      auto pass = pipeline.pass();
      for (int k = 0; k < 4; ++k) got.push_back(pass.next().value());
      // An even input the map handed out and the consumer has not received
      // (the prefetch holds it): the resumed pass replays it.
      while (failing < 0) {
        first = pipeline.state();
        for (const uint64_t input : logged_inputs(first)) {
          const auto x = static_cast<int64_t>(input);
          if (x % 2 == 0 && std::find(got.begin(), got.end(), x) == got.end()) failing = x;
        }
        std::this_thread::yield();  // until the prefetch has run ahead
      }
    }
    fails_once = failing;
    State second;
    {
      auto pipeline = make();
      pipeline.load_state(first);
      auto pass = pipeline.pass();
      for (int k = 0; k < 6; ++k) got.push_back(pass.next().value());
      ASSERT_EQ(fails_once.load(), -1) << "input " << failing << " was not replayed";
      second = pipeline.state();
    }
    auto pipeline = make();
    pipeline.load_state(second);
    for (const int64_t x : pipeline.pass()) got.push_back(x);
    std::sort(got.begin(), got.end());
    // Each even item once: a skipped input is not among those handed out,
    // so the last resume makes it again (as take() leaves a skipped one).
    std::vector<int64_t> expected;
    for (int64_t x = 0; x < 60; x += 2) expected.push_back(x);
    ASSERT_EQ(got, expected) << "input " << failing << " failed once as it was replayed";
  }
}

// An async_map out of order, resumed behind a batch (which takes the saved
// order again by pulling): its try_next() waits for no completion while it
// replays, since the consumer polling it may be what delivers them (an
// event loop on one thread).
TEST(PipelineResume, AnAsyncMapReplayingItsSavedOrderIsPolledWithoutWaiting) {
  std::mutex loop_mutex;
  std::deque<std::function<void()>> loop;  // completions, delivered by whoever runs the loop
  auto make = [&] {
    return nodes::from_range(0, 20) |
           nodes::async_map<int64_t>(
               [&](int64_t x, nodes::Completion<int64_t> done) {
                 auto completion = std::make_shared<nodes::Completion<int64_t>>(std::move(done));
                 const std::lock_guard lock(loop_mutex);
                 auto deliver = [completion, x] { (*completion)(x); };
                 if (x % 2 == 1) {
                   loop.push_front(deliver);  // odd inputs finish first: out of input order
                 } else {
                   loop.push_back(deliver);
                 }
               },
               {.max_in_flight = 4, .in_order = false}) |
           nodes::batch(2);
  };
  auto run_one = [&] {
    std::function<void()> deliver;
    {
      const std::lock_guard lock(loop_mutex);
      if (loop.empty()) return;
      deliver = std::move(loop.front());
      loop.pop_front();
    }
    deliver();
  };
  std::vector<int64_t> got;
  State saved;
  {
    auto pipeline = make();
    auto pass = pipeline.pass();
    std::optional<std::vector<int64_t>> batch;
    while (pass.try_next(batch) != conveyor::Poll::ready) run_one();
    got.insert(got.end(), batch->begin(), batch->end());
    for (int k = 0; k < 3; ++k) {  // the map hands out an item the batch holds, unfinished
      batch.reset();
      if (pass.try_next(batch) == conveyor::Poll::ready) got.insert(got.end(), batch->begin(), batch->end());
      run_one();
    }
    batch.reset();
    if (pass.try_next(batch) == conveyor::Poll::ready) got.insert(got.end(), batch->begin(), batch->end());
    saved = pipeline.state();
    const std::lock_guard lock(loop_mutex);
    loop.clear();  // the old pass's completions: dropped, as the pass is
  }
  auto pipeline = make();
  pipeline.load_state(saved);
  auto pass = pipeline.pass();
  auto first_poll = std::async(std::launch::async, [&pass] {
    std::optional<std::vector<int64_t>> batch;
    return std::make_pair(pass.try_next(batch), batch);
  });
  if (first_poll.wait_for(std::chrono::seconds(20)) != std::future_status::ready) {
    ADD_FAILURE() << "try_next() waited for a completion only its own thread delivers";
    while (first_poll.wait_for(std::chrono::milliseconds(1)) != std::future_status::ready) run_one();  // free it
  }
  auto [poll, batch] = first_poll.get();
  while (true) {
    if (poll == conveyor::Poll::end) break;
    if (poll == conveyor::Poll::ready) got.insert(got.end(), batch->begin(), batch->end());
    run_one();
    batch.reset();
    poll = pass.try_next(batch);
  }
  std::sort(got.begin(), got.end());
  std::vector<int64_t> all(20);
  std::iota(all.begin(), all.end(), 0);
  EXPECT_EQ(got, all);
}

}  // namespace
