// pipeline_tar: PyTorch RFC #49440's TarDataset, built from pipeline nodes
// over WebDataset tar shards (conveyor-make-shards writes Fashion-MNIST's):
//
//   list_files | shard | read_files | untar | group_by_key
//     | map(decode + augment, 2 workers) | shuffle(1000) | batch(64) | collate | prefetch(2)
//
// Prints, per epoch, the batches and samples it read, the label histogram
// and the first batch's first labels (the same for the same --seed).
//
//   pipeline_tar --shards DIR [--epochs N] [--workers N] [--seed S] [--rank R --world W]
#include <conveyor/conveyor.h>
#include <conveyor/nodes.h>
#include <conveyor/nodes/files.h>
#include <conveyor/tar_shards.h>
#include <conveyor/transforms.h>

#include <array>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <string>

#include "flags.h"

namespace nodes = conveyor::nodes;

namespace {

struct Sample {
  conveyor::Array<float> image;  // [1, 28, 28]
  int64_t label;
};

[[noreturn]] void usage(const std::string& problem) {
  std::fprintf(stderr,
               "pipeline_tar: %s\nusage: pipeline_tar --shards DIR [--epochs N] [--workers N] [--seed S] "
               "[--rank R --world W] [--metrics]\n",
               problem.c_str());
  std::exit(2);
}

struct Flags {
  std::string shards;
  int epochs = 1;
  int workers = 2;
  uint64_t seed = 0;
  conveyor::ShardSpec spec;
  bool metrics = false;
};

constexpr int64_t kMaxShards = std::numeric_limits<int32_t>::max();

Flags parse(int argc, char** argv) {
  using conveyor::examples::integer_flag;
  Flags flags;
  try {  // integer_flag throws FlagError
    for (int i = 1; i < argc; ++i) {
      const std::string flag = argv[i];
      if (flag == "--metrics") {
        flags.metrics = true;
        continue;
      }
      if (i + 1 >= argc) usage(flag + " needs a value");
      const char* value = argv[++i];
      if (flag == "--shards") {
        flags.shards = value;
      } else if (flag == "--epochs") {
        flags.epochs = integer_flag<int>(flag, value, 1);
      } else if (flag == "--workers") {
        flags.workers = integer_flag<int>(flag, value, 0, 1024);  // map's own limit
      } else if (flag == "--seed") {
        flags.seed = integer_flag<uint64_t>(flag, value, 0);
      } else if (flag == "--rank") {
        flags.spec.rank = integer_flag<int64_t>(flag, value, 0, kMaxShards - 1);
      } else if (flag == "--world") {
        flags.spec.world_size = integer_flag<int64_t>(flag, value, 1, kMaxShards);
      } else {
        usage("unknown flag " + flag);
      }
    }
  } catch (const conveyor::examples::FlagError& e) {
    usage(e.what());
  }
  if (flags.shards.empty()) usage("--shards is required");
  if (flags.spec.rank >= flags.spec.world_size) {
    usage("--rank " + std::to_string(flags.spec.rank) + " is not below --world " +
          std::to_string(flags.spec.world_size));
  }
  return flags;
}

}  // namespace

int main(int argc, char** argv) {
  const Flags flags = parse(argc, argv);
  try {
    const auto augment = conveyor::compose(conveyor::RandomCrop{28, 2}, conveyor::RandomHorizontalFlip{0.5},
                                           conveyor::ToFloat{}, conveyor::Normalize{{0.2860f}, {0.3530f}});
    auto decode = [&augment](conveyor::ShardSample&& sample) {
      conveyor::LabeledImage image =
          conveyor::decode_class_sample(sample, {.channels = 1, .num_classes = 10});
      return Sample{augment(image.image), image.label};  // the crop and flip draw from the item's seed
    };
    auto pipeline = nodes::list_files(flags.shards, "*.tar") | nodes::shard() | nodes::read_files() |
                    nodes::untar() | nodes::group_by_key() | nodes::map(decode, {.workers = flags.workers}) |
                    nodes::shuffle(1000) | nodes::batch(64) | nodes::collate() | nodes::prefetch(2);
    pipeline.seed(flags.seed).shard(flags.spec).timed(flags.metrics);
    for (int epoch = 0; epoch < flags.epochs; ++epoch) {
      size_t batches = 0, samples = 0;
      std::array<size_t, 10> histogram{};
      std::string first;
      for (auto& [images, labels] : pipeline.pass()) {
        if (batches == 0) {
          for (size_t i = 0; i < 8 && i < labels.numel(); ++i) first += std::to_string(labels[i]) + " ";
        }
        ++batches;
        samples += labels.numel();
        for (int64_t label : labels.values()) ++histogram[static_cast<size_t>(label)];
      }
      std::printf("epoch %d: %zu batches, %zu samples; labels", epoch, batches, samples);
      for (size_t count : histogram) std::printf(" %zu", count);
      std::printf("; first batch starts %s\n", first.c_str());
      // On stderr: timings differ run to run, the items do not.
      if (flags.metrics) std::fprintf(stderr, "%s", conveyor::metrics_table(pipeline.metrics()).c_str());
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "pipeline_tar: %s\n", e.what());
    return 1;
  }
  return 0;
}
