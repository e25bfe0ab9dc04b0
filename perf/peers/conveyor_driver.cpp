// conveyor's peer in the performance suite (perf/run_all): one workload
// through conveyor::DataLoader, timed after a warm-up epoch, one JSON line.
//
//   conveyor_driver --workload W0..W6 --workers N [--scheduling round_robin|work_stealing]
//                   [--in-order 0|1] [--seconds S] [--warmup S] [--samples N]
//                   [--w2-iterations K] [--shards a.tar,b.tar|URLs]
//                   [--pipeline loader|nodes|nodes-batched|limit|async]
//
// Options: batch_size per workload, sequential order (no shuffle),
// prefetch_factor 2, persistent_workers for N > 0. The JSON line adds
// conveyor's own metrics (Epoch::metrics()) over the timed phase.
//
// W5 with --pipeline nodes runs the same decode and augment as a node graph
// instead of a DataLoader (peer "conveyor-nodes"):
//   shard paths | untar (streamed) | group_by_key | map(decode + augment, W workers)
//          | batch | collate
// the serial nodes on the consumer's thread, map on W engine workers. With
// --pipeline nodes-batched ("conveyor-nodes-batched") the samples are batched
// before the workers, which decode, augment and collate a batch each, as
// LibTorch's workers do:
//   shard paths | untar | group_by_key | batch | map(decode + augment + collate)
// With --pipeline limit ("decode-limit") W threads run the decode, augment
// and collate on samples already in memory, with no loader: the CPU's limit.
// W5's --shards may be http(s):// URLs for the loader and both graphs, read
// through http_opener (peers "conveyor-http", "conveyor-nodes-batched-http").
//
// W6 (W6-http, peer "conveyor"): the Fashion-MNIST test JPEGs as
// single objects over HTTP, --in-flight GETs outstanding on the consumer's
// thread, the decode on W workers (run_w6).
//
// W3 with --pipeline async (peer "conveyor-async", W3-async): the same 1 ms
// per sample through the async interface instead of a sleeping worker each:
//   from_range | async_map(start a 1 ms timer, max_in_flight = --in-flight)
//          | batch | collate
// on two threads: the consumer's (every node) and one timer thread
// completing requests at their deadlines (deadline_timer.h).
#include <conveyor/conveyor.h>
#include <conveyor/nodes.h>
#include <conveyor/nodes/async.h>
#if CONVEYOR_PERF_HAVE_FORMATS
#include <conveyor/detail/worker_scope.h>
#include <conveyor/generator.h>
#include <conveyor/idx.h>
#include <conveyor/image.h>
#include <conveyor/nodes.h>
#include <conveyor/nodes/files.h>
#include <conveyor/tar_shards.h>
#if CONVEYOR_PERF_HAVE_IO
#include <conveyor/nodes/http.h>
#endif
#include <conveyor/transforms.h>
#endif

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <memory>
#include <thread>

#include "conveyor_run.h"
#include "deadline_timer.h"
#include "workloads.h"
#if CONVEYOR_PERF_HAVE_FORMATS
#include "w6_work.h"
#endif

