// The performance suite's workloads, shared by the C++ peers (conveyor_driver,
// libtorch_driver, conveyor_perf_limits): the per-sample work, the command
// line, the timing loop's bookkeeping and the JSON line every driver prints.
// Header-only and free of LibTorch and conveyor, so both drivers run exactly
// the same sample code. perf/README.md gives every parameter.
#pragma once

#include <fcntl.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace perf {

using Clock = std::chrono::steady_clock;

inline double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// ---- per-workload constants (the same in python_driver.py) ------------------

inline constexpr int64_t kW1Channels = 3, kW1Height = 32, kW1Width = 32;
inline constexpr int64_t kW1Floats = kW1Channels * kW1Height * kW1Width;            // 3072
inline constexpr size_t kW1SampleBytes = kW1Floats * sizeof(float) + sizeof(int64_t);  // 12296
inline constexpr auto kW3Sleep = std::chrono::microseconds(1000);
inline constexpr auto kW4Fast = std::chrono::microseconds(50);
inline constexpr auto kW4Straggler = std::chrono::microseconds(20000);
inline constexpr size_t kW4StragglerEvery = 100;  // index % 100 == 0

inline int64_t default_batch_size(const std::string& workload) {
  if (workload == "W0") return 8;
  if (workload == "W1") return 256;
  if (workload == "W2") return 64;
  if (workload == "W3" || workload == "W4") return 32;
  if (workload == "W5" || workload == "W6") return 64;
  throw std::invalid_argument("unknown workload " + workload);
}

// ---- the work itself ---------------------------------------------------------

// Sleeps of 50 us..1 ms are the workload in W3/W4; the kernel's default timer
// slack (50 us for ordinary threads) would add up to 50 us to each, so every
// thread that sleeps for a sample asks for 1 ns of slack first (once).
inline void tight_timer_slack() {
  thread_local bool done = false;
  if (!done) {
    prctl(PR_SET_TIMERSLACK, 1UL, 0UL, 0UL, 0UL);
    done = true;
  }
}

inline void sample_sleep(std::chrono::microseconds duration) {
  tight_timer_slack();
  std::this_thread::sleep_for(duration);
}

// W2: `iterations` rounds of a 64-bit LCG + xorshift, a serial dependency
// chain the compiler cannot shorten or vectorise. Returns the final state.
inline int64_t spin(uint64_t seed, int64_t iterations) {
  uint64_t x = seed * 0x9E3779B97F4A7C15ULL + 1;
  for (int64_t k = 0; k < iterations; ++k) {
    x = x * 6364136223846793005ULL + 1442695040888963407ULL;
    x ^= x >> 29;
  }
  return static_cast<int64_t>(x >> 1);
}

// W3: one 1 ms sleep, the sample is its index.
inline int64_t w3_sample(size_t index) {
  sample_sleep(kW3Sleep);
  return static_cast<int64_t>(index);
}

// W4: 50 us, but every 100th sample (index % 100 == 0) 20 ms.
inline int64_t w4_sample(size_t index) {
  sample_sleep(index % kW4StragglerEvery == 0 ? kW4Straggler : kW4Fast);
  return static_cast<int64_t>(index);
}

// W1's in-memory data set: N images of 3x32x32 float32 and N int64 labels,
// filled deterministically before the loader starts.
struct W1Data {
  std::vector<float> images;  // N * 3072
  std::vector<int64_t> labels;
  explicit W1Data(size_t n) : images(n * kW1Floats), labels(n) {
    for (size_t i = 0; i < n; ++i) {
      float* image = images.data() + i * kW1Floats;
      for (int64_t j = 0; j < kW1Floats; ++j) {
        image[j] = static_cast<float>((i * 131 + static_cast<size_t>(j) * 7) % 1024) / 1024.0f;
      }
      labels[i] = static_cast<int64_t>(i % 10);
    }
  }
  size_t size() const { return labels.size(); }
  size_t bytes() const { return images.size() * sizeof(float) + labels.size() * sizeof(int64_t); }
};

// W5's normalisation (Fashion-MNIST's mean and standard deviation).
inline constexpr float kW5Mean = 0.2860f, kW5Std = 0.3530f;
inline constexpr int64_t kW5Crop = 28, kW5Padding = 2;

// ---- a tar index, for the map-style W5 peers (LibTorch) ---------------------

// One sample of a WebDataset shard: where its jpg and cls members lie.
struct TarSample {
  int fd = -1;
  uint64_t jpg_offset = 0, jpg_size = 0;
  uint64_t cls_offset = 0, cls_size = 0;
};

