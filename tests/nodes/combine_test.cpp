// The pipeline's combine nodes: defects found by audit, each pinned by a test.
#include <gtest/gtest.h>

#include <conveyor/conveyor.h>
#include <conveyor/nodes.h>

#include <atomic>
#include <cfloat>
#include <chrono>
#include <cmath>
#include <future>
#include <limits>
#include <memory>
#include <numeric>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "support/datasets.h"
#include "support/pipelines.h"
#include "support/sync.h"

namespace {

namespace nodes = conveyor::nodes;
using conveyor::Pipeline;
using conveyor::State;

// 0 .. n - 1, whose reset number `fail_at` (1 for the first) throws, as a
// file lister does while its directory is away.
class FailsOneReset final : public nodes::MeteredNode<int64_t> {
 public:
  FailsOneReset(int64_t n, int fail_at, std::shared_ptr<int> resets)
      : n_(n), fail_at_(fail_at), resets_(std::move(resets)) {}
  using Node<int64_t>::reset;
  void reset(const conveyor::PassContext& pass, conveyor::detail::ResetWalk& walk) override {
    if (++*resets_ == fail_at_) throw std::runtime_error("cannot open: not there yet");
    next_ = 0;
    start_metering(pass, walk.next_id++);
  }
  std::string name() const override { return "fails_one_reset"; }

