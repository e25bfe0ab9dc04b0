// The engine on its own: forced completion orders, wraparound, timeouts,
// cancellation. Orders are forced with gates (atomic waits), never sleeps.
#include <gtest/gtest.h>

#include <conveyor/detail/cpu_relax.h>
#include <conveyor/detail/engine.h>
#include <conveyor/detail/seeds.h>
#include <conveyor/detail/sequenced_window.h>
#include <conveyor/errors.h>

#include <concurrentqueue.h>
#include <oneapi/tbb/info.h>

#include <algorithm>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <memory>
#include <mutex>
#include <numeric>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "support/sync.h"

namespace {

using conveyor::detail::Engine;
using conveyor::detail::EngineConfig;
using conveyor::detail::Job;
using conveyor::detail::ReadyJob;
using conveyor::testing::Counter;
using conveyor::testing::Gates;
using conveyor::testing::OrderLog;

// Each job waits at the gate of its batch index, then records its result:
// the batch index, in the job's slot.
class GatedRunner final : public conveyor::detail::TaskRunner {
 public:
  GatedRunner(size_t window, size_t jobs) : gates(jobs), results(window) {}
  void init_worker(int) override {}
  void run(Job& job, int, const std::exception_ptr&) noexcept override {
    entered.record(job.index);
    gates.wait(job.index);
    results[job.slot] = job.index;
    completed.record(job.index);
  }
  void clear(uint32_t slot) noexcept override { results[slot].reset(); }

