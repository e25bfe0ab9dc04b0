// conveyor-make-shards: an IDX image set (Fashion-MNIST by default) as
// WebDataset JPEG tar shards, so the tar -> decode path runs on real images.
//
//   conveyor-make-shards [--data DIR] [--test] [--out PREFIX] [--per-shard N] [--quality Q]
//
// PREFIX defaults to fashion-mnist-jpeg/train- (test- with --test).
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>

#include "shard_writing.h"

namespace {

[[noreturn]] void usage(const std::string& problem) {
  std::fprintf(stderr,
               "conveyor-make-shards: %s\n"
               "usage: conveyor-make-shards [--data DIR] [--test] [--out PREFIX] [--per-shard N] "
               "[--quality 1..100]\n",
               problem.c_str());
  std::exit(2);
}

long number(const std::string& flag, const char* text, long low, long high) {
  char* end = nullptr;
  const long value = std::strtol(text, &end, 10);
  if (*text == '\0' || *end != '\0' || value < low || value > high) {
    usage(flag + " needs an integer in [" + std::to_string(low) + ", " + std::to_string(high) +
          "], got '" + text + "'");
  }
  return value;
}

}  // namespace

int main(int argc, char** argv) {
  std::string data = conveyor::kFashionMnistDirectory;
  // Not the trainer's own directory (fashion-mnist-shards): it reads only
  // the shards its COMPLETE marker lists, and refuses a directory of others.
  std::string out;
  bool train = true;
  long per_shard = 5000, quality = 95;
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    if (flag == "--test") {
      train = false;
      continue;
    }
    if (flag == "--help" || flag == "-h") usage("write IDX images as JPEG tar shards");
    if (i + 1 >= argc) usage(flag + " needs a value");
    const char* value = argv[++i];
    if (flag == "--data") {
      data = value;
    } else if (flag == "--out") {
      out = value;
    } else if (flag == "--per-shard") {
      per_shard = number(flag, value, 1, 100000000);
    } else if (flag == "--quality") {
      quality = number(flag, value, 1, 100);
    } else {
      usage("unknown flag " + flag);
    }
  }
  if (out.empty()) out = train ? "fashion-mnist-jpeg/train-" : "fashion-mnist-jpeg/test-";
  try {
    const std::filesystem::path parent = std::filesystem::path(out).parent_path();
    if (!parent.empty()) std::filesystem::create_directories(parent);
    conveyor::IdxImageDataset dataset = conveyor::IdxImageDataset::from_directory(data, train);
    std::printf("conveyor-make-shards: %zu images from %s -> %s*.tar, %ld per shard, JPEG quality %ld\n",
                dataset.size(), data.c_str(), out.c_str(), per_shard, quality);
    const auto shards = conveyor::examples::write_image_shards(dataset, out, static_cast<size_t>(per_shard),
                                                               static_cast<int>(quality));
    std::printf("conveyor-make-shards: wrote %zu shards\n", shards.size());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "conveyor-make-shards: %s\n", e.what());
    return 1;
  }
  return 0;
}
