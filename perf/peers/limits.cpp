// The performance suite's limits and calibration (perf/run_all), in C++.
//
//   conveyor_perf_limits --calibrate [--target-us 50]
//     W2: spin() iterations for ~50 us of CPU per sample, and the measured
//     cost per sample at that count; W3: the measured length of one 1 ms
//     sample sleep; W4: the measured mean cost per sample over indices
//     0..999 (stragglers included); W0: the cost of a batch of 8 tiny
//     samples made and collated in a bare loop, no loader (a fresh 64-byte
//     aligned batch buffer per batch, as collate allocates one). One JSON line.
//
//   conveyor_perf_limits --memcpy --threads T [--seconds S] [--samples N] [--batch-size B]
//     W1's limit: T threads memcpy the W1 data set's samples (12288 image +
//     8 label bytes each) into batch buffers of their own (a ring of three
//     each, the share of a loader's window), batch b going to thread b % T,
//     as fast as they can. One JSON line with samples/s.
//
//   conveyor_perf_limits --core-round-trip
//     How far apart the first two CPUs the process may run on are: the mean
//     time for a cache line to go from one to the other and back, two
//     threads pinned to them passing a counter (median of 5 rounds of
//     100,000). On a VM the host moves its vCPUs: on the 2-vCPU machines of
//     perf/README.md it reads 50-120 ns (the vCPUs placed near) or 330-400
//     ns (apart), flipping within minutes, and W5's per-sample graph, which
//     hands every sample's bytes from core to core, runs 20% slower apart.
//     One JSON line; the suite runs it before each run.
#include <pthread.h>
#include <sched.h>

#include <atomic>
#include <cstring>
#include <new>
#include <optional>
#include <thread>
#include <utility>
#include <vector>

#include "workloads.h"

