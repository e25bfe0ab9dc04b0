// The engine's cost per batch, with no work in the batch: what the runtime
// itself adds between the sampler and the consumer.
//
// Contention model: one consumer (the benchmark thread) submits, waits and
// releases; W workers take jobs from their queues and publish. A batch costs
// a queue hand-off each way plus, when a side ran dry, a wake-up; the window
// (prefetch_factor x W) decides how often either side runs dry.
//
// Reported per batch: real ns, and context switches (voluntary +
// involuntary, all threads of the process, from getrusage).
#include <benchmark/benchmark.h>
#include <sys/resource.h>

#include <conveyor/conveyor.h>
#include <conveyor/detail/engine.h>

#include <concurrentqueue.h>

#include <atomic>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace {

long context_switches() {
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  return usage.ru_nvcsw + usage.ru_nivcsw;
}

// Produces nothing: the hand-off alone.
class NullRunner final : public conveyor::detail::TaskRunner {
 public:
  explicit NullRunner(size_t window) : results(window) {}
  void init_worker(int) override {}
  void run(conveyor::detail::Job& job, int, const std::exception_ptr&) noexcept override {
    results[job.slot] = job.index;
  }
  void clear(uint32_t slot) noexcept override { results[slot] = 0; }
  std::vector<uint64_t> results;
};

void BM_WindowHandoff(benchmark::State& state) {
  const auto workers = static_cast<size_t>(state.range(0));
  const auto prefetch = static_cast<size_t>(state.range(1));
  const bool work_stealing = state.range(2) != 0;
  conveyor::detail::EngineConfig config;
  config.num_workers = workers;
  config.window = workers * prefetch;
  config.per_worker_queues = !work_stealing;
  NullRunner runner(config.window);
  conveyor::detail::Engine engine(config, runner);
  engine.begin_pass();
  size_t next_worker = 0;
  auto fill = [&] {
    while (engine.has_room()) {
      engine.submit(work_stealing ? -1 : static_cast<int>(next_worker));
      next_worker = (next_worker + 1) % workers;
    }
  };
  fill();
  const long switches_before = context_switches();
  uint64_t checksum = 0;
  for (auto _ : state) {
    const auto ready = engine.wait_ready();
    checksum += runner.results[ready.slot];
    engine.release(ready);
    fill();
  }
  const long switches = context_switches() - switches_before;
  benchmark::DoNotOptimize(checksum);
  state.counters["ctx_switches/batch"] =
      benchmark::Counter(static_cast<double>(switches) / static_cast<double>(state.iterations()));
  state.SetItemsProcessed(state.iterations());
  engine.cancel();
}
BENCHMARK(BM_WindowHandoff)
    ->ArgNames({"workers", "prefetch", "stealing"})
    ->Args({1, 2, 0})
    ->Args({1, 8, 0})
    ->Args({2, 2, 0})
    ->Args({2, 8, 0})
    ->Args({4, 2, 0})
    ->Args({2, 8, 1})
    ->UseRealTime()
    ->MinTime(0.5);

// W0 of the perf suite: 8-byte samples, batch 8, through the whole loader
// (sampler, fetch, default collate, reorder window).
struct Tiny final : conveyor::Dataset<int64_t> {
  size_t size() const override { return 1 << 16; }
  int64_t get(size_t i) override { return static_cast<int64_t>(i); }
};

void BM_LoaderTinySamples(benchmark::State& state) {
  const int workers = static_cast<int>(state.range(0));
  Tiny dataset;
  conveyor::DataLoader loader(dataset, {.batch_size = 8, .shuffle = true, .num_workers = workers,
                                        .prefetch_factor = workers > 0 ? 8 : 2,
                                        .persistent_workers = workers > 0, .seed = 1});
  std::unique_ptr<conveyor::DataLoader<Tiny>::Epoch> epoch;
  int64_t checksum = 0;
  const long switches_before = context_switches();
  for (auto _ : state) {
    if (!epoch) epoch = std::make_unique<conveyor::DataLoader<Tiny>::Epoch>(loader.iter());
    auto batch = epoch->next();
    if (!batch) {
      epoch.reset();
      continue;
    }
    checksum += (*batch)[0];
  }
  const long switches = context_switches() - switches_before;
  benchmark::DoNotOptimize(checksum);
  state.counters["ctx_switches/batch"] =
      benchmark::Counter(static_cast<double>(switches) / static_cast<double>(state.iterations()));
  state.SetItemsProcessed(state.iterations());
}
BENCHMARK(BM_LoaderTinySamples)->ArgName("workers")->Arg(0)->Arg(1)->Arg(2)->Arg(4)->UseRealTime()->MinTime(0.5);

