// pin_memory and to_device as nodes, through the host stand-in device: the
// loader's transfer stage, standalone. Order, device copies that match,
// batches written once into the pinned pool (on any thread), a bounded pool,
// errors in place, and nothing left behind by a pass left mid-copy.
#include <gtest/gtest.h>

#include <conveyor/conveyor.h>
#include <conveyor/detail/buffer_pool.h>
#include <conveyor/nodes.h>

#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "support/random_pipeline.h"
#include "support/test_device.h"

namespace {

namespace nodes = conveyor::nodes;
using conveyor::testing::TestDevice;

constexpr int64_t kBatch = 32;
constexpr int64_t kBatches = 40;

std::shared_ptr<TestDevice> test_device() {
  return std::make_shared<TestDevice>(conveyor::make_host_standin_device());
}

// Checks one item: its device copy holds what the host holds.
void expect_copied(const nodes::OnDevice<conveyor::Array<int64_t>>& item) {
  item.device.ready.synchronize();
  ASSERT_EQ(item.device.buffers.size(), 1u);
  const conveyor::DeviceBuffer& buffer = item.device.buffers[0];
  EXPECT_EQ(buffer.host, item.host.data());
  EXPECT_EQ(buffer.bytes, static_cast<size_t>(item.host.numel()) * sizeof(int64_t));
  EXPECT_EQ(std::memcmp(buffer.device, buffer.host, buffer.bytes), 0);
  EXPECT_EQ(item.device.find(item.host), buffer.device);
}

TEST(ToDevice, ItemsArriveInOrderCopiedFromThePinnedPoolWhichStaysBounded) {
  for (size_t depth : {0, 1, 3}) {
    auto device = test_device();
    {
      auto pipeline = nodes::from_range(0, kBatch * kBatches) | nodes::batch(kBatch) | nodes::collate() |
                      nodes::pin_memory(device) | nodes::to_device(device, depth);
      EXPECT_EQ(device->pinned_allocations.load(), 0) << "nothing before the first pass";
      for (int pass = 0; pass < 2; ++pass) {
        int64_t expected = 0;
        for (auto& item : pipeline.pass()) {
          expect_copied(item);
          EXPECT_EQ(item.host[0], expected * kBatch);
          EXPECT_TRUE(conveyor::detail::is_pool_buffer(item.host.owner())) << "collate wrote into the pool";
          ++expected;
        }
        EXPECT_EQ(expected, kBatches);
      }
      // The pool recycles: buffers in use at once are the depth ahead, the
      // item held and the one being collated, not one per batch.
      EXPECT_LE(device->pinned_allocations.load(), static_cast<int>(depth) + 3) << "depth " << depth;
      // Each pool buffer has one device twin; nothing needed scratch memory.
      EXPECT_EQ(device->device_allocations.load(), device->pinned_allocations.load());
    }
    EXPECT_EQ(device->live_pinned.load(), 0);
    EXPECT_EQ(device->live_device.load(), 0);
  }
}

// A pass resumed behind to_device hands out the rest of the saved pass
// without making or copying the batches it passes over.
TEST(ToDevice, AResumedPassNeitherMakesNorCopiesWhatItPassesOver) {
  auto device = test_device();
  int collated = 0;
  const auto make = [&] {
    return nodes::from_range(0, kBatch * kBatches) | nodes::batch(kBatch) |
           nodes::collate([&collated](std::vector<int64_t> batch) {
             ++collated;
             return conveyor::default_collate(std::move(batch));
           }) |
           nodes::to_device(device, 2);
  };
  auto saved = make();
  conveyor::State state;
  {
    auto pass = saved.pass();
    for (int k = 0; k < 10; ++k) ASSERT_TRUE(pass.next());
    state = saved.state();
  }
  auto resumed = make();
  resumed.load_state(state);
  collated = 0;
  int64_t expected = 10;
  for (auto& item : resumed.pass()) {
    expect_copied(item);
    EXPECT_EQ(item.host[0], expected * kBatch);
    ++expected;
  }
  EXPECT_EQ(expected, kBatches);
  EXPECT_EQ(collated, kBatches - 10) << "the 10 batches received before the state were made again";
}

// try_next() through pin_memory and to_device: behind an upstream that is
// "not yet" at random (a stand-in async node), each batch arrives once, in
// order, copied; the stage queues copies ahead without waiting.
TEST(ToDevice, PolledBehindAnUpstreamNotYetReadyEveryItemArrivesInOrder) {
  for (size_t depth : {0, 2}) {
    auto device = test_device();
    auto batches = nodes::from_range(0, kBatch * kBatches) | nodes::batch(kBatch) | nodes::collate();
    auto pipeline = conveyor::testing::stutter(std::move(batches), 42 + depth) | nodes::pin_memory(device) |
                    nodes::to_device(device, depth);
    for (int pass_number = 0; pass_number < 2; ++pass_number) {
      auto pass = pipeline.pass();
      int64_t expected = 0;
      uint64_t pending = 0;
      while (true) {
        std::optional<nodes::OnDevice<conveyor::Array<int64_t>>> item;
        const conveyor::Poll poll = pass.try_next(item);
        if (poll == conveyor::Poll::end) break;
        if (poll == conveyor::Poll::pending) {
          ++pending;
          continue;
        }
        expect_copied(*item);
        EXPECT_EQ(item->host[0], expected * kBatch);
        ++expected;
      }
      EXPECT_EQ(expected, kBatches) << "depth " << depth;
      EXPECT_GT(pending, 0u) << "depth " << depth << ": upstream's \"not yet\" never reached the consumer";
    }
  }
}

TEST(ToDevice, CollateBehindAPrefetchStillWritesIntoThePool) {
  auto device = test_device();
  auto pipeline = nodes::from_range(0, kBatch * 10) | nodes::batch(kBatch) | nodes::collate() |
                  nodes::prefetch(2) | nodes::pin_memory(device) | nodes::to_device(device, 1);
  int64_t batches = 0;
  for (auto& item : pipeline.pass()) {
    expect_copied(item);
    EXPECT_TRUE(conveyor::detail::is_pool_buffer(item.host.owner()));
    ++batches;
  }
  EXPECT_EQ(batches, 10);
}

// Metrics are read for the current pass while a prefetch drives to_device
// on its own thread: every figure read there is one that thread may write
// at the same moment (a data race ThreadSanitizer reports, before the copy
// time was an atomic).
TEST(ToDevice, ItsMetricsAreReadWhileAPrefetchRunsIt) {
  auto device = test_device();
  auto pipeline = nodes::from_range(0, kBatch * kBatches) | nodes::batch(kBatch) | nodes::collate() |
                  nodes::pin_memory(device) | nodes::to_device(device, 2) | nodes::prefetch(3);
  pipeline.timed(true);
  int64_t batches = 0;
  double busy = 0;
  for (auto& item : pipeline.pass()) {
    expect_copied(item);
    for (const conveyor::NodeMetrics& node : pipeline.metrics()) {
      if (node.name.starts_with("to_device")) {
        EXPECT_GE(node.busy_seconds, busy) << "the copy time only grows within a pass";
        busy = node.busy_seconds;
      }
    }
    ++batches;
  }
  EXPECT_EQ(batches, kBatches);
  EXPECT_GT(busy, 0);
}

// The table's "in flight" for to_device: the batches copying ahead plus the
// one handed out, at each hand-out. A consumer that waits for each copy
// finds the depth's copies queued behind it nearly always.
TEST(ToDevice, ItsMeanInFlightCountsTheCopiesQueuedAhead) {
  auto device = test_device();
  auto pipeline = nodes::from_range(0, 32 * 40) | nodes::batch(32) | nodes::collate() |
                  nodes::pin_memory(device) | nodes::to_device(device, 2);
  for (auto& item : pipeline.pass()) item.device.ready.synchronize();
  bool found = false;
  for (const auto& node : pipeline.metrics()) {
    if (node.name != "to_device(2)") continue;
    found = true;
    EXPECT_EQ(node.window, 3u);
    EXPECT_EQ(node.items_out, 40u);
    EXPECT_GT(node.mean_in_flight, 2.5);  // 3 at each hand-out but the last two
    EXPECT_LE(node.mean_in_flight, 3.0);
  }
  EXPECT_TRUE(found);
}

TEST(ToDevice, MemoryFromOutsideThePoolGoesThroughScratchBuffersFreedWithTheItem) {
  auto device = test_device();
  {
    auto pipeline = nodes::from_range(0, kBatch * 6) | nodes::batch(kBatch) | nodes::collate() |
                    nodes::to_device(device, 2);
    std::vector<nodes::OnDevice<conveyor::Array<int64_t>>> kept;
    for (auto& item : pipeline.pass()) {
      expect_copied(item);
      EXPECT_FALSE(conveyor::detail::is_pool_buffer(item.host.owner()));
      kept.push_back(std::move(item));
    }
    ASSERT_EQ(kept.size(), 6u);
    // Kept items keep their device copies: every one still matches.
    for (const auto& item : kept) expect_copied(item);
    EXPECT_EQ(device->live_device.load(), 6);
    EXPECT_EQ(device->pinned_allocations.load(), 0);
  }
  EXPECT_EQ(device->live_device.load(), 0);
}

// A scratch buffer read by work kept on it (keep_until) is freed only after
// that work: its destructor waits for the event before the device frees it.
TEST(ToDevice, AScratchBufferWithWorkKeptOnItIsFreedOnlyAfterThatWork) {
  auto device = test_device();
  auto reading = std::make_shared<conveyor::testing::ManualEvent>(/*done_when_waited_for=*/true);
  const void* scratch = nullptr;
  {
    auto pipeline = nodes::from_range(0, kBatch * 6) | nodes::batch(kBatch) | nodes::collate() |
                    nodes::to_device(device, 2);
    auto pass = pipeline.pass();
    auto first = pass.next();
    ASSERT_TRUE(first.has_value());
    expect_copied(*first);
    scratch = first->device.buffers.at(0).device;
    first->device.keep_until(conveyor::TransferEvent(reading));
    first.reset();
    while (pass.next()) {
    }
  }
  bool freed = false;
  for (const TestDevice::Op& op : device->ops()) freed = freed || (op.what == "free" && op.device == scratch);
  EXPECT_TRUE(freed);
  EXPECT_GE(reading->waits.load(), 1) << "the scratch buffer was freed without waiting for the work on it";
  EXPECT_EQ(device->live_device.load(), 0);
}

TEST(ToDevice, UpstreamAndCopyErrorsKeepTheirPlaceAndThePassGoesOn) {
  auto device = test_device();
  auto fail_third = [](std::vector<int64_t>&& batch) {
    if (batch[0] == 3 * kBatch) throw std::runtime_error("bad batch");
    return conveyor::default_collate(std::move(batch));
  };
  auto pipeline = nodes::from_range(0, kBatch * 8) | nodes::batch(kBatch) | nodes::collate(fail_third) |
                  nodes::pin_memory(device) | nodes::to_device(device, 2);
  device->fail_copy_number = 5;  // the sixth copy queued: batch 6, after the failed batch 3 made none
  auto pass = pipeline.pass();
  std::vector<std::string> events;
  while (true) {
    try {
      auto item = pass.next();
      if (!item) break;
      expect_copied(*item);
      events.push_back(std::to_string(item->host[0] / kBatch));
    } catch (const conveyor::NodeError& e) {
      if (e.node() == "collate") {
        events.push_back("collate error@" + std::to_string(e.position()));
        continue;
      }
      // A copy that failed is the to_device node's error, at its item.
      EXPECT_EQ(e.node(), "to_device(2)");
      EXPECT_NE(std::string(e.what()).find("'to_device(2)' at item 6: "), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("copy engine fault"), std::string::npos) << e.what();
      events.push_back("copy error@" + std::to_string(e.position()));
    }
  }
  EXPECT_EQ(events,
            (std::vector<std::string>{"0", "1", "2", "collate error@3", "4", "5", "copy error@6", "7"}));
}

// A copy that fails after a resume names the batch's place in the whole
// pass, as it would have without the resume. Before the fix it counted from
// the resume ("batch 2" for batch 7) and was the loader's WorkerError.
TEST(ToDevice, ACopyFailingAfterAResumeNamesItsPlaceInThePass) {
  const auto make = [](std::shared_ptr<TestDevice> device) {
    return nodes::from_range(0, kBatch * 10) | nodes::batch(kBatch) | nodes::collate() |
           nodes::to_device(std::move(device), 0);
  };
  conveyor::State state;
  {
    auto saved = make(test_device());
    auto pass = saved.pass();
    for (int k = 0; k < 5; ++k) ASSERT_TRUE(pass.next());
    state = saved.state();
  }
  const auto failure = [&](bool resume) {
    auto device = test_device();
    device->fail_copy_number = resume ? 2 : 7;  // batch 7 either way
    auto pipeline = make(device);
    if (resume) pipeline.load_state(state);
    auto pass = pipeline.pass();
    for (int64_t batch = resume ? 5 : 0; batch < 7; ++batch) {
      std::optional<nodes::OnDevice<conveyor::Array<int64_t>>> item = pass.next();
      EXPECT_EQ(item->host[0], batch * kBatch);
    }
    try {
      (void)pass.next();
    } catch (const conveyor::NodeError& e) {
      EXPECT_EQ(e.node(), "to_device(0)");
      EXPECT_EQ(pass.next()->host[0], 8 * kBatch);  // the pass goes on
      return std::to_string(e.position()) + ": " + e.what();
    }
    return std::string("no error");
  };
  const std::string fresh = failure(false);
  EXPECT_EQ(fresh.substr(0, 3), "7: ") << fresh;
  EXPECT_EQ(failure(true), fresh);
}

// An item whose second buffer's copy fails: the first one's copy is queued
// (behind a busy stream) and may still run, so neither its pool block (kept
// by none: max_free_per_class 0) nor its scratch buffer, device or host
// side, is freed before it has; the pass then goes on intact.
TEST(ToDevice, ACopyFailingMidItemFreesNothingItsQueuedCopiesStillUse) {
  std::vector<std::pair<int64_t, float>> samples;
  for (int i = 0; i < 64; ++i) samples.emplace_back(i, static_cast<float>(i) * 0.5f);
  for (const bool pinned : {true, false}) {
    SCOPED_TRACE(pinned ? "from the pinned pool" : "through scratch buffers");
    auto device = test_device();
    {
      auto collated = nodes::from_vector(samples) | nodes::batch(16) | nodes::collate();
      auto pipeline = pinned ? std::move(collated) | nodes::pin_memory(device, 0) | nodes::to_device(device, 0)
                             : std::move(collated) | nodes::to_device(device, 0);
      device->hold_stream();
      device->fail_copy_number = 1;  // the first item's second buffer
      auto pass = pipeline.pass();
      try {
        (void)pass.next();
        ADD_FAILURE() << "the failed copy gave an item";
      } catch (const conveyor::NodeError& e) {
        EXPECT_EQ(e.node(), "to_device(0)");
      }
      EXPECT_EQ(device->frees_while_held.load(), 0) << "freed under a copy still queued";
      device->release_stream();
      int64_t first = 16;
      while (auto item = pass.next()) {
        EXPECT_EQ(item->host.first[0], first);
        item->device.ready.synchronize();
        std::vector<int64_t> on_device(16);
        std::memcpy(on_device.data(), item->device.buffers.at(0).device, on_device.size() * sizeof(int64_t));
        EXPECT_EQ(on_device[15], first + 15);
        first += 16;
      }
      EXPECT_EQ(first, 64);
    }
    EXPECT_EQ(device->live_device.load(), 0);
    EXPECT_EQ(device->live_pinned.load(), 0);
  }
}

// When the device cannot even record the event that fences an item's queued
// copies, what they read and write is never freed: the pool block and its
// twin are held for good (leaked), as scratch buffers are, not handed back
// with a default event that counts as done.
TEST(ToDevice, AnItemWhoseCopiesCannotBeFencedFreesNothingTheyUse) {
  for (const bool pinned : {true, false}) {
    SCOPED_TRACE(pinned ? "from the pinned pool" : "through scratch buffers");
    auto device = test_device();
    device->hold_stream();
    {
      auto collated = nodes::from_range(0, 64) | nodes::batch(16) | nodes::collate();
      auto pipeline = pinned ? std::move(collated) | nodes::pin_memory(device, 0) | nodes::to_device(device, 0)
                             : std::move(collated) | nodes::to_device(device, 0);
      device->fail_record = true;
      auto pass = pipeline.pass();
      try {
        (void)pass.next();
        ADD_FAILURE() << "an item without its event";
      } catch (const conveyor::NodeError& e) {
        EXPECT_EQ(e.node(), "to_device(0)");
        EXPECT_NE(std::string(e.what()).find("event record failed (test)"), std::string::npos) << e.what();
      }
    }
    EXPECT_EQ(device->frees_while_held.load(), 0) << "freed under a copy still queued";
    device->release_stream();
    EXPECT_EQ(device->live_device.load(), 1);  // the twin or scratch buffer, held for good
    if (pinned) {
      EXPECT_EQ(device->live_pinned.load(), 1);  // and the block
    }
  }
}

// After a sticky device error every wait fails: an item dropped then has
// its memory freed with a warning, not std::terminate from a noexcept path.
TEST(ToDevice, AFailingWaitWhereMemoryIsReleasedIsAWarning) {
  std::vector<std::string> warnings;
  auto previous = conveyor::set_warning_handler([&](const std::string& m) { warnings.push_back(m); });
  auto device = test_device();
  {
    auto pipeline = nodes::from_range(0, kBatch * 4) | nodes::batch(kBatch) | nodes::collate() |
                    nodes::pin_memory(device, 0) | nodes::to_device(device, 0);
    auto pass = pipeline.pass();
    device->fail_event_waits = true;
    try {
      auto item = pass.next();  // its copy's event fails when waited for
    } catch (const std::exception&) {
      // The stage may report it here; what matters is the release below.
    }
  }
  conveyor::set_warning_handler(previous);
  ASSERT_FALSE(warnings.empty());
  EXPECT_NE(warnings[0].find("illegal memory access"), std::string::npos) << warnings[0];
  EXPECT_EQ(device->live_pinned.load(), 0);
}

TEST(ToDevice, PassesLeftMidCopyLeaveNothingBehind) {
  auto device = test_device();
  {
    auto pipeline = nodes::from_range(0, kBatch * kBatches) | nodes::batch(kBatch) | nodes::collate() |
                    nodes::prefetch(3) | nodes::pin_memory(device) | nodes::to_device(device, 4);
    for (int round = 0; round < 200; ++round) {
      auto pass = pipeline.pass();
      for (int k = 0; k < round % 7; ++k) ASSERT_EQ((*pass.next()).host[0], k * kBatch);
    }
    const auto metrics = pipeline.metrics();
    EXPECT_EQ(metrics.back().name, "to_device(4)");
    EXPECT_EQ(metrics.back().items_out, 199u % 7);
    EXPECT_EQ(metrics.back().window, 5u);
  }
  EXPECT_EQ(device->live_pinned.load(), 0);
  EXPECT_EQ(device->live_device.load(), 0);
  EXPECT_THROW(nodes::from_range(0, 1) | nodes::to_device(nullptr), conveyor::ValueError);
}

}  // namespace
