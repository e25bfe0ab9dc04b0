// Fashion-MNIST (IDX) into WebDataset JPEG tar shards: shared by
// conveyor-make-shards and the trainer's --source shards.
#pragma once

#include <conveyor/idx.h>
#include <conveyor/image.h>
#include <conveyor/tar_shards.h>

#include <cstdio>
#include <string>
#include <vector>

namespace conveyor::examples {

// Writes every image of `dataset` as "<index>.jpg" + "<index>.cls" into
// shards `prefix`000000.tar, ... of `per_shard` samples each. Prints progress
// every 10%. Returns the shard paths.
inline std::vector<std::string> write_image_shards(IdxImageDataset& dataset, const std::string& prefix,
                                                   size_t per_shard, int quality) {
  TarShardWriter writer(prefix, per_shard);
  char key[24];  // %06zu of a size_t: up to 20 digits
  const size_t total = dataset.size();
  for (size_t i = 0; i < total; ++i) {
    LabeledImage sample = dataset.get(i);
    std::snprintf(key, sizeof key, "%06zu", i);
    const std::string label = std::to_string(sample.label);
    writer.write(key, {{"jpg", encode_jpeg(sample.image, quality)},
                       {"cls", std::vector<uint8_t>(label.begin(), label.end())}});
    if ((i + 1) % (total / 10 + 1) == 0 || i + 1 == total) {
      std::printf("  %zu/%zu samples written\n", i + 1, total);
      std::fflush(stdout);
    }
  }
  return writer.close();
}

}  // namespace conveyor::examples