namespace {

// ---- the data sets ------------------------------------------------------------

struct TinyDataset {  // W0: the sample is its index
  size_t n;
  size_t size() const { return n; }
  int64_t get(size_t index) { return static_cast<int64_t>(index); }
};

struct ImageSample {  // W1
  conveyor::Array<float> image;  // [3, 32, 32]
  int64_t label;
};

// W1: like PyTorch's TensorDataset, a sample is a view of the in-memory
// image (kept alive by the data set's storage); collate makes the one copy.
struct InMemoryImages {
  std::shared_ptr<perf::W1Data> data;
  size_t size() const { return data->size(); }
  ImageSample get(size_t index) {
    float* image = data->images.data() + index * perf::kW1Floats;
    return {conveyor::Array<float>({perf::kW1Channels, perf::kW1Height, perf::kW1Width}, image,
                                   std::shared_ptr<void>(data, image)),
            data->labels[index]};
  }
};

struct SpinDataset {  // W2
  size_t n;
  int64_t iterations;
  size_t size() const { return n; }
  int64_t get(size_t index) { return perf::spin(index, iterations); }
};

struct SleepDataset {  // W3
  size_t n;
  size_t size() const { return n; }
  int64_t get(size_t index) { return perf::w3_sample(index); }
};

struct StragglerDataset {  // W4
  size_t n;
  size_t size() const { return n; }
  int64_t get(size_t index) { return perf::w4_sample(index); }
};

#if CONVEYOR_PERF_HAVE_FORMATS
// W5: examples/train_fashion_mnist.cpp's `decode` and `augment`.
struct Sample {
  conveyor::Array<float> image;  // [1, 28, 28]
  int64_t label;
};

const conveyor::Normalize kNormalize{{perf::kW5Mean}, {perf::kW5Std}};

Sample augment(conveyor::LabeledImage&& sample) {
  static const auto transform =
      conveyor::compose(conveyor::RandomCrop{perf::kW5Crop, perf::kW5Padding},
                        conveyor::RandomHorizontalFlip{0.5}, conveyor::ToFloat{}, kNormalize);
  return {transform(sample.image), sample.label};
}

// A shard sample (jpg + cls) as a one-channel LabeledImage; a bad one is a
// DataError naming the shard and key.
conveyor::LabeledImage decode(conveyor::ShardSample&& sample) {
  return conveyor::decode_class_sample(sample, {.channels = 1, .num_classes = 10});
}

bool any_url(const std::vector<std::string>& shards) {
  return std::any_of(shards.begin(), shards.end(),
                     [](const std::string& s) { return s.starts_with("http://") || s.starts_with("https://"); });
}

// How W5's shards are opened: local paths as files; URLs streamed, as the
// trainer's --shards URL, with a fixed 2 MiB receive buffer: the server is on
// the loopback, where that beat the kernel's autotuning by 3-4%
// (perf/README.md; 0, autotuning, is the default). Empty when URLs cannot be
// read in this build (no conveyor::io), with a message.
std::optional<conveyor::StreamOpener> w5_opener(const std::vector<std::string>& shards) {
  if (!any_url(shards)) return conveyor::StreamOpener{};
#if CONVEYOR_PERF_HAVE_IO
  return conveyor::nodes::http_opener({.receive_buffer = uint64_t{2} << 20});
#else
  std::fprintf(stderr, "conveyor_driver: shard URLs need conveyor::io (libcurl), not built here\n");
  return std::nullopt;
#endif
}

int run_w5(perf::Args args) {
  conveyor::TarShardOptions shard_options;
  shard_options.shards = args.shards;
  shard_options.shuffle_shards = false;
  shard_options.shuffle_buffer = 0;
  shard_options.required_fields = {"jpg", "cls"};
  auto opener = w5_opener(args.shards);
  if (!opener) return 2;
  shard_options.open = std::move(*opener);
  auto shards = std::make_shared<conveyor::TarShardDataset>(shard_options);
  auto decoded = conveyor::map(
      shards, [](conveyor::ShardSample&& s) { return augment(decode(std::move(s))); },
      conveyor::OnError::skip);
  args.samples = 0;  // streamed: the count is whatever the shards hold
  return perf::run_conveyor(args, *decoded, "conveyor");
}

template <class P>
int drive_w5_pipeline(perf::Args args, P& pipeline);

int run_w5_nodes(perf::Args args) {
  namespace nodes = conveyor::nodes;
  auto opener = w5_opener(args.shards);
  if (!opener) return 2;
  const nodes::UntarOptions untar_options{.open = std::move(*opener)};
  if (args.pipeline == "nodes-batched") {
    // Batches of encoded samples go to the workers, which decode, augment
    // and collate them: the consumer's thread only reads the tar.
    auto pipeline =
        nodes::from_vector(args.shards) | nodes::untar(untar_options) | nodes::group_by_key() |
        nodes::batch(static_cast<size_t>(args.batch_size)) |
        nodes::map(
            [](std::vector<conveyor::ShardSample>&& encoded) {
              std::vector<Sample> samples;
              samples.reserve(encoded.size());
              for (conveyor::ShardSample& s : encoded) {
                try {
                  samples.push_back(augment(decode(std::move(s))));
                } catch (const conveyor::DataError&) {
                  // skipped, as OnError::skip does per sample
                }
              }
              return conveyor::DefaultCollate{}(std::move(samples));
            },
            {.workers = args.workers});
    return drive_w5_pipeline(args, pipeline);
  }
  auto pipeline = nodes::from_vector(args.shards) | nodes::untar(untar_options) | nodes::group_by_key() |
                  nodes::map([](conveyor::ShardSample&& s) { return augment(decode(std::move(s))); },
                             {.workers = args.workers, .on_error = conveyor::OnError::skip}) |
                  nodes::batch(static_cast<size_t>(args.batch_size)) | nodes::collate();
  return drive_w5_pipeline(args, pipeline);
}

template <class P>
int drive_w5_pipeline(perf::Args args, P& pipeline) {
  using Pass = decltype(pipeline.pass());
  std::optional<Pass> pass;
  perf::Result result = perf::drive(
      args,
      [&] {
        pass.reset();
        pass.emplace(pipeline.pass());
      },
      [&](size_t& samples) {
        auto batch = pass->next();
        if (!batch) return false;
        samples = perf::batch_length(*batch);
        return true;
      },
      [] {});
  pass.reset();
  result.peer = args.pipeline == "nodes-batched" ? "conveyor-nodes-batched" : "conveyor-nodes";
  print_result(args, result);
  return 0;
}
#endif

#if CONVEYOR_PERF_HAVE_FORMATS
// W5's limit (peer "decode-limit"): what the CPU allows for W5's own work
// with no loader and no I/O. The shards are read into memory first; then
// max(1, W) threads each decode, augment and collate batches of
// consecutive samples, each with its own generator (as a worker has), until
// the time is up. The per-sample CPU of this run is the floor every peer
// pays for the same decode code.
int run_w5_limit(perf::Args args) {
  namespace nodes = conveyor::nodes;
  std::vector<conveyor::ShardSample> samples;
  {
    auto read = nodes::from_vector(args.shards) | nodes::untar() | nodes::group_by_key();
    auto pass = read.pass();
    while (auto sample = pass.next()) samples.push_back(std::move(*sample));
  }
  if (samples.empty()) {
    std::fprintf(stderr, "conveyor_driver: no samples in --shards\n");
    return 2;
  }
  const size_t threads = static_cast<size_t>(std::max(1, args.workers));
  const size_t batch = static_cast<size_t>(args.batch_size);
  std::atomic<int> phase{0};  // 0 warm-up, 1 timed, 2 stop
  std::vector<size_t> timed_samples(threads, 0);
  std::vector<std::thread> pool;
  for (size_t t = 0; t < threads; ++t) {
    pool.emplace_back([&, t] {
      conveyor::Generator generator(t + 1);
      conveyor::detail::WorkerScope scope(nullptr, &generator);
      size_t next = t * batch;  // threads start apart, as workers take different batches
      size_t done = 0;
      int seen = 0;
      while (true) {
        const int now = phase.load(std::memory_order_relaxed);  // a flag; no data rides on it
        if (now == 2) break;
        if (now != seen) {
          seen = now;
          done = 0;
        }
        std::vector<Sample> items;
        items.reserve(batch);
        for (size_t i = 0; i < batch; ++i, ++next) {
          items.push_back(augment(conveyor::decode_class_sample(samples[next % samples.size()],
                                                                {.channels = 1, .num_classes = 10})));
        }
        auto collated = conveyor::DefaultCollate{}(std::move(items));
        done += perf::batch_length(collated);
      }
      timed_samples[t] = done;  // read after join
    });
  }
  std::this_thread::sleep_for(std::chrono::duration<double>(args.warmup));
  const double cpu_start = perf::cpu_seconds_self();
  const auto start = perf::Clock::now();
  phase.store(1, std::memory_order_relaxed);
  std::this_thread::sleep_for(std::chrono::duration<double>(args.seconds));
  phase.store(2, std::memory_order_relaxed);
  const double seconds = perf::seconds_since(start);
  for (std::thread& thread : pool) thread.join();
  perf::Result result;
  result.peer = "decode-limit";
  result.seconds = seconds;  // a thread's last batch may end a little later: counted, as in drive()
  result.cpu_seconds = perf::cpu_seconds_self() - cpu_start;
  for (size_t n : timed_samples) result.samples += n;
  result.batches = (result.samples + batch - 1) / batch;
  args.samples = samples.size();
  print_result(args, result);
  return 0;
}
#endif

#if CONVEYOR_PERF_HAVE_FORMATS && CONVEYOR_PERF_HAVE_IO
// W6-http (peer "conveyor": conveyor runs W6 this way only): one GET per sample on the consumer's
// thread, --in-flight of them outstanding (libcurl's multi interface), the
// decode on W workers:
//   from_vector(URLs) | http_get(max_in_flight) | map(decode, W workers) | batch | collate
int run_w6(perf::Args args) {
  namespace nodes = conveyor::nodes;
  const std::vector<std::string> urls = conveyor::expand_shard_pattern(args.objects);
  auto pipeline =
      nodes::from_vector(urls) | nodes::http_get({.max_in_flight = args.in_flight}) |
      nodes::map([](nodes::HttpObject&& object) { return perf::w6_image(object.bytes, object.url); },
                 {.workers = args.workers}) |
      nodes::batch(static_cast<size_t>(args.batch_size)) | nodes::collate();
  args.samples = urls.size();
  using Pass = decltype(pipeline.pass());
  std::optional<Pass> pass;
  perf::Result result = perf::drive(
      args,
      [&] {
        pass.reset();
        pass.emplace(pipeline.pass());
      },
      [&](size_t& samples) {
        auto batch = pass->next();
        if (!batch) return false;
        samples = perf::batch_length(*batch);
        return true;
      },
      [] {});
  pass.reset();
  result.peer = "conveyor";
  result.extra = ",\"in_flight\":" + std::to_string(args.in_flight);
  print_result(args, result);
  return 0;
}
#endif

// The process's thread count now (/proc/self/status "Threads:").
int thread_count() {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind("Threads:", 0) == 0) return std::atoi(line.c_str() + 8);
  }
  return -1;
}