namespace {

double mean_cost_us(int64_t iterations, int samples, uint64_t seed) {
  volatile int64_t sink = 0;
  const auto start = perf::Clock::now();
  for (int i = 0; i < samples; ++i) sink = sink + perf::spin(seed + static_cast<uint64_t>(i), iterations);
  return perf::seconds_since(start) * 1e6 / samples;
}

// W0 without a loader: get(i) = i for 8 indices, then what collate does,
// into a fresh aligned buffer. Median of 7 rounds of 200,000 batches.
double w0_loop_ns_per_batch() {
  constexpr size_t kBatch = 8;
  constexpr int kBatches = 200000;
  std::vector<double> rounds;
  size_t index = 0;
  for (int round = 0; round < 7; ++round) {
    const auto start = perf::Clock::now();
    for (int b = 0; b < kBatches; ++b) {
      int64_t samples[kBatch];
      for (int64_t& sample : samples) sample = static_cast<int64_t>(index++);
      auto* batch = static_cast<int64_t*>(::operator new(sizeof samples, std::align_val_t{64}));
      std::memcpy(batch, samples, sizeof samples);
      asm volatile("" : : "r"(batch) : "memory");  // keep the copy
      ::operator delete(batch, std::align_val_t{64});
    }
    rounds.push_back(perf::seconds_since(start) * 1e9 / kBatches);
  }
  return perf::percentile(rounds, 0.5);
}

int calibrate(double target_us) {
  // Coarse: grow until one batch of 200 samples takes >= 20 ms, then scale.
  int64_t iterations = 1000;
  double cost = mean_cost_us(iterations, 200, 1);
  while (cost * 200 < 20000 && iterations < (int64_t{1} << 30)) {
    iterations *= 2;
    cost = mean_cost_us(iterations, 200, 1);
  }
  for (int round = 0; round < 3; ++round) {
    iterations = std::max<int64_t>(1, static_cast<int64_t>(static_cast<double>(iterations) * target_us / cost));
    std::vector<double> trials;
    for (int t = 0; t < 5; ++t) trials.push_back(mean_cost_us(iterations, 200, 7 + t));
    cost = perf::percentile(trials, 0.5);
  }
  std::vector<double> trials;
  for (int t = 0; t < 7; ++t) trials.push_back(mean_cost_us(iterations, 400, 100 + t));
  const double w2_cost = perf::percentile(trials, 0.5);

  std::vector<double> sleeps;
  for (int i = 0; i < 200; ++i) {
    const auto start = perf::Clock::now();
    perf::w3_sample(static_cast<size_t>(i));
    sleeps.push_back(perf::seconds_since(start) * 1e6);
  }
  double w3_sum = 0;
  for (double s : sleeps) w3_sum += s;

  const auto w4_start = perf::Clock::now();
  for (size_t i = 0; i < 1000; ++i) perf::w4_sample(i);
  const double w4_mean = perf::seconds_since(w4_start) * 1e6 / 1000;

  const double w0_loop = w0_loop_ns_per_batch();

  std::printf(
      "{\"language\":\"c++\",\"w2_target_us\":%.3f,\"w2_iterations\":%lld,\"w2_cost_us\":%.4f,"
      "\"w2_cost_trials_us\":[%.4f,%.4f,%.4f,%.4f,%.4f,%.4f,%.4f],"
      "\"w3_sleep_mean_us\":%.4f,\"w3_sleep_p50_us\":%.4f,\"w3_sleep_p99_us\":%.4f,"
      "\"w4_mean_cost_us\":%.4f,\"w0_loop_ns_per_batch\":%.3f,\"cores\":%u}\n",
      target_us, static_cast<long long>(iterations), w2_cost, trials[0], trials[1], trials[2], trials[3],
      trials[4], trials[5], trials[6], w3_sum / static_cast<double>(sleeps.size()), perf::percentile(sleeps, 0.5),
      perf::percentile(sleeps, 0.99), w4_mean, w0_loop, std::thread::hardware_concurrency());
  return 0;
}

// Batch buffers per copying thread: a loader thread's share of the window
// (prefetch_factor 2) plus the one it is writing.
constexpr size_t kRingBatches = 3;

int memcpy_limit(int threads, double seconds, size_t samples, size_t batch_size) {
  const perf::W1Data data(samples);
  const size_t batches = (samples + batch_size - 1) / batch_size;
  std::atomic<bool> go{false}, stop{false}, measure{false};
  std::vector<uint64_t> copied(static_cast<size_t>(threads) * 8, 0);  // padded: one counter per 64 bytes
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t) {
    pool.emplace_back([&, t] {
      // A ring of batch buffers, as a loader's batches are: each stays out of
      // use while it is "in flight", so its lines leave the cache as a
      // loader's batches do (one buffer reused at once would stay hot).
      std::vector<std::vector<std::byte>> ring(kRingBatches,
                                               std::vector<std::byte>(batch_size * perf::kW1SampleBytes));
      size_t turn = 0;
      uint64_t done = 0;
      while (!go.load(std::memory_order_acquire)) std::this_thread::yield();
      size_t b = static_cast<size_t>(t);
      bool counting = false;
      while (!stop.load(std::memory_order_relaxed)) {
        if (!counting && measure.load(std::memory_order_relaxed)) {
          counting = true;
          done = 0;
        }
        const size_t first = b * batch_size;
        const size_t last = std::min(samples, first + batch_size);
        std::vector<std::byte>& batch = ring[turn];
        turn = (turn + 1) % ring.size();
        std::byte* out = batch.data();
        for (size_t i = first; i < last; ++i) {
          std::memcpy(out, data.images.data() + i * perf::kW1Floats, perf::kW1Floats * sizeof(float));
          std::memcpy(out + perf::kW1Floats * sizeof(float), &data.labels[i], sizeof(int64_t));
          out += perf::kW1SampleBytes;
        }
        done += last - first;
        b += static_cast<size_t>(threads);
        if (b >= batches) b = static_cast<size_t>(t) % batches;
        // Keep the compiler from dropping the copies.
        asm volatile("" : : "r"(batch.data()) : "memory");
      }
      copied[static_cast<size_t>(t) * 8] = done;
    });
  }
  go.store(true, std::memory_order_release);
  std::this_thread::sleep_for(std::chrono::milliseconds(500));  // warm-up
  measure.store(true);
  const auto start = perf::Clock::now();
  std::this_thread::sleep_for(std::chrono::duration<double>(seconds));
  stop.store(true);
  const double elapsed = perf::seconds_since(start);
  for (auto& thread : pool) thread.join();
  uint64_t total = 0;
  for (int t = 0; t < threads; ++t) total += copied[static_cast<size_t>(t) * 8];
  const double per_s = static_cast<double>(total) / elapsed;
  std::printf(
      "{\"limit\":\"memcpy\",\"threads\":%d,\"samples\":%llu,\"seconds\":%.6f,\"samples_per_s\":%.3f,"
      "\"bytes_per_s\":%.3f,\"sample_bytes\":%zu,\"dataset_samples\":%zu}\n",
      threads, static_cast<unsigned long long>(total), elapsed, per_s,
      per_s * static_cast<double>(perf::kW1SampleBytes), perf::kW1SampleBytes, samples);
  return 0;
}

