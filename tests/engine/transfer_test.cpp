// The transfer stage through the host stand-in device: order, pinned-pool
// bound, reuse only after release, events, cancellation mid-copy, errors.
#include <gtest/gtest.h>

#include <conveyor/conveyor.h>
#include <conveyor/transfer.h>

#include <atomic>
#include <cstring>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "support/datasets.h"
#include "support/epochs.h"
#include "support/sync.h"
#include "support/test_device.h"

namespace {

using conveyor::testing::RangeDataset;
using conveyor::testing::TestDevice;
using conveyor::testing::ThrowingDataset;

// 32 int64 samples per batch: 256 bytes, one pool size class.
constexpr int64_t kBatch = 32;

// A batch by its number (its first sample / the batch size).
std::string first_batch_number(const conveyor::Array<int64_t>& batch) { return std::to_string(batch[0] / kBatch); }

conveyor::LoaderOptions transfer_options(std::shared_ptr<conveyor::TransferDevice> device, int workers,
                                         int depth) {
  return {.batch_size = kBatch, .shuffle = true, .num_workers = workers, .prefetch_factor = 2,
          .pin_memory = true, .transfer_device = std::move(device), .prefetch_to_device = depth,
          .seed = 3};
}

TEST(Transfer, BatchesKeepSamplerOrderAndTheirDeviceCopiesMatch) {
  RangeDataset dataset(3200);
  for (int workers : {0, 1, 3}) {
    for (int depth : {1, 3}) {
      SCOPED_TRACE(std::to_string(workers) + " workers, depth " + std::to_string(depth));
      auto device = std::make_shared<TestDevice>(conveyor::make_host_standin_device());
      conveyor::DataLoader loader(dataset, transfer_options(device, workers, depth));
      conveyor::DataLoader reference(dataset, {.batch_size = kBatch, .shuffle = true, .seed = 3});
      auto expected = reference.iter();
      auto epoch = loader.iter();
      size_t batches = 0;
      while (auto batch = epoch.next()) {
        auto want = expected.next();
        ASSERT_TRUE(want.has_value());
        ASSERT_EQ(std::vector<int64_t>(batch->values().begin(), batch->values().end()),
                  std::vector<int64_t>(want->values().begin(), want->values().end()));
        const conveyor::DeviceBatch& copy = epoch.device();
        ASSERT_EQ(copy.buffers.size(), 1u);
        const int64_t* on_device = copy.find(*batch);
        ASSERT_NE(on_device, nullptr);
        copy.ready.synchronize();
        EXPECT_TRUE(copy.ready.ready());
        EXPECT_EQ(std::memcmp(on_device, batch->data(), batch->numel() * sizeof(int64_t)), 0);
        ++batches;
      }
      EXPECT_FALSE(expected.next().has_value());
      EXPECT_EQ(batches, 100u);
    }
  }
}

TEST(Transfer, ThePinnedPoolIsBoundedByTheWindowNotTheBatchCount) {
  RangeDataset dataset(kBatch * 500);
  auto device = std::make_shared<TestDevice>(conveyor::make_host_standin_device());
  const int workers = 2, depth = 2;
  {
    conveyor::DataLoader loader(dataset, transfer_options(device, workers, depth));
    for (int epoch = 0; epoch < 3; ++epoch) {
      for (auto& batch : loader) ASSERT_EQ(batch.numel(), static_cast<size_t>(kBatch));
    }
    // At most window (prefetch 2 x 2 workers) + batches copying ahead + the
    // consumer's + one being handed over are in use; the pool keeps as many
    // idle. A momentary miss on the free list can add a block, never one per
    // batch: 1500 batches, a handful of buffers.
    const int in_use = 2 * workers + depth + 2;
    EXPECT_LE(device->pinned_allocations.load(), 2 * in_use) << "1500 batches";
    EXPECT_LE(device->device_allocations.load(), device->pinned_allocations.load());
  }
  EXPECT_EQ(device->live_pinned.load(), 0);  // everything freed with the loader
  EXPECT_EQ(device->live_device.load(), 0);
}

TEST(Transfer, ABufferIsReusedOnlyAfterItsBatchIsReleased) {
  RangeDataset dataset(kBatch * 200);
  auto device = std::make_shared<TestDevice>(conveyor::make_host_standin_device());
  conveyor::DataLoader loader(dataset, transfer_options(device, 2, 2));
  auto epoch = loader.iter();
  std::vector<conveyor::Array<int64_t>> held;
  std::set<const void*> held_memory;
  for (int i = 0; i < 10; ++i) {  // hold ten batches: ten distinct buffers
    auto batch = epoch.next();
    ASSERT_TRUE(batch.has_value());
    EXPECT_TRUE(held_memory.insert(batch->data()).second) << "batch " << i << " reused a held buffer";
    held.push_back(std::move(*batch));
  }
  for (size_t i = 0; i < held.size(); ++i) {  // and they still hold their own samples
    EXPECT_EQ(held[i].numel(), static_cast<size_t>(kBatch));
  }
  held.clear();
  std::set<const void*> seen_after;
  while (auto batch = epoch.next()) seen_after.insert(batch->data());
  size_t reused = 0;
  for (const void* memory : held_memory) reused += seen_after.count(memory);
  EXPECT_GT(reused, 0u) << "released buffers go back to the pool";
}

// The consumer's own work may still read a device copy after its host batch
// is released: keep_until makes the next copy into that memory wait for it
// (PyTorch's Tensor.record_stream).
TEST(Transfer, AKeptDeviceCopyIsNotOverwrittenBeforeTheWorkReadingItCompletes) {
  RangeDataset dataset(kBatch * 200);
  auto device = std::make_shared<TestDevice>(conveyor::make_host_standin_device());
  conveyor::DataLoader loader(dataset, transfer_options(device, 2, 2));
  auto epoch = loader.iter();
  auto first = epoch.next();
  ASSERT_TRUE(first.has_value());
  const conveyor::DeviceBatch& first_copy = epoch.device();
  first_copy.ready.synchronize();
  const int64_t* twin = first_copy.find(*first);
  ASSERT_NE(twin, nullptr);
  const std::vector<int64_t> first_values(first->values().begin(), first->values().end());
  auto reading = std::make_shared<conveyor::testing::ManualEvent>();  // a kernel still reading `twin`
  first_copy.keep_until(conveyor::TransferEvent(reading));
  const size_t ops_at_keep = device->ops().size();
  first.reset();  // the host batch goes back to the pool; its twin with it

  // Batches until one is copied into the same twin (the pool recycles).
  std::optional<conveyor::Array<int64_t>> reuser;
  for (int i = 0; i < 150 && !reuser; ++i) {
    auto batch = epoch.next();
    ASSERT_TRUE(batch.has_value()) << "the pool never reused the kept batch's buffer";
    if (epoch.device().find(*batch) == twin) reuser = std::move(batch);
  }
  ASSERT_TRUE(reuser.has_value());
  const conveyor::DeviceBatch& reuser_copy = epoch.device();
  // The copy into the twin waits behind the work: not done, and the twin
  // still holds the first batch.
  EXPECT_FALSE(reuser_copy.ready.ready());
  EXPECT_EQ(std::memcmp(twin, first_values.data(), first_values.size() * sizeof(int64_t)), 0);
  const std::vector<TestDevice::Op> ops = device->ops();
  bool waited = false;
  for (size_t i = ops_at_keep; i < ops.size(); ++i) {
    if (ops[i].what == "wait") waited = true;
    if (ops[i].what == "copy" && ops[i].device == twin) {
      EXPECT_TRUE(waited) << "the twin was copied into without waiting for the work kept on it";
      break;
    }
  }
  reading->complete();  // the kernel finishes: the copy goes ahead
  reuser_copy.ready.synchronize();
  EXPECT_EQ(std::memcmp(twin, reuser->data(), reuser->numel() * sizeof(int64_t)), 0);
  EXPECT_GE(reading->waits.load(), 1) << "the stand-in's copy thread waited for the work";
  while (epoch.next()) {
  }
}

// Work kept on a twin that is never copied into again: the pool frees the
// twin only after waiting for it.
TEST(Transfer, APoolFreesATwinOnlyAfterTheWorkKeptOnIt) {
  RangeDataset dataset(kBatch * 20);
  auto device = std::make_shared<TestDevice>(conveyor::make_host_standin_device());
  auto reading = std::make_shared<conveyor::testing::ManualEvent>(/*done_when_waited_for=*/true);
  conveyor::DeviceBatch outliving;
  {
    conveyor::DataLoader loader(dataset, transfer_options(device, 2, 2));
    auto epoch = loader.iter();
    std::optional<conveyor::Array<int64_t>> last;
    while (auto batch = epoch.next()) last = std::move(batch);
    ASSERT_TRUE(last.has_value());
    epoch.device().keep_until(conveyor::TransferEvent(reading));
    outliving = epoch.device();
  }
  EXPECT_EQ(device->live_device.load(), 0);
  EXPECT_GE(reading->waits.load(), 1) << "the twin was freed without waiting for the work kept on it";
  // Too late to matter, but safe once the pool and its memory are gone
  // (AddressSanitizer's build runs this).
  outliving.keep_until(conveyor::TransferEvent());
}

TEST(Transfer, DestroyingTheEpochMidCopyReleasesEverything) {
  RangeDataset dataset(kBatch * 400);
  auto device = std::make_shared<TestDevice>(conveyor::make_host_standin_device());
  {
    conveyor::DataLoader loader(dataset, transfer_options(device, 3, 4));
    for (int round = 0; round < 200; ++round) {
      auto epoch = loader.iter();
      for (int taken = 0; taken < round % 5; ++taken) ASSERT_TRUE(epoch.next().has_value());
    }  // copies of the batches queued ahead may still be running here
  }
  EXPECT_EQ(device->live_pinned.load(), 0);
  EXPECT_EQ(device->live_device.load(), 0);
}

TEST(Transfer, CopyAndAllocationFailuresArriveInOrderAndTheEpochGoesOn) {
  RangeDataset dataset(kBatch * 10);
  auto device = std::make_shared<TestDevice>(conveyor::make_host_standin_device());
  device->fail_copy_number = 3;  // the fourth batch's copy
  conveyor::DataLoader loader(dataset, {.batch_size = kBatch, .num_workers = 2, .pin_memory = true,
                                        .transfer_device = device, .prefetch_to_device = 2});
  auto epoch = loader.iter();
  const auto events = conveyor::testing::walk_epoch(epoch, first_batch_number, [](const conveyor::WorkerError& e) {
    EXPECT_EQ(e.context().stage, "transfer");
    EXPECT_NE(std::string(e.what()).find("copy engine fault"), std::string::npos) << e.what();
  });
  EXPECT_EQ(events, (std::vector<std::string>{"0", "1", "2", "error@3", "4", "5", "6", "7", "8", "9"}));
}

TEST(Transfer, WorkerErrorsKeepTheirPlaceThroughTheStage) {
  ThrowingDataset dataset(kBatch * 6, {kBatch * 2 + 5});
  auto device = conveyor::make_host_standin_device();
  conveyor::DataLoader loader(dataset, {.batch_size = kBatch, .num_workers = 3, .pin_memory = true,
                                        .transfer_device = device, .prefetch_to_device = 3});
  auto epoch = loader.iter();
  const auto events = conveyor::testing::walk_epoch(
      epoch, first_batch_number, [](const conveyor::WorkerError& e) { EXPECT_EQ(e.context().stage, "fetch"); });
  EXPECT_EQ(events, (std::vector<std::string>{"0", "1", "error@2", "3", "4", "5"}));
}

TEST(Transfer, PinMemoryWithoutADeviceWarnsAndStaysOnTheHost) {
  RangeDataset dataset(64);
  std::vector<std::string> warnings;
  auto previous = conveyor::set_warning_handler([&](const std::string& m) { warnings.push_back(m); });
  conveyor::DataLoader loader(dataset, {.batch_size = 8, .pin_memory = true});
  conveyor::set_warning_handler(previous);
  ASSERT_EQ(warnings.size(), 1u);
  EXPECT_NE(warnings[0].find("'pin_memory' argument is set as true but no accelerator is found"),
            std::string::npos);
  size_t batches = 0;
  auto epoch = loader.iter();
  while (epoch.next()) {
    EXPECT_TRUE(epoch.device().buffers.empty());
    ++batches;
  }
  EXPECT_EQ(batches, 8u);
  EXPECT_THROW(conveyor::DataLoader(dataset, {.batch_size = 8, .prefetch_to_device = 2}), conveyor::ValueError);
  EXPECT_THROW(conveyor::DataLoader(dataset, {.batch_size = 8, .pin_memory = true,
                                              .transfer_device = conveyor::make_host_standin_device(),
                                              .prefetch_to_device = -1}),
               conveyor::ValueError);
}

TEST(Transfer, CustomBatchesOptInThroughTransferTraits) {
  struct Pair final : conveyor::Dataset<std::pair<int64_t, float>> {
    size_t size() const override { return 64; }
    std::pair<int64_t, float> get(size_t i) override { return {static_cast<int64_t>(i), i * 0.5f}; }
  } dataset;
  auto device = conveyor::make_host_standin_device();
  conveyor::DataLoader loader(dataset, {.batch_size = 16, .num_workers = 1, .pin_memory = true,
                                        .transfer_device = device, .prefetch_to_device = 1});
  auto epoch = loader.iter();
  while (auto batch = epoch.next()) {
    const conveyor::DeviceBatch& copy = epoch.device();
    ASSERT_EQ(copy.buffers.size(), 2u);  // both halves of the pair
    copy.ready.synchronize();
    EXPECT_EQ(std::memcmp(copy.find(batch->first), batch->first.data(), 16 * sizeof(int64_t)), 0);
    EXPECT_EQ(std::memcmp(copy.find(batch->second), batch->second.data(), 16 * sizeof(float)), 0);
  }
}

}  // namespace

