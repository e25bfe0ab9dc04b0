// Microbenchmarks of conveyor's core pieces: generator draws, samplers,
// collate bandwidth against a plain memcpy of the same bytes.
#include <benchmark/benchmark.h>

#include <conveyor/conveyor.h>

#include <cstring>
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

}  // namespace
