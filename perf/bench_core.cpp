// Microbenchmarks of conveyor's core pieces: generator draws, samplers,
// collate bandwidth against a plain memcpy of the same bytes.
#include <benchmark/benchmark.h>

#include <conveyor/conveyor.h>

#include <cstring>
#include <string>
#include <vector>

namespace {

void BM_Randperm(benchmark::State& state) {
  conveyor::Generator g(0);
  std::vector<size_t> out(static_cast<size_t>(state.range(0)));
  for (auto _ : state) {
    conveyor::randperm(std::span<size_t>(out), g);
    benchmark::DoNotOptimize(out.data());
  }
  state.SetItemsProcessed(state.iterations() * state.range(0));
}
BENCHMARK(BM_Randperm)->Arg(60000)->Arg(1 << 20);

void BM_BatchSamplerEpoch(benchmark::State& state) {
  auto inner = std::make_shared<conveyor::RandomSampler>(60000, false, std::nullopt, conveyor::Generator(1));
  conveyor::BatchSampler sampler(inner, state.range(0), false);
  conveyor::BatchIndices batch;
  for (auto _ : state) {
    auto it = sampler.iter();
    while (it->next(batch)) benchmark::DoNotOptimize(batch.data());
  }
  state.SetItemsProcessed(state.iterations() * 60000);
}
BENCHMARK(BM_BatchSamplerEpoch)->Arg(8)->Arg(256);

// Stacking B samples of 3x32x32 floats against one memcpy of the same bytes.
void BM_CollateStack(benchmark::State& state) {
  const auto batch = static_cast<size_t>(state.range(0));
  std::vector<conveyor::Array<float>> samples;
  for (size_t i = 0; i < batch; ++i) {
    conveyor::Array<float> a({3, 32, 32});
    std::memset(a.data(), 1, a.numel() * sizeof(float));
    samples.push_back(a);
  }
  for (auto _ : state) {
    auto copy = samples;
    auto out = conveyor::default_collate(std::move(copy));
    benchmark::DoNotOptimize(out.data());
  }
  state.SetBytesProcessed(state.iterations() * static_cast<int64_t>(batch * 3 * 32 * 32 * sizeof(float)));
}
BENCHMARK(BM_CollateStack)->Arg(256);

void BM_MemcpyLimit(benchmark::State& state) {
  const size_t bytes = static_cast<size_t>(state.range(0)) * 3 * 32 * 32 * sizeof(float);
  std::vector<char> from(bytes, 1), to(bytes);
  for (auto _ : state) {
    std::memcpy(to.data(), from.data(), bytes);
    benchmark::DoNotOptimize(to.data());
  }
  state.SetBytesProcessed(state.iterations() * static_cast<int64_t>(bytes));
}
BENCHMARK(BM_MemcpyLimit)->Arg(256);


// Checkpoints of the trainer's loader (60,000 samples, batch 64, shuffled,
// 2 workers, persistent), 400 batches into an epoch: taking a state (to
// JSON text), and loading it into a new loader up to its first batch (the
// sampler's replay of 400 batches included). Arg: 0 work_stealing, 1
// round_robin. The state's size is reported as a counter.
struct Pixels final : conveyor::Dataset<int64_t> {
  size_t size() const override { return 60000; }
  int64_t get(size_t i) override { return static_cast<int64_t>(i) + conveyor::default_generator().random() % 7; }
};

conveyor::LoaderOptions checkpoint_options(int64_t mode) {
  return {.batch_size = 64, .shuffle = true, .num_workers = 2, .persistent_workers = true, .seed = 3,
          .scheduling = mode ? conveyor::Scheduling::round_robin : conveyor::Scheduling::work_stealing};
}

void BM_LoaderStateDict(benchmark::State& state) {
  auto dataset = std::make_shared<Pixels>();
  conveyor::DataLoader loader(dataset, checkpoint_options(state.range(0)));
  auto epoch = loader.iter();
  for (int i = 0; i < 400; ++i) epoch.next();
  size_t bytes = 0;
  for (auto _ : state) {
    const std::string text = loader.state_dict().to_json();
    bytes = text.size();
    benchmark::DoNotOptimize(text.data());
  }
  state.counters["state_bytes"] = static_cast<double>(bytes);
}
BENCHMARK(BM_LoaderStateDict)->Arg(0)->Arg(1)->Unit(benchmark::kMicrosecond);

void BM_LoaderLoadStateDict(benchmark::State& state) {
  auto dataset = std::make_shared<Pixels>();
  std::string text;
  {
    conveyor::DataLoader loader(dataset, checkpoint_options(state.range(0)));
    auto epoch = loader.iter();
    for (int i = 0; i < 400; ++i) epoch.next();
    text = loader.state_dict().to_json();
  }
  for (auto _ : state) {
    conveyor::DataLoader loader(dataset, checkpoint_options(state.range(0)));
    loader.load_state_dict(conveyor::State::from_json(text));
    auto epoch = loader.iter();
    benchmark::DoNotOptimize(epoch.next());
  }
}
BENCHMARK(BM_LoaderLoadStateDict)->Arg(0)->Arg(1)->Unit(benchmark::kMicrosecond);

// A node's decision log in a checkpoint: Arg 26-bit integers as JSON text,
// parsed (packed, 8 bytes a value) and written back. Peak memory of a whole
// load is measured with /usr/bin/time in the commit that packed them.
void BM_StateIntegerList(benchmark::State& state) {
  std::vector<uint64_t> values(static_cast<size_t>(state.range(0)));
  uint64_t x = 88172645463325252ull;
  for (uint64_t& value : values) {
    x ^= x << 13, x ^= x >> 7, x ^= x << 17;
    value = x & ((1u << 26) - 1);
  }
  const std::string text = conveyor::State::list(values).to_json();
  for (auto _ : state) {
    const conveyor::State parsed = conveyor::State::from_json(text);
    benchmark::DoNotOptimize(parsed.to_json().size());
  }
  state.SetItemsProcessed(state.iterations() * state.range(0));
  state.counters["text_bytes"] = static_cast<double>(text.size());
}
BENCHMARK(BM_StateIntegerList)->Arg(1 << 20)->Unit(benchmark::kMillisecond);

}  // namespace
