// Errors from user code the loader calls (samplers, iterable datasets,
// worker_init_fn, get_batch): each arrives once, in its place, and nothing
// is lost or made up around it; the epoch always ends.
#include <gtest/gtest.h>

#include <conveyor/conveyor.h>

#include <algorithm>
#include <atomic>
#include <optional>
#include <span>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "support/datasets.h"

namespace {

using conveyor::BatchIndices;
using conveyor::Scheduling;
using conveyor::testing::RangeDataset;

// Batches {0,1}, {2,3}, ... of a dataset of `n`; the pass's call for batch
// `fail_at` throws once (the call after it goes on with that batch), or its
// iter() throws on pass `iter_fail_pass`.
class FlakySampler final : public conveyor::Sampler<BatchIndices> {
 public:
  FlakySampler(size_t n, int64_t fail_at, int64_t iter_fail_pass = -1)
      : n_(n), fail_at_(fail_at), iter_fail_pass_(iter_fail_pass) {}
  size_t size() const override { return (n_ + 1) / 2; }
  std::string name() const override { return "FlakySampler"; }
  std::unique_ptr<conveyor::SamplerIterator<BatchIndices>> iter() override {
    if (passes_++ == iter_fail_pass_) throw std::runtime_error("sampler iter() broke");
    class Iterator final : public conveyor::SamplerIterator<BatchIndices> {
     public:
      Iterator(size_t n, int64_t fail_at) : n_(n), fail_at_(fail_at) {}
      bool next(BatchIndices& out) override {
        if (next_ >= n_) return false;
        if (static_cast<int64_t>(next_ / 2) == fail_at_ && !failed_) {
          failed_ = true;
          throw std::runtime_error("sampler next() broke");
        }
        out.clear();
        out.push_back(next_++);
        if (next_ < n_) out.push_back(next_++);
        return true;
      }

     private:
      size_t n_;
      int64_t fail_at_;
      size_t next_ = 0;
      bool failed_ = false;
    };
    return std::make_unique<Iterator>(n_, fail_at_);
  }

 private:
  size_t n_;
  int64_t fail_at_;
  int64_t iter_fail_pass_;
  int64_t passes_ = 0;
};

// Walks an epoch to its end: batches as their first sample, a WorkerError as
// "worker-error:<stage>@<worker>", any other exception as "error:<what>".
template <class Epoch>
std::vector<std::string> walk(Epoch& epoch, size_t limit = 10000) {
  std::vector<std::string> events;
  while (events.size() < limit) {
    try {
      auto batch = epoch.next();
      if (!batch) return events;
      events.push_back(std::to_string((*batch)[0]));
    } catch (const conveyor::WorkerError& e) {
      events.push_back("worker-error:" + e.context().stage + "@" + std::to_string(e.context().worker_id));
    } catch (const std::exception& e) {
      events.push_back(std::string("error:") + e.what());
    }
  }
  ADD_FAILURE() << "the epoch did not end after " << limit << " events";
  return events;
}

// The next `count` events of an epoch that has at least that many.
template <class Epoch>
std::vector<std::string> take_events(Epoch& epoch, size_t count) {
  std::vector<std::string> events;
  while (events.size() < count) {
    try {
      auto batch = epoch.next();
      if (!batch) {
        ADD_FAILURE() << "the epoch ended after " << events.size() << " events";
        break;
      }
      events.push_back(std::to_string((*batch)[0]));
    } catch (const std::exception& e) {
      events.push_back(std::string("error:") + e.what());
    }
  }
  return events;
}

TEST(SamplerErrors, ASamplerThatThrowsOnceLosesNoBatchAndTheErrorKeepsItsPlace) {
  // At num_workers = 0 the error comes where the sampler failed and every
  // batch arrives; with workers the same, although the batch drawn before
  // the failure was already taken for the consumer.
  RangeDataset dataset(20);
  const std::vector<std::string> expected = {"0", "2", "4", "error:sampler next() broke",
                                             "6", "8", "10", "12", "14", "16", "18"};
  for (int workers : {0, 1, 2, 3}) {
    for (Scheduling scheduling : {Scheduling::round_robin, Scheduling::work_stealing}) {
      for (int prefetch : {1, 2, 4}) {
        if (workers == 0 && prefetch != 2) continue;
        SCOPED_TRACE(std::to_string(workers) + " workers, prefetch " + std::to_string(prefetch));
        conveyor::DataLoader loader(dataset, {.batch_sampler = std::make_shared<FlakySampler>(20, 3),
                                              .num_workers = workers, .prefetch_factor = prefetch,
                                              .scheduling = scheduling});
        auto epoch = loader.iter();
        EXPECT_EQ(walk(epoch), expected);
      }
    }
  }
}

// Indices 0..n-1; the pass's call for index `fail_at` throws once and the
// call after it would go on with that index.
class FlakyIndexSampler final : public conveyor::Sampler<size_t> {
 public:
  FlakyIndexSampler(size_t n, size_t fail_at) : n_(n), fail_at_(fail_at) {}
  size_t size() const override { return n_; }
  std::string name() const override { return "FlakyIndexSampler"; }
  std::unique_ptr<conveyor::SamplerIterator<size_t>> iter() override {
    class Iterator final : public conveyor::SamplerIterator<size_t> {
     public:
      Iterator(size_t n, size_t fail_at) : n_(n), fail_at_(fail_at) {}
      bool next(size_t& out) override {
        if (next_ >= n_) return false;
        if (next_ == fail_at_ && !failed_) {
          failed_ = true;
          throw std::runtime_error("sampler next() broke");
        }
        out = next_++;
        return true;
      }

     private:
      size_t n_;
      size_t fail_at_;
      size_t next_ = 0;
      bool failed_ = false;
    };
    return std::make_unique<Iterator>(n_, fail_at_);
  }

