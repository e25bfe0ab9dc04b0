// Loads a synthetic image dataset through a shuffled, batched loader and
// prints what it got and how fast.
//   load_demo [--samples N] [--batch-size B] [--epochs E] [--seed S]
#include <conveyor/conveyor.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

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

long flag(int argc, char** argv, const char* name, long fallback) {
  for (int i = 1; i + 1 < argc; ++i) {
    if (std::strcmp(argv[i], name) == 0) {
      char* end = nullptr;
      const long value = std::strtol(argv[i + 1], &end, 10);
      if (*end != '\0' || value < 0) {
        std::fprintf(stderr, "load_demo: %s needs a non-negative integer, got '%s'\n", name, argv[i + 1]);
        std::exit(2);
      }
      return value;
    }
  }
  return fallback;
}

}  // namespace

int main(int argc, char** argv) {
  const auto samples = static_cast<size_t>(flag(argc, argv, "--samples", 20000));
  const long batch_size = flag(argc, argv, "--batch-size", 64);
  const long epochs = flag(argc, argv, "--epochs", 2);
  const auto seed = static_cast<uint64_t>(flag(argc, argv, "--seed", 0));

  SyntheticImages dataset(samples);
  conveyor::DataLoader loader(dataset, {.batch_size = batch_size, .shuffle = true, .seed = seed});
  std::printf("load_demo: %zu samples, batch %ld, %zu batches per epoch\n", samples, batch_size,
              loader.size());
  for (long epoch = 0; epoch < epochs; ++epoch) {
    loader.set_epoch(static_cast<uint64_t>(epoch));
    const auto start = std::chrono::steady_clock::now();
    size_t batches = 0, seen = 0;
    int64_t label_sum = 0;
    std::vector<int64_t> first_labels;
    for (auto& [pixels, labels] : loader) {
      ++batches;
      seen += static_cast<size_t>(pixels.shape()[0]);
      for (int64_t label : labels.values()) label_sum += label;
      if (first_labels.empty()) first_labels.assign(labels.values().begin(), labels.values().begin() + 8);
    }
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    std::printf("epoch %ld: %zu batches, %zu samples, images [%ld, 3, 32, 32], label sum %ld, "
                "first labels", epoch, batches, seen, batch_size, static_cast<long>(label_sum));
    for (int64_t l : first_labels) std::printf(" %ld", static_cast<long>(l));
    std::printf(", %.0f samples/s\n", static_cast<double>(seen) / seconds);
  }
  return 0;
}
