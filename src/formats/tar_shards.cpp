// WebDataset-style tar shards: reading (TarShardDataset, read_shard), writing
// (TarShardWriter) and shard-name patterns, on top of libarchive.
#include "conveyor/tar_shards.h"

#include <archive.h>
#include <archive_entry.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <iterator>
#include <limits>
#include <new>
#include <numeric>
#include <set>
#include <system_error>
#include <unordered_set>
#include <utility>

#include "conveyor/errors.h"
#include "conveyor/generator.h"
#include "conveyor/image.h"
#include "conveyor/nodes/files.h"
#include "conveyor/nodes/shuffle.h"
#include "conveyor/nodes/sources.h"
#include "tar_source.h"

namespace conveyor {
namespace {

// Writers stamp every member with this mtime so the same samples always make
// the same bytes.
constexpr time_t kFixedMtime = 0;
// expand_shard_pattern() refuses to build more paths than this (a typo such
// as {0..999999999} would otherwise exhaust memory).
constexpr size_t kMaxExpandedPaths = 10'000'000;
// ... nor paths taking more memory than this together (long names: ten
// million paths of 300 characters would take 3 GB).
constexpr uint64_t kMaxExpandedBytes = uint64_t{1} << 30;

// The shard reader: untar straight into group_by_key, which checks each
// member's size from its header (max_sample_bytes bounds untar too). Both
// raise: the callers count what they skip.
template <class Input>
Pipeline<ShardSample> shard_reader(Pipeline<Input>&& archives,
                                   const std::vector<std::string>& required_fields,
                                   uint64_t max_sample_bytes, StreamOpener open = {}) {
  return std::move(archives) | nodes::untar({.max_member_bytes = max_sample_bytes, .open = std::move(open)}) |
         nodes::group_by_key({.required_fields = required_fields, .max_sample_bytes = max_sample_bytes});
}

using detail::archive_reason;
using detail::succeeded;

struct ArchiveEntryFree {
  void operator()(struct archive_entry* entry) const noexcept { archive_entry_free(entry); }
};

// One replica's samples: its shards in order, one open at a time, through
// the reader's nodes and, with a buffer, shuffle(n), seeded by a draw from
// default_generator() (on a loader worker, the worker's: the order follows
// the loader's seed).
Pipeline<ShardSample> replica_reader(std::vector<std::string> shards, const TarShardOptions& options) {
  Pipeline<ShardSample> samples =
      shard_reader(nodes::from_vector(std::move(shards)), options.required_fields, options.max_sample_bytes,
                   options.open);
  if (options.shuffle_buffer == 0) return samples;
  Pipeline<ShardSample> shuffled = std::move(samples) | nodes::shuffle(options.shuffle_buffer);
  shuffled.seed(default_generator().random64());
  return shuffled;
}

// A replica's pass over its reader; what fails is raised or counted.
class TarShardIterator final : public SampleIterator<ShardSample> {
 public:
  TarShardIterator(std::vector<std::string> shards, const TarShardOptions& options,
                   std::shared_ptr<std::atomic<uint64_t>> skipped)
      : reader_(replica_reader(std::move(shards), options)),
        samples_(reader_.pass()),
        on_error_(options.on_error),
        skipped_(std::move(skipped)) {}

  std::optional<ShardSample> next() override {
    while (true) {
      try {
        return samples_.next();
      } catch (const DataError&) {
        if (on_error_ == OnError::raise) throw;
        skipped_->fetch_add(1, std::memory_order_relaxed);
      }
    }
  }

