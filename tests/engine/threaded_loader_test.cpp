// The DataLoader with num_workers > 0: PyTorch's worker semantics, the two
// scheduling modes, errors, timeouts, persistent workers, iterable datasets,
// clean stop.
#include <gtest/gtest.h>

#include <conveyor/conveyor.h>
#include <oneapi/tbb/blocked_range.h>
#include <oneapi/tbb/parallel_reduce.h>
#include <oneapi/tbb/task_arena.h>

#include <atomic>
#include <latch>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "support/datasets.h"
#include "support/epochs.h"
#include "support/fixtures.h"
#include "support/sync.h"

namespace {

using conveyor::LoaderOptions;
using conveyor::Scheduling;
using conveyor::testing::FixtureCase;
using conveyor::testing::Gates;
using conveyor::testing::LiveCounter;
using conveyor::testing::RangeDataset;
using conveyor::testing::split;
using conveyor::testing::ThrowingDataset;
using conveyor::testing::Tracked;

using Triple = std::tuple<int64_t, int64_t, int64_t>;

// PyTorch's fixture dataset: (i, torch.randint(0, 1000000) from the worker's
// default generator, worker id).
struct Draws final : conveyor::Dataset<Triple> {
  explicit Draws(size_t n) : n(n) {}
  size_t size() const override { return n; }
  Triple get(size_t i) override {
    int64_t draw = 0;
    conveyor::randint(0, 1000000, std::span<int64_t>(&draw, 1), conveyor::default_generator());
    const conveyor::WorkerInfo* info = conveyor::get_worker_info();
    return {static_cast<int64_t>(i), draw, info ? info->id : -1};
  }
  size_t n;
};

// Worker w yields lengths[w] samples (w*1000 + k, a draw, w).
struct WorkerStreams final : conveyor::IterableDataset<Triple> {
  explicit WorkerStreams(std::vector<int64_t> lengths) : lengths(std::move(lengths)) {}
  std::unique_ptr<conveyor::SampleIterator<Triple>> iter(const conveyor::WorkerInfo* worker) override {
    const int64_t w = worker ? worker->id : 0;
    return conveyor::make_sample_iterator<Triple>(
        [w, k = int64_t{0}, n = lengths[static_cast<size_t>(w)]]() mutable -> std::optional<Triple> {
          if (k == n) return std::nullopt;
          int64_t draw = 0;
          conveyor::randint(0, 1000000, std::span<int64_t>(&draw, 1), conveyor::default_generator());
          return Triple{w * 1000 + k++, draw, w};
        });
  }
  std::vector<int64_t> lengths;
};

template <class Loader>
std::string format_epoch(Loader& loader) {
  std::string text;
  for (auto& [ids, draws, workers] : loader) {
    if (!text.empty()) text += ",";
    for (size_t i = 0; i < ids.numel(); ++i) {
      if (i > 0) text += " ";
      text += std::to_string(ids[i]) + ":" + std::to_string(draws[i]) + ":" + std::to_string(workers[i]);
    }
  }
  return text;
}

TEST(WorkerParity, RoundRobinMatchesPyTorchWorkersOrderAndDraws) {
  const auto cases = conveyor::testing::load_fixtures("workers.txt", "map");
  ASSERT_FALSE(cases.empty());
  for (const FixtureCase& c : cases) {
    SCOPED_TRACE(c.describe());
    Draws dataset(static_cast<size_t>(c.integer("n")));
    conveyor::DataLoader loader(dataset, {.batch_size = c.integer("batch_size"),
                                          .shuffle = c.integer("shuffle") != 0,
                                          .num_workers = static_cast<int>(c.integer("workers")),
                                          .persistent_workers = c.integer("persistent") != 0,
                                          .drop_last = c.integer("drop_last") != 0,
                                          .seed = c.unsigned_integer("seed"),
                                          .scheduling = Scheduling::round_robin});
    const auto epochs = split(c.results.at(0), '/');
    for (size_t e = 0; e < epochs.size(); ++e) EXPECT_EQ(format_epoch(loader), epochs[e]) << "epoch " << e;
  }
}

TEST(WorkerParity, IterableReplicasRoundRobinAndLeaveTheRotationLikePyTorch) {
  const auto cases = conveyor::testing::load_fixtures("workers.txt", "iterable");
  ASSERT_FALSE(cases.empty());
  for (const FixtureCase& c : cases) {
    SCOPED_TRACE(c.describe());
    WorkerStreams dataset(conveyor::testing::numbers<int64_t>(c.param("lengths")));
    conveyor::DataLoader loader(dataset, {.batch_size = c.integer("batch_size"),
                                          .num_workers = static_cast<int>(c.integer("workers")),
                                          .drop_last = c.integer("drop_last") != 0,
                                          .seed = c.unsigned_integer("seed")});
    const auto epochs = split(c.results.at(0), '/');
    for (size_t e = 0; e < epochs.size(); ++e) EXPECT_EQ(format_epoch(loader), epochs[e]) << "epoch " << e;
  }
}

// A batch's values, drawn inside the dataset from default_generator().
struct Augmented final : conveyor::Dataset<std::pair<int64_t, double>> {
  size_t size() const override { return 200; }
  std::pair<int64_t, double> get(size_t i) override {
    return {static_cast<int64_t>(i), conveyor::uniform(conveyor::default_generator())};
  }
};

std::vector<std::pair<std::vector<int64_t>, std::vector<double>>> two_epochs(int workers, bool persistent) {
  Augmented dataset;
  conveyor::DataLoader loader(dataset, {.batch_size = 7, .shuffle = true, .num_workers = workers,
                                        .persistent_workers = persistent && workers > 0, .seed = 11,
                                        .scheduling = Scheduling::work_stealing});
  std::vector<std::pair<std::vector<int64_t>, std::vector<double>>> out;
  for (int epoch = 0; epoch < 2; ++epoch) {
    loader.set_epoch(static_cast<uint64_t>(epoch));
    for (auto& [ids, values] : loader) {
      out.emplace_back(std::vector<int64_t>(ids.values().begin(), ids.values().end()),
                       std::vector<double>(values.values().begin(), values.values().end()));
    }
  }
  return out;
}

TEST(WorkStealing, BatchesAreIdenticalForAnyNumberOfWorkers) {
  const auto one = two_epochs(1, false);
  ASSERT_EQ(one.size(), 2 * 29u);
  EXPECT_NE(one[0].second, one[29].second);  // epochs differ
  for (int workers : {0, 2, 3, 8}) EXPECT_EQ(two_epochs(workers, false), one) << workers << " workers";
  for (int workers : {1, 3}) EXPECT_EQ(two_epochs(workers, true), two_epochs(workers, true)) << "persistent";
}

TEST(WorkStealing, OneStuckBatchDoesNotIdleTheOthers) {
  // Batch 0's sample waits at a gate that opens only once every other batch
  // of the window has been produced: with round_robin, batch 3 would wait
  // behind batch 0 on worker 0; with work_stealing the free workers take it.
  Gates gate(1);
  std::atomic<int> produced{0};
  struct Stuck final : conveyor::Dataset<int64_t> {
    Gates* gate;
    std::atomic<int>* produced;
    size_t size() const override { return 8; }
    int64_t get(size_t i) override {
      if (i == 0) {
        gate->wait(0);
      } else if (produced->fetch_add(1) + 1 == 7) {
        gate->open(0);  // all seven others are done
      }
      return static_cast<int64_t>(i);
    }
  } dataset;
  dataset.gate = &gate;
  dataset.produced = &produced;
  conveyor::DataLoader loader(dataset, {.batch_size = 1, .num_workers = 3, .prefetch_factor = 3,
                                        .timeout = 60, .scheduling = Scheduling::work_stealing});
  std::vector<int64_t> got;
  for (auto& batch : loader) got.push_back(batch[0]);
  EXPECT_EQ(got, (std::vector<int64_t>{0, 1, 2, 3, 4, 5, 6, 7}));
}

TEST(ThreadedLoader, EveryModeDeliversEachBatchOnceInSamplerOrderWhenAsked) {
  RangeDataset dataset(503);
  for (Scheduling scheduling : {Scheduling::round_robin, Scheduling::work_stealing}) {
    for (bool in_order : {true, false}) {
      for (int workers : {1, 2, 5}) {
        SCOPED_TRACE(std::to_string(workers) + " workers, in_order " + std::to_string(in_order));
        conveyor::DataLoader loader(dataset, {.batch_size = 4, .shuffle = true, .num_workers = workers,
                                              .seed = 3, .in_order = in_order, .scheduling = scheduling});
        conveyor::DataLoader reference(dataset, {.batch_size = 4, .shuffle = true, .seed = 3});
        std::vector<std::vector<int64_t>> got, expected;
        for (auto& b : loader) got.emplace_back(b.values().begin(), b.values().end());
        for (auto& b : reference) expected.emplace_back(b.values().begin(), b.values().end());
        if (!in_order) {
          std::sort(got.begin(), got.end());
          std::sort(expected.begin(), expected.end());
        }
        EXPECT_EQ(got, expected);
      }
    }
  }
}

TEST(ThreadedLoader, NeverHoldsMoreThanTheWindowPlusTheConsumersBatch) {
  LiveCounter live;
  struct Source final : conveyor::Dataset<int64_t> {
    size_t size() const override { return 400; }
    int64_t get(size_t i) override { return static_cast<int64_t>(i); }
  } dataset;
  auto collate = [&live](std::vector<int64_t>&& samples) { return Tracked(&live, samples.front()); };
  for (int workers : {1, 3, 6}) {
    for (int prefetch : {1, 2, 4}) {
      live.peak = 0;
      conveyor::DataLoader loader(dataset, {.batch_size = 2, .num_workers = workers, .prefetch_factor = prefetch},
                                  collate);
      int64_t expected = 0;
      for (auto& batch : loader) {
        EXPECT_EQ(batch.value(), expected);
        expected += 2;
        conveyor::testing::spin_delay(2000);  // a slow consumer: the workers fill the window
      }
      EXPECT_LE(live.peak.load(), workers * prefetch + 1) << workers << " workers, prefetch " << prefetch;
      EXPECT_EQ(live.live.load(), 0);
    }
  }
}

TEST(ThreadedLoader, ErrorsArriveInOrderWithContextAndTheEpochContinues) {
  ThrowingDataset dataset(30, {13, 22});
  for (Scheduling scheduling : {Scheduling::round_robin, Scheduling::work_stealing}) {
    conveyor::DataLoader loader(dataset, {.batch_size = 3, .num_workers = 3, .scheduling = scheduling});
    auto epoch = loader.iter();
    const auto events = conveyor::testing::walk_epoch(
        epoch, [](const conveyor::Array<int64_t>& batch) { return std::to_string(batch[0]); },
        [&](const conveyor::WorkerError& e) {
          const auto& context = e.context();
          EXPECT_EQ(context.stage, "fetch");
          EXPECT_EQ(context.indices.size(), 3u);
          if (scheduling == Scheduling::round_robin) {
            EXPECT_EQ(context.worker_id, static_cast<int>(context.batch_seq % 3));
          }
          EXPECT_NE(std::string(e.what()).find("bad sample"), std::string::npos);
        });
    EXPECT_EQ(events, (std::vector<std::string>{"0", "3", "6", "9", "error@4", "15", "18", "error@7", "24", "27"}));
  }
}

TEST(ThreadedLoader, AThrowingWorkerInitFnFailsThatWorkersBatchesOnly) {
  RangeDataset dataset(12);
  std::atomic<int> calls{0};
  conveyor::DataLoader loader(dataset, {.batch_size = 2, .num_workers = 3,
                                        .worker_init_fn = [&](int id) {
                                          calls.fetch_add(1);
                                          if (id == 1) throw std::runtime_error("no handle for worker 1");
                                        },
                                        .scheduling = Scheduling::round_robin});
  auto epoch = loader.iter();
  std::vector<std::string> events;
  for (int i = 0; i < 6; ++i) {
    try {
      events.push_back(std::to_string((*epoch.next())[0]));
    } catch (const conveyor::WorkerError& e) {
      EXPECT_EQ(e.context().stage, "worker_init_fn");
      EXPECT_EQ(e.context().worker_id, 1);
      EXPECT_NE(std::string(e.what()).find("no handle for worker 1"), std::string::npos);
      events.push_back("init-error");
    }
  }
  EXPECT_FALSE(epoch.next().has_value());
  EXPECT_EQ(events, (std::vector<std::string>{"0", "init-error", "4", "6", "init-error", "10"}));
  EXPECT_EQ(calls.load(), 3);
}

TEST(ThreadedLoader, TimeoutNamesTheStuckBatchAndTheWaitCanGoOn) {
  Gates gate(1);
  std::atomic<bool> inside{false};
  struct Stuck final : conveyor::Dataset<int64_t> {
    Gates* gate;
    std::atomic<bool>* inside;
    size_t size() const override { return 6; }
    int64_t get(size_t i) override {
      if (i == 4) {
        inside->store(true);
        inside->notify_all();
        gate->wait(0);
      }
      return static_cast<int64_t>(i);
    }
  } dataset;
  dataset.gate = &gate;
  dataset.inside = &inside;
  conveyor::DataLoader loader(dataset, {.batch_size = 2, .num_workers = 2, .timeout = 0.2,
                                        .scheduling = Scheduling::round_robin});
  auto epoch = loader.iter();
  EXPECT_EQ((*epoch.next())[0], 0);
  EXPECT_EQ((*epoch.next())[0], 2);
  inside.wait(false);
  try {
    epoch.next();
    FAIL() << "no timeout";
  } catch (const conveyor::TimeoutError& e) {
    const std::string message = e.what();
    EXPECT_NE(message.find("DataLoader timed out after 0.2 seconds waiting for batch 2 (worker 0 has been on it"),
              std::string::npos)
        << message;
  }
  gate.open(0);
  EXPECT_EQ((*epoch.next())[0], 4);
  EXPECT_FALSE(epoch.next().has_value());
}

// A resumed epoch's jobs skip the batches its consumer had: its first job
// makes batch 3. Before, a timeout there named "batch 0", the job's number.
TEST(ThreadedLoader, ATimeoutInAResumedEpochNamesTheEpochsBatch) {
  Gates gate(1);
  std::atomic<bool> inside{false};
  struct Stuck final : conveyor::Dataset<int64_t> {
    Gates* gate = nullptr;  // index 6 (batch 3) waits on it, once set
    std::atomic<bool>* inside = nullptr;
    size_t size() const override { return 12; }
    int64_t get(size_t i) override {
      if (gate && i == 6) {
        inside->store(true);
        inside->notify_all();
        gate->wait(0);
      }
      return static_cast<int64_t>(i);
    }
  } dataset;
  const conveyor::LoaderOptions options{.batch_size = 2, .num_workers = 2, .timeout = 0.2,
                                        .scheduling = Scheduling::round_robin};
  conveyor::State saved;
  {
    conveyor::DataLoader loader(dataset, options);
    auto epoch = loader.iter();
    for (int k = 0; k < 3; ++k) ASSERT_TRUE(epoch.next().has_value());
    saved = loader.state_dict();
  }
  dataset.gate = &gate;
  dataset.inside = &inside;
  conveyor::DataLoader loader(dataset, options);
  loader.load_state_dict(saved);
  auto epoch = loader.iter();  // its jobs start at the first next()
  try {
    epoch.next();
    FAIL() << "no timeout";
  } catch (const conveyor::TimeoutError& e) {
    // Worker 1's (3 % 2), begun or still queued: whichever the machine's load made it.
    const std::string message = e.what();
    EXPECT_NE(message.find("DataLoader timed out after 0.2 seconds waiting for batch 3 ("), std::string::npos)
        << message;
    EXPECT_NE(message.find("worker 1"), std::string::npos) << message;
  }
  inside.wait(false);
  gate.open(0);
  std::vector<int64_t> firsts;
  while (auto batch = epoch.next()) firsts.push_back((*batch)[0]);
  EXPECT_EQ(firsts, (std::vector<int64_t>{6, 8, 10}));
}

// A timeout whose wait then went on is over once the batch came: leaving
// that epoch with batches in flight keeps a persistent loader's workers,
// their init and their generators' streams (dropping the pool as if a task
// were stuck changed the next epoch's data).
TEST(ThreadedLoader, ARetriedTimeoutKeepsPersistentWorkersAndTheirStreams) {
  struct Drawing final : conveyor::Dataset<int64_t> {
    Gates* gate = nullptr;  // batch 0's first sample waits on it, once
    std::atomic<bool> held{false};
    size_t size() const override { return 16; }
    int64_t get(size_t i) override {
      if (gate && i == 0 && !held.exchange(true)) gate->wait(0);
      return static_cast<int64_t>(conveyor::default_generator().random() % 1000);
    }
  };
  auto run = [](bool hiccup, int& inits) {
    Gates gate(1);
    auto dataset = std::make_shared<Drawing>();  // owned: a stuck task may keep it
    if (hiccup) dataset->gate = &gate;
    std::atomic<int> init_calls{0};
    conveyor::DataLoader loader(dataset, {.batch_size = 2, .num_workers = 2, .persistent_workers = true,
                                          .timeout = 0.2, .worker_init_fn = [&init_calls](int) { ++init_calls; },
                                          .seed = 7, .scheduling = Scheduling::round_robin});
    {
      auto epoch = loader.iter();
      if (hiccup) {
        EXPECT_THROW(epoch.next(), conveyor::TimeoutError);
        gate.open(0);
      }
      for (int taken = 0; taken < 3; ++taken) EXPECT_TRUE(epoch.next().has_value());
    }  // left with batches in flight
    std::vector<int64_t> next_epoch;
    for (auto& batch : loader) {
      for (int64_t value : batch.values()) next_epoch.push_back(value);
    }
    inits = init_calls.load();
    return next_epoch;
  };
  int inits_plain = 0, inits_hiccup = 0;
  const std::vector<int64_t> plain = run(false, inits_plain);
  const std::vector<int64_t> after_timeout = run(true, inits_hiccup);
  EXPECT_EQ(inits_plain, 2);
  EXPECT_EQ(inits_hiccup, 2) << "worker_init_fn ran again: the persistent workers were replaced";
  EXPECT_EQ(after_timeout, plain);
}

TEST(ThreadedLoader, IteratorDestroyedMidEpochAThousandTimes) {
  LiveCounter live;
  RangeDataset dataset(1000);
  auto collate = [&live](std::vector<int64_t>&& samples) { return Tracked(&live, samples.front()); };
  conveyor::DataLoader loader(dataset, {.batch_size = 3, .shuffle = true, .num_workers = 4, .seed = 1}, collate);
  for (int round = 0; round < 1000; ++round) {
    auto epoch = loader.iter();
    for (int taken = 0; taken < round % 4; ++taken) ASSERT_TRUE(epoch.next().has_value());
  }  // each ~Epoch cancels, waits, frees
  EXPECT_EQ(live.live.load(), 0);
}

TEST(ThreadedLoader, LoaderDestroyedWhileAnEpochLivesKeepsWhatTheEpochUses) {
  auto dataset = std::make_shared<RangeDataset>(100);
  std::optional<conveyor::DataLoader<RangeDataset>::Epoch> epoch;
  {
    conveyor::DataLoader loader(dataset, {.batch_size = 10, .num_workers = 2});
    epoch.emplace(loader.iter());
  }
  int64_t sum = 0;
  while (auto batch = epoch->next()) sum += (*batch)[0];
  EXPECT_EQ(sum, 0 + 10 + 20 + 30 + 40 + 50 + 60 + 70 + 80 + 90);
}

TEST(PersistentWorkers, InitOnceBaseSeedOnceOneLiveEpoch) {
  RangeDataset dataset(20);
  std::atomic<int> inits{0};
  conveyor::DataLoader loader(dataset, {.batch_size = 5, .num_workers = 3, .persistent_workers = true,
                                        .worker_init_fn = [&](int) { inits.fetch_add(1); }, .seed = 4,
                                        .scheduling = Scheduling::round_robin});
  int64_t base_seed = 0;
  for (int e = 0; e < 3; ++e) {
    auto epoch = loader.iter();
    if (e == 0) base_seed = epoch.base_seed();
    EXPECT_EQ(epoch.base_seed(), base_seed);
    int batches = 0;
    while (epoch.next()) ++batches;
    EXPECT_EQ(batches, 4);
  }
  EXPECT_EQ(inits.load(), 3);
  auto first = loader.iter();
  EXPECT_THROW(loader.iter(), conveyor::RuntimeError);
}

TEST(WorkerInfo, ManualSeedInWorkerInitFnSeedsThatWorkersGenerator) {
  // PyTorch's idiom: torch.manual_seed in worker_init_fn seeds the worker
  // process's default generator. Here it used to reseed the process-wide one
  // from a worker thread.
  const std::vector<uint8_t> process_before = conveyor::default_generator().get_state();
  Augmented dataset;
  conveyor::DataLoader loader(dataset, {.batch_size = 1, .num_workers = 2,
                                        .worker_init_fn = [](int id) { conveyor::manual_seed(1000 + id); },
                                        .seed = 5, .scheduling = Scheduling::round_robin});
  std::vector<double> draws[2];
  int64_t k = 0;
  for (auto& [ids, values] : loader) {
    EXPECT_EQ(ids[0], k);
    draws[k++ % 2].push_back(values[0]);
    if (k == 20) break;
  }
  for (int w = 0; w < 2; ++w) {
    conveyor::Generator expected(static_cast<uint64_t>(1000 + w));
    for (double draw : draws[w]) EXPECT_EQ(draw, conveyor::uniform(expected)) << "worker " << w;
  }
  EXPECT_EQ(conveyor::default_generator().get_state(), process_before);
}

TEST(WorkerInfo, UnderWorkStealingWorkerInitFnDrawsFromItsWorkersSeed) {
  // Which batch a worker of the shared queue takes first is a race, so its
  // worker_init_fn draws from the worker's own seed (base seed + id), not
  // from a batch's.
  RangeDataset dataset(64);
  std::mutex mutex;
  std::map<int, std::pair<uint64_t, double>> seen;  // id -> (info seed, first draw)
  conveyor::DataLoader loader(dataset, {.batch_size = 4, .num_workers = 3,
                                        .worker_init_fn =
                                            [&](int id) {
                                              const double draw = conveyor::uniform(conveyor::default_generator());
                                              std::lock_guard lock(mutex);
                                              seen[id] = {conveyor::get_worker_info()->seed, draw};
                                            },
                                        .seed = 6, .scheduling = Scheduling::work_stealing});
  auto epoch = loader.iter();
  while (epoch.next()) {
  }
  std::lock_guard lock(mutex);
  for (const auto& [id, seed_and_draw] : seen) {
    EXPECT_EQ(seed_and_draw.first, static_cast<uint64_t>(epoch.base_seed()) + static_cast<uint64_t>(id));
    conveyor::Generator expected(seed_and_draw.first);
    EXPECT_EQ(seed_and_draw.second, conveyor::uniform(expected)) << "worker " << id;
  }
  EXPECT_FALSE(seen.empty());
}

TEST(WorkerInfo, DatasetsSeeTheirWorker) {
  struct Introspective final : conveyor::Dataset<std::vector<int64_t>> {
    size_t size() const override { return 9; }
    std::vector<int64_t> get(size_t) override {
      const conveyor::WorkerInfo* info = conveyor::get_worker_info();
      if (!info) return {-1, -1, -1, 0};
      return {info->id, info->num_workers, static_cast<int64_t>(info->seed),
              &info->dataset<Introspective>() == this ? 1 : 0};
    }
  } dataset;
  conveyor::DataLoader loader(dataset, {.batch_size = 1, .num_workers = 3, .seed = 8,
                                        .scheduling = Scheduling::round_robin});
  auto epoch = loader.iter();
  const int64_t base = epoch.base_seed();
  int64_t k = 0;
  while (auto batch = epoch.next()) {
    auto& fields = *batch;
    EXPECT_EQ(fields[0][0], k % 3);
    EXPECT_EQ(fields[1][0], 3);
    EXPECT_EQ(fields[2][0], base + k % 3);
    EXPECT_EQ(fields[3][0], 1);
    ++k;
  }
  EXPECT_EQ(k, 9);
  EXPECT_EQ(conveyor::get_worker_info(), nullptr);  // not on the consumer's thread
}

TEST(Arena, MoreWorkersThanCoresAllRunAtOnce) {
  // 64 samples that each wait until all 64 are being fetched at the same time:
  // passes only if 64 workers really run concurrently (on 2 cores).
  constexpr int kWorkers = 64;
  std::latch all_inside(kWorkers);
  struct Blocking final : conveyor::Dataset<int64_t> {
    std::latch* latch;
    size_t size() const override { return kWorkers; }
    int64_t get(size_t i) override {
      latch->arrive_and_wait();
      return static_cast<int64_t>(i);
    }
  } dataset;
  dataset.latch = &all_inside;
  conveyor::DataLoader loader(dataset, {.batch_size = 1, .num_workers = kWorkers, .prefetch_factor = 1,
                                        .timeout = 120});
  int64_t count = 0;
  for (auto& batch : loader) EXPECT_EQ(batch[0], count++);
  EXPECT_EQ(count, kWorkers);
}

TEST(Arena, ADatasetsParallelForRunsInTheLoadersArena) {
#if defined(__SANITIZE_THREAD__)
  GTEST_SKIP() << "tbb::parallel_reduce's internals run in Debian's libtbb, which is not "
                  "TSan-instrumented; the normal build runs this test";
#endif
  struct Parallel final : conveyor::Dataset<int64_t> {
    size_t size() const override { return 16; }
    int64_t get(size_t i) override {
      concurrency.store(tbb::this_task_arena::max_concurrency());
      return tbb::parallel_reduce(
          tbb::blocked_range<int64_t>(0, 1000), int64_t{0},
          [&](const tbb::blocked_range<int64_t>& r, int64_t acc) {
            for (int64_t v = r.begin(); v != r.end(); ++v) acc += v * static_cast<int64_t>(i);
            return acc;
          },
          std::plus<>());
    }
    std::atomic<int> concurrency{0};
  } dataset;
  conveyor::DataLoader loader(dataset, {.batch_size = 4, .num_workers = 3});
  int64_t i = 0;
  for (auto& batch : loader) {
    for (int64_t v : batch.values()) EXPECT_EQ(v, 499500 * i++);
  }
  EXPECT_EQ(dataset.concurrency.load(), 3);
}

}  // namespace