// Reads the ustar headers of `path` (members grouped by the name up to the
// first '.' after the last '/', as conveyor::TarShardDataset groups them)
// and appends one TarSample per key holding both a .jpg and a .cls member.
// The file stays open (fd) for pread.
inline void index_tar(const std::string& path, std::vector<TarSample>& out) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw std::runtime_error("cannot open " + path);
  uint64_t offset = 0;
  std::string current_key;
  TarSample current;
  bool have_jpg = false, have_cls = false;
  auto flush = [&] {
    if (have_jpg && have_cls) out.push_back(current);
    current = TarSample{};
    current.fd = fd;
    have_jpg = have_cls = false;
  };
  current.fd = fd;
  char header[512];
  while (::pread(fd, header, sizeof header, static_cast<off_t>(offset)) == 512) {
    if (header[0] == '\0') break;  // end-of-archive blocks
    std::string name(header, strnlen(header, 100));
    const std::string prefix(header + 345, strnlen(header + 345, 155));
    if (!prefix.empty()) name = prefix + "/" + name;
    const uint64_t size = std::strtoull(std::string(header + 124, 12).c_str(), nullptr, 8);
    const char type = header[156];
    const uint64_t data = offset + 512;
    offset = data + (size + 511) / 512 * 512;
    if (type != '0' && type != '\0') continue;  // directories, links, pax headers
    const size_t slash = name.rfind('/');
    const std::string base = slash == std::string::npos ? name : name.substr(slash + 1);
    const size_t dot = base.find('.');
    if (dot == std::string::npos) continue;
    const std::string key = name.substr(0, name.size() - base.size() + dot);
    const std::string extension = base.substr(dot + 1);
    if (key != current_key) {
      flush();
      current_key = key;
    }
    if (extension == "jpg") {
      current.jpg_offset = data;
      current.jpg_size = size;
      have_jpg = true;
    } else if (extension == "cls") {
      current.cls_offset = data;
      current.cls_size = size;
      have_cls = true;
    }
  }
  flush();
}

inline std::vector<uint8_t> pread_bytes(int fd, uint64_t offset, uint64_t size) {
  std::vector<uint8_t> bytes(size);
  size_t done = 0;
  while (done < size) {
    const ssize_t got = ::pread(fd, bytes.data() + done, size - done, static_cast<off_t>(offset + done));
    if (got <= 0) throw std::runtime_error("short read from a shard");
    done += static_cast<size_t>(got);
  }
  return bytes;
}

// ---- command line -------------------------------------------------------------

struct Args {
  std::string workload = "W0";
  int workers = 0;
  std::string scheduling;  // empty: the loader's default
  int in_order = 1;
  double seconds = 2.0;   // timed phase
  double warmup = 1.0;    // the warm-up epoch, cut after this many seconds
  size_t samples = 0;     // data set length (0: the workload's default)
  int64_t batch_size = 0;  // 0: the workload's default
  int64_t w2_iterations = 0;  // W2: spin() iterations per sample (run_all calibrates)
  std::vector<std::string> shards;  // W5
  std::string objects;              // W6: a URL pattern, one JPEG per URL ({00000..09999})
  int prefetch_factor = 2;
  // W5 on conveyor: "loader" (DataLoader), "nodes" (a node graph mapping
  // samples), "nodes-batched" (a node graph mapping batches), "limit" (the
  // decode alone on W threads); W3: "async" (async_map, --in-flight
  // requests, one timer thread).
  std::string pipeline = "loader";
  int in_flight = 256;              // W3 with --pipeline async: requests outstanding
};

[[noreturn]] inline void usage(const char* program, const std::string& problem) {
  std::fprintf(stderr,
               "%s: %s\n"
               "usage: %s --workload W0..W6 --workers N [--scheduling round_robin|work_stealing]\n"
               "       [--in-order 0|1] [--seconds S] [--warmup S] [--samples N] [--batch-size B]\n"
               "       [--w2-iterations K] [--shards a.tar,b.tar,...] [--objects URL-pattern]\n"
               "       [--pipeline loader|nodes|nodes-batched|limit|async] [--in-flight N]\n",
               program, problem.c_str(), program);
  std::exit(2);
}

