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

#include <cstdint>
#include <memory>
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
    results[job.slot] = job.batch_index;
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
  config.per_batch_generators = work_stealing;
  NullRunner runner(config.window);
  conveyor::detail::Engine engine(config, runner);
  engine.begin_epoch(0, 0);
  size_t next_worker = 0;
  auto fill = [&] {
    while (engine.has_room()) {
      engine.submit(work_stealing ? -1 : static_cast<int>(next_worker), {});
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

}  // namespace
