// Leaving an epoch: early (break), after a timeout, behind a sample that
// never returns. The timeout bounds each next(), whatever the stages.
#include <gtest/gtest.h>

#include <conveyor/conveyor.h>
#include <conveyor/transfer.h>

#include <atomic>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "support/datasets.h"
#include "support/sync.h"

namespace {

using conveyor::testing::Counter;
using conveyor::testing::Gates;
using conveyor::testing::RangeDataset;

#if defined(__SANITIZE_THREAD__) || defined(__SANITIZE_ADDRESS__)
constexpr int kBreakRounds = 20000;  // sanitizers run ~10x slower
#else
constexpr int kBreakRounds = 200000;
#endif

TEST(LeavingEarly, PersistentOutOfOrderEpochsLeftWithBreakNeverLeakAStaleSlot) {
  // A worker publishes a slot's turn before it enqueues the slot as done;
  // an epoch left early must not stop looking before that enqueue lands, or
  // the stale slot reaches the next epoch (an internal check aborts).
  RangeDataset dataset(64);
  conveyor::DataLoader loader(dataset, {.batch_size = 2, .num_workers = 3, .persistent_workers = true,
                                        .in_order = false});
  int64_t taken = 0;
  for (int round = 0; round < kBreakRounds; ++round) {
    for (auto& batch : loader) {
      taken += batch.numel() == 2 ? 1 : 0;
      break;
    }
  }
  EXPECT_EQ(taken, kBreakRounds);
  size_t samples = 0;
  for (auto& batch : loader) samples += batch.numel();
  EXPECT_EQ(samples, 64u);  // a whole epoch after all that
}

// Sample `stuck` waits at gate 0 the first time, then sets `returned`
// (later fetches of it return at once); the destructor bumps
// `destroyed`. What it signals through is shared with the test, so that
// either may go first while the dataset goes away on another thread.
struct StuckSample final : conveyor::Dataset<int64_t> {
  struct Signals {
    Gates gate{1};
    std::atomic<bool> returned{false};
    Counter destroyed;
  };
  StuckSample(size_t n, size_t stuck, std::shared_ptr<Signals> signals)
      : n(n), stuck(stuck), signals(std::move(signals)) {}
  ~StuckSample() override { signals->destroyed.bump(); }
  size_t size() const override { return n; }
  int64_t get(size_t i) override {
    if (i == stuck && !fetched_stuck.exchange(true)) {
      signals->gate.wait(0);
      signals->returned.store(true);
    }
    return static_cast<int64_t>(i);
  }
  size_t n;
  size_t stuck;
  std::shared_ptr<Signals> signals;
  std::atomic<bool> fetched_stuck{false};
};

TEST(Timeouts, TheTimeoutBoundsNextWhateverTheTransferStageHoldsAhead) {
  // With prefetch_to_device = N the stage used to wait for N + 1 batches,
  // each for a whole timeout, and queued a TimeoutError for each: after the
  // stuck batch came back, next() still threw the queued ones.
  for (int depth : {1, 3}) {
    SCOPED_TRACE("prefetch_to_device " + std::to_string(depth));
    auto signals = std::make_shared<StuckSample::Signals>();
    StuckSample dataset(12, /*stuck=*/4, signals);
    conveyor::DataLoader loader(dataset, {.batch_size = 2, .num_workers = 2, .pin_memory = true,
                                          .transfer_device = conveyor::make_host_standin_device(),
                                          .prefetch_to_device = depth, .timeout = 1});
    auto epoch = loader.iter();
    EXPECT_EQ((*epoch.next())[0], 0);
    EXPECT_EQ((*epoch.next())[0], 2);
    EXPECT_THROW(epoch.next(), conveyor::TimeoutError);
    signals->gate.open(0);
    std::vector<int64_t> rest;
    while (auto batch = epoch.next()) rest.push_back((*batch)[0]);
    EXPECT_EQ(rest, (std::vector<int64_t>{4, 6, 8, 10}));
  }
}

// Opens `gate` if not stood down within a minute: code that blocks on the
// gate then fails the test instead of hanging it.
class Watchdog {
 public:
  explicit Watchdog(Gates& gate)
      : thread_([this, &gate] {
          std::unique_lock lock(mutex_);
          if (!done_cv_.wait_for(lock, std::chrono::minutes(1), [this] { return done_; })) {
            fired_ = true;
            gate.open(0);
          }
        }) {}
  ~Watchdog() {
    if (thread_.joinable()) stand_down();
  }
  // The guarded code returned: stand down. True if it had to fire first.
  bool stand_down() {
    {
      std::lock_guard lock(mutex_);
      done_ = true;
    }
    done_cv_.notify_all();
    thread_.join();
    return fired_;
  }

 private:
  std::mutex mutex_;
  std::condition_variable done_cv_;
  bool done_ = false;
  bool fired_ = false;
  std::thread thread_;
};

TEST(Timeouts, DroppingEpochAndLoaderAfterATimeoutReturnsWhileTheSampleIsStuck) {
  // The loader co-owns the dataset: destruction returns at once, and the
  // stuck task finishes later in the background, touching nothing freed
  // (ASan checks that build).
  for (bool persistent : {false, true}) {
    SCOPED_TRACE(persistent ? "persistent" : "not persistent");
    auto signals = std::make_shared<StuckSample::Signals>();
    {
      Watchdog watchdog(signals->gate);
      {
        conveyor::DataLoader loader(std::make_shared<StuckSample>(40, /*stuck=*/6, signals),
                                    {.batch_size = 2, .num_workers = 2,
                                     .persistent_workers = persistent, .timeout = 2});
        std::optional<conveyor::DataLoader<StuckSample>::Epoch> epoch(loader.iter());
        for (int64_t expected : {0, 2, 4}) EXPECT_EQ((*epoch->next())[0], expected);
        EXPECT_THROW(epoch->next(), conveyor::TimeoutError);
        if (persistent) {
          // The loader goes on with fresh workers; the stuck one is left behind.
          epoch.reset();
          epoch.emplace(loader.iter());
          EXPECT_EQ((*epoch->next())[0], 0);
        }
      }  // epoch and loader go here, the sample still stuck
      EXPECT_FALSE(watchdog.stand_down()) << "destruction waited for the stuck sample";
    }
    EXPECT_FALSE(signals->returned.load());
    EXPECT_EQ(signals->destroyed.get(), 0u);  // the stuck task still holds the dataset
    signals->gate.open(0);                    // it finishes in the background...
    signals->destroyed.wait_for(1);           // ...and frees the dataset there
    EXPECT_TRUE(signals->returned.load());
  }
}

}  // namespace