  Gates gates;
  std::vector<std::optional<uint64_t>> results;
  OrderLog entered;
  OrderLog completed;
};

EngineConfig config(size_t workers, size_t window, bool in_order) {
  EngineConfig c;
  c.num_workers = workers;
  c.window = window;
  c.in_order = in_order;
  c.per_worker_queues = true;
  return c;
}

// Opens the gates in `order`, each only after the previous job completed, so
// the workers finish in exactly that order.
std::thread force_completion_order(GatedRunner& runner, std::vector<uint64_t> order) {
  return std::thread([&runner, order] {
    for (size_t i = 0; i < order.size(); ++i) {
      runner.gates.open(order[i]);
      runner.completed.wait_for(i + 1);
    }
  });
}

// `patient`: wait as long as it takes, past the engine's timeout (a test of
// the timeout itself must not time out again once the job may finish: on a
// loaded machine finishing can take longer than the timeout).
std::vector<uint64_t> collect(Engine& engine, GatedRunner& runner, size_t count,
                              Counter* delivered = nullptr, bool patient = false) {
  std::vector<uint64_t> got;
  for (size_t i = 0; i < count; ++i) {
    const ReadyJob ready = patient ? engine.wait_ready(std::chrono::steady_clock::time_point::max())
                                   : engine.wait_ready();
    if (delivered) delivered->bump();
    EXPECT_TRUE(runner.results[ready.slot].has_value());
    EXPECT_EQ(*runner.results[ready.slot], ready.index);
    got.push_back(ready.index);
    runner.clear(ready.slot);
    engine.release(ready);
  }
  return got;
}

const std::vector<uint64_t> kForced = {3, 7, 0, 5, 1, 6, 2, 4};

TEST(Engine, InOrderDeliversSamplerOrderWhateverTheCompletionOrder) {
  GatedRunner runner(8, 8);
  Engine engine(config(8, 8, true), runner);
  engine.begin_pass();
  for (int k = 0; k < 8; ++k) engine.submit(k % 8);
  std::thread opener = force_completion_order(runner, kForced);
  const auto got = collect(engine, runner, 8);
  opener.join();
  EXPECT_EQ(runner.completed.order(), kForced);  // the workers really finished in that order
  EXPECT_EQ(got, (std::vector<uint64_t>{0, 1, 2, 3, 4, 5, 6, 7}));
}

TEST(Engine, OutOfOrderDeliversEachBatchOnceAsItCompletes) {
  GatedRunner runner(8, 8);
  Engine engine(config(8, 8, false), runner);
  engine.begin_pass();
  for (int k = 0; k < 8; ++k) engine.submit(k % 8);
  // Here a job counts as finished once the consumer has it: the next gate
  // opens only then, so publication follows the forced order too.
  Counter delivered;
  std::thread opener([&] {
    for (size_t i = 0; i < kForced.size(); ++i) {
      runner.gates.open(kForced[i]);
      delivered.wait_for(i + 1);
    }
  });
  const auto got = collect(engine, runner, 8, &delivered);
  opener.join();
  EXPECT_EQ(got, kForced);
}

TEST(Engine, WindowRefillsAsTheConsumerReleases) {
  // 32 jobs through a window of 4 on 2 workers; completions forced in reverse
  // within each window's worth.
  const size_t total = 32, window = 4;
  GatedRunner runner(window, total);
  Engine engine(config(2, window, true), runner);
  engine.begin_pass();
  std::vector<uint64_t> got;
  size_t submitted = 0;
  while (got.size() < total) {
    while (engine.has_room() && submitted < total) engine.submit(static_cast<int>(submitted++ % 2));
    EXPECT_EQ(engine.stats().in_flight, std::min(window, total - got.size()));
    if (submitted < total) {
      EXPECT_FALSE(engine.has_room());
    }
    if (got.size() % window == 0) {
      // Open this window's gates last-first.
      for (size_t k = got.size() + window; k-- > got.size();) runner.gates.open(k);
    }
    const ReadyJob ready = engine.wait_ready();
    got.push_back(ready.index);
    runner.clear(ready.slot);
    engine.release(ready);
  }
  for (size_t i = 0; i < total; ++i) EXPECT_EQ(got[i], i);
}

TEST(Engine, SequenceNumbersWrapSafely) {
  for (bool in_order : {true, false}) {
    SCOPED_TRACE(in_order ? "in order" : "out of order");
    const size_t total = 200;
    GatedRunner runner(3, total);
    runner.gates.open_all();
    EngineConfig c = config(2, 3, in_order);
    c.first_seq = std::numeric_limits<uint64_t>::max() - 7;  // wraps after 8 jobs
    Engine engine(c, runner);
    engine.begin_pass();
    std::vector<uint64_t> got;
    std::vector<uint64_t> seqs;
    size_t submitted = 0;
    while (got.size() < total) {
      while (engine.has_room() && submitted < total) engine.submit(static_cast<int>(submitted++ % 2));
      const ReadyJob ready = engine.wait_ready();
      got.push_back(ready.index);
      seqs.push_back(ready.seq);
      runner.clear(ready.slot);
      engine.release(ready);
    }
    std::vector<uint64_t> sorted = got;
    std::sort(sorted.begin(), sorted.end());
    for (size_t i = 0; i < total; ++i) EXPECT_EQ(sorted[i], i);
    if (in_order) {
      EXPECT_EQ(got, sorted);
      EXPECT_EQ(seqs.front(), std::numeric_limits<uint64_t>::max() - 7);
      EXPECT_EQ(seqs[8], 0u);  // really wrapped
    }
  }
}

TEST(Engine, TimeoutNamesTheBatchItsWorkerAndTheLoadThenTheWaitCanResume) {
  GatedRunner runner(2, 2);
  EngineConfig c = config(1, 2, true);
  c.timeout = std::chrono::milliseconds(50);
  Engine engine(c, runner);
  engine.begin_pass();
  engine.submit(0);
  engine.submit(0);
  runner.entered.wait_for(1);  // worker 0 is inside batch 0
  try {
    engine.wait_ready();
    FAIL() << "no timeout";
  } catch (const conveyor::TimeoutError& e) {
    const std::string message = e.what();
    EXPECT_NE(message.find("DataLoader timed out after 0.05 seconds waiting for batch 0"), std::string::npos)
        << message;
    EXPECT_NE(message.find("worker 0 has been on it for"), std::string::npos) << message;
    EXPECT_NE(message.find("2 batches in flight"), std::string::npos) << message;
  }
  runner.gates.open_all();
  EXPECT_EQ(collect(engine, runner, 2, nullptr, /*patient=*/true), (std::vector<uint64_t>{0, 1}));
}

TEST(Engine, CancelSkipsQueuedJobsWaitsForTheRunningOneAndLeavesTheEngineUsable) {
  const size_t window = 4;
  GatedRunner runner(window, 16);
  Engine engine(config(1, window, true), runner);
  engine.begin_pass();
  for (int k = 0; k < 4; ++k) engine.submit(0);
  runner.entered.wait_for(1);  // job 0 runs; 1..3 wait behind it on worker 0
  std::thread opener([&] {
    // Let job 0 finish only once the cancellation has begun: then jobs 1..3
    // must be skipped (their gates stay shut, so running one would hang).
    while (engine.cancellations() == 0) std::this_thread::yield();
    runner.gates.open(0);
  });
  engine.cancel();  // returns only after job 0 finished
  opener.join();
  EXPECT_EQ(runner.completed.order(), (std::vector<uint64_t>{0}));
  EXPECT_EQ(engine.stats().in_flight, 0u);
  for (const auto& r : runner.results) EXPECT_FALSE(r.has_value());

  engine.begin_pass();  // the next pass starts at batch 0 again
  for (size_t k = 0; k < 4; ++k) runner.gates.open(k);
  for (int k = 0; k < 4; ++k) engine.submit(0);
  EXPECT_EQ(collect(engine, runner, 4), (std::vector<uint64_t>{0, 1, 2, 3}));
}

TEST(Engine, DestructionMidEpochWaitsForRunningJobs) {
  GatedRunner runner(4, 4);
  std::thread opener;
  {
    Engine engine(config(2, 4, false), runner);
    engine.begin_pass();
    for (int k = 0; k < 4; ++k) engine.submit(k % 2);
    runner.entered.wait_for(2);  // both workers are inside a job
    opener = std::thread([&] { runner.gates.open_all(); });
  }  // ~Engine: waits for what runs; what was still queued is skipped
  opener.join();
  // Nothing runs after the engine is gone: every job that started finished.
  const auto entered = runner.entered.order();
  const auto done = runner.completed.order();
  EXPECT_EQ(entered.size(), done.size());
  EXPECT_GE(done.size(), 2u);
}

TEST(Engine, WorkStealingRunsJobsOnAnyWorkerInSubmissionOrder) {
  const size_t total = 64;
  GatedRunner runner(8, total);
  runner.gates.open_all();
  EngineConfig c = config(4, 8, true);
  c.per_worker_queues = false;
  Engine engine(c, runner);
  engine.begin_pass();
  std::vector<uint64_t> got;
  size_t submitted = 0;
  while (got.size() < total) {
    while (engine.has_room() && submitted < total) {
      engine.submit(-1);
      ++submitted;
    }
    const ReadyJob ready = engine.wait_ready();
    got.push_back(ready.index);
    runner.clear(ready.slot);
    engine.release(ready);
  }
  for (size_t i = 0; i < total; ++i) EXPECT_EQ(got[i], i);
}

TEST(Executor, EnginesShareItsArenaAndItRefusesReservationsOnceStarted) {
  auto executor = std::make_shared<conveyor::detail::Executor>();
  ASSERT_TRUE(executor->reserve(2));
  ASSERT_TRUE(executor->reserve(1));
  GatedRunner runner_a(4, 4), runner_b(4, 4);
  Engine a(config(2, 4, true), runner_a, executor);
  EXPECT_FALSE(executor->reserve(1));  // the arena started with the first engine
  EXPECT_EQ(executor->reserved(), 3u);
  Engine b(config(1, 4, true), runner_b, executor);
  a.begin_pass();
  b.begin_pass();
  for (int k = 0; k < 4; ++k) {
    a.submit(k % 2);
    b.submit(0);
  }
  // All three lanes are inside a job at once: the arena holds them all.
  runner_a.entered.wait_for(2);
  runner_b.entered.wait_for(1);
  runner_a.gates.open_all();
  runner_b.gates.open_all();
  EXPECT_EQ(collect(a, runner_a, 4), (std::vector<uint64_t>{0, 1, 2, 3}));
  EXPECT_EQ(collect(b, runner_b, 4), (std::vector<uint64_t>{0, 1, 2, 3}));
}

// Counts jobs that ran as a worker another thread was running as.
class OverlapRunner final : public conveyor::detail::TaskRunner {
 public:
  explicit OverlapRunner(size_t workers) : busy(workers) {}
  void init_worker(int worker) override {
    if (worker < 0 || static_cast<size_t>(worker) >= busy.size()) out_of_range.fetch_add(1);
  }
  void run(Job&, int worker, const std::exception_ptr&) noexcept override {
    if (worker < 0 || static_cast<size_t>(worker) >= busy.size()) {
      out_of_range.fetch_add(1);
      return;
    }
    if (busy[static_cast<size_t>(worker)].fetch_add(1) != 0) overlaps.fetch_add(1);
    for (int spin = 0; spin < 2000; ++spin) conveyor::detail::cpu_relax();  // holds the worker a while
    busy[static_cast<size_t>(worker)].fetch_sub(1);
  }
  void clear(uint32_t) noexcept override {}

