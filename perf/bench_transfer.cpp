// The transfer stage on a real GPU (skipped, with a message, without one):
//   - H2D throughput through the stage (loader with pin_memory and
//     prefetch_to_device) against a raw pinned cudaMemcpyAsync loop of the
//     same bytes, in the same run;
//   - overlap: a compute kernel on the trainer's stream while the stage copies
//     the next batches; reports how much of the copy time stays hidden.
#include <benchmark/benchmark.h>
#include <cuda_runtime_api.h>

#include <conveyor/conveyor.h>
#include <conveyor/cuda.h>

#include <chrono>
#include <cstring>
#include <vector>

extern "C" cudaError_t conveyor_launch_busy_kernel(float* data, int n, int rounds, cudaStream_t stream);

namespace {

bool skip_without_gpu(benchmark::State& state) {
  if (conveyor::cuda::device_count() > 0) return false;
  state.SkipWithError("no CUDA device here: transfer benchmarks are unmeasured on this machine");
  return true;
}

// Batches of `floats` floats each (an image batch, say), made on the workers.
struct Floats final : conveyor::Dataset<conveyor::Array<float>> {
  explicit Floats(size_t floats) : floats(floats) {}
  size_t size() const override { return 1 << 20; }
  conveyor::Array<float> get(size_t i) override {
    conveyor::Array<float> sample({static_cast<int64_t>(floats)});
    std::memset(sample.data(), static_cast<int>(i & 0xff), floats * sizeof(float));
    return sample;
  }
  size_t floats;
};

void BM_RawPinnedCopy(benchmark::State& state) {
  if (skip_without_gpu(state)) return;
  const auto bytes = static_cast<size_t>(state.range(0));
  void* host = nullptr;
  void* device = nullptr;
  cudaStream_t stream = nullptr;
  cudaHostAlloc(&host, bytes, cudaHostAllocDefault);
  cudaMalloc(&device, bytes);
  cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
  for (auto _ : state) {
    cudaMemcpyAsync(device, host, bytes, cudaMemcpyHostToDevice, stream);
    cudaStreamSynchronize(stream);
  }
  state.SetBytesProcessed(state.iterations() * static_cast<int64_t>(bytes));
  cudaStreamDestroy(stream);
  cudaFree(device);
  cudaFreeHost(host);
}
BENCHMARK(BM_RawPinnedCopy)->Arg(1 << 20)->Arg(12 << 20)->UseRealTime();

// Args: batch bytes, workers. The workers make each sample (a memset) and
// collate it into the pinned pool, so with few of them this measures the
// host side, not the copy engine: compare against BM_RawPinnedCopy.
void BM_StageCopy(benchmark::State& state) {
  if (skip_without_gpu(state)) return;
  const auto batch_bytes = static_cast<size_t>(state.range(0));
  const auto workers = static_cast<int>(state.range(1));
  const int64_t batch = 64;
  Floats dataset(batch_bytes / sizeof(float) / batch);
  auto device = conveyor::cuda::make_device(0);
  conveyor::DataLoader loader(dataset, {.batch_size = batch, .num_workers = workers, .persistent_workers = true,
                                        .pin_memory = true, .transfer_device = device, .prefetch_to_device = 2});
  auto epoch = loader.iter();
  for (auto _ : state) {
    auto next = epoch.next();
    epoch.device().ready.synchronize();
    benchmark::DoNotOptimize(next);
  }
  state.SetBytesProcessed(state.iterations() * static_cast<int64_t>(batch_bytes));
}
BENCHMARK(BM_StageCopy)->Args({1 << 20, 4})->Args({12 << 20, 4})->Args({12 << 20, 12})->UseRealTime();

// Compute on the trainer's stream that waits on each batch's event; the
// counter "hidden" is 1 - (time with copies - compute alone) / copy time.
void BM_OverlapUnderCompute(benchmark::State& state) {
  if (skip_without_gpu(state)) return;
  const size_t batch_bytes = 12 << 20;
  const int64_t batch = 64;
  Floats dataset(batch_bytes / sizeof(float) / batch);
  auto device = conveyor::cuda::make_device(0);
  conveyor::DataLoader loader(dataset, {.batch_size = batch, .num_workers = 4, .persistent_workers = true,
                                        .pin_memory = true, .transfer_device = device, .prefetch_to_device = 2});
  cudaStream_t compute = nullptr;
  cudaStreamCreateWithFlags(&compute, cudaStreamNonBlocking);
  float* work = nullptr;
  const int n = 1 << 22;
  cudaMalloc(reinterpret_cast<void**>(&work), n * sizeof(float));
  const int rounds = static_cast<int>(state.range(0));
  auto epoch = loader.iter();
  for (auto _ : state) {
    auto next = epoch.next();
    cudaStreamWaitEvent(compute, static_cast<cudaEvent_t>(epoch.device().ready.native()), 0);
    conveyor_launch_busy_kernel(work, n, rounds, compute);
    cudaStreamSynchronize(compute);
    benchmark::DoNotOptimize(next);
  }
  state.SetBytesProcessed(state.iterations() * static_cast<int64_t>(batch_bytes));
  cudaFree(work);
  cudaStreamDestroy(compute);
}
BENCHMARK(BM_OverlapUnderCompute)->Arg(0)->Arg(2000)->Arg(8000)->UseRealTime();

}  // namespace
