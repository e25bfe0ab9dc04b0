// Seeded stress: random delays, random throws, random abandonment, every
// scheduling mode. Each run prints its seed; `--seed=N` replays one,
// `--batches=N` sets the volume (default 100000).
#include <gtest/gtest.h>

#include <conveyor/conveyor.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "support/sync.h"

namespace {

uint64_t g_seed = 0;
bool g_seed_given = false;
uint64_t g_batches = 100000;

// Sample i is i. A sample "fails" when its hash says so (so the expected
// errors are known without running), and every get() spins a random while.
struct Chaotic final : conveyor::Dataset<int64_t> {
  Chaotic(size_t n, uint64_t seed, uint32_t fail_per_mille, uint32_t max_delay_ns)
      : n(n), seed(seed), fail_per_mille(fail_per_mille), max_delay_ns(max_delay_ns) {}
  size_t size() const override { return n; }
  static uint64_t hash(uint64_t x) {
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdULL;
    x ^= x >> 33;
    x *= 0xc4ceb9fe1a85ec53ULL;
    return x ^ (x >> 33);
  }
  bool fails(size_t i) const { return hash(seed ^ (i * 0x9e3779b97f4a7c15ULL)) % 1000 < fail_per_mille; }
  int64_t get(size_t i) override {
    const uint64_t h = hash(seed + i);
    if (max_delay_ns > 0 && h % 4 == 0) conveyor::testing::spin_delay(h % max_delay_ns);
    if (fails(i)) throw std::runtime_error("chaos at " + std::to_string(i));
    return static_cast<int64_t>(i);
  }
  size_t n;
  uint64_t seed;
  uint32_t fail_per_mille;
  uint32_t max_delay_ns;
};

struct Outcome {
  std::vector<int64_t> first_index;  // per delivered batch: its first sample, or -1 - seq for an error
};

TEST(Stress, NothingLostDuplicatedOrReordered) {
  const uint64_t seed = g_seed_given ? g_seed : std::random_device{}();
  std::printf("stress seed: %llu (replay with --seed=%llu), batches: %llu\n",
              static_cast<unsigned long long>(seed), static_cast<unsigned long long>(seed),
              static_cast<unsigned long long>(g_batches));
  std::mt19937_64 rng(seed);
  uint64_t delivered = 0;
  int runs = 0;
  while (delivered < g_batches) {
    ++runs;
    const int workers = std::uniform_int_distribution<int>(1, 8)(rng);
    const int prefetch = std::uniform_int_distribution<int>(1, 4)(rng);
    const int64_t batch_size = std::uniform_int_distribution<int64_t>(1, 4)(rng);
    const bool in_order = rng() % 2 == 0;
    const bool persistent = rng() % 3 == 0;
    const auto scheduling = rng() % 2 ? conveyor::Scheduling::round_robin : conveyor::Scheduling::work_stealing;
    const size_t n = std::uniform_int_distribution<size_t>(1, 3000)(rng);
    Chaotic dataset(n, rng(), static_cast<uint32_t>(rng() % 30), static_cast<uint32_t>(rng() % 20000));
    SCOPED_TRACE("run " + std::to_string(runs) + ": workers " + std::to_string(workers) + ", prefetch " +
                 std::to_string(prefetch) + ", batch " + std::to_string(batch_size) + ", in_order " +
                 std::to_string(in_order) + ", persistent " + std::to_string(persistent) + ", work_stealing " +
                 std::to_string(scheduling == conveyor::Scheduling::work_stealing) + ", n " + std::to_string(n));
    // The order comes from a sampler with its own generator, seeded alike for
    // both loaders: persistent workers draw their base seed only once, so a
    // loader-level generator would drift from the reference after epoch 0.
    const bool shuffle = rng() % 2 == 0;
    const uint64_t order_seed = rng();
    auto sampler = [&]() -> std::shared_ptr<conveyor::Sampler<size_t>> {
      if (!shuffle) return std::make_shared<conveyor::SequentialSampler>(n);
      return std::make_shared<conveyor::RandomSampler>(n, false, std::nullopt, conveyor::Generator(order_seed));
    };
    conveyor::DataLoader loader(dataset, {.batch_size = batch_size, .sampler = sampler(),
                                          .num_workers = workers, .prefetch_factor = prefetch,
                                          .persistent_workers = persistent, .seed = rng(),
                                          .in_order = in_order, .scheduling = scheduling});
    conveyor::DataLoader reference(dataset, {.batch_size = batch_size, .sampler = sampler()});
    for (int epoch = 0; epoch < 2; ++epoch) {
      // What the batches must be: the in-thread loader's order.
      std::vector<std::vector<int64_t>> expected;
      std::vector<bool> expected_error;
      {
        auto it = reference.iter();
        while (true) {
          try {
            auto batch = it.next();
            if (!batch) break;
            expected.emplace_back(batch->values().begin(), batch->values().end());
            expected_error.push_back(false);
          } catch (const conveyor::WorkerError& e) {
            expected.push_back(std::vector<int64_t>(e.context().indices.begin(), e.context().indices.end()));
            expected_error.push_back(true);
          }
        }
      }
      // Sometimes walk away mid-epoch.
      const size_t stop_after = rng() % 4 == 0 ? rng() % (expected.size() + 1) : expected.size();
      auto it = loader.iter();
      std::vector<std::vector<int64_t>> got;
      std::vector<bool> got_error;
      while (got.size() < stop_after) {
        try {
          auto batch = it.next();
          if (!batch) break;
          got.emplace_back(batch->values().begin(), batch->values().end());
          got_error.push_back(false);
        } catch (const conveyor::WorkerError& e) {
          got.push_back(std::vector<int64_t>(e.context().indices.begin(), e.context().indices.end()));
          got_error.push_back(true);
        }
      }
      delivered += got.size();
      if (stop_after < expected.size()) {
        ASSERT_EQ(got.size(), stop_after);
        if (in_order) {
          expected.resize(stop_after);
          expected_error.resize(stop_after);
          ASSERT_EQ(got, expected);
          ASSERT_EQ(got_error, expected_error);
        }
        // ~Epoch mid-epoch. The abandoned pass drew less from its sampler's
        // generator than the reference did, so later epochs would differ:
        // move on to the next loader.
        break;
      }
      ASSERT_FALSE(it.next().has_value());
      if (!in_order) {
        // Each batch exactly once: compare as multisets.
        std::multiset<std::pair<std::vector<int64_t>, bool>> a, b;
        for (size_t i = 0; i < got.size(); ++i) a.insert({got[i], got_error[i]});
        for (size_t i = 0; i < expected.size(); ++i) b.insert({expected[i], expected_error[i]});
        ASSERT_EQ(a, b);
      } else {
        ASSERT_EQ(got, expected);
        ASSERT_EQ(got_error, expected_error);
      }
    }
  }
  std::printf("stress: %llu batches over %d loaders\n", static_cast<unsigned long long>(delivered), runs);
}

}  // namespace

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  for (int i = 1; i < argc; ++i) {
    if (std::strncmp(argv[i], "--seed=", 7) == 0) {
      g_seed = std::strtoull(argv[i] + 7, nullptr, 10);
      g_seed_given = true;
    } else if (std::strncmp(argv[i], "--batches=", 10) == 0) {
      g_batches = std::strtoull(argv[i] + 10, nullptr, 10);
    }
  }
  if (const char* env = std::getenv("CONVEYOR_STRESS_BATCHES")) g_batches = std::strtoull(env, nullptr, 10);
  return RUN_ALL_TESTS();
}
