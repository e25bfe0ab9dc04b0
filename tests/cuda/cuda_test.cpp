// conveyor::cuda. Without a device (CI) the device tests skip with a message;
// the fallbacks and errors are tested everywhere.
#include <gtest/gtest.h>

#include <conveyor/conveyor.h>
#include <conveyor/cuda.h>
#include <cuda_runtime_api.h>

#include <cstring>
#include <string>
#include <vector>

#include "cuda/require_device.h"
#include "support/datasets.h"

namespace {

TEST(CudaFallback, WithoutADeviceSelectionWarnsAndFallsBack) {
  if (conveyor::cuda::device_count() > 0) GTEST_SKIP() << "a CUDA device is present: no fallback to test";
  std::vector<std::string> warnings;
  auto previous = conveyor::set_warning_handler([&](const std::string& m) { warnings.push_back(m); });
  EXPECT_EQ(conveyor::cuda::select_transfer_device(0, false), nullptr);
  auto standin = conveyor::cuda::select_transfer_device(0, true);
  conveyor::set_warning_handler(previous);
  ASSERT_NE(standin, nullptr);
  EXPECT_EQ(standin->name(), "host-standin");
  ASSERT_EQ(warnings.size(), 2u);
  EXPECT_NE(warnings[0].find("no CUDA device 0"), std::string::npos) << warnings[0];
}

TEST(CudaFallback, MakingAMissingDeviceIsATypedError) {
  if (conveyor::cuda::device_count() > 0) GTEST_SKIP() << "a CUDA device is present";
  try {
    conveyor::cuda::make_device(0);
    FAIL() << "no CudaError";
  } catch (const conveyor::cuda::CudaError& e) {
    EXPECT_NE(e.code(), 0);
    EXPECT_NE(std::string(e.what()).find("failed in"), std::string::npos) << e.what();
  }
}

TEST(CudaDevice, LoaderBatchesArriveOnTheDeviceInOrder) {
  REQUIRE_CUDA_DEVICE();
  conveyor::testing::RangeDataset dataset(64 * 100);
  auto device = conveyor::cuda::make_device(0);
  conveyor::DataLoader loader(dataset, {.batch_size = 64, .num_workers = 2, .pin_memory = true,
                                        .transfer_device = device, .prefetch_to_device = 2});
  auto epoch = loader.iter();
  int64_t expected_first = 0;
  std::vector<int64_t> back(64);
  while (auto batch = epoch.next()) {
    const conveyor::DeviceBatch& copy = epoch.device();
    ASSERT_NE(copy.ready.native(), nullptr);
    copy.ready.synchronize();
    ASSERT_EQ(cudaMemcpy(back.data(), copy.find(*batch), 64 * sizeof(int64_t), cudaMemcpyDeviceToHost),
              cudaSuccess);
    EXPECT_EQ(back[0], expected_first);
    EXPECT_EQ(std::memcmp(back.data(), batch->data(), 64 * sizeof(int64_t)), 0);
    expected_first += 64;
  }
  EXPECT_EQ(expected_first, 64 * 100);
}

TEST(CudaDevice, PinnedMemoryIsPageLocked) {
  REQUIRE_CUDA_DEVICE();
  auto device = conveyor::cuda::make_device(0);
  void* memory = device->allocate_pinned(4096);
  cudaPointerAttributes attributes{};
  ASSERT_EQ(cudaPointerGetAttributes(&attributes, memory), cudaSuccess);
  EXPECT_EQ(attributes.type, cudaMemoryTypeHost);
  device->free_pinned(memory);
}

}  // namespace
