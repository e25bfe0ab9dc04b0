// conveyor's peer in the performance suite (perf/run_all): one workload
// through conveyor::DataLoader, timed after a warm-up epoch, one JSON line.
//
//   conveyor_driver --workload W0..W5 --workers N [--scheduling round_robin|work_stealing]
//                   [--in-order 0|1] [--seconds S] [--warmup S] [--samples N]
//                   [--w2-iterations K] [--shards a.tar,b.tar] [--pipeline loader|nodes]
//
// Options: batch_size per workload, sequential order (no shuffle),
// prefetch_factor 2, persistent_workers for N > 0. The JSON line adds
// conveyor's own metrics (Epoch::metrics()) over the timed phase.
//
// W5 with --pipeline nodes runs the same decode and augment as a node graph
// instead of a DataLoader (peer "conveyor-nodes"):
//   shard paths | untar (streamed) | group_by_key | map(decode + augment, W workers)
//          | batch | collate
// the serial nodes on the consumer's thread, map on W engine workers.
#include <conveyor/conveyor.h>
#if CONVEYOR_PERF_HAVE_FORMATS
#include <conveyor/idx.h>
#include <conveyor/image.h>
#include <conveyor/nodes.h>
#include <conveyor/nodes/files.h>
#include <conveyor/tar_shards.h>
#include <conveyor/transforms.h>
#endif

#include <cstring>
#include <memory>

#include "conveyor_run.h"
#include "workloads.h"

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

int run_w5(perf::Args args) {
  conveyor::TarShardOptions shard_options;
  shard_options.shards = args.shards;
  shard_options.shuffle_shards = false;
  shard_options.shuffle_buffer = 0;
  shard_options.required_fields = {"jpg", "cls"};
  auto shards = std::make_shared<conveyor::TarShardDataset>(shard_options);
  auto decoded = conveyor::map(
      shards, [](conveyor::ShardSample&& s) { return augment(decode(std::move(s))); },
      conveyor::OnError::skip);
  args.samples = 0;  // streamed: the count is whatever the shards hold
  return perf::run_conveyor(args, *decoded, "conveyor");
}

int run_w5_nodes(perf::Args args) {
  namespace nodes = conveyor::nodes;
  auto pipeline = nodes::from_vector(args.shards) | nodes::untar() | nodes::group_by_key() |
                  nodes::map([](conveyor::ShardSample&& s) { return augment(decode(std::move(s))); },
                             {.workers = args.workers, .on_error = conveyor::OnError::skip}) |
                  nodes::batch(static_cast<size_t>(args.batch_size)) | nodes::collate();
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
  result.peer = "conveyor-nodes";
  print_result(args, result);
  return 0;
}
#endif

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
    if (args.workload == "W3") {
      SleepDataset dataset{args.samples};
      return perf::run_conveyor(args, dataset, "conveyor");
    }
    if (args.workload == "W4") {
      StragglerDataset dataset{args.samples};
      return perf::run_conveyor(args, dataset, "conveyor");
    }
#if CONVEYOR_PERF_HAVE_FORMATS
    if (args.workload == "W5") return args.pipeline == "nodes" ? run_w5_nodes(args) : run_w5(args);
#endif
    std::fprintf(stderr, "conveyor_driver: %s is not built in (conveyor::formats missing)\n",
                 args.workload.c_str());
    return 3;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "conveyor_driver: %s\n", e.what());
    return 1;
  }
}
