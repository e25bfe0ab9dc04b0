// conveyor's main job: a small LibTorch CNN trained on Fashion-MNIST, fed by
// conveyor's loader (shuffled, multi-worker, augmented on the workers).
//
//   train_fashion_mnist [--epochs 2] [--workers 2] [--batch-size 64] [--seed 0]
//                       [--source idx|shards] [--shards DIR] [--data DIR]
//                       [--scheduling work_stealing|round_robin] [--threads N]
//                       [--limit N] [--lr 0.002] [--loader-only] [--pin-memory]
//
// Prints a progress bar per epoch (samples/s, loss, data stall: the share of
// the epoch the trainer spent waiting for the loader), test accuracy after
// each epoch, and a final summary with a fingerprint of the loss curve: the
// same seed gives the same fingerprint, and under work_stealing the same for
// any number of workers.
#include <conveyor/conveyor.h>
#if CONVEYOR_HAVE_CUDA
#include <conveyor/cuda.h>
#endif
#include <conveyor/idx.h>
#include <conveyor/image.h>
#include <conveyor/tar_shards.h>
#include <conveyor/torch.h>
#include <conveyor/transforms.h>
#include <torch/torch.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "shard_writing.h"

namespace {

using Clock = std::chrono::steady_clock;

struct Flags {
  int epochs = 2;
  int workers = 2;
  int64_t batch_size = 64;
  uint64_t seed = 0;
  std::string source = "idx";
  std::string data = conveyor::kFashionMnistDirectory;
  std::string shards = "fashion-mnist-shards";
  conveyor::Scheduling scheduling = conveyor::Scheduling::work_stealing;
  int threads = 0;  // 0: LibTorch's default
  int64_t limit = 0;  // 0: the whole training set
  double lr = 2e-3;
  bool loader_only = false;  // time the loader alone: no model, no training
  bool pin_memory = false;   // pinned batches, copied to the device 2 ahead
};

[[noreturn]] void usage(const std::string& problem) {
  std::fprintf(stderr,
               "train_fashion_mnist: %s\n"
               "usage: train_fashion_mnist [--epochs N] [--workers N] [--batch-size N] [--seed N]\n"
               "       [--source idx|shards] [--data DIR] [--shards DIR]\n"
               "       [--scheduling work_stealing|round_robin] [--threads N] [--limit N] [--lr X]\n"
               "       [--loader-only] [--pin-memory]\n",
               problem.c_str());
  std::exit(2);
}

int64_t integer_flag(const std::string& name, const char* text, int64_t minimum) {
  char* end = nullptr;
  const long long value = std::strtoll(text, &end, 10);
  if (*text == '\0' || *end != '\0' || value < minimum) {
    usage(name + " needs an integer >= " + std::to_string(minimum) + ", got '" + text + "'");
  }
  return value;
}

Flags parse(int argc, char** argv) {
  Flags flags;
  for (int i = 1; i < argc; ++i) {
    const std::string name = argv[i];
    if (name == "--help" || name == "-h") usage("train a CNN on Fashion-MNIST through conveyor");
    if (name == "--loader-only") {
      flags.loader_only = true;
      continue;
    }
    if (name == "--pin-memory") {
      flags.pin_memory = true;
      continue;
    }
    if (i + 1 >= argc) usage(name + " needs a value");
    const char* value = argv[++i];
    if (name == "--epochs") {
      flags.epochs = static_cast<int>(integer_flag(name, value, 1));
    } else if (name == "--workers") {
      flags.workers = static_cast<int>(integer_flag(name, value, 0));
    } else if (name == "--batch-size") {
      flags.batch_size = integer_flag(name, value, 1);
    } else if (name == "--seed") {
      flags.seed = static_cast<uint64_t>(integer_flag(name, value, 0));
    } else if (name == "--threads") {
      flags.threads = static_cast<int>(integer_flag(name, value, 0));
    } else if (name == "--limit") {
      flags.limit = integer_flag(name, value, 0);
    } else if (name == "--source") {
      flags.source = value;
      if (flags.source != "idx" && flags.source != "shards") usage("--source is idx or shards, not '" + flags.source + "'");
    } else if (name == "--data") {
      flags.data = value;
    } else if (name == "--shards") {
      flags.shards = value;
    } else if (name == "--scheduling") {
      const std::string mode = value;
      if (mode == "work_stealing") {
        flags.scheduling = conveyor::Scheduling::work_stealing;
      } else if (mode == "round_robin") {
        flags.scheduling = conveyor::Scheduling::round_robin;
      } else {
        usage("--scheduling is work_stealing or round_robin, not '" + mode + "'");
      }
    } else if (name == "--lr") {
      char* end = nullptr;
      flags.lr = std::strtod(value, &end);
      if (*end != '\0' || !(flags.lr > 0)) usage(std::string("--lr needs a positive number, got '") + value + "'");
    } else {
      usage("unknown flag " + name);
    }
  }
  return flags;
}

// Two conv blocks and a classifier: ~1.2 M multiply-adds per image.
struct NetImpl : torch::nn::Module {
  NetImpl()
      : conv1(register_module("conv1", torch::nn::Conv2d(torch::nn::Conv2dOptions(1, 16, 3).padding(1)))),
        conv2(register_module("conv2", torch::nn::Conv2d(torch::nn::Conv2dOptions(16, 32, 3).padding(1)))),
        fc1(register_module("fc1", torch::nn::Linear(32 * 7 * 7, 128))),
        fc2(register_module("fc2", torch::nn::Linear(128, 10))) {}