 private:
  Pipeline<ShardSample> reader_;
  Pipeline<ShardSample>::Pass samples_;
  OnError on_error_;
  std::shared_ptr<std::atomic<uint64_t>> skipped_;
};

}  // namespace

// ---- TarShardDataset ----------------------------------------------------------

TarShardDataset::TarShardDataset(TarShardOptions options) : options_(std::move(options)) {
  if (options_.shards.empty()) throw ValueError("TarShardDataset: no shards given");
  options_.shards = expand_shard_patterns(options_.shards);
  if (options_.num_replicas < 1) {
    throw ValueError("TarShardDataset: num_replicas must be at least 1, got " +
                     std::to_string(options_.num_replicas));
  }
  if (options_.rank < 0 || options_.rank >= options_.num_replicas) {
    throw ValueError("TarShardDataset: invalid rank " + std::to_string(options_.rank) +
                     ", rank should be in the interval [0, " +
                     std::to_string(options_.num_replicas - 1) + "]");
  }
  nodes::group_by_key({.required_fields = options_.required_fields});  // checks them now, not at the first pass
}

std::unique_ptr<SampleIterator<ShardSample>> TarShardDataset::iter(const WorkerInfo* worker) {
  return std::make_unique<TarShardIterator>(shards_for(worker), options_, skipped_);
}

void TarShardDataset::set_epoch(uint64_t epoch) { epoch_.store(epoch); }

std::vector<std::string> TarShardDataset::shards_for(const WorkerInfo* worker) const {
  const std::vector<std::string>& shards = options_.shards;
  std::vector<size_t> order(shards.size());
  if (options_.shuffle_shards) {
    // One generator seeded by (seed, epoch) alone: every rank and worker
    // computes the same order, so their slices never overlap.
    Generator generator(options_.seed + epoch_.load());
    order = randperm(shards.size(), generator);
  } else {
    std::iota(order.begin(), order.end(), size_t{0});
  }
  size_t worker_id = 0;
  size_t num_workers = 1;
  if (worker != nullptr) {
    if (worker->num_workers < 1 || worker->id < 0 || worker->id >= worker->num_workers) {
      throw ValueError("TarShardDataset: invalid worker " + std::to_string(worker->id) + " of " +
                       std::to_string(worker->num_workers));
    }
    worker_id = static_cast<size_t>(worker->id);
    num_workers = static_cast<size_t>(worker->num_workers);
    // Split by rank twice, each rank would read only its share of its share.
    if (worker->num_ranks > 1 && options_.num_replicas > 1) {
      throw ValueError("TarShardDataset: num_replicas=" + std::to_string(options_.num_replicas) +
                       " splits the shards across ranks, and so does the pipeline's ShardSpec (world_size " +
                       std::to_string(worker->num_ranks) +
                       "): leave num_replicas at 1 and let the pipeline split them");
    }
  }
  const auto rank = static_cast<size_t>(options_.rank);
  const auto replicas = static_cast<size_t>(options_.num_replicas);
  std::vector<std::string> mine;
  // shards[rank::replicas], then [worker::num_workers] of that.
  for (size_t position = rank, local = 0; position < order.size(); position += replicas, ++local) {
    if (local % num_workers == worker_id) mine.push_back(shards[order[position]]);
  }
  return mine;
}

uint64_t TarShardDataset::skipped() const noexcept { return skipped_->load(); }

// ---- read_shard ------------------------------------------------------------------

std::vector<ShardSample> read_shard(std::span<const uint8_t> bytes, const std::string& name,
                                    const std::vector<std::string>& required_fields,
                                    OnError on_error, uint64_t* skipped,
                                    uint64_t max_sample_bytes) {
  std::vector<nodes::FileBytes> shard;
  shard.push_back({name, std::vector<uint8_t>(bytes.begin(), bytes.end())});
  Pipeline<ShardSample> reader =
      shard_reader(nodes::from_vector(std::move(shard)), required_fields, max_sample_bytes);
  auto pass = reader.pass();
  std::vector<ShardSample> samples;
  while (true) {
    try {
      std::optional<ShardSample> sample = pass.next();
      if (!sample) return samples;
      samples.push_back(std::move(*sample));
    } catch (const DataError&) {
      if (on_error == OnError::raise) throw;
      if (skipped != nullptr) ++*skipped;
    }
  }
}

// ---- expand_shard_pattern -------------------------------------------------------

namespace {

// One {first..last} of a pattern: its numbers' bounds and width.
struct BraceRange {
  uint64_t low = 0, high = 0;
  size_t width = 0;  // zero padding (0: none)
  uint64_t count() const { return high - low + 1; }
  std::string number(uint64_t value) const {
    std::string text = std::to_string(value);
    if (text.size() < width) text.insert(0, width - text.size(), '0');
    return text;
  }
};

// "000000..000011" -> its bounds, zero-padded to the wider bound when either
// bound has a leading zero (as Python's braceexpand does).
BraceRange parse_range(const std::string& pattern, const std::string& range) {
  const auto malformed = [&](const std::string& why) {
    return ValueError("expand_shard_pattern('" + pattern + "'): malformed range '{" + range +
                      "}': " + why);
  };
  const size_t dots = range.find("..");
  if (dots == std::string::npos) throw malformed("expected {first..last}");
  const std::string first = range.substr(0, dots);
  const std::string last = range.substr(dots + 2);
  for (const std::string* bound : {&first, &last}) {
    if (bound->empty()) throw malformed("a bound is missing");
    if (bound->size() > 18) throw malformed("a bound has more than 18 digits");
    if (!std::all_of(bound->begin(), bound->end(), [](char c) { return c >= '0' && c <= '9'; })) {
      throw malformed("bounds must be decimal numbers");
    }
  }
  BraceRange parsed;
  parsed.low = std::stoull(first);
  parsed.high = std::stoull(last);
  if (parsed.low > parsed.high) throw malformed("the last number is smaller than the first");
  if (parsed.high - parsed.low >= kMaxExpandedPaths) throw malformed("too many paths");
  const bool padded = (first.size() > 1 && first[0] == '0') || (last.size() > 1 && last[0] == '0');
  parsed.width = padded ? std::max(first.size(), last.size()) : 0;
  return parsed;
}

// A pattern as its literal parts and ranges: literals[0] range[0]
// literals[1] range[1] ... literals[n]. Throws as expand_shard_pattern().
struct ParsedPattern {
  std::vector<std::string> literals;
  std::vector<BraceRange> ranges;
  // How many paths it stands for, or more than kMaxExpandedPaths.
  uint64_t count() const {
    uint64_t paths = 1;
    for (const BraceRange& range : ranges) {
      paths *= range.count();  // both factors <= kMaxExpandedPaths: no overflow
      if (paths > kMaxExpandedPaths) return kMaxExpandedPaths + 1;
    }
    return paths;
  }
  // The longest path it makes, in characters.
  uint64_t longest() const {
    uint64_t length = 0;
    for (const std::string& literal : literals) length += literal.size();
    for (const BraceRange& range : ranges) length += std::max(range.width, std::to_string(range.high).size());
    return length;
  }
  // An upper bound on the memory its paths take, as std::strings; with
  // count() <= kMaxExpandedPaths, no overflow.
  uint64_t bytes() const { return count() * path_bytes(longest()); }
  static uint64_t path_bytes(uint64_t length) { return sizeof(std::string) + length + 1; }
};

ParsedPattern parse_pattern(const std::string& pattern) {
  ParsedPattern parsed;
  size_t position = 0;
  while (true) {
    const size_t open = pattern.find_first_of("{}", position);
    parsed.literals.push_back(pattern.substr(position, open - position));
    if (open == std::string::npos) return parsed;
    if (pattern[open] == '}') {
      throw ValueError("expand_shard_pattern('" + pattern + "'): '}' without '{'");
    }
    const size_t close = pattern.find_first_of("{}", open + 1);
    if (close == std::string::npos || pattern[close] == '{') {
      throw ValueError("expand_shard_pattern('" + pattern + "'): '{' without its '}'");
    }
    parsed.ranges.push_back(parse_range(pattern, pattern.substr(open + 1, close - open - 1)));
    position = close + 1;
  }
}

}  // namespace

bool is_shard_pattern(std::string_view path) {
  for (size_t open = path.find('{'); open != std::string_view::npos; open = path.find('{', open + 1)) {
    const size_t next_brace = path.find_first_of("{}", open + 1);
    const std::string_view inside = path.substr(open + 1, next_brace == std::string_view::npos
                                                              ? std::string_view::npos
                                                              : next_brace - open - 1);
    if (inside.find("..") != std::string_view::npos) return true;
  }
  return false;
}

namespace {

std::string too_much_memory(const char* function, const std::string& pattern) {
  return std::string(function) + ": the paths would take more than " +
         std::to_string(kMaxExpandedBytes >> 20) + " MiB, the last pattern being '" + pattern + "'";
}

}  // namespace

std::vector<std::string> expand_shard_pattern(const std::string& pattern) {
  const ParsedPattern parsed = parse_pattern(pattern);
  if (parsed.count() > kMaxExpandedPaths) {
    throw ValueError("expand_shard_pattern('" + pattern + "'): more than " + std::to_string(kMaxExpandedPaths) +
                     " paths");
  }
  if (parsed.bytes() > kMaxExpandedBytes) {
    throw ValueError("expand_shard_pattern('" + pattern + "'): its " + std::to_string(parsed.count()) +
                     " paths of up to " + std::to_string(parsed.longest()) + " characters would take more than " +
                     std::to_string(kMaxExpandedBytes >> 20) + " MiB");
  }
  std::vector<std::string> paths{parsed.literals[0]};
  for (size_t r = 0; r < parsed.ranges.size(); ++r) {
    const BraceRange& range = parsed.ranges[r];
    std::vector<std::string> expanded;
    expanded.reserve(paths.size() * range.count());
    for (const std::string& path : paths) {
      for (uint64_t value = range.low; value <= range.high; ++value) {
        expanded.push_back(path + range.number(value) + parsed.literals[r + 1]);
      }
    }
    paths = std::move(expanded);
  }
  return paths;
}

std::vector<std::string> expand_shard_patterns(const std::vector<std::string>& patterns) {
  // Counted first: the cap holds before a path is made.
  uint64_t total = 0, bytes = 0;
  for (const std::string& pattern : patterns) {
    if (is_shard_pattern(pattern)) {
      const ParsedPattern parsed = parse_pattern(pattern);
      total += parsed.count();
      bytes += parsed.bytes();
    } else {
      total += 1;
      bytes += ParsedPattern::path_bytes(pattern.size());
    }
    if (total > kMaxExpandedPaths) {
      throw ValueError("expand_shard_patterns: more than " + std::to_string(kMaxExpandedPaths) +
                       " paths, the last pattern being '" + pattern + "'");
    }
    if (bytes > kMaxExpandedBytes) throw ValueError(too_much_memory("expand_shard_patterns", pattern));
  }
  std::vector<std::string> paths;
  paths.reserve(static_cast<size_t>(total));
  for (const std::string& pattern : patterns) {
    if (!is_shard_pattern(pattern)) {
      paths.push_back(pattern);
      continue;
    }
    std::vector<std::string> expanded = expand_shard_pattern(pattern);
    paths.insert(paths.end(), std::make_move_iterator(expanded.begin()), std::make_move_iterator(expanded.end()));
  }
  return paths;
}

// ---- TarShardWriter --------------------------------------------------------------

struct TarShardWriter::Impl {
  std::string prefix;
  size_t samples_per_shard = 0;
  struct archive* archive = nullptr;  // the open shard, or null
  std::string path;                   // the open shard's
  size_t samples_in_shard = 0;
  std::set<std::string> keys_in_shard;
  size_t next_shard_number = 0;
  std::vector<std::string> paths;
  bool closed = false;
  std::string failure;  // set after a failed write: the writer is unusable