 private:
  size_t n_;
  size_t fail_at_;
};

TEST(SamplerErrors, ASamplerUnderTheDefaultBatchSamplerEndsTheEpochWhenItRaises) {
  // PyTorch's BatchSampler is a generator: once the sampler inside it
  // raised, it is finished. The error keeps its place after the batches
  // drawn before it; the batch it was filling ({4, 5}) is gone with it.
  RangeDataset dataset(20);
  const std::vector<std::string> expected = {"0", "2", "error:sampler next() broke"};
  for (int workers : {0, 2}) {
    SCOPED_TRACE(std::to_string(workers) + " workers");
    conveyor::DataLoader loader(dataset, {.batch_size = 2, .sampler = std::make_shared<FlakyIndexSampler>(20, 5),
                                          .num_workers = workers});
    auto epoch = loader.iter();
    EXPECT_EQ(walk(epoch), expected);
  }
}

// A state taken just after the consumer received a sampler error resumes
// with the batch after it, also when a transfer stage ran ahead of the
// consumer (its bookkeeping commits one record per thing received, and the
// error is one).
TEST(SamplerErrors, AStateTakenRightAfterASamplerErrorResumesWithTheNextBatch) {
  RangeDataset dataset(40);
  for (const bool to_device : {false, true}) {
    SCOPED_TRACE(to_device ? "prefetch_to_device" : "no transfer stage");
    auto options_with = [to_device](std::shared_ptr<conveyor::Sampler<BatchIndices>> sampler) {
      // No workers: every batch is ready when the transfer stage looks
      // ahead, so it always runs past the error before the consumer has it.
      conveyor::LoaderOptions options{.batch_sampler = std::move(sampler), .num_workers = 0};
      if (to_device) {
        options.pin_memory = true;
        options.transfer_device = conveyor::make_host_standin_device();
        options.prefetch_to_device = 2;
      }
      return options;
    };
    conveyor::DataLoader loader(dataset, options_with(std::make_shared<FlakySampler>(40, 3)));
    auto epoch = loader.iter();
    std::vector<std::string> before;
    while (before.size() < 10 && (before.empty() || before.back().rfind("error:", 0) != 0)) {
      try {
        auto batch = epoch.next();
        ASSERT_TRUE(batch);
        before.push_back(std::to_string((*batch)[0]));
      } catch (const std::exception& e) {
        before.push_back(std::string("error:") + e.what());
      }
    }
    EXPECT_EQ(before, (std::vector<std::string>{"0", "2", "4", "error:sampler next() broke"}));
    const conveyor::State state = loader.state_dict();
    // The same sampler (by name and size) that no longer fails.
    conveyor::DataLoader resumed(dataset, options_with(std::make_shared<FlakySampler>(40, -1)));
    resumed.load_state_dict(state);
    auto rest = resumed.iter();
    const std::vector<std::string> after = walk(rest);
    ASSERT_FALSE(after.empty());
    EXPECT_EQ(after.front(), "6");
    EXPECT_EQ(after.size(), 17u);
  }
}

TEST(SamplerErrors, OutOfOrderTheBatchesBeforeTheErrorStillComeFirst) {
  RangeDataset dataset(20);
  conveyor::DataLoader loader(dataset, {.batch_sampler = std::make_shared<FlakySampler>(20, 5),
                                        .num_workers = 3, .in_order = false});
  auto epoch = loader.iter();
  std::vector<std::string> events = walk(epoch);
  ASSERT_EQ(events.size(), 11u);
  const auto error = std::find(events.begin(), events.end(), "error:sampler next() broke");
  ASSERT_NE(error, events.end());
  std::vector<std::string> before(events.begin(), error), after(error + 1, events.end());
  std::sort(before.begin(), before.end());
  std::sort(after.begin(), after.end());
  EXPECT_EQ(before, (std::vector<std::string>{"0", "2", "4", "6", "8"}));
  EXPECT_EQ(after, (std::vector<std::string>{"10", "12", "14", "16", "18"}));
}

TEST(SamplerErrors, ASamplerWhoseIterThrowsOnceDoesNotLockAPersistentLoader) {
  RangeDataset dataset(8);
  for (bool persistent : {true, false}) {
    SCOPED_TRACE(persistent ? "persistent" : "not persistent");
    conveyor::DataLoader loader(dataset, {.batch_sampler = std::make_shared<FlakySampler>(8, -1, 1),
                                          .num_workers = 2, .persistent_workers = persistent});
    {
      auto first = loader.iter();
      EXPECT_EQ(walk(first), (std::vector<std::string>{"0", "2", "4", "6"}));
    }
    try {
      loader.iter();
      ADD_FAILURE() << "the sampler's iter() did not throw";
    } catch (const std::runtime_error& e) {
      EXPECT_STREQ(e.what(), "sampler iter() broke");
    }
    auto third = loader.iter();  // refused for ever before the fix
    EXPECT_EQ(walk(third), (std::vector<std::string>{"0", "2", "4", "6"}));
  }
}

// A sampler that fails at the same place in the resumed pass: the consumer
// had that error before the state was taken, and does not get it again;
// a failure the saved pass did not have still comes.
TEST(SamplerErrors, AResumedEpochDoesNotHandOutASamplerErrorItsConsumerHad) {
  RangeDataset dataset(32);
  for (const int workers : {0, 2}) {
    for (const bool to_device : {false, true}) {
      SCOPED_TRACE(std::to_string(workers) + " workers" + (to_device ? ", prefetch_to_device" : ""));
      auto options_with = [&](int64_t fail_at) {
        conveyor::LoaderOptions options{.batch_sampler = std::make_shared<FlakySampler>(32, fail_at),
                                        .num_workers = workers};
        if (to_device) {
          options.pin_memory = true;
          options.transfer_device = conveyor::make_host_standin_device();
          options.prefetch_to_device = 2;
        }
        return options;
      };
      std::vector<std::string> uninterrupted;
      {
        conveyor::DataLoader loader(dataset, options_with(3));
        auto epoch = loader.iter();
        uninterrupted = walk(epoch);
      }
      ASSERT_EQ(uninterrupted.size(), 17u);
      ASSERT_EQ(uninterrupted[3], "error:sampler next() broke");
      for (const size_t stop : {size_t{4}, size_t{6}}) {
        conveyor::DataLoader loader(dataset, options_with(3));
        auto epoch = loader.iter();
        std::vector<std::string> events = take_events(epoch, stop);
        const conveyor::State state = loader.state_dict();
        conveyor::DataLoader resumed(dataset, options_with(3));
        resumed.load_state_dict(state);
        auto rest = resumed.iter();
        for (std::string& event : walk(rest)) events.push_back(std::move(event));
        EXPECT_EQ(events, uninterrupted) << "stopped after " << stop;
      }
      // Resumed past the error with a sampler that now fails later: that
      // failure is new, and comes.
      conveyor::DataLoader loader(dataset, options_with(3));
      auto epoch = loader.iter();
      (void)take_events(epoch, 6);
      conveyor::DataLoader resumed(dataset, options_with(9));
      resumed.load_state_dict(loader.state_dict());
      auto rest = resumed.iter();
      const std::vector<std::string> after = walk(rest);
      EXPECT_EQ(std::count(after.begin(), after.end(), "error:sampler next() broke"), 1);
    }
  }
}

// An iter() that fails (the sampler's iter() throws, a persistent loader's
// epoch is still live) starts no epoch: nothing stays live, the epoch count
// and a pending resume are as they were, and the retry is that iter().
TEST(LoaderIter, AFailedIterLeavesTheLoaderWhereItStood) {
  RangeDataset dataset(8);
  for (const int workers : {0, 2}) {
    SCOPED_TRACE(std::to_string(workers) + " workers");
    conveyor::State saved;
    {
      conveyor::DataLoader loader(dataset, {.batch_sampler = std::make_shared<FlakySampler>(8, -1), .num_workers = workers});
      auto epoch = loader.iter();
      ASSERT_TRUE(epoch.next());
      ASSERT_TRUE(epoch.next());
      saved = loader.state_dict();
    }
    conveyor::DataLoader loader(dataset, {.batch_sampler = std::make_shared<FlakySampler>(8, -1, 0),
                                          .num_workers = workers});
    const conveyor::State fresh = loader.state_dict();
    loader.load_state_dict(saved);
    EXPECT_THROW(loader.iter(), std::runtime_error);
    EXPECT_NO_THROW(loader.load_state_dict(saved)) << "the failed iter() left an epoch live";
    {
      auto rest = loader.iter();
      EXPECT_EQ(walk(rest), (std::vector<std::string>{"4", "6"})) << "the resume was lost with the failed iter()";
    }
    EXPECT_NO_THROW(loader.load_state_dict(fresh));
  }

  // A persistent loader refusing a second live epoch: the next epoch's
  // per-batch seeds (by epoch) are those it would have had.
  struct Drawing final : conveyor::Dataset<int64_t> {
    size_t size() const override { return 12; }
    int64_t get(size_t) override { return static_cast<int64_t>(conveyor::default_generator().random() % 1000); }
  } drawing;
  auto second_epoch = [&drawing](bool refused_between) {
    conveyor::DataLoader loader(drawing, {.batch_size = 2, .num_workers = 2, .persistent_workers = true, .seed = 3,
                                          .scheduling = Scheduling::work_stealing});
    {
      auto first = loader.iter();
      if (refused_between) {
        EXPECT_THROW(loader.iter(), conveyor::RuntimeError);
      }
      while (first.next()) {
      }
    }
    std::vector<int64_t> values;
    for (auto& batch : loader) {
      const auto drawn = batch.values();
      values.insert(values.end(), drawn.begin(), drawn.end());
    }
    EXPECT_NO_THROW(loader.load_state_dict(loader.state_dict()));
    return values;
  };
  EXPECT_EQ(second_epoch(true), second_epoch(false));
}

// Worker w yields w*100, w*100+1, ..., `per_worker` samples; the replica of
// worker `broken` throws from iter(). Without workers, iter(nullptr) throws
// when `broken` is -1... or yields worker 0's stream otherwise.
struct BrokenReplica final : conveyor::IterableDataset<int64_t> {
  BrokenReplica(int broken, int64_t per_worker) : broken(broken), per_worker(per_worker) {}
  std::unique_ptr<conveyor::SampleIterator<int64_t>> iter(const conveyor::WorkerInfo* worker) override {
    const int id = worker ? worker->id : -1;
    if (id == broken) throw std::runtime_error("no shard for worker " + std::to_string(id));
    const int64_t first = std::max(id, 0) * 100;
    return conveyor::make_sample_iterator<int64_t>(
        [next = first, end = first + per_worker]() mutable -> std::optional<int64_t> {
          if (next == end) return std::nullopt;
          return next++;
        });
  }
  int broken;
  int64_t per_worker;
};

TEST(IterableErrors, AWorkerWhoseIterThrowsReportsItOnceAndCountsAsExhausted) {
  // PyTorch's rule: a worker that fails to start its replica is done; the
  // epoch ends even for a consumer that goes on past every error.
  BrokenReplica dataset(/*broken=*/1, /*per_worker=*/4);
  for (int prefetch : {1, 2, 3}) {
    for (bool persistent : {false, true}) {
      SCOPED_TRACE("prefetch " + std::to_string(prefetch) + (persistent ? ", persistent" : ""));
      conveyor::DataLoader loader(dataset, {.batch_size = 2, .num_workers = 3, .prefetch_factor = prefetch,
                                            .persistent_workers = persistent});
      for (int epoch_number = 0; epoch_number < 2; ++epoch_number) {
        auto epoch = loader.iter();
        EXPECT_EQ(walk(epoch), (std::vector<std::string>{"0", "worker-error:iter@1", "200", "2", "202"}));
      }
    }
  }
}

TEST(IterableErrors, AWorkerWhoseInitFnThrowsReportsItOnceAndCountsAsExhausted) {
  BrokenReplica dataset(/*broken=*/-2, /*per_worker=*/4);
  std::atomic<int> inits{0};
  for (bool persistent : {false, true}) {
    conveyor::DataLoader loader(dataset, {.batch_size = 2, .num_workers = 3, .persistent_workers = persistent,
                                          .worker_init_fn = [&](int id) {
                                            inits.fetch_add(1);
                                            if (id == 2) throw std::runtime_error("no device for worker 2");
                                          }});
    for (int epoch_number = 0; epoch_number < 2; ++epoch_number) {
      auto epoch = loader.iter();
      EXPECT_EQ(walk(epoch),
                (std::vector<std::string>{"0", "100", "worker-error:worker_init_fn@2", "2", "102"}));
    }
  }
  EXPECT_EQ(inits.load(), 3 * 2 + 3);  // each pass's pool, or once for the persistent one
}

TEST(IterableErrors, WithoutWorkersIterThrowsAWorkerErrorFromNextNotFromIter) {
  // README: one catch (WorkerError&) serves both; the epoch then ends.
  BrokenReplica dataset(/*broken=*/-1, /*per_worker=*/4);
  conveyor::DataLoader loader(dataset, {.batch_size = 2});
  std::optional<conveyor::DataLoader<BrokenReplica>::Epoch> epoch;
  ASSERT_NO_THROW(epoch.emplace(loader.iter()));
  try {
    epoch->next();
    ADD_FAILURE() << "no error";
  } catch (const conveyor::WorkerError& e) {
    EXPECT_EQ(e.context().stage, "iter");
    EXPECT_EQ(e.context().worker_id, -1);
    EXPECT_NE(std::string(e.what()).find("no shard for worker -1"), std::string::npos) << e.what();
  }
  EXPECT_FALSE(epoch->next().has_value());
}

// Worker 1 (or, without workers, the consumer's thread) has no shard and
// returns no iterator at all: a TypeError for that worker, once, in its
// place, as PyTorch's "iter() returned non-iterator"; the others go on.
struct NoIteratorForWorker1 final : conveyor::IterableDataset<int64_t> {
  std::unique_ptr<conveyor::SampleIterator<int64_t>> iter(const conveyor::WorkerInfo* worker) override {
    if (!worker || worker->id == 1) return nullptr;
    return conveyor::make_sample_iterator<int64_t>([next = int64_t{0}]() mutable -> std::optional<int64_t> {
      if (next == 3) return std::nullopt;
      return next++;
    });
  }
};

TEST(IterableErrors, AnIterThatReturnsNoIteratorFailsThatWorkerOnce) {
  NoIteratorForWorker1 dataset;
  conveyor::DataLoader loader(dataset, {.batch_size = 2, .num_workers = 2});
  for (int epoch_number = 0; epoch_number < 2; ++epoch_number) {
    auto epoch = loader.iter();
    EXPECT_EQ(walk(epoch), (std::vector<std::string>{"0", "worker-error:iter@1", "2"}));
  }
  conveyor::DataLoader alone(dataset, {.batch_size = 2});
  auto epoch = alone.iter();
  try {
    (void)epoch.next();
    ADD_FAILURE() << "no error";
  } catch (const conveyor::WorkerError& error) {
    EXPECT_EQ(error.context().stage, "iter");
    EXPECT_NE(std::string(error.what()).find("iter() returned no iterator"), std::string::npos) << error.what();
  }
  EXPECT_FALSE(epoch.next().has_value());
}

// A ChainDataset part that returns no iterator is reported once; the chain
// goes on with the next part.
TEST(IterableErrors, AChainPartThatReturnsNoIteratorIsReportedOnceAndSkipped) {
  auto parts = std::vector<std::shared_ptr<conveyor::IterableDataset<int64_t>>>{
      std::make_shared<NoIteratorForWorker1>(), std::make_shared<BrokenReplica>(/*broken=*/-2, /*per_worker=*/2)};
  conveyor::ChainDataset<int64_t> chain(parts);
  conveyor::DataLoader loader(chain, {.batch_size = 1});
  auto epoch = loader.iter();
  // Without workers the first part has no iterator: its error, then the second part's 0, 1.
  EXPECT_EQ(walk(epoch), (std::vector<std::string>{"worker-error:iterate@-1", "0", "1"}));
}

// A collate that asks for more than any buffer can be (a shape read from a
// corrupt header): an error in that batch's place, with and without
// workers, not an abort of the process.
struct HugeCollate final : conveyor::Dataset<int64_t> {
  size_t size() const override { return 6; }
  int64_t get(size_t i) override { return static_cast<int64_t>(i); }
};

TEST(MapErrors, ACollateBeyondAnyBufferIsAWorkerErrorInItsPlace) {
  for (int workers : {0, 2}) {
    SCOPED_TRACE(std::to_string(workers) + " workers");
    HugeCollate dataset;
    auto collate = [](std::vector<int64_t> samples) {
      if (samples.front() == 2) return conveyor::Array<uint8_t>({int64_t{1} << 55});
      conveyor::Array<uint8_t> out({static_cast<int64_t>(samples.size())});
      for (size_t i = 0; i < samples.size(); ++i) out.data()[i] = static_cast<uint8_t>(samples[i]);
      return out;
    };
    conveyor::DataLoader loader(dataset, {.batch_size = 2, .num_workers = workers}, collate);
    auto epoch = loader.iter();
    std::vector<std::string> events;
    while (true) {
      try {
        auto batch = epoch.next();
        if (!batch) break;
        events.push_back(std::to_string(batch->data()[0]));
      } catch (const conveyor::WorkerError& error) {
        events.push_back("error");
        EXPECT_EQ(error.context().stage, "collate");
        EXPECT_NE(std::string(error.what()).find("36028797018963968 bytes"), std::string::npos) << error.what();
      }
    }
    EXPECT_EQ(events, (std::vector<std::string>{"0", "error", "4"}));
  }
}

// get_batch that returns one sample too many or too few.
struct MiscountingBatches final : conveyor::Dataset<int64_t> {
  explicit MiscountingBatches(int delta) : delta(delta) {}
  size_t size() const override { return 12; }
  int64_t get(size_t i) override { return static_cast<int64_t>(i); }
  std::vector<int64_t> get_batch(std::span<const size_t> indices) override {
    std::vector<int64_t> out(indices.begin(), indices.end());
    if (indices.front() == 4) out.resize(out.size() + static_cast<size_t>(delta), 99);
    return out;
  }
  int delta;
};

TEST(MapErrors, GetBatchReturningTheWrongNumberOfSamplesIsAWorkerError) {
  for (int delta : {+1, -1}) {
    for (int workers : {0, 2}) {
      SCOPED_TRACE(std::to_string(delta) + ", " + std::to_string(workers) + " workers");
      MiscountingBatches dataset(delta);
      conveyor::DataLoader loader(dataset, {.batch_size = 4, .num_workers = workers});
      auto epoch = loader.iter();
      std::string message;
      std::vector<std::string> events;
      while (true) {
        try {
          auto batch = epoch.next();
          if (!batch) break;
          events.push_back(std::to_string(batch->numel()));
        } catch (const conveyor::WorkerError& e) {
          events.push_back("error");
          message = e.what();
          EXPECT_EQ(e.context().stage, "fetch");
        }
      }
      EXPECT_EQ(events, (std::vector<std::string>{"4", "error", "4"}));
      EXPECT_NE(message.find("get_batch returned " + std::to_string(4 + delta) + " samples for 4 indices"),
                std::string::npos)
          << message;
    }
  }
}

}  // namespace