namespace {

TEST(Metrics, AnEpochAccountsForItsBatchesStagesAndWaits) {
  struct Busy final : conveyor::Dataset<int64_t> {
    size_t size() const override { return 240; }
    int64_t get(size_t i) override {
      conveyor::testing::spin_delay(20000);  // 20 us of fetch per sample
      return static_cast<int64_t>(i);
    }
  } dataset;
  for (int workers : {0, 3}) {
    conveyor::DataLoader loader(dataset, {.batch_size = 8, .num_workers = workers});
    auto epoch = loader.iter();
    while (epoch.next()) {
    }
    const conveyor::LoaderMetrics metrics = epoch.metrics();
    EXPECT_EQ(metrics.batches, 30u);
    EXPECT_GE(metrics.fetch_seconds, 240 * 20e-6) << "every sample's fetch is counted";
    EXPECT_GT(metrics.collate_seconds, 0);
    EXPECT_LE(metrics.wait_seconds, metrics.wall_seconds);
    EXPECT_GT(metrics.stall_fraction(), 0);  // nothing downstream: the consumer only waits
    EXPECT_EQ(metrics.window, static_cast<size_t>(2 * workers));
    EXPECT_LE(metrics.mean_in_flight, static_cast<double>(metrics.window));
    if (workers > 0) {
      EXPECT_GT(metrics.mean_in_flight, 0);
    }
    EXPECT_NE(metrics.summary().find("30 batches"), std::string::npos) << metrics.summary();
  }
}

// An epoch's wall time ends at its end: metrics read after validation, or
// kept by the loader when the epoch goes, describe the epoch alone.
TEST(Metrics, AnEpochsWallTimeStopsAtItsEnd) {
  struct Numbers final : conveyor::Dataset<int64_t> {
    size_t size() const override { return 40; }
    int64_t get(size_t i) override { return static_cast<int64_t>(i); }
  } dataset;
  for (int workers : {0, 2}) {
    conveyor::DataLoader loader(dataset, {.batch_size = 8, .num_workers = workers});
    double at_end = 0;
    {
      auto epoch = loader.iter();
      while (epoch.next()) {
      }
      at_end = epoch.metrics().wall_seconds;
      ASSERT_GT(at_end, 0);
      conveyor::testing::spin_delay(30'000'000);  // 30 ms of "validation"
      EXPECT_EQ(epoch.metrics().wall_seconds, at_end);
      EXPECT_FALSE(epoch.next().has_value());  // asking again moves nothing
      EXPECT_EQ(epoch.metrics().wall_seconds, at_end);
    }
    ASSERT_TRUE(loader.last_metrics().has_value());
    EXPECT_EQ(loader.last_metrics()->wall_seconds, at_end);
  }
}

}  // namespace