  std::vector<std::atomic<int>> busy;
  std::atomic<int> overlaps{0}, out_of_range{0};
};

// On an Executor shared by two engines the arena holds four threads; each
// engine's shared lane runs as its two workers, never one worker on two
// threads at once (arena slots 0 and 2 were both worker 0: thousands of
// overlaps in 3 runs of 7).
TEST(Executor, OnASharedArenaASharedLanesWorkersNeverRunTwice) {
  auto executor = std::make_shared<conveyor::detail::Executor>();
  ASSERT_TRUE(executor->reserve(2));
  ASSERT_TRUE(executor->reserve(2));
  OverlapRunner runner_a(2), runner_b(2);
  EngineConfig shared_lane = config(2, 8, false);
  shared_lane.per_worker_queues = false;
  Engine a(shared_lane, runner_a, executor), b(shared_lane, runner_b, executor);
  const auto drive = [](Engine& engine) {
    for (int pass = 0; pass < 20; ++pass) {
      engine.begin_pass();
      size_t submitted = 0, taken = 0;
      while (taken < 200) {
        while (submitted < 200 && engine.has_room()) {
          engine.submit(-1);
          ++submitted;
        }
        engine.release(engine.wait_ready());
        ++taken;
      }
    }
  };
  std::thread other([&] { drive(b); });
  drive(a);
  other.join();
  EXPECT_EQ(runner_a.overlaps.load(), 0);
  EXPECT_EQ(runner_b.overlaps.load(), 0);
  EXPECT_EQ(runner_a.out_of_range.load() + runner_b.out_of_range.load(), 0);
}

// As many workers as cores: no core to spare, so a consumer with wake_after
// parks for a run of jobs (EngineConfig::wake_after), if the window holds
// more than the workers keep busy behind the run: `run_room` more jobs.
size_t oversubscribing_workers() { return std::max(2, tbb::info::default_concurrency()); }
size_t window_with_room_for_runs(size_t workers, size_t run_room) { return workers + 1 + run_room; }

TEST(Engine, AConsumerWokenForARunStillTakesJobsInOrderWhateverTheCompletionOrder) {
  const char* given = std::getenv("CONVEYOR_ENGINE_SEED");
  const uint64_t seed = given ? std::strtoull(given, nullptr, 10) : std::random_device{}();
  std::printf("completion orders seed: %llu (replay with CONVEYOR_ENGINE_SEED=%llu)\n",
              static_cast<unsigned long long>(seed), static_cast<unsigned long long>(seed));
  std::fflush(stdout);
  std::mt19937_64 rng(seed);
  const size_t workers = oversubscribing_workers();
  const size_t jobs = window_with_room_for_runs(workers, 8);
  for (size_t wake_after : {1, 3, 8, 100}) {
    for (int round = 0; round < 5; ++round) {
      SCOPED_TRACE("seed " + std::to_string(seed) + ", wake_after " + std::to_string(wake_after) + ", round " +
                   std::to_string(round));
      // Job k runs on lane k % workers, a strand: a random interleaving of
      // the lanes, each in its own order, is an order the workers can finish in.
      std::vector<std::vector<uint64_t>> lanes(workers);
      for (uint64_t k = 0; k < jobs; ++k) lanes[k % workers].push_back(k);
      std::vector<size_t> next(workers, 0);
      std::vector<uint64_t> order;
      while (order.size() < jobs) {
        const size_t lane = rng() % workers;
        if (next[lane] < lanes[lane].size()) order.push_back(lanes[lane][next[lane]++]);
      }
      GatedRunner runner(jobs, jobs);
      EngineConfig c = config(workers, jobs, true);
      c.wake_after = wake_after;
      Engine engine(c, runner);
      engine.begin_pass();
      for (size_t k = 0; k < jobs; ++k) engine.submit(static_cast<int>(k % workers));
      std::thread opener = force_completion_order(runner, order);
      const auto got = collect(engine, runner, jobs);
      opener.join();
      EXPECT_EQ(runner.completed.order(), order);
      std::vector<uint64_t> in_order(jobs);
      std::iota(in_order.begin(), in_order.end(), uint64_t{0});
      EXPECT_EQ(got, in_order);
    }
  }
}

// Job 4 waits until the consumer has taken job 0: f depends on the consumer.
// A consumer parked for the run's last job (job 4 with wake_after 4) must
// stop waiting for it and take job 0, or neither moves. A watchdog opens job
// 4's gate after 20 s so that a failure ends, and says so.
TEST(Engine, AConsumerWaitingForARunTakesTheFirstJobWhenTheRunCannotFinishWithoutIt) {
  const size_t workers = oversubscribing_workers();
  const size_t jobs = window_with_room_for_runs(workers, 8);
  for (int round = 0; round < 100; ++round) {
    GatedRunner runner(jobs, jobs);
    EngineConfig c = config(workers, jobs, true);
    c.per_worker_queues = false;  // a blocked job holds one worker, not a strand
    c.wake_after = 4;
    Engine engine(c, runner);
    engine.begin_pass();
    for (uint64_t k = 0; k < jobs; ++k) {
      if (k != 0 && k != 4) runner.gates.open(k);
    }
    for (size_t k = 0; k < jobs; ++k) engine.submit(-1);
    Counter waiting, delivered;
    std::mutex mutex;
    std::condition_variable done_changed;
    bool done = false, rescued = false;
    std::thread opener([&] {
      waiting.wait_for(1);
      runner.gates.open(0);  // racing the consumer's wait, so that some rounds park first
      delivered.wait_for(1);
      runner.gates.open(4);
    });
    std::thread watchdog([&] {
      std::unique_lock lock(mutex);
      if (!done_changed.wait_for(lock, std::chrono::seconds(20), [&] { return done; })) {
        rescued = true;
        runner.gates.open(0);
        runner.gates.open(4);
      }
    });
    waiting.bump();
    const auto got = collect(engine, runner, jobs, &delivered, /*patient=*/true);
    {
      std::lock_guard lock(mutex);
      done = true;
    }
    done_changed.notify_all();
    watchdog.join();
    if (rescued) delivered.bump();  // the opener may still wait for a delivery
    opener.join();
    ASSERT_FALSE(rescued) << "round " << round << ": the consumer waited for job 4, which waited for it";
    std::vector<uint64_t> in_order(jobs);
    std::iota(in_order.begin(), in_order.end(), uint64_t{0});
    EXPECT_EQ(got, in_order);
  }
}

// Each job k waits until the consumer has taken job k - 1: no run can ever
// finish before its first job is taken, so every run wait would end at the
// bound (1 ms an item). Each such timeout halves the run; after a few, the
// consumer waits for each job again.
class WaitsOnTheConsumer final : public conveyor::detail::TaskRunner {
 public:
  explicit WaitsOnTheConsumer(size_t window) : results(window) {}
  void init_worker(int) override {}
  void run(Job& job, int, const std::exception_ptr&) noexcept override {
    if (job.index > 0) taken.wait_for(job.index);
    results[job.slot] = job.index;
  }
  void clear(uint32_t slot) noexcept override { results[slot].reset(); }
  Counter taken;
  std::vector<std::optional<uint64_t>> results;
};

TEST(Engine, RunWaitsThatTimeOutBehindAnFWaitingOnTheConsumerSwitchThemselvesOff) {
  const size_t workers = oversubscribing_workers();
  const size_t window = window_with_room_for_runs(workers, 32);
  WaitsOnTheConsumer runner(window);
  EngineConfig c = config(workers, window, true);
  c.per_worker_queues = false;
  c.wake_after = 32;
  Engine engine(c, runner);
  EXPECT_EQ(engine.stats().run_ahead, 32u);
  engine.begin_pass();
  const size_t total = 300;
  size_t submitted = 0;
  for (uint64_t k = 0; k < total; ++k) {
    while (engine.has_room() && submitted < total) {
      engine.submit(-1);
      ++submitted;
    }
    const ReadyJob ready = engine.wait_ready(std::chrono::steady_clock::time_point::max());
    ASSERT_EQ(ready.index, k);
    ASSERT_EQ(runner.results[ready.slot], std::optional<uint64_t>(k));
    runner.clear(ready.slot);
    engine.release(ready);
    runner.taken.bump();
  }
  EXPECT_EQ(engine.stats().run_ahead, 0u);
}

TEST(Seeds, WorkStealingSeedsDependOnlyOnBaseSeedEpochAndBatch) {
  using conveyor::detail::work_stealing_seed;
  EXPECT_EQ(work_stealing_seed(5, 1, 9), work_stealing_seed(5, 1, 9));
  EXPECT_NE(work_stealing_seed(5, 1, 9), work_stealing_seed(5, 1, 10));
  EXPECT_NE(work_stealing_seed(5, 1, 9), work_stealing_seed(5, 2, 9));
  EXPECT_NE(work_stealing_seed(5, 1, 9), work_stealing_seed(6, 1, 9));
}

// ---- ThreadSanitizer's suppressions hide no race of ours --------------------
#if defined(__SANITIZE_THREAD__)
constexpr bool kThreadSanitizer = true;
#else
constexpr bool kThreadSanitizer = false;
#endif

int written_without_sync = 0;  // the race's target; plain on purpose

// An element whose move reads what another thread writes unsynchronised:
// out of line, so its frame is its own inside the queue's enqueue.
struct RacyElement {
  RacyElement() = default;
  [[gnu::noinline]] RacyElement(RacyElement&& other) noexcept
      : value(other.value + written_without_sync) {}
  int value = 0;
};

[[noreturn]] void race_on_an_element_moved_through_the_queue() {
  moodycamel::ConcurrentQueue<RacyElement> queue;
  std::thread writer([] { written_without_sync = 1; });
  queue.enqueue(RacyElement{});
  writer.join();
  std::_Exit(0);  // TSan (halt_on_error) exits 66 before this on a report
}

// ---- SequencedWindow: the window with its payloads ----------------------

// A slot's payload: the consumer's input and what the worker made of it. The
// input is a shared_ptr so a test can see whether a slot still holds it.
struct GatedPayload {
  std::shared_ptr<uint64_t> input;
  std::optional<uint64_t> output;
};

// Each job waits at the gate of its batch index, then writes 10 x its input.
class GatedWork final : public conveyor::detail::SequencedWindow<GatedPayload>::Work {
 public:
  explicit GatedWork(size_t jobs) : gates(jobs) {}
  void run(Job& job, conveyor::detail::NoInput&, GatedPayload& payload, int,
           const std::exception_ptr&) noexcept override {
    entered.record(job.index);
    gates.wait(job.index);
    payload.output = *payload.input * 10;
    completed.record(job.index);
  }
  Gates gates;
  OrderLog entered;
  OrderLog completed;
};

using GatedWindow = conveyor::detail::SequencedWindow<GatedPayload>;

std::shared_ptr<uint64_t> submit_input(GatedWindow& window, uint64_t value, int worker) {
  auto input = std::make_shared<uint64_t>(value);
  window.next_payload().input = input;
  window.submit(worker);
  return input;
}

TEST(SequencedWindow, EachPayloadComesOutWithItsTurnWhateverTheCompletionOrder) {
  for (const bool in_order : {true, false}) {
    SCOPED_TRACE(in_order ? "in order" : "out of order");
    const std::vector<uint64_t> finish = {2, 0, 3, 1};
    GatedWork work(finish.size());
    GatedWindow window(config(4, 4, in_order), work);
    window.begin_pass();
    std::vector<std::shared_ptr<uint64_t>> inputs;
    for (uint64_t k = 0; k < 4; ++k) inputs.push_back(submit_input(window, 100 + k, static_cast<int>(k)));
    EXPECT_FALSE(window.has_room());
    // Out of order a job counts as finished once the consumer has it, so
    // publication follows the forced order too (a job records completion
    // just before it publishes).
    Counter delivered;
    std::thread opener([&] {
      for (size_t i = 0; i < finish.size(); ++i) {
        work.gates.open(finish[i]);
        if (in_order) {
          work.completed.wait_for(i + 1);
        } else {
          delivered.wait_for(i + 1);
        }
      }
    });
    std::vector<uint64_t> order;
    for (int k = 0; k < 4; ++k) {
      GatedWindow::Taken taken = window.take();
      delivered.bump();
      order.push_back(taken.index);
      ASSERT_TRUE(taken.payload.output.has_value());
      EXPECT_EQ(*taken.payload.output, (100 + taken.index) * 10);  // its own input's result
      EXPECT_EQ(taken.payload.input, inputs[taken.index]);
      EXPECT_EQ(taken.lane, static_cast<int>(taken.index));
    }
    opener.join();
    EXPECT_EQ(order, in_order ? std::vector<uint64_t>({0, 1, 2, 3}) : finish);
    // Taken payloads leave their slots empty: only the test holds the inputs.
    for (const auto& input : inputs) EXPECT_EQ(input.use_count(), 1);
    EXPECT_TRUE(window.has_room());
    EXPECT_FALSE(window.try_take().has_value());
  }
}

TEST(SequencedWindow, CancelEmptiesEveryPayloadAndTheWindowGoesOn) {
  GatedWork work(8);
  GatedWindow window(config(1, 4, true), work);
  window.begin_pass();
  std::vector<std::shared_ptr<uint64_t>> inputs;
  for (uint64_t k = 0; k < 4; ++k) inputs.push_back(submit_input(window, k, 0));
  work.entered.wait_for(1);  // job 0 runs; 1..3 queue behind it
  std::thread opener([&] {
    while (window.cancellations() == 0) std::this_thread::yield();
    work.gates.open(0);
  });
  window.cancel();
  opener.join();
  EXPECT_EQ(window.in_flight(), 0u);
  // The run job's and the skipped jobs' payloads are gone alike.
  for (const auto& input : inputs) EXPECT_EQ(input.use_count(), 1);

  window.begin_pass();
  for (size_t k = 0; k < 4; ++k) work.gates.open(k);
  submit_input(window, 7, 0);
  GatedWindow::Taken taken = window.take();
  EXPECT_EQ(taken.index, 0u);
  EXPECT_EQ(taken.payload.output, std::optional<uint64_t>(70));
}

TEST(SequencedWindow, DestructionMidPassFreesEveryPayload) {
  GatedWork work(4);
  std::vector<std::shared_ptr<uint64_t>> inputs;
  std::thread opener;
  {
    GatedWindow window(config(2, 4, false), work);
    window.begin_pass();
    for (uint64_t k = 0; k < 4; ++k) inputs.push_back(submit_input(window, k, static_cast<int>(k % 2)));
    work.entered.wait_for(2);
    opener = std::thread([&] { work.gates.open_all(); });
  }
  opener.join();
  for (const auto& input : inputs) EXPECT_EQ(input.use_count(), 1);
}

// Each job sums its input into its payload once its gate opens.
class SummingWork final : public conveyor::detail::SequencedWindow<std::optional<int>, std::vector<int>>::Work {
 public:
  explicit SummingWork(size_t jobs) : gates(jobs) {}
  void run(Job& job, std::vector<int>& input, std::optional<int>& sum, int,
           const std::exception_ptr&) noexcept override {
    gates.wait(job.index);
    sum = 0;
    for (const int v : input) *sum += v;
  }
  Gates gates;
};

TEST(SequencedWindow, InputsStayInTheirSlotsForTheNextJobAndCancelFreesThem) {
  using Window = conveyor::detail::SequencedWindow<std::optional<int>, std::vector<int>>;
  SummingWork work(4);
  Window window(config(1, 1, true), work, nullptr, conveyor::detail::InputsAfterTake::keep);
  window.begin_pass();
  window.next_input().assign(100, 1);
  const int* storage = window.next_input().data();
  window.submit(0);
  work.gates.open(0);
  EXPECT_EQ(window.take().payload, std::optional<int>(100));
  // The slot's vector is reused: the next input of that size is written into
  // the same storage (no allocation once warm).
  window.next_input().assign(100, 2);
  EXPECT_EQ(window.next_input().data(), storage);
  window.submit(0);
  work.gates.open(1);
  EXPECT_EQ(window.take().payload, std::optional<int>(200));
  // A cancelled job's input goes with it.
  window.next_input().assign(100, 3);
  window.submit(0);  // job 2: its gate stays shut until the cancel has begun
  std::thread opener([&] {
    while (window.cancellations() == 0) std::this_thread::yield();
    work.gates.open(2);
  });
  window.cancel();
  opener.join();
  EXPECT_EQ(window.next_input().capacity(), 0u);
}

TEST(SequencedWindow, InputsAreFreedWhenTheirResultIsTakenByDefault) {
  using Window = conveyor::detail::SequencedWindow<std::optional<int>, std::vector<int>>;
  SummingWork work(1);
  Window window(config(1, 1, true), work);
  window.begin_pass();
  window.next_input().assign(100, 1);
  window.submit(0);
  work.gates.open(0);
  EXPECT_EQ(window.take().payload, std::optional<int>(100));
  EXPECT_EQ(window.next_input().capacity(), 0u);  // freed by take(), on this thread
}

// Out of order, a job handed out and not yet released is done: the timeout
// names the job still running (it named batch 0, "queued for worker 0, not
// started", while batch 1 was the one stuck).
TEST(Engine, AnOutOfOrderTimeoutNamesTheJobNotYetDone) {
  GatedRunner runner(4, 2);
  EngineConfig c = config(2, 4, false);
  c.timeout = std::chrono::milliseconds(50);
  Engine engine(c, runner);
  engine.begin_pass();
  engine.submit(0);
  engine.submit(1);
  runner.gates.open(0);
  const ReadyJob first = engine.wait_ready(std::chrono::steady_clock::time_point::max());
  ASSERT_EQ(first.index, 0u);
  runner.entered.wait_for(2);  // worker 1 is inside batch 1
  try {
    engine.wait_ready();
    FAIL() << "no timeout";
  } catch (const conveyor::TimeoutError& e) {
    const std::string message = e.what();
    EXPECT_NE(message.find("waiting for batch 1 (worker 1 has been on it for"), std::string::npos) << message;
  }
  runner.clear(first.slot);
  engine.release(first);
  runner.gates.open_all();
  EXPECT_EQ(collect(engine, runner, 1, nullptr, /*patient=*/true), (std::vector<uint64_t>{1}));
}

TEST(Engine, TimeoutMessagesNameTheirSubjectAndJobs) {
  GatedRunner runner(1, 1);
  EngineConfig c = config(1, 1, true);
  c.timeout = std::chrono::milliseconds(20);
  c.timeout_subject = "map(workers=1)";
  c.job_noun = "item";
  c.jobs_noun = "items";
  Engine engine(c, runner);
  engine.begin_pass();
  engine.submit(0);
  runner.entered.wait_for(1);
  try {
    engine.wait_ready();
    FAIL() << "no timeout";
  } catch (const conveyor::TimeoutError& e) {
    const std::string message = e.what();
    EXPECT_NE(message.find("map(workers=1) timed out after 0.02 seconds waiting for item 0"), std::string::npos)
        << message;
    EXPECT_NE(message.find("1 items in flight"), std::string::npos) << message;
  }
  runner.gates.open_all();
  EXPECT_EQ(collect(engine, runner, 1, nullptr, /*patient=*/true), (std::vector<uint64_t>{0}));
}

TEST(ThreadSanitizer, ARaceInAnElementMovedThroughTheQueueIsReported) {
  // The suppression for moodycamel's own block recycling once matched any
  // frame ("race:"), so it hid every race under an enqueue, ours too. It
  // matches the queue's file in the top frame only now.
  if (!kThreadSanitizer) GTEST_SKIP() << "checks the TSan build's suppressions; CI runs it there";
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(race_on_an_element_moved_through_the_queue(), ::testing::ExitedWithCode(66),
              "ThreadSanitizer: data race");
}

}  // namespace