namespace {

// The epoch is a node graph: from_sampler, fetch+collate, then to_device.
// Each node counts what it took and handed on, failed batches included, and
// they print as a metrics table in the data's order.
TEST(EpochGraph, NodeMetricsCountEachNodesBatchesFailuresIncluded) {
  ThrowingDataset dataset(kBatch * 6, {kBatch * 2 + 5});
  auto device = conveyor::make_host_standin_device();
  for (int workers : {0, 3}) {
    SCOPED_TRACE("num_workers " + std::to_string(workers));
    conveyor::DataLoader loader(dataset, {.batch_size = kBatch, .num_workers = workers, .pin_memory = true,
                                          .transfer_device = device, .prefetch_to_device = 2});
    auto epoch = loader.iter();
    const auto events = conveyor::testing::walk_epoch(epoch, first_batch_number, [](const conveyor::WorkerError&) {});
    EXPECT_EQ(events, (std::vector<std::string>{"0", "1", "error@2", "3", "4", "5"}));

    const std::vector<conveyor::NodeMetrics> nodes = epoch.node_metrics();
    ASSERT_EQ(nodes.size(), 3u);
    EXPECT_EQ(nodes[0].name, "from_sampler");
    EXPECT_EQ(nodes[0].items_in, 0u);
    EXPECT_EQ(nodes[0].items_out, 6u);  // the batch sampler's 6 batches of indices
    EXPECT_EQ(nodes[1].name, workers ? "fetch+collate(3 workers)" : "fetch+collate");
    EXPECT_EQ(nodes[1].items_in, 6u);
    EXPECT_EQ(nodes[1].items_out, 6u);
    EXPECT_EQ(nodes[1].window, workers ? 6u : 0u);
    EXPECT_GT(nodes[1].busy_seconds, 0);
    EXPECT_EQ(nodes[2].name, "to_device(2)");
    EXPECT_EQ(nodes[2].items_in, 6u);
    EXPECT_EQ(nodes[2].items_out, 6u);
    EXPECT_EQ(nodes[2].window, 3u);
    EXPECT_LT(nodes[0].id, nodes[1].id);  // ids in the data's order
    EXPECT_LT(nodes[1].id, nodes[2].id);
    const std::string table = conveyor::metrics_table(nodes);
    EXPECT_NE(table.find("from_sampler"), std::string::npos) << table;
    EXPECT_NE(table.find("to_device(2)"), std::string::npos) << table;
  }
}

// Without a device the graph ends at fetch+collate, and a pass that stops
// early reports what it handed out so far: the sampler has drawn exactly
// what fetch+collate took.
TEST(EpochGraph, APartialEpochReportsWhatItHandedOut) {
  RangeDataset dataset(kBatch * 10);
  conveyor::DataLoader loader(dataset, {.batch_size = kBatch, .num_workers = 2});
  auto epoch = loader.iter();
  for (int i = 0; i < 3; ++i) ASSERT_TRUE(epoch.next().has_value());
  const std::vector<conveyor::NodeMetrics> nodes = epoch.node_metrics();
  ASSERT_EQ(nodes.size(), 2u);
  EXPECT_EQ(nodes[0].name, "from_sampler");
  EXPECT_EQ(nodes[1].items_out, 3u);
  EXPECT_GE(nodes[1].items_in, 3u);  // and the window's worth submitted ahead
  EXPECT_LE(nodes[1].items_in, 3u + nodes[1].window);
  EXPECT_EQ(nodes[0].items_out, nodes[1].items_in);
}

// An iterable dataset has no sampler: its replicas are fetch+collate's own.
TEST(EpochGraph, AnIterableDatasetsGraphStartsAtFetchAndCollate) {
  conveyor::testing::StridedStream stream(kBatch * 4);
  conveyor::DataLoader loader(stream, {.batch_size = kBatch, .num_workers = 2});
  auto epoch = loader.iter();
  size_t batches = 0;
  while (epoch.next()) ++batches;
  EXPECT_EQ(batches, 4u);
  const std::vector<conveyor::NodeMetrics> nodes = epoch.node_metrics();
  ASSERT_EQ(nodes.size(), 1u);
  EXPECT_EQ(nodes[0].name, "fetch+collate(2 workers)");
  EXPECT_EQ(nodes[0].items_out, 4u);
}

}  // namespace
