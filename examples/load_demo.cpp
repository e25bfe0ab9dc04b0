// Loads a synthetic image dataset through a shuffled, batched loader and
// prints what it got and how fast.
//   load_demo [--samples N] [--batch-size B] [--epochs E] [--seed S]
#include <conveyor/conveyor.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <string>
#include <vector>

#include "flags.h"

namespace {

struct Image {
  conveyor::Array<float> pixels;  // 3 x 32 x 32
  int64_t label;
};

// Deterministic pixels made from the index: no files needed.
class SyntheticImages final : public conveyor::Dataset<Image> {
 public:
  explicit SyntheticImages(size_t n) : n_(n) {}
  size_t size() const override { return n_; }
  Image get(size_t index) override {
    conveyor::Array<float> pixels({3, 32, 32});
    for (size_t i = 0; i < pixels.numel(); ++i) {
      pixels[i] = static_cast<float>((index * 31 + i * 7) % 255) / 255.0f;
    }
    return {std::move(pixels), static_cast<int64_t>(index % 10)};
  }

 private:
  size_t n_;
};

struct Flags {
  size_t samples = 20000;
  int64_t batch_size = 64;
  int64_t epochs = 2;
  uint64_t seed = 0;
};

[[noreturn]] void usage(const std::string& problem) {
  std::fprintf(stderr,
               "load_demo: %s\nusage: load_demo [--samples N] [--batch-size B] [--epochs E] [--seed S]\n",
               problem.c_str());
  std::exit(2);
}

Flags parse(int argc, char** argv) {
  using conveyor::examples::integer_flag;
  Flags flags;
  try {  // integer_flag throws FlagError
    for (int i = 1; i < argc; ++i) {
      const std::string name = argv[i];
      if (name == "--help" || name == "-h") usage("a shuffled, batched loader over synthetic images");
      if (i + 1 >= argc) usage(name + " needs a value");
      const char* value = argv[++i];
      if (name == "--samples") {
        // At most an index (int64): a RandomSampler's num_samples.
        flags.samples = integer_flag<size_t>(name, value, 0, static_cast<size_t>(std::numeric_limits<int64_t>::max()));
      } else if (name == "--batch-size") {
        flags.batch_size = integer_flag<int64_t>(name, value, 1);
      } else if (name == "--epochs") {
        flags.epochs = integer_flag<int64_t>(name, value, 0);
      } else if (name == "--seed") {
        flags.seed = integer_flag<uint64_t>(name, value, 0);
      } else {
        usage("unknown flag " + name);
      }
    }
  } catch (const conveyor::examples::FlagError& e) {
    usage(e.what());
  }
  return flags;
}

// "[64, 3, 32, 32]"
std::string shape_text(const std::vector<int64_t>& shape) {
  std::string text = "[";
  for (size_t i = 0; i < shape.size(); ++i) text += (i ? ", " : "") + std::to_string(shape[i]);
  return text + "]";
}

}  // namespace

int main(int argc, char** argv) {
  const Flags flags = parse(argc, argv);
  try {
    SyntheticImages dataset(flags.samples);
    conveyor::DataLoader loader(dataset, {.batch_size = flags.batch_size, .shuffle = true, .seed = flags.seed});
    std::printf("load_demo: %zu samples, batch %lld, %zu batches per epoch\n", flags.samples,
                static_cast<long long>(flags.batch_size), loader.size());
    for (int64_t epoch = 0; epoch < flags.epochs; ++epoch) {
      loader.set_epoch(static_cast<uint64_t>(epoch));
      const auto start = std::chrono::steady_clock::now();
      size_t batches = 0, seen = 0;
      int64_t label_sum = 0;
      std::vector<int64_t> first_shape, first_labels;  // of the first batch: up to 8 labels
      for (auto& [pixels, labels] : loader) {
        if (batches == 0) {
          first_shape = pixels.shape();
          const auto first = labels.values().first(std::min<size_t>(8, labels.numel()));
          first_labels.assign(first.begin(), first.end());
        }
        ++batches;
        seen += static_cast<size_t>(pixels.shape()[0]);
        for (int64_t label : labels.values()) label_sum += label;
      }
      const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      std::printf("epoch %lld: %zu batches, %zu samples, images %s, label sum %lld, first labels",
                  static_cast<long long>(epoch), batches, seen, shape_text(first_shape).c_str(),
                  static_cast<long long>(label_sum));
      for (int64_t l : first_labels) std::printf(" %lld", static_cast<long long>(l));
      std::printf(", %.0f samples/s\n", static_cast<double>(seen) / seconds);
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "load_demo: %s\n", e.what());
    return 1;
  }
  return 0;
}
