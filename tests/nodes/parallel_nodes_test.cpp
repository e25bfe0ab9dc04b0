// The nodes that run on threads (map with workers, prefetch): the same items
// as the serial run, in order or not, with errors in place, passes left
// early, and a seeded property test over random pipelines with random delays
// and failures.
#include <gtest/gtest.h>
#include <oneapi/tbb/task_arena.h>

#include <conveyor/conveyor.h>
#include <conveyor/nodes.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <set>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "support/pipelines.h"
#include "support/random_pipeline.h"
#include "support/sync.h"

namespace {

namespace nodes = conveyor::nodes;
using conveyor::Pipeline;

using conveyor::testing::one_pass;

TEST(ParallelMap, YieldsWhatTheSerialMapYieldsForAnyWorkerCount) {
  // f draws from default_generator(): the item's own, so the values match too.
  auto f = [](int64_t x) { return x * 1000 + static_cast<int64_t>(conveyor::uniform(conveyor::default_generator()) * 1000); };
  auto serial = nodes::from_range(0, 500) | nodes::map(f);
  serial.seed(3);
  const std::vector<int64_t> expected = one_pass(serial);
  for (int workers : {1, 2, 3, 8}) {
    for (int window : {0, 1, 5}) {
      auto parallel = nodes::from_range(0, 500) | nodes::map(f, {.workers = workers, .window = window});
      parallel.seed(3);
      EXPECT_EQ(one_pass(parallel), expected) << workers << " workers, window " << window;
    }
    auto unordered = nodes::from_range(0, 500) | nodes::map(f, {.workers = workers, .in_order = false});
    unordered.seed(3);
    std::vector<int64_t> got = one_pass(unordered), sorted = expected;
    std::sort(got.begin(), got.end());
    std::sort(sorted.begin(), sorted.end());
    EXPECT_EQ(got, sorted) << workers << " workers, out of order";
  }
}

TEST(ParallelMap, ErrorsKeepTheirPlaceAndSkippedItemsAreCounted) {
  auto f = [](int64_t x) {
    if (x % 7 == 3) throw std::runtime_error("no " + std::to_string(x));
    return x;
  };
  auto pipeline = nodes::from_range(0, 20) | nodes::map(f, {.workers = 3});
  auto pass = pipeline.pass();
  std::vector<std::string> events;
  while (true) {
    try {
      auto item = pass.next();
      if (!item) break;
      events.push_back(std::to_string(*item));
    } catch (const conveyor::NodeError& e) {
      EXPECT_EQ(e.node(), "map(workers=3)");
      events.push_back("error@" + std::to_string(e.position()));
    }
  }
  std::vector<std::string> expected;
  for (int64_t x = 0; x < 20; ++x) expected.push_back(x % 7 == 3 ? "error@" + std::to_string(x) : std::to_string(x));
  EXPECT_EQ(events, expected);
  auto skipping = nodes::from_range(0, 20) | nodes::map(f, {.workers = 2, .on_error = conveyor::OnError::skip});
  EXPECT_EQ(one_pass(skipping).size(), 17u);
}

// An error from upstream when nothing is in flight (here the first item):
// thrown in its place, and the pass goes on. It once ended the pass there,
// silently (found by the property test below).
TEST(ParallelMap, AnUpstreamErrorWithAnEmptyWindowKeepsItsPlaceAndThePassGoesOn) {
  auto fail_first = [](int64_t x) {
    if (x == 0) throw std::runtime_error("the first fails");
    return x;
  };
  auto pipeline = nodes::from_range(0, 10) | nodes::map(fail_first) |
                  nodes::map([](int64_t x) { return x * 10; }, {.workers = 2});
  for (int epoch = 0; epoch < 2; ++epoch) {
    auto pass = pipeline.pass();
    try {
      pass.next();
      FAIL() << "the first item's error was not thrown";
    } catch (const conveyor::NodeError& e) {
      EXPECT_EQ(e.node(), "map");
      EXPECT_EQ(e.position(), 0u);
    }
    std::vector<int64_t> rest;
    while (std::optional<int64_t> item = pass.next()) rest.push_back(*item);
    EXPECT_EQ(rest, (std::vector<int64_t>{10, 20, 30, 40, 50, 60, 70, 80, 90}));
  }
}

TEST(ParallelMap, PassesLeftEarlyAThousandTimesLoseAndLeakNothing) {
  conveyor::testing::LiveCounter live;
  auto pipeline = nodes::from_range(0, 1000) |
                  nodes::map([&live](int64_t x) { return conveyor::testing::Tracked(&live, x); }, {.workers = 4});
  for (int round = 0; round < 1000; ++round) {
    auto pass = pipeline.pass();
    for (int k = 0; k < round % 5; ++k) ASSERT_EQ(pass.next()->value(), k);
  }
  EXPECT_EQ(one_pass(pipeline).size(), 1000u);
  EXPECT_EQ(live.live.load(), 0);
  EXPECT_THROW(nodes::from_range(0, 1) | nodes::map([](int64_t x) { return x; }, {.workers = 2000}),
               conveyor::ValueError);
}

TEST(ParallelMap, MetricsSumTheWorkersTimeAndShowTheWindow) {
  constexpr int64_t kItems = 64;
  constexpr uint64_t kSpinNs = 1'000'000;
  auto pipeline = nodes::from_range(0, kItems) |
                  nodes::map(
                      [](int64_t x) {
                        if (x % 16 == 5) throw std::runtime_error("bad");
                        conveyor::testing::spin_delay(kSpinNs);
                        return x;
                      },
                      {.workers = 4, .window = 8, .on_error = conveyor::OnError::skip}) |
                  nodes::prefetch(3);
  pipeline.timed();
  EXPECT_EQ(one_pass(pipeline).size(), static_cast<size_t>(kItems - 4));
  const auto metrics = pipeline.metrics();
  ASSERT_EQ(metrics.size(), 3u);
  const auto& map = metrics[1];
  EXPECT_EQ(map.name, "map(workers=4, on_error=skip)");
  EXPECT_EQ(map.items_in, static_cast<uint64_t>(kItems));
  EXPECT_EQ(map.items_out, static_cast<uint64_t>(kItems - 4));
  EXPECT_EQ(map.skipped, 4u);
  EXPECT_EQ(map.window, 8u);
  // Busy is the workers' time summed: at least every spin, whichever thread ran it.
  EXPECT_GE(map.busy_seconds, static_cast<double>((kItems - 4) * kSpinNs) * 1e-9);
  EXPECT_GT(map.mean_in_flight, 0.0);
  EXPECT_LE(map.mean_in_flight, 8.0);
  const auto& prefetch = metrics[2];
  EXPECT_EQ(prefetch.name, "prefetch(3)");
  EXPECT_EQ(prefetch.items_out, static_cast<uint64_t>(kItems - 4));
  EXPECT_EQ(prefetch.window, 3u);
  EXPECT_LE(prefetch.mean_in_flight, 3.0);
  EXPECT_GT(prefetch.upstream_wait_seconds, 0.0);  // the strand waited on the map
}

// A resumed out-of-order map behind a filter (which skips by pulling)
// makes the saved outputs again on the consumer's thread: that f time is
// busy time too. Before, busy counted the workers' items alone (about 10
// of 40 items' worth).
TEST(ParallelMap, AResumedOutOfOrderMapCountsTheItemsItReplaysAsBusy) {
  constexpr int64_t kItems = 40;
  constexpr uint64_t kSpinNs = 1'000'000;
  auto make = [] {
    return nodes::from_range(0, kItems) |
           nodes::map(
               [](int64_t x) {
                 conveyor::testing::spin_delay(kSpinNs);
                 return x;
               },
               {.workers = 2, .window = 4, .in_order = false}) |
           nodes::filter([](int64_t) { return true; });
  };
  conveyor::State saved;
  {
    auto pipeline = make();
    auto pass = pipeline.pass();
    for (int k = 0; k < 30; ++k) ASSERT_TRUE(pass.next().has_value());
    saved = pipeline.state();
  }
  auto pipeline = make();
  pipeline.timed();
  pipeline.load_state(saved);
  size_t items = 0;
  for (auto pass = pipeline.pass(); pass.next();) ++items;
  EXPECT_EQ(items, 10u);
  const auto metrics = pipeline.metrics();
  ASSERT_EQ(metrics.size(), 3u);
  EXPECT_EQ(metrics[1].items_out, static_cast<uint64_t>(kItems));  // the 30 replayed, then 10
  EXPECT_GE(metrics[1].busy_seconds, static_cast<double>(kItems * kSpinNs) * 1e-9);
}

// prefetch's mean_in_flight tells a starved prefetch from a full one: the
// items ready when the consumer took one. Starved: upstream makes item k
// only once the consumer has asked for it, so exactly one is ready at each
// take. Full: the consumer asks only once upstream has made every item the
// window holds. Before the fix both read 8 (it counted jobs submitted, and
// the window is always full of those).
TEST(Prefetch, MeanInFlightCountsTheItemsReadyWhenTheConsumerTakesOne) {
  constexpr int64_t kItems = 40;
  constexpr int kDepth = 8;
  const auto mean_ready = [&](bool starved) {
    std::atomic<int64_t> asked{-1};
    std::atomic<int64_t> made{0};
    auto pipeline = nodes::from_range(0, kItems) | nodes::map([&](int64_t x) {
                      while (starved && asked.load() < x) std::this_thread::yield();
                      made.fetch_add(1);
                      return x;
                    }) |
                    nodes::prefetch(kDepth);
    auto pass = pipeline.pass();
    for (int64_t k = 0; k < kItems; ++k) {
      asked.store(k);
      // The window is refilled as next() begins: before asking for item k
      // the consumer can see at most items up to k + kDepth - 2 made.
      while (!starved && k > 0 && made.load() < std::min<int64_t>(k + kDepth - 1, kItems)) {
        std::this_thread::yield();
      }
      EXPECT_EQ(pass.next(), std::optional<int64_t>(k));
    }
    EXPECT_FALSE(pass.next());
    return pipeline.metrics().back().mean_in_flight;
  };
  EXPECT_EQ(mean_ready(/*starved=*/true), 1.0);
  // kDepth - 1 or kDepth are ready at each take (the job submitted as next()
  // began may have run too), fewer only at the first take and as the end
  // nears.
  const double full = mean_ready(/*starved=*/false);
  EXPECT_GT(full, 5.0);
  EXPECT_LE(full, static_cast<double>(kDepth));
}

TEST(Prefetch, RunsUpstreamAheadOnItsOwnStrandAndKeepsErrorsInPlace) {
  auto upstream = [] {
    return nodes::from_range(0, 50) | nodes::map([](int64_t x) {
             if (x == 17) throw std::runtime_error("seventeen");
             return x;
           });
  };
  auto pipeline = upstream() | nodes::prefetch(4) | nodes::batch(10);
  auto pass = pipeline.pass();
  std::vector<size_t> sizes;
  int errors = 0;
  while (true) {
    try {
      auto batch = pass.next();
      if (!batch) break;
      sizes.push_back(batch->size());
    } catch (const conveyor::NodeError& e) {
      EXPECT_EQ(e.node(), "map");
      EXPECT_EQ(e.position(), 17u);
      ++errors;
    }
  }
  EXPECT_EQ(errors, 1);
  EXPECT_EQ(sizes, (std::vector<size_t>{10, 10, 10, 10, 9}));
  // Again, and left early.
  for (int round = 0; round < 200; ++round) {
    auto again = pipeline.pass();
    ASSERT_EQ(again.next()->size(), 10u);
  }
}

TEST(Executor, AGraphsParallelNodesShareOneArenaSizedForAllOfThem) {
  // Each map records the size of the arena its function runs in: the graph's
  // one arena holds every parallel node's threads (3 + 1 + 2 + 1), where each
  // node had an arena of its own (3, 2). A prefetch's strand waits inside the
  // arena for the map upstream of it, whose workers still find threads.
  std::mutex mutex;
  std::set<int> arena_sizes;
  auto record = [&](int64_t x) {
    std::lock_guard lock(mutex);
    arena_sizes.insert(tbb::this_task_arena::max_concurrency());
    return x;
  };
  auto pipeline = nodes::from_range(0, 300) | nodes::map(record, {.workers = 3}) | nodes::prefetch(4) |
                  nodes::map([&](int64_t x) { return record(x) * 2; }, {.workers = 2}) | nodes::prefetch(2);
  std::vector<int64_t> expected;
  for (int64_t x = 0; x < 300; ++x) expected.push_back(x * 2);
  for (int pass = 0; pass < 3; ++pass) EXPECT_EQ(one_pass(pipeline), expected) << "pass " << pass;
  EXPECT_EQ(arena_sizes, (std::set<int>{7}));

  // A node reset on its own (no graph walk before it) still has threads.
  auto alone = std::make_unique<nodes::Prefetch<int64_t>>(nodes::from_range(0, 5).release(), 2);
  alone->reset(conveyor::PassContext{});
  int64_t sum = 0;
  while (auto x = alone->next()) sum += *x;
  EXPECT_EQ(sum, 10);
}

// ---- property test ------------------------------------------------------------

using conveyor::testing::outcomes;
using conveyor::testing::polled_outcomes;
using conveyor::testing::property_graphs;
using conveyor::testing::property_rng;
using conveyor::testing::random_pipeline;

TEST(PipelineProperty, ParallelRunsYieldTheSerialRunItemForItem) {
  std::mt19937_64 rng = property_rng("nodes property");
  const int graphs = property_graphs(100, 40);
  int unordered = 0, with_errors = 0;
  for (int g = 0; g < graphs; ++g) {
    const uint64_t graph_seed = rng();
    bool ordered = true;
    auto serial = random_pipeline(std::mt19937_64(graph_seed), false, ordered);
    auto parallel = random_pipeline(std::mt19937_64(graph_seed), true, ordered);
    serial.seed(graph_seed);
    parallel.seed(graph_seed);
    unordered += !ordered;
    for (int epoch = 0; epoch < 2; ++epoch) {
      std::vector<std::string> expected = outcomes(serial);
      std::vector<std::string> got = outcomes(parallel);
      with_errors += epoch == 0 && std::any_of(expected.begin(), expected.end(),
                                               [](const std::string& o) { return o.starts_with("error"); });
      if (!ordered) {
        std::sort(expected.begin(), expected.end());
        std::sort(got.begin(), got.end());
      }
      ASSERT_EQ(got, expected) << "graph " << g << " (seed " << graph_seed << "), epoch " << epoch
                               << (ordered ? "" : ", compared as multisets");
    }
  }
  std::printf("%d graphs: %d out of order, %d with errors raised in place\n", graphs, unordered, with_errors);
}

// try_next() through every node: with a stand-in async node (Stutter) after
// the source and after every stage answering "not yet" at random, a pass
// taken with try_next() yields what the same graph without a single "not
// yet" yields with next(): serial nodes keep what they gathered, mux keeps
// its rotation, weighted_mux its picks, a parallel map its inputs.
TEST(PipelineProperty, PolledRunsThroughNodesThatAreNotYetReadyYieldTheWaitingRun) {
  std::mt19937_64 rng = property_rng("polled nodes property");
  const int graphs = property_graphs(80, 30);
  uint64_t pending = 0;
  for (int g = 0; g < graphs; ++g) {
    const uint64_t graph_seed = rng();
    bool ordered = true;
    auto waiting = random_pipeline(std::mt19937_64(graph_seed), false, ordered);
    auto serial = random_pipeline(std::mt19937_64(graph_seed), false, ordered, 0, true, graph_seed | 1);
    auto parallel = random_pipeline(std::mt19937_64(graph_seed), true, ordered, 0, true, graph_seed | 1);
    waiting.seed(graph_seed);
    serial.seed(graph_seed);
    parallel.seed(graph_seed);
    for (int epoch = 0; epoch < 2; ++epoch) {
      std::vector<std::string> expected = outcomes(waiting);
      std::vector<std::string> serial_got = polled_outcomes(serial, pending);
      std::vector<std::string> parallel_got = polled_outcomes(parallel, pending);
      if (!ordered) {  // a join's order is timing's, serial or not
        std::sort(expected.begin(), expected.end());
        std::sort(serial_got.begin(), serial_got.end());
        std::sort(parallel_got.begin(), parallel_got.end());
      }
      ASSERT_EQ(serial_got, expected) << "graph " << g << " (seed " << graph_seed << "), epoch " << epoch
                                      << ", serial nodes polled" << (ordered ? "" : ", compared as multisets");
      ASSERT_EQ(parallel_got, expected) << "graph " << g << " (seed " << graph_seed << "), epoch " << epoch
                                        << ", parallel nodes polled" << (ordered ? "" : ", compared as multisets");
    }
  }
  EXPECT_GT(pending, 0u) << "no pass was ever told \"not yet\": the test tested nothing";
  std::printf("%d graphs: %llu answers of \"not yet\" to the consumer\n", graphs,
              static_cast<unsigned long long>(pending));
}

// A random graph of nodes that treat items one by one (maps serial,
// parallel, out of order, async; filter; flat_map; prefetch) over ranges
// merged by mux or join: each item's outcome depends on the item alone, so
// shards taken apart yield, together, what the whole graph yields.
Pipeline<int64_t> random_shardable_pipeline(std::mt19937_64& rng, int64_t base, int depth = 0) {
  const int64_t n = std::uniform_int_distribution<int64_t>(0, 300)(rng);
  Pipeline<int64_t> p = nodes::from_range(base, base + n);
  const int stages = std::uniform_int_distribution<int>(1, 4)(rng);
  for (int s = 0; s < stages; ++s) {
    int kind = std::uniform_int_distribution<int>(0, 8)(rng);
    if ((kind == 6 || kind == 7) && depth >= 2) kind = 8;
    const int64_t k = std::uniform_int_distribution<int64_t>(2, 9)(rng);
    const int workers = std::uniform_int_distribution<int>(1, 4)(rng);
    auto work = [k](int64_t x) {
      conveyor::testing::spin_delay(x % 7 == 0 ? static_cast<uint64_t>(x % 5) * 4000 : 0);
      if (x % 37 == k) throw std::runtime_error("fails on " + std::to_string(x));
      return x * k % 1000003;
    };
    const auto skip = conveyor::OnError::skip;
    switch (kind) {
      case 0:
        p = std::move(p) | nodes::map(work, {.workers = workers, .on_error = skip});
        break;
      case 1:
        p = std::move(p) | nodes::filter([k](int64_t x) { return x % k != 0; });
        break;
      case 2:
        p = std::move(p) | nodes::flat_map([k](int64_t x) { return std::vector<int64_t>(static_cast<size_t>(x % 3), x + k); });
        break;
      case 3:
        p = std::move(p) | nodes::prefetch(static_cast<int>(k));
        break;
      case 4:
        p = std::move(p) | nodes::map(work, {.workers = workers, .in_order = false, .on_error = skip});
        break;
      case 5:
        p = std::move(p) | nodes::async_map<int64_t>(
                               [work](int64_t x, nodes::Completion<int64_t> done) {
                                 auto held = std::make_shared<nodes::Completion<int64_t>>(std::move(done));
                                 conveyor::testing::LateCompleter::instance().later([work, x, held] {
                                   try {
                                     (*held)(work(x));
                                   } catch (...) {
                                     const std::exception_ptr error = std::current_exception();
                                     held->fail(error);
                                   }
                                 });
                               },
                               {.max_in_flight = static_cast<int>(k * 3), .in_order = k % 2 == 0, .on_error = skip});
        break;
      case 6:
      case 7: {
        std::vector<Pipeline<int64_t>> sources;
        sources.push_back(std::move(p));
        sources.push_back(random_shardable_pipeline(rng, base + 100000 * (s + 1), depth + 1));
        p = kind == 6 ? nodes::mux(std::move(sources)) : nodes::join(std::move(sources));
        break;
      }
      default:
        p = std::move(p) | nodes::map([k](int64_t x) { return x + k; }, {.workers = workers});
        break;
    }
  }
  return p;
}

// Framework-level sharding: for any number of ranks and workers, each
// (rank, worker)'s run of a random graph takes its own share, and the shares
// together are the whole run's items, each once. Seeds printed and replayable.
TEST(PipelineProperty, ShardsOfARandomGraphTogetherYieldTheWholeRunOnce) {
  std::mt19937_64 rng = property_rng("sharded nodes property");
  const int graphs = property_graphs(40, 12);
  for (int g = 0; g < graphs; ++g) {
    const uint64_t graph_seed = rng();
    const auto make = [graph_seed] {
      std::mt19937_64 graph_rng(graph_seed);
      return random_shardable_pipeline(graph_rng, 0);
    };
    auto whole_pipeline = make();
    std::vector<std::string> whole = outcomes(whole_pipeline);
    std::sort(whole.begin(), whole.end());
    for (int64_t world = 1; world <= 3; ++world) {
      for (int64_t workers = 1; workers <= 2; ++workers) {
        std::vector<std::string> together;
        for (int64_t rank = 0; rank < world; ++rank) {
          for (int64_t worker = 0; worker < workers; ++worker) {
            auto pipeline = make();
            pipeline.shard(conveyor::ShardSpec{rank, world, worker, workers});
            for (std::string& outcome : outcomes(pipeline)) together.push_back(std::move(outcome));
          }
        }
        std::sort(together.begin(), together.end());
        ASSERT_EQ(together, whole) << "graph " << g << " (seed " << graph_seed << "), " << world << " ranks of "
                                   << workers << " workers";
      }
    }
  }
}

}  // namespace