  torch::Tensor forward(torch::Tensor x) {
    x = torch::max_pool2d(torch::relu(conv1->forward(x)), 2);
    x = torch::max_pool2d(torch::relu(conv2->forward(x)), 2);
    x = torch::relu(fc1->forward(x.flatten(1)));
    return fc2->forward(x);
  }

  torch::nn::Conv2d conv1, conv2;
  torch::nn::Linear fc1, fc2;
};
TORCH_MODULE(Net);

// What the loader hands the trainer: a normalised image and its class.
struct Sample {
  conveyor::Array<float> image;  // [1, 28, 28]
  int64_t label;
};

// Fashion-MNIST's mean and standard deviation.
const conveyor::Normalize kNormalize{{0.2860f}, {0.3530f}};

// Augmentation, on the workers, from the task's generator.
Sample augment(conveyor::LabeledImage&& sample) {
  static const auto transform = conveyor::compose(conveyor::RandomCrop{28, 2},
                                                  conveyor::RandomHorizontalFlip{0.5},
                                                  conveyor::ToFloat{}, kNormalize);
  return {transform(sample.image), sample.label};
}

Sample plain(conveyor::LabeledImage&& sample) {
  return {kNormalize(conveyor::ToFloat{}(sample.image)), sample.label};
}

// A shard sample (jpg + cls) as a one-channel LabeledImage; a bad one is a
// DataError naming the shard and key.
conveyor::LabeledImage decode(conveyor::ShardSample&& sample) {
  return conveyor::decode_class_sample(sample, {.channels = 1, .num_classes = 10});
}

// Fashion-MNIST as JPEG shards, written once into `directory`.
std::vector<std::string> ensure_shards(const std::string& directory, const std::string& data) {
  namespace fs = std::filesystem;
  const std::string done = directory + "/COMPLETE";
  if (!fs::exists(done)) {
    std::printf("writing JPEG tar shards of the training set into %s ...\n", directory.c_str());
    fs::create_directories(directory);
    conveyor::IdxImageDataset train = conveyor::IdxImageDataset::from_directory(data, true);
    conveyor::examples::write_image_shards(train, directory + "/train-", 5000, 95);
    std::FILE* marker = std::fopen(done.c_str(), "w");
    if (marker) std::fclose(marker);
  }
  std::vector<std::string> shards;
  for (const auto& entry : fs::directory_iterator(directory)) {
    if (entry.path().extension() == ".tar") shards.push_back(entry.path().string());
  }
  std::sort(shards.begin(), shards.end());
  if (shards.empty()) throw conveyor::DataError("no .tar shards", directory);
  return shards;
}

// One line of progress, redrawn in place on a terminal, every 10% otherwise.
class Progress {
 public:
  Progress(int epoch, int epochs, size_t total)
      : epoch_(epoch), epochs_(epochs), total_(total), tty_(isatty(STDOUT_FILENO) != 0) {}

  void update(size_t done, double seconds, double loss, double stall) {
    const int tenth = total_ ? static_cast<int>(10 * done / total_) : 10;
    if (!tty_ && tenth == last_tenth_ && done != total_) return;
    last_tenth_ = tenth;
    char bar[31];
    const size_t filled = total_ ? 30 * done / total_ : 30;
    for (size_t i = 0; i < 30; ++i) bar[i] = i < filled ? '#' : '.';
    bar[30] = '\0';
    std::printf("%sepoch %d/%d [%s] %6zu/%zu  %7.0f samples/s  loss %.4f  data stall %4.1f%%%s",
                tty_ ? "\r" : "", epoch_ + 1, epochs_, bar, done, total_,
                seconds > 0 ? static_cast<double>(done) / seconds : 0.0, loss, 100 * stall,
                tty_ ? "" : "\n");
    std::fflush(stdout);
  }
  void finish() {
    if (tty_) std::printf("\n");
  }

