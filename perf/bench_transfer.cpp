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

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
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

// The next batch, in a new epoch where the last one ended: a fast stage
// would otherwise run past the end and time empty next() calls.
template <class Loader, class Epoch>
auto next_batch(Loader& loader, std::optional<Epoch>& epoch) {
  auto batch = epoch->next();
  if (!batch) {
    epoch.reset();  // a persistent loader runs one epoch at a time
    epoch.emplace(loader.iter());
    batch = epoch->next();
  }
  return batch;
}

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
  std::optional<decltype(loader.iter())> epoch;
  epoch.emplace(loader.iter());
  for (auto _ : state) {
    auto next = next_batch(loader, epoch);
    epoch->device().ready.synchronize();
    benchmark::DoNotOptimize(next);
  }
  state.SetBytesProcessed(state.iterations() * static_cast<int64_t>(batch_bytes));
}
BENCHMARK(BM_StageCopy)->Args({1 << 20, 4})->Args({12 << 20, 4})->Args({12 << 20, 12})->UseRealTime();

// The trainer's compute: a kernel of `rounds` on 4M floats, on a stream of
// its own, waited for.
struct TrainerKernel {
  static constexpr int kFloats = 1 << 22;
  TrainerKernel() {
    cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
    cudaMalloc(reinterpret_cast<void**>(&data), kFloats * sizeof(float));
  }
  ~TrainerKernel() {
    cudaFree(data);
    cudaStreamDestroy(stream);
  }
  TrainerKernel(const TrainerKernel&) = delete;
  TrainerKernel& operator=(const TrainerKernel&) = delete;
  void run(int rounds) {
    conveyor_launch_busy_kernel(data, kFloats, rounds, stream);
    cudaStreamSynchronize(stream);
  }
  cudaStream_t stream = nullptr;
  float* data = nullptr;
};

// Counts the pinned and device allocations a loader makes (each a driver
// call; cudaFree and cudaFreeHost synchronise the whole device).
class CountingDevice final : public conveyor::TransferDevice {
 public:
  explicit CountingDevice(std::shared_ptr<conveyor::TransferDevice> inner) : inner_(std::move(inner)) {}
  std::string name() const override { return inner_->name(); }
  void* allocate_pinned(size_t bytes) override {
    allocations.fetch_add(1, std::memory_order_relaxed);  // a count only
    return inner_->allocate_pinned(bytes);
  }
  void free_pinned(void* memory) noexcept override { inner_->free_pinned(memory); }
  void* allocate_device(size_t bytes) override {
    allocations.fetch_add(1, std::memory_order_relaxed);
    return inner_->allocate_device(bytes);
  }
  void free_device(void* memory) noexcept override { inner_->free_device(memory); }
  void copy_to_device(void* device, const void* host, size_t bytes) override {
    inner_->copy_to_device(device, host, bytes);
  }
  conveyor::TransferEvent record() override { return inner_->record(); }
  std::atomic<int64_t> allocations{0};

 private:
  std::shared_ptr<conveyor::TransferDevice> inner_;
};

// Compute on the trainer's stream that waits on each batch's event. With
// BM_ComputeAlone (the kernel by itself) and BM_OverlapUnderCompute/0 (the
// stage by itself), the share of the shorter one hidden under the other is
// (stage + compute - together) / min(stage, compute). Counters: the share
// of batches whose copy had finished when next() handed them out, and
// driver allocations per batch once timing began.
// Args: kernel rounds (0: no kernel), workers, prefetch_to_device.
void BM_OverlapUnderCompute(benchmark::State& state) {
  if (skip_without_gpu(state)) return;
  const size_t batch_bytes = 12 << 20;
  const int64_t batch = 64;
  Floats dataset(batch_bytes / sizeof(float) / batch);
  auto device = std::make_shared<CountingDevice>(conveyor::cuda::make_device(0));
  conveyor::DataLoader loader(dataset, {.batch_size = batch, .num_workers = static_cast<int>(state.range(1)),
                                        .persistent_workers = true, .pin_memory = true,
                                        .transfer_device = device,
                                        .prefetch_to_device = static_cast<int>(state.range(2))});
  TrainerKernel kernel;
  const int rounds = static_cast<int>(state.range(0));
  std::optional<decltype(loader.iter())> epoch;
  epoch.emplace(loader.iter());
  int64_t copied_ahead = 0;
  const int64_t allocations_before = device->allocations.load();
  for (auto _ : state) {
    auto next = next_batch(loader, epoch);
    copied_ahead += epoch->device().ready.ready() ? 1 : 0;
    cudaStreamWaitEvent(kernel.stream, static_cast<cudaEvent_t>(epoch->device().ready.native()), 0);
    kernel.run(rounds);
    benchmark::DoNotOptimize(next);
  }
  state.SetBytesProcessed(state.iterations() * static_cast<int64_t>(batch_bytes));
  const auto batches = static_cast<double>(std::max<int64_t>(state.iterations(), 1));
  state.counters["copied_ahead"] = static_cast<double>(copied_ahead) / batches;
  state.counters["allocs_per_batch"] = static_cast<double>(device->allocations.load() - allocations_before) / batches;
}
BENCHMARK(BM_OverlapUnderCompute)
    ->ArgsProduct({{0, 2000, 8000}, {4, 12}, {2}})
    ->Args({8000, 4, 1})
    ->Args({8000, 4, 6})
    ->UseRealTime();

void BM_ComputeAlone(benchmark::State& state) {
  if (skip_without_gpu(state)) return;
  TrainerKernel kernel;
  const int rounds = static_cast<int>(state.range(0));
  for (auto _ : state) kernel.run(rounds);
}
BENCHMARK(BM_ComputeAlone)->Arg(2000)->Arg(8000)->UseRealTime();

}  // namespace