// The first two CPUs in this thread's affinity mask, or nothing with one.
std::optional<std::pair<int, int>> first_two_cpus() {
  cpu_set_t allowed;
  if (sched_getaffinity(0, sizeof allowed, &allowed) != 0) return std::nullopt;
  std::vector<int> cpus;
  for (int cpu = 0; cpu < CPU_SETSIZE && cpus.size() < 2; ++cpu) {
    if (CPU_ISSET(cpu, &allowed)) cpus.push_back(cpu);
  }
  if (cpus.size() < 2) return std::nullopt;
  return std::pair{cpus[0], cpus[1]};
}

bool pin_to(int cpu) {
  cpu_set_t one;
  CPU_ZERO(&one);
  CPU_SET(cpu, &one);
  return pthread_setaffinity_np(pthread_self(), sizeof one, &one) == 0;
}

int core_round_trip() {
  const auto cpus = first_two_cpus();
  if (!cpus) {
    std::printf("{\"core_round_trip_ns\":null,\"why\":\"fewer than two CPUs\"}\n");
    return 0;
  }
  constexpr int kTrips = 100000;
  // The ball: odd while it is the echo thread's to return, even while it is
  // the timer's. Acquire/release so each side sees the other's last write;
  // the line moving between the cores is what is timed.
  alignas(64) std::atomic<int64_t> ball{0};
  std::atomic<bool> pinned{true};
  std::vector<double> rounds;
  for (int round = 0; round < 5; ++round) {
    ball.store(0, std::memory_order_relaxed);
    std::thread echo([&] {
      if (!pin_to(cpus->second)) pinned.store(false, std::memory_order_relaxed);
      for (int64_t trip = 0; trip < kTrips; ++trip) {
        while (ball.load(std::memory_order_acquire) != 2 * trip + 1) {
        }
        ball.store(2 * trip + 2, std::memory_order_release);
      }
    });
    if (!pin_to(cpus->first)) pinned.store(false, std::memory_order_relaxed);
    const auto start = perf::Clock::now();
    for (int64_t trip = 0; trip < kTrips; ++trip) {
      ball.store(2 * trip + 1, std::memory_order_release);
      while (ball.load(std::memory_order_acquire) != 2 * trip + 2) {
      }
    }
    rounds.push_back(perf::seconds_since(start) * 1e9 / kTrips);
    echo.join();
  }
  std::printf("{\"core_round_trip_ns\":%.1f,\"cpus\":[%d,%d],\"pinned\":%s}\n", perf::percentile(rounds, 0.5),
              cpus->first, cpus->second, pinned.load() ? "true" : "false");
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  bool do_calibrate = false, do_memcpy = false, do_round_trip = false;
  int threads = 1;
  double seconds = 2, target_us = 50;
  size_t samples = perf::default_samples("W1"), batch_size = 256;
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    if (flag == "--calibrate") {
      do_calibrate = true;
    } else if (flag == "--memcpy") {
      do_memcpy = true;
    } else if (flag == "--core-round-trip") {
      do_round_trip = true;
    } else if (i + 1 < argc && flag == "--threads") {
      threads = std::max(1, std::atoi(argv[++i]));
    } else if (i + 1 < argc && flag == "--seconds") {
      seconds = std::atof(argv[++i]);
    } else if (i + 1 < argc && flag == "--target-us") {
      target_us = std::atof(argv[++i]);
    } else if (i + 1 < argc && flag == "--samples") {
      samples = std::strtoull(argv[++i], nullptr, 10);
    } else if (i + 1 < argc && flag == "--batch-size") {
      batch_size = std::strtoull(argv[++i], nullptr, 10);
    } else {
      std::fprintf(stderr,
                   "usage: conveyor_perf_limits --calibrate [--target-us 50] | --memcpy --threads T "
                   "[--seconds S] [--samples N] [--batch-size B] | --core-round-trip\n");
      return 2;
    }
  }
  if (do_calibrate) return calibrate(target_us);
  if (do_memcpy) return memcpy_limit(threads, seconds, samples, batch_size);
  if (do_round_trip) return core_round_trip();
  std::fprintf(stderr, "conveyor_perf_limits: --calibrate, --memcpy or --core-round-trip\n");
  return 2;
}
