// The batch-buffer pool: what it recycles, what it keeps idle, and that a
// dataset's own allocations never come from it.
#include <gtest/gtest.h>

#include <conveyor/conveyor.h>
#include <conveyor/detail/buffer_pool.h>

#include <atomic>
#include <cstring>
#include <fstream>
#include <memory>
#include <new>
#include <string>
#include <vector>

namespace {

using conveyor::detail::is_pool_buffer;
using conveyor::detail::is_scalable_heap_buffer;
using conveyor::detail::make_recycling_allocator;
using conveyor::detail::pool_stats;

constexpr size_t kMiB = size_t{1} << 20;

TEST(BufferPool, ARecycledBufferIsReusedForItsSizeClass) {
  auto pool = make_recycling_allocator(4);
  std::byte* first = nullptr;
  {
    auto buffer = pool->allocate(1000);
    first = buffer.get();
    EXPECT_TRUE(is_pool_buffer(buffer));
  }
  EXPECT_EQ(pool->allocate(1000).get(), first);  // 1000 and 1024 share a class
  EXPECT_EQ(pool->allocate(1024).get(), first);
}

// A size from a collate's shape is user input: beyond the largest class
// (or wrapping the rounding) it is a std::bad_alloc naming it, not an abort.
TEST(BufferPool, ARequestBeyondEverySizeClassThrowsNamingItsSize) {
  auto pool = make_recycling_allocator(2);
  for (const size_t bytes : {size_t{1} << 55, SIZE_MAX}) {
    try {
      (void)pool->allocate(bytes);
      ADD_FAILURE() << bytes << " bytes were handed out";
    } catch (const std::bad_alloc& error) {  // as any allocation beyond memory, naming the size
      EXPECT_NE(std::string(error.what()).find(std::to_string(bytes) + " bytes"), std::string::npos) << error.what();
    }
  }
  EXPECT_EQ(pool_stats(*pool).in_use_bytes, 0u);
  EXPECT_NE(pool->allocate(100), nullptr);  // the pool goes on
}

TEST(BufferPool, KeepsNoMoreIdleThanWasEverInUseWhateverTheSizes) {
  // A pool capped only per size class kept up to the cap in every class a
  // batch ever touched: many classes, many times what the loader needed.
  auto pool = make_recycling_allocator(8);
  {
    std::vector<std::shared_ptr<std::byte>> window;
    for (int i = 0; i < 4; ++i) window.push_back(pool->allocate(kMiB));
  }
  EXPECT_EQ(pool_stats(*pool).peak_in_use_bytes, 4 * kMiB);
  EXPECT_LE(pool_stats(*pool).idle_bytes, pool_stats(*pool).peak_in_use_bytes);
  EXPECT_GE(pool_stats(*pool).idle_bytes, 4 * kMiB);  // a window's worth stays warm
  for (size_t bytes : {2 * kMiB, 3 * kMiB, 5 * kMiB, 7 * kMiB, size_t{100}, size_t{300} * 1024}) {
    pool->allocate(bytes);  // one at a time, in a new class each
    EXPECT_LE(pool_stats(*pool).idle_bytes, pool_stats(*pool).peak_in_use_bytes) << bytes;
  }
  EXPECT_EQ(pool_stats(*pool).in_use_bytes, 0u);
}

// Each sample is an image allocated the way decoders allocate
// (allocate_batch_buffer); collate allocates the batch.
struct Images final : conveyor::Dataset<conveyor::Array<uint8_t>> {
  size_t size() const override { return 64; }
  conveyor::Array<uint8_t> get(size_t i) override {
    conveyor::Array<uint8_t> image({3, 16 + static_cast<int64_t>(i % 7), 16});
    if (is_pool_buffer(image.owner())) from_pool.fetch_add(1);
    return image;
  }
  std::atomic<int> from_pool{0};
};

TEST(BufferPool, WhatADatasetAllocatesOnAWorkerDoesNotComeFromTheBatchPool) {
  // Only collate's output is window memory; a decoded image in get() used to
  // be served from (and cached by) the batch pool in power-of-two classes.
  for (int workers : {0, 2}) {
    Images dataset;
    std::atomic<int> batches_from_pool{0};
    auto collate = [&](std::vector<conveyor::Array<uint8_t>>&& images) {
      conveyor::Array<uint8_t> batch({static_cast<int64_t>(images.size())});
      if (is_pool_buffer(batch.owner())) batches_from_pool.fetch_add(1);
      return batch;
    };
    conveyor::DataLoader loader(dataset, {.batch_size = 4, .num_workers = workers,
                                          .persistent_workers = workers > 0},
                                collate);
    for (int epoch = 0; epoch < 2; ++epoch) {
      for (auto& batch : loader) EXPECT_EQ(batch.numel(), 4u);
    }
    EXPECT_EQ(dataset.from_pool.load(), 0) << workers << " workers";
    // Collate writes into the recycled pool, with or without workers.
    EXPECT_EQ(batches_from_pool.load(), 32) << workers << " workers";
  }
}

// A batch is its sample count: samples of any size, and no batch memory.
int64_t count_samples(std::vector<conveyor::Array<float>>&& samples) { return static_cast<int64_t>(samples.size()); }

// A sample at or above glibc's mmap threshold: glibc gave each back to the
// kernel as its batch freed it (munmap, or trimming its arena), and the next
// batch page-faulted it in again (64 to 3,000 faults a batch here; the
// transfer stage ran 3-6x slower on an H200). A loader's task takes such
// samples from oneTBB's scalable heap, which keeps them; smaller ones still
// come from glibc, and so does anything made outside a loader.
TEST(BufferPool, ALoadersLargeSamplesComeFromTheScalableHeapSmallOnesFromGlibc) {
  struct Mixed final : conveyor::Dataset<conveyor::Array<float>> {
    size_t size() const override { return 64 * 20; }
    conveyor::Array<float> get(size_t i) override {
      const bool large = i % 2 == 0;
      conveyor::Array<float> sample({large ? 48 * 1024 : 4 * 1024});  // 192 KiB or 16 KiB
      if (is_scalable_heap_buffer(sample.owner())) (large ? large_kept : small_kept).fetch_add(1);
      return sample;
    }
    std::atomic<int> large_kept{0}, small_kept{0};
  };
  for (int workers : {0, 2}) {
    Mixed dataset;
    conveyor::DataLoader loader(dataset, {.batch_size = 64, .num_workers = workers}, count_samples);
    int64_t samples = 0;
    for (int64_t batch : loader) samples += batch;
    ASSERT_EQ(samples, 64 * 20);
    EXPECT_EQ(dataset.large_kept.load(), 64 * 10) << workers << " workers";
    EXPECT_EQ(dataset.small_kept.load(), 0) << workers << " workers";
  }
  EXPECT_FALSE(is_scalable_heap_buffer(conveyor::Array<float>({48 * 1024}).owner())) << "outside a loader";
}

long resident_kib() {
  std::ifstream status("/proc/self/status");
  for (std::string line; std::getline(status, line);) {
    if (line.rfind("VmRSS:", 0) == 0) return std::stol(line.substr(6));
  }
  return -1;
}

// What the scalable heap kept goes back to the kernel with the loader, as
// glibc gave back each large sample it freed.
TEST(BufferPool, ALoaderGoneGivesItsLargeSamplesBack) {
#if defined(__SANITIZE_THREAD__) || defined(__SANITIZE_ADDRESS__)
  GTEST_SKIP() << "the sanitizer's allocator stands in for glibc's and oneTBB's here";
#endif
  struct Large final : conveyor::Dataset<conveyor::Array<float>> {
    size_t size() const override { return 64 * 50; }
    conveyor::Array<float> get(size_t i) override {
      conveyor::Array<float> sample({48 * 1024});  // 192 KiB, written whole
      std::memset(sample.data(), static_cast<int>(i), sample.numel() * sizeof(float));
      return sample;
    }
  } dataset;
  const long start = resident_kib();
  {
    conveyor::DataLoader loader(dataset, {.batch_size = 64, .num_workers = 2}, count_samples);
    int64_t samples = 0;
    for (int64_t batch : loader) samples += batch;
    ASSERT_EQ(samples, 64 * 50);
  }
  // 2 workers x 64 samples of 192 KiB were alive at once: 24 MiB.
  EXPECT_LT(resident_kib() - start, 8 * 1024) << "KiB still resident after the loader went";
}

}  // namespace