  ~Impl() { abandon(); }

  // Frees the open shard without reporting anything.
  void abandon() noexcept {
    if (archive != nullptr) archive_write_free(archive);
    archive = nullptr;
  }

  [[noreturn]] void fail(const std::string& what, const std::string& member) {
    std::string reason = what;
    if (archive != nullptr) reason += ": " + archive_reason(archive);
    failure = path + ": " + reason;
    abandon();
    throw DataError(reason, path, member);
  }

  void check_usable() const {
    if (closed) throw ValueError("TarShardWriter: write() after close()");
    if (!failure.empty()) {
      throw DataError("TarShardWriter is unusable after an earlier failure (" + failure + ")",
                      path);
    }
  }

  void open_shard() {
    char number[32];
    std::snprintf(number, sizeof number, "%06zu", next_shard_number++);
    path = prefix + number + ".tar";
    archive = archive_write_new();
    if (archive == nullptr) fail("cannot allocate a libarchive writer", {});
    if (archive_write_set_format_pax_restricted(archive) != ARCHIVE_OK) {
      fail("cannot select the pax format", {});
    }
    // Stop after the end-of-archive blocks instead of padding to 10 KiB.
    if (archive_write_set_bytes_in_last_block(archive, 1) != ARCHIVE_OK) {
      fail("cannot set the last block's size", {});
    }
    if (archive_write_open_filename(archive, path.c_str()) != ARCHIVE_OK) {
      fail("cannot create shard", {});
    }
    paths.push_back(path);
    samples_in_shard = 0;
    keys_in_shard.clear();
  }