// The queue under the hand-off: one producer (the benchmark thread) and one
// consumer thread moving 8-byte items through a moodycamel ConcurrentQueue
// (the engine's queue, with a producer token) and, in the same run, through a
// mutex-guarded deque, the obvious peer. Each side polls (no parking), so this
// is the queue's own cost under two-thread contention.
template <class Queue>
void queue_pair(benchmark::State& state, Queue& queue) {
  std::atomic<bool> stop{false};
  std::atomic<uint64_t> received{0};
  std::thread consumer([&] {
    uint64_t item = 0, count = 0;
    // Relaxed: `stop` only ends the loop; the join below orders the rest.
    while (!stop.load(std::memory_order_relaxed)) {
      if (queue.pop(item)) ++count;
    }
    while (queue.pop(item)) ++count;
    received.store(count, std::memory_order_relaxed);  // read after join()
  });
  uint64_t sent = 0;
  for (auto _ : state) {
    queue.push(sent++);
    // Bound the backlog so both queues stay in their steady state.
    if ((sent & 1023) == 0) {
      while (queue.approx_size() > 4096) std::this_thread::yield();
    }
  }
  stop.store(true, std::memory_order_relaxed);
  consumer.join();
  if (received.load(std::memory_order_relaxed) != sent) state.SkipWithError("items lost");
  state.SetItemsProcessed(state.iterations());
}

struct MoodycamelQueue {
  moodycamel::ConcurrentQueue<uint64_t> queue;
  moodycamel::ProducerToken token{queue};
  void push(uint64_t item) { queue.enqueue(token, item); }
  bool pop(uint64_t& item) { return queue.try_dequeue(item); }
  size_t approx_size() const { return queue.size_approx(); }
};

struct MutexQueue {
  std::mutex mutex;
  std::deque<uint64_t> items;
  void push(uint64_t item) {
    std::lock_guard lock(mutex);
    items.push_back(item);
  }
  bool pop(uint64_t& item) {
    std::lock_guard lock(mutex);
    if (items.empty()) return false;
    item = items.front();
    items.pop_front();
    return true;
  }
  size_t approx_size() {
    std::lock_guard lock(mutex);
    return items.size();
  }
};

void BM_QueueMoodycamel(benchmark::State& state) {
  MoodycamelQueue queue;
  queue_pair(state, queue);
}
BENCHMARK(BM_QueueMoodycamel)->UseRealTime()->MinTime(0.5);

void BM_QueueMutexDeque(benchmark::State& state) {
  MutexQueue queue;
  queue_pair(state, queue);
}
BENCHMARK(BM_QueueMutexDeque)->UseRealTime()->MinTime(0.5);

// The machine's floor for any hand-off: one cache line bounced between the
// benchmark thread and another, both spinning. An iteration is a round trip
// (two one-way transfers), the least a batch can cost that crosses to a
// worker and back; the hand-off above is judged against it in the same run.
void BM_CacheLineRoundTrip(benchmark::State& state) {
  alignas(64) std::atomic<uint64_t> turn{0};
  constexpr uint64_t kStop = UINT64_MAX;
  std::thread echo([&] {
    uint64_t seen = 0;
    while (true) {
      // Acquire/release: each side's store hands the line, and the turn, to
      // the other; nothing else is shared.
      const uint64_t now = turn.load(std::memory_order_acquire);
      if (now == kStop) return;
      if (now != seen && (now & 1) == 1) {
        seen = now + 1;
        turn.store(seen, std::memory_order_release);
      }
    }
  });
  uint64_t next = 1;
  for (auto _ : state) {
    turn.store(next, std::memory_order_release);
    while (turn.load(std::memory_order_acquire) != next + 1) {
    }
    next += 2;
  }
  turn.store(kStop, std::memory_order_release);
  echo.join();
  state.SetItemsProcessed(state.iterations());
}
BENCHMARK(BM_CacheLineRoundTrip)->UseRealTime()->MinTime(0.5);

}  // namespace