 private:
  std::optional<int64_t> produce() override {
    if (next_ == n_) return std::nullopt;
    return next_++;
  }
  int64_t n_;
  int64_t next_ = 0;
  int fail_at_;
  std::shared_ptr<int> resets_;
};

// Every item of a fresh pass as text ("0 1 2 "), "" for none.
std::string drain(Pipeline<int64_t>& pipeline) {
  std::string got;
  auto pass = pipeline.pass();
  while (std::optional<int64_t> x = pass.next()) got += std::to_string(*x) + " ";
  return got;
}

// A pass() that throws leaves the fork's upstream reset by the next pass(),
// whichever consumer's it is: not found "already reset" (the retry read
// nothing, or the last pass's leftovers).
TEST(Combine, AForkWhoseUpstreamResetFailedResetsItAgainOnTheRetry) {
  {
    auto resets = std::make_shared<int>(0);
    auto outputs = nodes::fork(Pipeline<int64_t>(std::make_unique<FailsOneReset>(5, 2, resets)), 1, 8);
    EXPECT_EQ(drain(outputs[0]), "0 1 2 3 4 ");
    EXPECT_THROW((void)outputs[0].pass(), std::runtime_error);
    EXPECT_EQ(drain(outputs[0]), "0 1 2 3 4 ") << "the retried pass";
    EXPECT_EQ(drain(outputs[0]), "0 1 2 3 4 ");
    EXPECT_EQ(*resets, 4);
  }
  {
    auto resets = std::make_shared<int>(0);
    auto outputs = nodes::fork(Pipeline<int64_t>(std::make_unique<FailsOneReset>(5, 2, resets)), 2, 8);
    {
      auto a = outputs[0].pass();
      auto b = outputs[1].pass();
      for (int64_t k = 0; k < 5; ++k) {
        EXPECT_EQ(a.next(), k);
        EXPECT_EQ(b.next(), k);
      }
      EXPECT_EQ(a.next(), std::nullopt);
      EXPECT_EQ(b.next(), std::nullopt);
    }
    EXPECT_THROW((void)outputs[0].pass(), std::runtime_error);  // consumer 0's reset fails
    auto b = outputs[1].pass();                                 // consumer 1 resets upstream itself
    auto a = outputs[0].pass();                                 // and consumer 0 joins that pass
    EXPECT_EQ(*resets, 3);
    for (int64_t k = 0; k < 5; ++k) {
      EXPECT_EQ(b.next(), k);
      EXPECT_EQ(a.next(), k);
    }
    EXPECT_EQ(b.next(), std::nullopt);
    EXPECT_EQ(a.next(), std::nullopt);
  }
}

// A consumer mid-pass when another starts the next pass has lost the rest
// of its own: it is told, not handed an end that looks like the pass's.
// One that had taken every item gets the end.
TEST(Combine, AForkConsumerCutOffByAnotherConsumersNewPassIsToldSo) {
  auto outputs = nodes::fork(nodes::from_range(0, 6), 2, 8);
  {
    auto a = outputs[0].pass();
    {
      auto b = outputs[1].pass();
      for (int64_t k = 0; k < 2; ++k) {
        EXPECT_EQ(a.next(), k);
        EXPECT_EQ(b.next(), k);
      }
    }
    auto b = outputs[1].pass();  // consumer 1 starts over, consumer 0 two items in
    EXPECT_EQ(b.next(), 0);
    try {
      const std::optional<int64_t> x = a.next();
      ADD_FAILURE() << "consumer 0 went on: " << (x ? std::to_string(*x) : "the end");
    } catch (const conveyor::StateError& e) {
      EXPECT_STREQ(e.what(),
                   "fork: consumer 1 started a new pass while consumer 0 was 2 items into the last one; start every "
                   "consumer's pass together");
    }
    EXPECT_THROW((void)a.next(), conveyor::StateError);  // and again: its pass is over
  }
  // Reset into the pass, it takes it from the start with the other.
  {
    auto a = outputs[0].pass();
    for (int64_t k = 0; k < 6; ++k) EXPECT_EQ(a.next(), k);
    EXPECT_EQ(a.next(), std::nullopt);
  }
  // Both at the end: the next pass cuts nothing off.
  {
    auto a = outputs[0].pass();
    auto b = outputs[1].pass();
    for (int64_t k = 0; k < 6; ++k) {
      EXPECT_EQ(a.next(), k);
      EXPECT_EQ(b.next(), k);
    }
    EXPECT_EQ(a.next(), std::nullopt);
    auto b2 = outputs[1].pass();
    EXPECT_EQ(b2.next(), 0);
    EXPECT_EQ(a.next(), std::nullopt);
  }
}

// The overflow error takes no item's place: the consumer's next item comes
// after it, and a state taken after it resumes with the item after the
// last one handed out (the error counted as the output it was).
TEST(Combine, AForkConsumerResumesExactlyAfterABufferOverflowError) {
  // `retried`: the state is taken once consumer 0 has its item 3 after the
  // error; else right after the error.
  for (const bool retried : {true, false}) {
    SCOPED_TRACE(retried ? "after the retry" : "right after the error");
    std::string saved_a, saved_b;
    {
      auto outputs = nodes::fork(nodes::from_range(0, 10), 2, /*buffer=*/3);
      auto a = outputs[0].pass();
      auto b = outputs[1].pass();
      for (int64_t k = 0; k < 3; ++k) EXPECT_EQ(a.next(), k);
      try {
        (void)a.next();
        ADD_FAILURE() << "consumer 0 went 4 items ahead of a buffer of 3";
      } catch (const nodes::ForkOverflowError& e) {
        EXPECT_STREQ(e.what(),
                     "fork: consumer 0 is 3 items ahead of the slowest, the buffer's limit; take from the others or "
                     "raise it (its next item, 3, is still to come: this error takes no item's place)");
      }
      for (int64_t k = 0; k < 3; ++k) EXPECT_EQ(b.next(), k);
      if (retried) {
        EXPECT_EQ(a.next(), 3);
      }
      saved_a = outputs[0].state().to_json();
      saved_b = outputs[1].state().to_json();
    }
    auto outputs = nodes::fork(nodes::from_range(0, 10), 2, 3);
    outputs[0].load_state(State::from_json(saved_a));
    outputs[1].load_state(State::from_json(saved_b));
    auto a = outputs[0].pass();
    auto b = outputs[1].pass();
    std::string rest_a, rest_b;
    while (true) {  // in step
      const std::optional<int64_t> x = a.next(), y = b.next();
      if (x) rest_a += std::to_string(*x) + " ";
      if (y) rest_b += std::to_string(*y) + " ";
      if (!x && !y) break;
    }
    EXPECT_EQ(rest_a, retried ? "4 5 6 7 8 9 " : "3 4 5 6 7 8 9 ");
    EXPECT_EQ(rest_b, "3 4 5 6 7 8 9 ");
  }
}

// An upstream error is met by every consumer in its place, each with an
// exception object of its own: consumers run on different threads, and one
// shared object would be freed by whichever let go last (see
// ForkState::rethrow_own_copy). Its nested original is still the one.
TEST(Combine, EveryForkConsumerIsThrownAnUpstreamErrorOfItsOwn) {
  auto failing = nodes::from_range(0, 6) | nodes::map([](int64_t x) {
                   if (x == 3) throw std::runtime_error("item three is bad");
                   return x;
                 });
  auto outputs = nodes::fork(std::move(failing), 2, 8);
  auto a = outputs[0].pass();
  auto b = outputs[1].pass();
  std::exception_ptr met[2];
  std::string items[2];
  for (int consumer = 0; consumer < 2; ++consumer) {
    auto& pass = consumer == 0 ? a : b;
    for (int guard = 0; guard < 10; ++guard) {
      try {
        const std::optional<int64_t> x = pass.next();
        if (!x) break;
        items[consumer] += std::to_string(*x) + " ";
      } catch (const conveyor::NodeError& e) {
        EXPECT_EQ(e.position(), 3u);
        EXPECT_NE(std::string(e.what()).find("item three is bad"), std::string::npos) << e.what();
        met[consumer] = std::current_exception();
      }
    }
  }
  EXPECT_EQ(items[0], "0 1 2 4 5 ");
  EXPECT_EQ(items[1], "0 1 2 4 5 ");
  ASSERT_TRUE(met[0] && met[1]);
  EXPECT_NE(met[0], met[1]) << "both consumers were thrown the same exception object";
  const auto node_error = [](const std::exception_ptr& p) -> const conveyor::NodeError* {
    try {
      std::rethrow_exception(p);
    } catch (const conveyor::NodeError& e) {
      return &e;
    } catch (...) {
    }
    return nullptr;
  };
  const conveyor::NodeError* first = node_error(met[0]);
  const conveyor::NodeError* second = node_error(met[1]);
  ASSERT_TRUE(first && second);
  EXPECT_STREQ(first->what(), second->what());
  EXPECT_EQ(first->node(), second->node());
  EXPECT_EQ(first->original(), second->original());
}

// One branch behind a prefetch(8), a fork buffer of 2 (below the 8 + 2 the
// sizing rule asks): the strand runs ahead of the other branch and meets
// overflow errors. zip hands them out, and every pair is still a's item k
// with b's item k, none lost; a state taken among them resumes with the
// next pair.
TEST(Combine, AnUndersizedForkBufferBehindAPrefetchNeverMisalignsAZip) {
  constexpr int64_t kItems = 50;
  const auto make = [] {
    auto a_seen = std::make_shared<conveyor::testing::Counter>();
    auto outputs = nodes::fork(nodes::from_range(0, kItems), 2, /*buffer=*/2);
    outputs[0] = std::move(outputs[0]) | nodes::map([a_seen](int64_t x) {
                   a_seen->bump();
                   return x;
                 }) |
                 nodes::prefetch(8);
    outputs[1] = std::move(outputs[1]) | nodes::map([a_seen](int64_t x) {
                   // Slower than a's strand; item 0 waits until the strand
                   // is past a's item 1, and on for its queued pulls.
                   if (x == 0) a_seen->wait_for(2);
                   const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(x == 0 ? 100 : 1);
                   while (std::chrono::steady_clock::now() < until) {
                   }
                   return x;
                 });
    return nodes::zip(std::move(outputs[0]), std::move(outputs[1]));
  };
  struct Outcome {
    std::vector<int64_t> pairs;  // first of each, where first == second
    int misaligned = 0;
    int errors = 0;
  };
  // Until the end, or the first error once `stop_after_pairs` pairs came.
  const auto run = [](auto& pass, Outcome& got, size_t stop_after_pairs) {
    for (int guard = 0; guard < 1000000; ++guard) {
      try {
        const std::optional<std::pair<int64_t, int64_t>> pair = pass.next();
        if (!pair) return true;
        if (pair->first == pair->second) {
          got.pairs.push_back(pair->first);
        } else if (got.misaligned++ < 3) {
          ADD_FAILURE() << "pair (" << pair->first << ", " << pair->second << ")";
        }
      } catch (const nodes::ForkOverflowError& e) {
        EXPECT_TRUE(std::string(e.what()).starts_with("fork: consumer 0 is ")) << e.what();
        ++got.errors;
        if (got.pairs.size() >= stop_after_pairs) return false;
      }
    }
    ADD_FAILURE() << "no end after a million outputs";
    return true;
  };

  auto zipped = make();
  Outcome whole;
  {
    auto pass = zipped.pass();
    EXPECT_TRUE(run(pass, whole, std::numeric_limits<size_t>::max()));
  }
  EXPECT_GT(whole.errors, 0) << "the strand never ran ahead of the buffer: the test tests nothing";
  EXPECT_EQ(whole.misaligned, 0);
  std::vector<int64_t> every(kItems);
  std::iota(every.begin(), every.end(), int64_t{0});
  EXPECT_EQ(whole.pairs, every);

  // A state taken at an overflow error, some pairs in.
  std::string saved;
  Outcome before;
  {
    auto pass = zipped.pass();
    if (run(pass, before, 5)) {
      ADD_FAILURE() << "no overflow error after 5 pairs";
      return;
    }
    saved = zipped.state().to_json();
  }
  auto resumed = make();
  resumed.load_state(State::from_json(saved));
  Outcome after;
  {
    auto pass = resumed.pass();
    EXPECT_TRUE(run(pass, after, std::numeric_limits<size_t>::max()));
  }
  EXPECT_EQ(after.misaligned, 0);
  std::vector<int64_t> rest(every.begin() + static_cast<std::ptrdiff_t>(before.pairs.size()), every.end());
  EXPECT_EQ(after.pairs, rest) << before.pairs.size() << " pairs before the state";
}

// Finite weights whose sum is not: the picks are as for any equal weights,
// not every one the last source's.
TEST(Combine, WeightedMuxWeightsNearDblMaxStillMix) {
  const auto from_first = [](std::vector<double> weights) {
    std::vector<Pipeline<int64_t>> sources;
    for (size_t i = 0; i < weights.size(); ++i) {
      sources.push_back(nodes::from_range(static_cast<int64_t>(i) * 100000, static_cast<int64_t>(i) * 100000 + 1000));
    }
    auto p = nodes::weighted_mux(std::move(sources), std::move(weights)) | nodes::take(1000);
    p.seed(4);
    int count = 0;
    for (const int64_t x : p.pass()) count += x < 100000;
    return count;
  };
  const int ones = from_first({1.0, 1.0});
  EXPECT_EQ(ones, 511);  // seed 4's draws
  EXPECT_EQ(from_first({DBL_MAX, DBL_MAX}), ones);
  EXPECT_EQ(from_first({1e308, 1e308}), ones);
  EXPECT_EQ(from_first({1.5, 1.5}), ones);
  const int third = from_first({DBL_MAX, DBL_MAX, DBL_MAX});
  EXPECT_EQ(third, 340);
  EXPECT_EQ(from_first({1.0, 1.0, 1.0}), third);
}

TEST(Combine, WeightedMuxNamesTheBadWeightAndItsIndex) {
  const auto refusal = [](std::vector<double> weights) -> std::string {
    std::vector<Pipeline<int64_t>> sources;
    for (size_t i = 0; i < weights.size(); ++i) sources.push_back(nodes::from_range(0, 1));
    try {
      (void)nodes::weighted_mux(std::move(sources), std::move(weights));
    } catch (const conveyor::ValueError& e) {
      return e.what();
    }
    return "accepted";
  };
  EXPECT_EQ(refusal({0.5, 0.25, -1e-9}), "weighted_mux: weight 2 should be positive and finite, but got -1e-09");
  EXPECT_EQ(refusal({0.0, 1.0}), "weighted_mux: weight 0 should be positive and finite, but got 0");
  EXPECT_EQ(refusal({1.0, std::nan("")}), "weighted_mux: weight 1 should be positive and finite, but got nan");
  EXPECT_EQ(refusal({1.0, HUGE_VAL}), "weighted_mux: weight 1 should be positive and finite, but got inf");
  EXPECT_EQ(refusal({1.0, 0.1}), "accepted");
  // No sources: the error names the node.
  EXPECT_EQ(refusal({}), "weighted_mux: needs at least one pipeline to merge, but got none");
  try {
    (void)nodes::mux(std::vector<Pipeline<int64_t>>{});
    ADD_FAILURE() << "mux of none accepted";
  } catch (const conveyor::ValueError& e) {
    EXPECT_STREQ(e.what(), "mux: needs at least one pipeline to merge, but got none");
  }
  try {
    (void)nodes::join(std::vector<Pipeline<int64_t>>{});
    ADD_FAILURE() << "join of none accepted";
  } catch (const conveyor::ValueError& e) {
    EXPECT_STREQ(e.what(), "join: needs at least one pipeline to merge, but got none");
  }
}

// A fork's upstream is numbered from the graph of the consumer that starts
// the pass. A state taken with one consumer starting first and resumed with
// another first would hand upstream's saved decisions and seeds to other
// nodes: before, 3 of 12 items came out twice and 3 were lost. It is refused,
// naming both, and the pass started in the saved order resumes exactly.
TEST(Combine, AForkStateIsRefusedWhereAnotherConsumerStartsThePassNamingIt) {
  struct Graph {
    Pipeline<int64_t> zipped;
    Pipeline<int64_t> bare;
  };
  const auto make = [] {
    auto outputs = nodes::fork(nodes::from_range(0, 12) | nodes::shuffle(12), 2, 64);
    auto zipped = nodes::zip(nodes::from_range(100, 200), std::move(outputs[0])) |
                  nodes::map([](std::pair<int64_t, int64_t> pair) { return pair.second; });
    Graph graph{std::move(zipped), std::move(outputs[1])};
    graph.zipped.seed(5);
    graph.bare.seed(5);
    return graph;
  };
  std::string uninterrupted, resumed;
  State zipped_state, bare_state;
  {
    Graph graph = make();
    auto zipped = graph.zipped.pass();
    auto bare = graph.bare.pass();
    for (int i = 0; i < 4; ++i) {
      uninterrupted += std::to_string(*zipped.next()) + " ";
      (void)bare.next();
    }
    resumed = uninterrupted;
    zipped_state = graph.zipped.state();
    bare_state = graph.bare.state();
    while (std::optional<int64_t> x = zipped.next()) uninterrupted += std::to_string(*x) + " ";
  }
  Graph graph = make();
  graph.zipped.load_state(zipped_state);
  graph.bare.load_state(bare_state);
  try {
    (void)graph.bare.pass();
    ADD_FAILURE() << "the bare consumer started the resumed pass, numbering upstream from elsewhere";
  } catch (const conveyor::StateError& e) {
    EXPECT_STREQ(e.what(),
                 "load_state: fork[1]'s state was taken when consumer 0 started the pass, its upstream numbered from "
                 "node 1, but consumer 1 started this one, numbering it from node 0: upstream's seeds and saved "
                 "decisions would go to other nodes; start consumer 0's pass first, as when the state was taken");
  }
  // Refused, it left the state loaded: started in the saved order, the pass
  // resumes exactly.
  auto zipped = graph.zipped.pass();
  auto bare = graph.bare.pass();
  while (std::optional<int64_t> x = zipped.next()) {
    resumed += std::to_string(*x) + " ";
    EXPECT_EQ(bare.next(), x);
  }
  EXPECT_EQ(resumed, uninterrupted);
}

// A consumer joining a pass another one started, with a state whose
// upstream was numbered elsewhere, is refused; the pass stays the other
// consumer's, whole (marked unreset, it would have ended for it there).
TEST(Combine, AForkConsumerRefusedOnJoiningLeavesTheOthersPassWhole) {
  const auto make = [] {
    auto outputs = nodes::fork(nodes::from_range(0, 12) | nodes::shuffle(12), 2, 64);
    auto zipped = nodes::zip(nodes::from_range(100, 200), std::move(outputs[0])) |
                  nodes::map([](std::pair<int64_t, int64_t> pair) { return pair.second; });
    return std::make_pair(std::move(zipped), std::move(outputs[1]));
  };
  State bare_state;
  {
    auto [zipped, bare] = make();
    auto bare_pass = bare.pass();  // the bare consumer first: upstream numbered from node 0
    auto zipped_pass = zipped.pass();
    for (int i = 0; i < 4; ++i) {
      (void)bare_pass.next();
      (void)zipped_pass.next();
    }
    bare_state = bare.state();
  }
  auto [zipped, bare] = make();
  auto zipped_pass = zipped.pass();  // a fresh pass, upstream numbered from node 1
  bare.load_state(bare_state);
  EXPECT_THROW((void)bare.pass(), conveyor::StateError);
  int64_t items = 0;
  while (zipped_pass.next()) ++items;
  EXPECT_EQ(items, 12);
}

// A consumer joining a pass takes what upstream draws under the starting
// consumer's seed and epoch. Before, fork[1] with seed 8 silently took the
// items shuffled with fork[0]'s seed 7; now its pass() is refused, naming
// both, and fork[0]'s pass goes on whole. With the same seed it joins.
TEST(Combine, AForkConsumerWithAnotherSeedOrEpochIsRefusedOnJoining) {
  const auto expect_refused = [](uint64_t seed, uint64_t epoch, const std::string& message) {
    auto outputs = nodes::fork(nodes::from_range(0, 12) | nodes::shuffle(12), 2, 64);
    Pipeline<int64_t> first = std::move(outputs[0]);
    Pipeline<int64_t> second = std::move(outputs[1]);
    first.seed(7);
    second.seed(seed);
    second.set_epoch(epoch);
    auto first_pass = first.pass();
    try {
      (void)second.pass();
      ADD_FAILURE() << "fork[1] joined with seed " << seed << ", epoch " << epoch;
    } catch (const conveyor::ValueError& e) {
      EXPECT_EQ(std::string(e.what()), message);
    }
    int64_t items = 0;
    while (first_pass.next()) ++items;
    EXPECT_EQ(items, 12);
  };
  expect_refused(8, 0,
                 "fork[1]: its pass has seed 8, epoch 0, shard 0/1 worker 0/1, but fork[0] started the fork's pass "
                 "with seed 7, epoch 0, shard 0/1 worker 0/1: a fork's consumers share one pass of upstream; give "
                 "every consumer's pipeline the same seed(), set_epoch() and shard()");
  expect_refused(7, 3,
                 "fork[1]: its pass has seed 7, epoch 3, shard 0/1 worker 0/1, but fork[0] started the fork's pass "
                 "with seed 7, epoch 0, shard 0/1 worker 0/1: a fork's consumers share one pass of upstream; give "
                 "every consumer's pipeline the same seed(), set_epoch() and shard()");

  auto outputs = nodes::fork(nodes::from_range(0, 12) | nodes::shuffle(12), 2, 64);
  outputs[0].seed(7);
  outputs[1].seed(7);
  auto first_pass = outputs[0].pass();
  auto second_pass = outputs[1].pass();
  for (int i = 0; i < 12; ++i) EXPECT_EQ(*first_pass.next(), *second_pass.next());
}

// A consumer whose pipeline is destroyed mid-pass no longer holds the
// others back. Before, it stayed "the slowest" and, once the buffer was
// full, every call of the other consumer was an overflow error for ever.
// A consumer's try_next() never waits on another thread: while the other
// consumer's pull is inside a slow upstream item (under the fork's lock),
// it answers "not yet" at once, and takes its item once the pull is done
// (it waited for the whole pull).
TEST(Combine, AForkConsumersTryNextDoesNotWaitForAnotherConsumersPull) {
  conveyor::testing::Gates gates(1);
  conveyor::testing::Counter entered;
  auto outputs = nodes::fork(nodes::from_range(0, 10) | nodes::map([&](int64_t x) {
                               if (x == 2) {
                                 entered.bump();
                                 gates.wait(0);
                               }
                               return x;
                             }),
                             2, 8);
  auto first = outputs[0].pass();
  auto second = outputs[1].pass();
  ASSERT_EQ(first.next(), 0);
  ASSERT_EQ(first.next(), 1);
  ASSERT_EQ(second.next(), 0);
  std::thread puller([&] { EXPECT_EQ(first.next(), 2); });
  entered.wait_for(1);  // the puller is inside item 2, holding the fork
  auto poll = std::async(std::launch::async, [&] {
    std::optional<int64_t> item;
    return std::pair(second.try_next(item), item);
  });
  const bool answered = poll.wait_for(std::chrono::seconds(20)) == std::future_status::ready;
  gates.open(0);
  puller.join();
  ASSERT_TRUE(answered) << "try_next waited for the other consumer's upstream pull";
  EXPECT_EQ(poll.get().first, conveyor::Poll::pending);
  std::optional<int64_t> item;
  EXPECT_EQ(second.try_next(item), conveyor::Poll::ready);
  EXPECT_EQ(item, 1);
}

TEST(Combine, AForkConsumerDestroyedMidPassLeavesTheOthersFree) {
  auto outputs = nodes::fork(nodes::from_range(0, 20), 2, 4);
  Pipeline<int64_t> kept = std::move(outputs[0]);
  std::string got;
  {
    Pipeline<int64_t> gone = std::move(outputs[1]);
    auto kept_pass = kept.pass();
    auto gone_pass = gone.pass();
    (void)gone_pass.next();
    for (int i = 0; i < 3; ++i) got += std::to_string(*kept_pass.next()) + " ";
    EXPECT_EQ(got, "0 1 2 ");
    // Gone mid-pass, with the kept consumer 3 items in: the same pass goes on.
  }
  EXPECT_EQ(drain(kept), std::string("0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 "));
}

TEST(Combine, AForkConsumerDestroyedLeavesTheRestOfThePassToTheOthers) {
  auto outputs = nodes::fork(nodes::from_range(0, 12), 2, 2);
  Pipeline<int64_t> kept = std::move(outputs[0]);
  auto kept_pass = kept.pass();
  std::string got;
  {
    Pipeline<int64_t> gone = std::move(outputs[1]);
    auto gone_pass = gone.pass();
    (void)gone_pass.next();
    got += std::to_string(*kept_pass.next()) + " ";
  }
  while (std::optional<int64_t> x = kept_pass.next()) got += std::to_string(*x) + " ";
  EXPECT_EQ(got, "0 1 2 3 4 5 6 7 8 9 10 11 ");
}

// join's rotation over sources that are always ready is fixed, and a resumed
// pass goes on with it where the saved one was: after the source of its
// last output. Before, it started again at source 0.
TEST(Combine, AResumedJoinGoesOnWithTheRotationWhereItWas) {
  const auto make = [] {
    std::vector<Pipeline<int64_t>> sources;
    sources.push_back(nodes::from_range(0, 5));
    sources.push_back(nodes::from_range(100, 108));
    sources.push_back(nodes::from_range(200, 203));
    return nodes::join(std::move(sources));
  };
  auto whole = make();
  const std::string uninterrupted = drain(whole);
  for (int k = 0; k <= 16; ++k) {
    SCOPED_TRACE("state after " + std::to_string(k) + " items");
    auto saved = make();
    std::string got;
    State state;
    {
      auto pass = saved.pass();
      for (int i = 0; i < k; ++i) {
        std::optional<int64_t> x = pass.next();
        ASSERT_TRUE(x);
        got += std::to_string(*x) + " ";
      }
      state = saved.state();
    }
    auto resumed = make();
    resumed.load_state(state);
    got += drain(resumed);
    EXPECT_EQ(got, uninterrupted);
  }
}

}  // namespace