  void finish_shard() {
    if (archive == nullptr) return;
    if (archive_write_close(archive) != ARCHIVE_OK) fail("cannot finish shard", {});
    archive_write_free(archive);
    archive = nullptr;
  }

  void write_member(const std::string& name, const std::vector<uint8_t>& bytes) {
    std::unique_ptr<struct archive_entry, ArchiveEntryFree> entry(archive_entry_new());
    if (!entry) fail("cannot allocate a tar entry", name);
    archive_entry_set_pathname(entry.get(), name.c_str());
    archive_entry_set_filetype(entry.get(), AE_IFREG);
    archive_entry_set_perm(entry.get(), 0644);
    archive_entry_set_size(entry.get(), static_cast<la_int64_t>(bytes.size()));
    archive_entry_set_mtime(entry.get(), kFixedMtime, 0);
    if (!succeeded(archive_write_header(archive, entry.get()))) {
      fail("cannot write member header", name);
    }
    size_t written = 0;
    while (written < bytes.size()) {
      const la_ssize_t count =
          archive_write_data(archive, bytes.data() + written, bytes.size() - written);
      if (count <= 0) fail("cannot write member data", name);
      written += static_cast<size_t>(count);
    }
    if (!succeeded(archive_write_finish_entry(archive))) fail("cannot finish member", name);
  }
};

TarShardWriter::TarShardWriter(std::string prefix, size_t samples_per_shard)
    : impl_(std::make_unique<Impl>()) {
  if (samples_per_shard == 0) throw ValueError("TarShardWriter: samples_per_shard must be > 0");
  impl_->prefix = std::move(prefix);
  impl_->samples_per_shard = samples_per_shard;
}

TarShardWriter::~TarShardWriter() {
  try {
    if (!impl_->closed && impl_->failure.empty()) impl_->finish_shard();
  } catch (...) {
    // Destructors stay quiet; close() reports.
  }
}

void TarShardWriter::write(const std::string& key, const SampleFields& fields) {
  Impl& impl = *impl_;
  impl.check_usable();
  // Names the reader would group differently are refused up front.
  const size_t base = key.rfind('/') == std::string::npos ? 0 : key.rfind('/') + 1;
  if (base == key.size() || key.find('.', base) != std::string::npos) {
    throw ValueError("TarShardWriter: key '" + key + "' must end in a non-empty name without '.'");
  }
  if (fields.empty()) throw ValueError("TarShardWriter: sample '" + key + "' has no fields");
  for (const auto& [field, bytes] : fields) {
    if (field.empty() || field.find('/') != std::string::npos || field.find('\0') != field.npos) {
      throw ValueError("TarShardWriter: sample '" + key + "' has an invalid field name '" + field +
                       "'");
    }
  }
  if (key.find('\0') != std::string::npos) {
    throw ValueError("TarShardWriter: key contains a NUL character");
  }
  if (impl.archive != nullptr && impl.samples_in_shard == impl.samples_per_shard) {
    impl.finish_shard();
  }
  if (impl.archive == nullptr) impl.open_shard();
  if (!impl.keys_in_shard.insert(key).second) {
    throw ValueError("TarShardWriter: key '" + key + "' is already in shard " + impl.path);
  }
  for (const auto& [field, bytes] : fields) impl.write_member(key + "." + field, bytes);
  ++impl.samples_in_shard;
}

std::vector<std::string> TarShardWriter::close() {
  Impl& impl = *impl_;
  if (!impl.failure.empty()) impl.check_usable();
  if (!impl.closed) {
    impl.finish_shard();
    impl.closed = true;
  }
  return impl.paths;
}

LabeledImage decode_class_sample(const ShardSample& sample, const ClassSampleFields& fields) {
  const auto image = sample.fields.find(fields.image);
  const auto label = sample.fields.find(fields.label);
  if (image == sample.fields.end() || label == sample.fields.end()) {
    throw DataError("sample lacks its " +
                        (image == sample.fields.end() ? fields.image : fields.label) + " field",
                    sample.shard, sample.key);
  }
  const std::string text(label->second.begin(), label->second.end());
  // At most 18 digits: always fits int64_t, so stoll cannot throw.
  const bool digits_only =
      !text.empty() && text.size() <= 18 &&
      std::all_of(text.begin(), text.end(), [](char c) { return c >= '0' && c <= '9'; });
  const int64_t value = digits_only ? std::stoll(text) : -1;
  if (!digits_only || (fields.num_classes > 0 && value >= fields.num_classes)) {
    std::string message = "bad class label '" + text + "'";
    if (fields.num_classes > 0) {
      message += " (expected 0.." + std::to_string(fields.num_classes - 1) + ")";
    }
    throw DataError(message, sample.shard, sample.key);
  }
  return {decode_image(image->second, sample.shard, sample.key, fields.channels), value};
}

}  // namespace conveyor