int run_w3_async(perf::Args args) {
  namespace nodes = conveyor::nodes;
  perf::DeadlineTimer<int64_t> timer;
  auto pipeline = nodes::from_range(0, static_cast<int64_t>(args.samples)) |
                  nodes::async_map<int64_t>(
                      [&timer](int64_t index, nodes::Completion<int64_t> done) {
                        timer.complete_at(perf::Clock::now() + perf::kW3Sleep, std::move(done), index);
                      },
                      {.max_in_flight = args.in_flight}) |
                  nodes::batch(static_cast<size_t>(args.batch_size)) | nodes::collate();
  using Pass = decltype(pipeline.pass());
  std::optional<Pass> pass;
  int threads = 0;
  perf::Result result = perf::drive(
      args,
      [&] {
        pass.reset();
        pass.emplace(pipeline.pass());
      },
      [&](size_t& samples) {
        auto batch = pass->next();
        if (!batch) return false;
        samples = perf::batch_length(*batch);
        return true;
      },
      [&] { threads = thread_count(); });
  const auto metrics = pipeline.metrics();  // from_range, async_map, batch, collate
  pass.reset();
  result.peer = "conveyor-async";
  char extra[256];
  std::snprintf(extra, sizeof extra,
                ",\"in_flight\":%d,\"threads\":%d,\"timer_lateness_us\":%.3f,\"mean_in_flight\":%.2f",
                args.in_flight, threads, timer.mean_lateness_us(), metrics[1].mean_in_flight);
  result.extra = extra;
  print_result(args, result);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const perf::Args args = perf::parse_args(argc, argv);
  try {
    if (args.workload == "W0") {
      TinyDataset dataset{args.samples};
      return perf::run_conveyor(args, dataset, "conveyor");
    }
    if (args.workload == "W1") {
      InMemoryImages dataset{std::make_shared<perf::W1Data>(args.samples)};
      return perf::run_conveyor(args, dataset, "conveyor", ",\"dataset_bytes\":" + std::to_string(dataset.data->bytes()));
    }
    if (args.workload == "W2") {
      SpinDataset dataset{args.samples, args.w2_iterations};
      return perf::run_conveyor(args, dataset, "conveyor", ",\"w2_iterations\":" + std::to_string(args.w2_iterations));
    }
    if (args.workload == "W3" && args.pipeline == "async") return run_w3_async(args);
    if (args.workload == "W3") {
      SleepDataset dataset{args.samples};
      return perf::run_conveyor(args, dataset, "conveyor");
    }
    if (args.workload == "W4") {
      StragglerDataset dataset{args.samples};
      return perf::run_conveyor(args, dataset, "conveyor");
    }
#if CONVEYOR_PERF_HAVE_FORMATS
    if (args.workload == "W5") {
      if (args.pipeline == "limit") return run_w5_limit(args);
      return args.pipeline.starts_with("nodes") ? run_w5_nodes(args) : run_w5(args);
    }
#if CONVEYOR_PERF_HAVE_IO
    if (args.workload == "W6") return run_w6(args);
#endif
#endif
    std::fprintf(stderr, "conveyor_driver: %s is not built in (W5 needs conveyor::formats, W6 conveyor::io too)\n",
                 args.workload.c_str());
    return 3;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "conveyor_driver: %s\n", e.what());
    return 1;
  }
}