inline std::vector<std::string> split_commas(const std::string& text) {
  std::vector<std::string> parts;
  size_t start = 0;
  while (start <= text.size()) {
    const size_t comma = text.find(',', start);
    const std::string part = text.substr(start, comma == std::string::npos ? std::string::npos : comma - start);
    if (!part.empty()) parts.push_back(part);
    if (comma == std::string::npos) break;
    start = comma + 1;
  }
  return parts;
}

inline size_t default_samples(const std::string& workload) {
  if (workload == "W1") return 10000;  // ~123 MB in memory
  return size_t{1} << 20;              // W0, W2-W4: indices only
}

inline Args parse_args(int argc, char** argv) {
  Args args;
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    if (flag == "--help" || flag == "-h") usage(argv[0], "a peer of conveyor's performance suite");
    if (i + 1 >= argc) usage(argv[0], flag + " needs a value");
    const std::string value = argv[++i];
    if (flag == "--workload") {
      args.workload = value;
    } else if (flag == "--workers") {
      args.workers = std::atoi(value.c_str());
    } else if (flag == "--scheduling") {
      if (value != "round_robin" && value != "work_stealing") usage(argv[0], "bad --scheduling " + value);
      args.scheduling = value;
    } else if (flag == "--in-order") {
      args.in_order = std::atoi(value.c_str());
    } else if (flag == "--seconds") {
      args.seconds = std::atof(value.c_str());
    } else if (flag == "--warmup") {
      args.warmup = std::atof(value.c_str());
    } else if (flag == "--samples") {
      args.samples = std::strtoull(value.c_str(), nullptr, 10);
    } else if (flag == "--batch-size") {
      args.batch_size = std::atoll(value.c_str());
    } else if (flag == "--w2-iterations") {
      args.w2_iterations = std::atoll(value.c_str());
    } else if (flag == "--shards") {
      args.shards = split_commas(value);
    } else if (flag == "--objects") {
      args.objects = value;
    } else if (flag == "--prefetch-factor") {
      args.prefetch_factor = std::atoi(value.c_str());
    } else if (flag == "--pipeline") {
      if (value != "loader" && value != "nodes" && value != "nodes-batched" && value != "limit" &&
          value != "async") {
        usage(argv[0], "bad --pipeline " + value);
      }
      args.pipeline = value;
    } else if (flag == "--in-flight") {
      args.in_flight = std::atoi(value.c_str());
    } else {
      usage(argv[0], "unknown flag " + flag);
    }
  }
  const std::string& w = args.workload;
  if (w != "W0" && w != "W1" && w != "W2" && w != "W3" && w != "W4" && w != "W5" && w != "W6") {
    usage(argv[0], "unknown workload " + w);
  }
  if (args.workers < 0) usage(argv[0], "--workers must be >= 0");
  if (args.batch_size <= 0) args.batch_size = default_batch_size(w);
  if (args.samples == 0 && w != "W5" && w != "W6") args.samples = default_samples(w);
  if (w == "W2" && args.w2_iterations <= 0) usage(argv[0], "W2 needs --w2-iterations (run_all calibrates it)");
  if (w == "W5" && args.shards.empty()) usage(argv[0], "W5 needs --shards");
  if (w == "W6" && args.objects.empty()) usage(argv[0], "W6 needs --objects (a URL pattern)");
  if (args.pipeline.starts_with("nodes") && w != "W5") usage(argv[0], "--pipeline " + args.pipeline + " is W5's only");
  if (args.pipeline == "limit" && w != "W5") usage(argv[0], "--pipeline limit is W5's only");
  if (args.pipeline == "async" && w != "W3") usage(argv[0], "--pipeline async is W3's only");
  if (args.in_flight < 1) usage(argv[0], "--in-flight must be >= 1");
  return args;
}

// ---- the timing loop's bookkeeping ---------------------------------------------

inline double cpu_seconds_self() {
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  return static_cast<double>(usage.ru_utime.tv_sec + usage.ru_stime.tv_sec) +
         1e-6 * static_cast<double>(usage.ru_utime.tv_usec + usage.ru_stime.tv_usec);
}

inline double percentile(std::vector<double> values, double q) {
  if (values.empty()) return 0;
  std::sort(values.begin(), values.end());
  const double rank = q * static_cast<double>(values.size() - 1);
  const size_t low = static_cast<size_t>(std::floor(rank));
  const size_t high = std::min(values.size() - 1, low + 1);
  return values[low] + (values[high] - values[low]) * (rank - static_cast<double>(low));
}