 private:
  int epoch_, epochs_;
  size_t total_;
  bool tty_;
  int last_tenth_ = -1;
};

// FNV-1a over the bits of every step's loss.
struct Fingerprint {
  uint64_t hash = 1469598103934665603ULL;
  void add(float value) {
    uint32_t bits = 0;
    std::memcpy(&bits, &value, sizeof bits);
    for (int i = 0; i < 4; ++i) {
      hash ^= (bits >> (8 * i)) & 0xff;
      hash *= 1099511628211ULL;
    }
  }
};

template <class Loader>
double evaluate(Net& net, Loader& loader) {
  torch::NoGradGuard no_grad;
  net->eval();
  int64_t correct = 0, seen = 0;
  for (auto& [images, labels] : loader) {
    const torch::Tensor x = conveyor::to_tensor(images);
    const torch::Tensor y = conveyor::to_tensor(labels);
    correct += net->forward(x).argmax(1).eq(y).sum().template item<int64_t>();
    seen += y.size(0);
  }
  net->train();
  return seen ? static_cast<double>(correct) / static_cast<double>(seen) : 0.0;
}

// The loader alone, at full speed: what the pipeline (read, decode, augment,
// collate) delivers when nothing downstream waits.
template <class Loader>
int time_loader(const Flags& flags, Loader& loader, size_t samples_per_epoch) {
  for (int epoch = 0; epoch < flags.epochs; ++epoch) {
    loader.set_epoch(static_cast<uint64_t>(epoch));
    Progress progress(epoch, flags.epochs, samples_per_epoch);
    const auto start = Clock::now();
    size_t done = 0;
    for (auto& [images, labels] : loader) {
      done += labels.numel();
      const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
      progress.update(done, seconds, 0, 1);
      if (flags.limit > 0 && done >= static_cast<size_t>(flags.limit)) break;
    }
    progress.finish();
    const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
    std::printf("loader only, epoch %d/%d: %zu samples in %.2f s, %.0f samples/s (source %s, %d workers)\n",
                epoch + 1, flags.epochs, done, seconds, static_cast<double>(done) / seconds,
                flags.source.c_str(), flags.workers);
  }
  return 0;
}

template <class TrainDataset, class TestLoader>
int train(const Flags& flags, std::shared_ptr<TrainDataset> dataset, TestLoader& test_loader,
          size_t samples_per_epoch) {
  torch::manual_seed(flags.seed);
  Net net;
  torch::optim::Adam optimizer(net->parameters(), torch::optim::AdamOptions(flags.lr));

  conveyor::LoaderOptions options{.batch_size = flags.batch_size,
                                  .num_workers = flags.workers,
                                  .persistent_workers = flags.workers > 0,
                                  .drop_last = false,
                                  .seed = flags.seed,
                                  .scheduling = flags.scheduling};
  if constexpr (conveyor::MapStyleDataset<TrainDataset>) options.shuffle = true;
  if (flags.pin_memory) {
#if CONVEYOR_HAVE_CUDA
    // CUDA when there is a GPU, else the host stand-in (with a warning).
    options.transfer_device = conveyor::cuda::select_transfer_device(0, /*standin_fallback=*/true);
#else
    options.transfer_device = conveyor::make_host_standin_device();
#endif
    options.pin_memory = true;
    options.prefetch_to_device = 2;
    std::printf("pin_memory: batches collated into pinned memory of %s, copied 2 batches ahead\n",
                options.transfer_device->name().c_str());
  }
  conveyor::DataLoader loader(dataset, options);

  if (flags.loader_only) return time_loader(flags, loader, samples_per_epoch);

  Fingerprint fingerprint;
  double accuracy = 0, total_seconds = 0, total_wait = 0;
  size_t total_samples = 0;
  for (int epoch = 0; epoch < flags.epochs; ++epoch) {
    loader.set_epoch(static_cast<uint64_t>(epoch));
    Progress progress(epoch, flags.epochs, samples_per_epoch);
    const auto start = Clock::now();
    double waited = 0, running_loss = 0;
    size_t done = 0, steps = 0;
    auto pass = loader.iter();
    while (true) {
      const auto asked = Clock::now();
      auto batch = pass.next();
      waited += std::chrono::duration<double>(Clock::now() - asked).count();
      if (!batch) break;
      auto& [images, labels] = *batch;
      // LibTorch here is CPU-only: the model reads the (pinned) host batch;
      // a CUDA build would wait on pass.device().ready on its stream instead.
      const torch::Tensor x = conveyor::to_tensor(images);
      const torch::Tensor y = conveyor::to_tensor(labels);
      optimizer.zero_grad();
      torch::Tensor loss = torch::nn::functional::cross_entropy(net->forward(x), y);
      loss.backward();
      optimizer.step();
      const float value = loss.item<float>();
      fingerprint.add(value);
      running_loss = steps == 0 ? value : 0.98 * running_loss + 0.02 * value;
      ++steps;
      done += static_cast<size_t>(y.size(0));
      const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
      progress.update(done, seconds, running_loss, seconds > 0 ? waited / seconds : 0);
      if (flags.limit > 0 && done >= static_cast<size_t>(flags.limit)) break;
    }
    progress.finish();
    std::printf("loader: %s\n", pass.metrics().summary().c_str());
    const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
    total_seconds += seconds;
    total_wait += waited;
    total_samples += done;
    accuracy = evaluate(net, test_loader);
    std::printf("epoch %d/%d: test accuracy %.2f%%, %.0f samples/s, data stall %.1f%%\n", epoch + 1,
                flags.epochs, 100 * accuracy, static_cast<double>(done) / seconds, 100 * waited / seconds);
  }
  uint64_t skipped = 0;
  if constexpr (requires { dataset->skipped(); }) skipped = dataset->skipped();
  std::printf(
      "final: %d epochs, test accuracy %.2f%%, %.0f samples/s, data stall %.1f%%, skipped samples %llu, "
      "loss-curve fingerprint %016llx (source %s, %d workers, %s, seed %llu)\n",
      flags.epochs, 100 * accuracy, static_cast<double>(total_samples) / total_seconds,
      100 * total_wait / total_seconds, static_cast<unsigned long long>(skipped),
      static_cast<unsigned long long>(fingerprint.hash), flags.source.c_str(), flags.workers,
      flags.scheduling == conveyor::Scheduling::work_stealing ? "work_stealing" : "round_robin",
      static_cast<unsigned long long>(flags.seed));
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const Flags flags = parse(argc, argv);
  if (flags.threads > 0) torch::set_num_threads(flags.threads);
  try {
    auto test = std::make_shared<conveyor::IdxImageDataset>(
        conveyor::IdxImageDataset::from_directory(flags.data, false));
    auto test_set = conveyor::map(test, plain);
    conveyor::DataLoader test_loader(test_set, {.batch_size = 1000, .num_workers = flags.workers});
    std::printf("conveyor %s, LibTorch %d threads: Fashion-MNIST from %s, %d workers, batch %lld\n",
                CONVEYOR_VERSION_STRING, torch::get_num_threads(),
                flags.source == "idx" ? flags.data.c_str() : flags.shards.c_str(), flags.workers,
                static_cast<long long>(flags.batch_size));
    if (flags.source == "idx") {
      auto train_set = std::make_shared<conveyor::IdxImageDataset>(
          conveyor::IdxImageDataset::from_directory(flags.data, true));
      const size_t samples = flags.limit > 0 ? std::min<size_t>(train_set->size(), static_cast<size_t>(flags.limit))
                                             : train_set->size();
      return train(flags, conveyor::map(train_set, augment), test_loader, samples);
    }
    conveyor::TarShardOptions shard_options;
    shard_options.shards = ensure_shards(flags.shards, flags.data);
    shard_options.shuffle_shards = true;
    shard_options.seed = flags.seed;
    shard_options.shuffle_buffer = 2000;
    shard_options.required_fields = {"jpg", "cls"};
    auto shards = std::make_shared<conveyor::TarShardDataset>(shard_options);
    auto decoded = conveyor::map(shards, [](conveyor::ShardSample&& s) { return augment(decode(std::move(s))); },
                                 conveyor::OnError::skip);
    const size_t samples = flags.limit > 0 ? static_cast<size_t>(flags.limit) : 60000;
    return train(flags, decoded, test_loader, samples);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "train_fashion_mnist: %s\n", e.what());
    return 1;
  }
}
