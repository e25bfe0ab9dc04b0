// conveyor/tar_shards.h: WebDataset-style tar shards, read with libarchive
// (target conveyor::formats).
//
// A shard is a tar file whose members are grouped into samples by key: the
// member name up to its first '.' after the last '/' (000123.jpg and
// 000123.cls are the fields "jpg" and "cls" of sample "000123"). Members of a
// sample are consecutive in the archive.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "conveyor/byte_stream.h"
#include "conveyor/data_error.h"
#include "conveyor/dataset.h"
#include "conveyor/idx.h"
#include "conveyor/sample_fields.h"

namespace conveyor {

struct ShardSample {
  std::string key;    // "000123"
  std::string shard;  // the shard's path
  SampleFields fields;  // extension, in lower case -> bytes ("jpg", "cls"), in name order
};

// TarShardOptions::max_sample_bytes's default: 1 GiB, far above any image,
// audio clip or caption (ImageNet's largest JPEG is about 15 MB), yet small
// enough that one corrupt or hostile header cannot claim the machine. Shards
// of long videos raise it.
inline constexpr uint64_t kDefaultMaxSampleBytes = uint64_t{1} << 30;

struct TarShardOptions {
  // Paths, or URLs read through `open`. Brace ranges expand, in place
  // ("train-{000000..000011}.tar" stands for its 12 shards; see
  // expand_shard_patterns()), so options().shards lists the expanded paths. A
  // path must name a regular file: a device, a FIFO or a directory is a
  // DataError when its turn comes.
  std::vector<std::string> shards;
  // Reshuffle the shard order every epoch (Generator(seed + epoch), the same
  // on every rank), before shards are split across ranks and workers. The
  // epoch is DataLoader::set_epoch()'s, as for a DistributedSampler: call it
  // before each epoch. Without it every pass has epoch 0's order, and passes
  // after one set_epoch(e) (a rank padding its share again) all have e's.
  bool shuffle_shards = false;
  uint64_t seed = 0;
  // Shuffle samples through a buffer of this many (0: no shuffle): the
  // replica's nodes end in nodes::shuffle(n), seeded by one draw from
  // default_generator() as the replica starts (the worker's: reproducible).
  size_t shuffle_buffer = 0;
  // Distributed training: this process takes shards rank, rank + R, ...;
  // within it, worker w of W takes every W-th of those. In a pipeline
  // sharded by ShardSpec (from_iterable(dataset) with .shard()), leave it 1:
  // the pipeline splits by rank, and both together are a ValueError.
  int64_t num_replicas = 1;
  int64_t rank = 0;
  // Every sample must have these fields; a sample missing one is an error.
  // In lower case, as fields are read (ValueError otherwise).
  std::vector<std::string> required_fields;
  // raise: a malformed shard or sample throws DataError naming the shard,
  // the member and the sample. skip: it is dropped and counted in skipped()
  // (a truncated shard: its remaining samples are lost and counted as one).
  OnError on_error = OnError::raise;
  // The most bytes one sample's members may hold together (0: no limit). A
  // reader holds one sample at a time (plus the shuffle buffer's), so this
  // bounds its memory whatever sizes the tar headers claim. A sample over it
  // is a DataError, raised from the member's header before its data is read.
  uint64_t max_sample_bytes = kDefaultMaxSampleBytes;
  // Opens each shard as a stream (nodes::http_opener() for http(s):// URLs,
  // conveyor/nodes/http.h); a shard it declines, or every shard when unset,
  // is read as a local file. Shared by the workers: see StreamOpener.
  StreamOpener open;
};

// An IterableDataset over tar shards. Each replica (one per worker) reads its
// share of the shards in order, one shard open at a time.
class TarShardDataset final : public IterableDataset<ShardSample> {
 public:
  // Throws ValueError for no shards, num_replicas < 1 or a rank outside
  // [0, num_replicas - 1].
  explicit TarShardDataset(TarShardOptions options);

  std::unique_ptr<SampleIterator<ShardSample>> iter(const WorkerInfo* worker) override;
  void set_epoch(uint64_t epoch) override;

  // The shards replica (rank, worker) reads this epoch, in order.
  std::vector<std::string> shards_for(const WorkerInfo* worker) const;
  // Samples or shards dropped under OnError::skip, all epochs together.
  uint64_t skipped() const noexcept;
  const TarShardOptions& options() const noexcept { return options_; }

 private:
  TarShardOptions options_;
  std::atomic<uint64_t> epoch_{0};
  std::shared_ptr<std::atomic<uint64_t>> skipped_ = std::make_shared<std::atomic<uint64_t>>(0);
};

// Reads a whole shard held in memory (`name` stands for its path in errors),
// grouping and checking it as TarShardDataset does. raise: the first error
// throws DataError; skip: bad samples are dropped (a truncated or corrupt
// shard ends there) and each drop is added to *skipped when it is given.
// max_sample_bytes as in TarShardOptions.
std::vector<ShardSample> read_shard(std::span<const uint8_t> bytes, const std::string& name,
                                    const std::vector<std::string>& required_fields,
                                    OnError on_error = OnError::raise, uint64_t* skipped = nullptr,
                                    uint64_t max_sample_bytes = kDefaultMaxSampleBytes);

// "dir/train-{000000..000011}.tar" -> the 12 paths (zero padding kept); a
// pattern without braces is returned as the one path, and several ranges
// multiply out left to right. Throws ValueError for a malformed range
// (including a descending one, or more than ten million paths).
std::vector<std::string> expand_shard_pattern(const std::string& pattern);
// Whether `path` holds a brace pair with ".." inside ("{0..9}": a pattern,
// even a malformed one such as "{-1..1}" or "{a..c}", which expanding
// refuses). In a path without one, braces ("odd-{x}.tar") are part of the
// name; in a pattern every brace pair must be a range. Expanding also
// refuses paths that would take more than 1 GiB together.
bool is_shard_pattern(std::string_view path);
// Each pattern expanded in turn, their paths in order; an entry that is no
// pattern (is_shard_pattern) is kept as it is. The same errors, and the same
// ten-million cap on all the paths together, checked before any is made.
std::vector<std::string> expand_shard_patterns(const std::vector<std::string>& patterns);

// Where a classification sample keeps its parts (WebDataset's convention).
struct ClassSampleFields {
  std::string image = "jpg";  // an encoded JPEG or PNG
  std::string label = "cls";  // the class as decimal text
  int channels = 0;           // decode to 1 or 3 channels; 0 keeps the stored count
  int64_t num_classes = 0;    // > 0: a label must be below it
};

// A classification sample as a LabeledImage: the image decoded, the label
// parsed. Throws DataError naming the shard (file()) and key (member()) for
// a missing field, a label that is not a non-negative decimal number (below
// num_classes when set), or an image that does not decode, including one
// over max_image_pixels() (conveyor/image.h).
LabeledImage decode_class_sample(const ShardSample& sample, const ClassSampleFields& fields = {});

// Writes samples into numbered shards of `samples_per_shard` samples each:
// `prefix` + 6-digit shard number + ".tar". Members are written in field-name
// order. Throws DataError naming the shard if a write fails.
class TarShardWriter {
 public:
  TarShardWriter(std::string prefix, size_t samples_per_shard);
  ~TarShardWriter();  // finishes the open shard; never throws (call close() to see errors)
  TarShardWriter(const TarShardWriter&) = delete;
  TarShardWriter& operator=(const TarShardWriter&) = delete;

  void write(const std::string& key, const SampleFields& fields);
  // Finishes the open shard. Returns the paths of every shard written.
  std::vector<std::string> close();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace conveyor