// What one run measured; printed as one JSON line.
struct Result {
  std::string peer;
  size_t warmup_batches = 0;
  size_t warmup_samples = 0;
  double warmup_seconds = 0;
  bool warmup_full_epoch = false;
  size_t batches = 0;
  size_t samples = 0;
  double seconds = 0;
  size_t epochs_started = 0;  // in the timed phase
  double cpu_seconds = 0;     // of this process during the timed phase
  std::vector<double> waits_us;  // each next() in the timed phase
  std::string extra;          // more JSON members, ",\"k\":v..." (metrics, calibration)
};

inline std::string json_string(const std::string& text) {
  std::string out = "\"";
  for (char c : text) {
    if (c == '"' || c == '\\') out += '\\';
    if (static_cast<unsigned char>(c) < 0x20) continue;
    out += c;
  }
  return out + "\"";
}

inline void print_result(const Args& args, const Result& r) {
  const double per_s = r.seconds > 0 ? static_cast<double>(r.samples) / r.seconds : 0;
  const double batches_per_s = r.seconds > 0 ? static_cast<double>(r.batches) / r.seconds : 0;
  std::printf(
      "{\"peer\":%s,\"workload\":%s,\"workers\":%d,\"scheduling\":%s,\"in_order\":%d,"
      "\"batch_size\":%lld,\"dataset_samples\":%zu,\"samples\":%zu,\"batches\":%zu,\"seconds\":%.6f,"
      "\"samples_per_s\":%.3f,\"batches_per_s\":%.3f,\"wait_p50_us\":%.3f,\"wait_p99_us\":%.3f,"
      "\"wait_max_us\":%.3f,\"warmup_batches\":%zu,\"warmup_samples\":%zu,\"warmup_seconds\":%.6f,"
      "\"warmup_full_epoch\":%s,\"epochs_started\":%zu,\"cpu_seconds_timed\":%.6f%s}\n",
      json_string(r.peer).c_str(), json_string(args.workload).c_str(), args.workers,
      json_string(args.scheduling).c_str(), args.in_order, static_cast<long long>(args.batch_size),
      args.samples, r.samples, r.batches, r.seconds, per_s, batches_per_s, percentile(r.waits_us, 0.50),
      percentile(r.waits_us, 0.99), r.waits_us.empty() ? 0.0 : *std::max_element(r.waits_us.begin(), r.waits_us.end()),
      r.warmup_batches, r.warmup_samples, r.warmup_seconds, r.warmup_full_epoch ? "true" : "false",
      r.epochs_started, r.cpu_seconds, r.extra.c_str());
  std::fflush(stdout);
}

// Drives any loader through the suite's protocol:
//   warm-up: one epoch, cut after args.warmup seconds if it is longer;
//   timed:   args.seconds of batches, going on in the same epoch and
//            starting new ones as they end, each next() timed.
// `begin_epoch()` starts an epoch; `next(size_t& samples)` returns false at
// its end, else sets the batch's sample count. Cut epochs are not finished.
template <class BeginEpoch, class Next, class OnTimedStart>
Result drive(const Args& args, BeginEpoch begin_epoch, Next next, OnTimedStart on_timed_start) {
  Result r;
  size_t batch_samples = 0;
  const auto warm_start = Clock::now();
  begin_epoch();
  bool epoch_open = true;
  while (true) {
    if (!next(batch_samples)) {
      epoch_open = false;
      r.warmup_full_epoch = true;
      break;
    }
    ++r.warmup_batches;
    r.warmup_samples += batch_samples;
    if (seconds_since(warm_start) >= args.warmup) break;
  }
  r.warmup_seconds = seconds_since(warm_start);
  r.waits_us.reserve(1 << 16);
  on_timed_start();
  const double cpu_start = cpu_seconds_self();
  const auto start = Clock::now();
  auto last = start;
  while (true) {
    if (!epoch_open) {
      begin_epoch();
      epoch_open = true;
      ++r.epochs_started;
    }
    const auto asked = Clock::now();
    const bool got = next(batch_samples);
    last = Clock::now();
    if (!got) {
      epoch_open = false;
      if (std::chrono::duration<double>(last - start).count() >= args.seconds) break;
      continue;
    }
    r.waits_us.push_back(std::chrono::duration<double, std::micro>(last - asked).count());
    ++r.batches;
    r.samples += batch_samples;
    if (std::chrono::duration<double>(last - start).count() >= args.seconds) break;
  }
  r.seconds = std::chrono::duration<double>(last - start).count();
  r.cpu_seconds = cpu_seconds_self() - cpu_start;
  return r;
}

}  // namespace perf
