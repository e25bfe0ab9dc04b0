// conveyor/nodes/sources.h: where a pipeline's items come from.
//
//   from_vector(items)            the items, in order
//   from_range(begin, end)        begin, begin + 1, ..., end - 1 (int64_t)
//   from_sampler(s)               s's indices, or batches of indices
//   from_map_dataset(d[, s])      d.get(i) for i in sampler s (default: 0..size-1);
//                                 with a batch sampler, d.get_batch(b) per batch
//   from_iterable(d)              d.iter(worker)'s stream
//
// Each is shardable: under a ShardSpec it yields only its shard's part
// (every count()-th item from index(); an iterable dataset is told the shard
// as its WorkerInfo and splits itself, as PyTorch's workers do).
#pragma once

#include <algorithm>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "conveyor/dataset.h"
#include "conveyor/detail/worker_scope.h"
#include "conveyor/errors.h"
#include "conveyor/generator.h"
#include "conveyor/node.h"
#include "conveyor/nodes/stage.h"
#include "conveyor/sampler.h"
#include "conveyor/state.h"

namespace conveyor::nodes {

namespace detail {
// Where a shardable source starts and how far it strides this pass.
struct Stride {
  size_t first = 0;
  size_t step = 1;
};
inline Stride take_shard(const PassContext& pass, conveyor::detail::ResetWalk& walk) {
  if (walk.sharded) return {};
  walk.sharded = true;
  return {static_cast<size_t>(pass.shard.index()), static_cast<size_t>(pass.shard.count())};
}
}  // namespace detail

template <class T>
class VectorSource final : public Source<T> {
 public:
  explicit VectorSource(std::shared_ptr<const std::vector<T>> items) : items_(std::move(items)) {}
  using Node<T>::reset;
  void reset(const PassContext& pass, conveyor::detail::ResetWalk& walk) override {
    stride_ = detail::take_shard(pass, walk);
    next_ = stride_.first;
    this->start_metering(pass, walk.next_id++);
  }
  std::optional<T> produce() override {
    if (next_ >= items_->size()) return std::nullopt;
    const size_t index = next_;
    next_ += stride_.step;
    return (*items_)[index];
  }
  std::string name() const override { return "from_vector"; }
  uint64_t skip(uint64_t count, bool) override {
    const size_t left = next_ < items_->size() ? (items_->size() - next_ + stride_.step - 1) / stride_.step : 0;
    const uint64_t skipped = std::min<uint64_t>(count, left);
    next_ += static_cast<size_t>(skipped) * stride_.step;
    return skipped;
  }

 private:
  std::shared_ptr<const std::vector<T>> items_;
  detail::Stride stride_;
  size_t next_ = 0;
};

template <class T>
Pipeline<T> from_vector(std::vector<T> items) {
  return Pipeline<T>(
      std::make_unique<VectorSource<T>>(std::make_shared<const std::vector<T>>(std::move(items))));
}

class RangeSource final : public Source<int64_t> {
 public:
  RangeSource(int64_t begin, int64_t end) : begin_(begin), end_(end) {}
  using Node<int64_t>::reset;
  void reset(const PassContext& pass, conveyor::detail::ResetWalk& walk) override {
    const detail::Stride stride = detail::take_shard(pass, walk);
    step_ = static_cast<int64_t>(stride.step);
    // This shard's first: begin_ + first, unless that is past the end.
    const uint64_t span = begin_ < end_ ? static_cast<uint64_t>(end_) - static_cast<uint64_t>(begin_) : 0;
    next_ = stride.first < span ? static_cast<int64_t>(static_cast<uint64_t>(begin_) + stride.first) : end_;
    start_metering(pass, walk.next_id++);
  }
  std::optional<int64_t> produce() override {
    if (next_ >= end_) return std::nullopt;
    const int64_t value = next_;
    const uint64_t span = static_cast<uint64_t>(end_) - static_cast<uint64_t>(next_);  // > 0
    next_ = span > static_cast<uint64_t>(step_) ? next_ + step_ : end_;
    return value;
  }
  std::string name() const override { return "from_range"; }
  uint64_t skip(uint64_t count, bool) override {
    const uint64_t skipped = std::min(count, left());
    advance(skipped);
    return skipped;
  }

 private:
  // In unsigned arithmetic: a range may span all of int64_t, where end_ -
  // next_ and next_ + step_ overflow.
  uint64_t left() const {
    if (next_ >= end_) return 0;
    const uint64_t span = static_cast<uint64_t>(end_) - static_cast<uint64_t>(next_);
    const auto step = static_cast<uint64_t>(step_);
    return span / step + (span % step != 0 ? 1 : 0);
  }
  void advance(uint64_t count) {  // count <= left()
    if (count == left()) {
      next_ = end_;
      return;
    }
    next_ = static_cast<int64_t>(static_cast<uint64_t>(next_) + count * static_cast<uint64_t>(step_));
  }

  int64_t begin_, end_;
  int64_t next_ = 0, step_ = 1;
};

inline Pipeline<int64_t> from_range(int64_t begin, int64_t end) {
  return Pipeline<int64_t>(std::make_unique<RangeSource>(begin, end));
}

// A sampler's indices (Index = size_t) or batches of indices (BatchIndices),
// one pass of it per reset. It is from_sampler(s) on its own, the index half
// of from_map_dataset, and a DataLoader's first node (from_sampler, then
// fetch+collate, then to_device). Shardable: the k-th index (or batch) of
// the sampler's pass goes to shard k % count.
template <class Index>
class SamplerSource final : public Source<Index> {
 public:
  struct Options {
    // Each pass tells the sampler its epoch (DistributedSampler reshuffles
    // by it). A DataLoader leaves that to its set_epoch(), as PyTorch does.
    bool follow_pass_epoch = true;
    // A state holds the sampler (and the process generator, when the
    // sampler draws from it) as the pass began, so that a resumed pass,
    // in a new process too, draws the same order. Off where the owner saves
    // them (a DataLoader's epoch start) or there is nothing to save.
    bool save_start = true;
    // Names the node in metrics and its sampler in errors.
    std::string name = "from_sampler";
  };

  explicit SamplerSource(std::shared_ptr<Sampler<Index>> sampler, Options options = {})
      : sampler_(std::move(sampler)), options_(std::move(options)) {
    if (!sampler_) throw ValueError(options_.name + ": the sampler is null");
  }

  using Node<Index>::reset;
  void reset(const PassContext& pass, conveyor::detail::ResetWalk& walk) override {
    reset_as(pass, walk, walk.next_id++);
  }
  // A pass under an id its owner chose: a node that holds this one in place
  // of an upstream (from_map_dataset gives its own; a DataLoader numbers its
  // nodes in the data's order).
  void reset_as(const PassContext& pass, conveyor::detail::ResetWalk& walk, uint64_t id) {
    this->start_metering(pass, id);
    begin_pass(pass, walk, id);
  }
  // reset_as() without this node's meter: for an owner that counts what it
  // makes of the indices in its own (from_map_dataset).
  void begin_pass(const PassContext& pass, conveyor::detail::ResetWalk& walk, uint64_t id) {
    stride_ = detail::take_shard(pass, walk);
    if (options_.save_start) {
      // What iter() draws from, as this pass starts: a resumed pass starts
      // from the saved one (a RandomSampler's permutation is then the same
      // in a new process).
      if (const State* saved = conveyor::detail::restored_extras(walk, id)) restore_start(*saved);
      auto start = std::make_shared<const State>(sampler_start());
      std::lock_guard lock(pass_start_mutex_);
      pass_start_ = std::move(start);
    }
    if (options_.follow_pass_epoch) sampler_->set_epoch(pass.epoch);
    indices_ = sampler_->iter();
    position_ = 0;
  }

  // This shard's next index (or batch) into `out`, and its place in the
  // sampler's pass into `position`; false at the end. Not counted as an
  // output: for an owner that hands out something made from it.
  bool advance(Index& out, size_t* position = nullptr) {
    while (true) {
      if (!indices_->next(out)) return false;
      const size_t k = position_++;
      if (k % stride_.step != stride_.first) continue;
      if (position) *position = k;
      return true;
    }
  }
  // The place in the sampler's pass of the next draw, every shard's counted.
  size_t drawn() const noexcept { return position_; }
  // next() into `out`, counted: allocates nothing once `out` has room (a
  // DataLoader draws each batch's indices into one reused vector). A draw
  // that throws reaches the caller as the sampler threw it (a DataLoader
  // raises it as PyTorch does); next() names the node and the place.
  bool next_into(Index& out) {
    return this->meter_.count([&] { return advance(out) ? std::optional<bool>(true) : std::nullopt; }).has_value();
  }

  std::optional<Index> produce() override {
    Index index{};
    try {
      if (!advance(index)) return std::nullopt;
    } catch (...) {
      conveyor::detail::throw_node_error(name(), position_);
    }
    return index;
  }
  std::string name() const override { return options_.name; }
  // Draws without handing out. With `clean` false some of the outputs were
  // errors: a draw that throws was one of them, as it was when pulled.
  uint64_t skip(uint64_t count, bool clean) override {
    uint64_t skipped = 0;
    Index index{};
    while (skipped < count) {
      try {
        if (!advance(index)) break;
      } catch (...) {
        if (clean) throw;  // no output failed: this is a new failure, the caller's to see
      }
      ++skipped;
    }
    return skipped;
  }
  void save_extras(State& nodes, bool in_pass) const override { save_start(nodes, in_pass, this->id_); }
  // The sampler as the pass began or, between passes, as the next one will
  // begin, under `id`.
  void save_start(State& nodes, bool in_pass, uint64_t id) const {
    if (!options_.save_start) return;
    std::shared_ptr<const State> start;
    {
      std::lock_guard lock(pass_start_mutex_);
      start = pass_start_;
    }
    nodes.set(std::to_string(id), in_pass && start ? *start : sampler_start());
  }

 private:
  State sampler_start() const {
    State out = State::object();
    out.set("sampler_fingerprint", sampler_->fingerprint());
    out.set("sampler", sampler_->state());
    if (sampler_->draws_from_default_generator()) {
      const std::vector<uint8_t> bytes = default_generator().get_state();
      out.set("process_generator", std::string(bytes.begin(), bytes.end()));
    }
    return out;
  }
  void restore_start(const State& saved) {
    const State& fingerprint = saved.at("sampler_fingerprint");
    if (!(fingerprint == sampler_->fingerprint())) {
      throw StateError("load_state: " + options_.name + "'s sampler was saved as " + fingerprint.to_json() +
                       ", but this one is " + sampler_->fingerprint().to_json());
    }
    const State* process = saved.find("process_generator");
    if (sampler_->draws_from_default_generator() != (process != nullptr)) {
      throw StateError("load_state: " + options_.name + "'s sampler " +
                       (process ? "drew from the process generator when saved, and has a generator of its own now"
                                : "had a generator of its own when saved, and draws from the process generator now"));
    }
    sampler_->load_state(saved.at("sampler"));
    if (process) {
      const std::string& text = process->as_string("process_generator");
      default_generator().set_state(std::span(reinterpret_cast<const uint8_t*>(text.data()), text.size()));
    }
  }

  std::shared_ptr<Sampler<Index>> sampler_;
  Options options_;
  // Set at reset (a mid-pass one may run on a strand), read by state() on
  // the consumer's thread: under a mutex, taken once a pass and once a state.
  mutable std::mutex pass_start_mutex_;
  std::shared_ptr<const State> pass_start_;
  std::unique_ptr<SamplerIterator<Index>> indices_;
  detail::Stride stride_;
  size_t position_ = 0;  // the sampler's indices drawn this pass, every shard's
};

// Any sampler: from_sampler(std::make_shared<RandomSampler>(n)) is a
// Pipeline<size_t>; a batch sampler's, a Pipeline<BatchIndices>.
template <class S>
  requires std::derived_from<S, Sampler<typename S::index_type>>
Pipeline<typename S::index_type> from_sampler(std::shared_ptr<S> sampler) {
  using Index = typename S::index_type;
  return Pipeline<Index>(std::make_unique<SamplerSource<Index>>(std::move(sampler)));
}

// d.get(i) for the sampler's indices (default: 0 .. d.size() - 1, read at
// each pass); with a batch sampler (Index = BatchIndices), d.get_batch(b)
// for each batch of indices, one item a batch. The dataset is shared, or
// borrowed through a shared_ptr that owns nothing (it must then outlive the
// pipeline).
template <MapStyleDataset D, class Index = size_t>
class MapDatasetSource final
    : public Source<std::conditional_t<std::is_same_v<Index, size_t>, sample_t<D>, std::vector<sample_t<D>>>> {
 public:
  static_assert(std::is_same_v<Index, size_t> || std::is_same_v<Index, BatchIndices>,
                "from_map_dataset: a sampler of indices or of batches of indices");
  static constexpr bool kBatches = std::is_same_v<Index, BatchIndices>;
  using T = std::conditional_t<kBatches, std::vector<sample_t<D>>, sample_t<D>>;
  MapDatasetSource(std::shared_ptr<D> dataset, std::shared_ptr<Sampler<Index>> sampler)
      : dataset_(std::move(dataset)),
        indices_(index_sampler(dataset_.get(), sampler), index_options(sampler != nullptr)) {}
  using Node<T>::reset;
  void reset(const PassContext& pass, conveyor::detail::ResetWalk& walk) override {
    const uint64_t id = walk.next_id++;
    this->start_metering(pass, id);
    pass_ = pass;
    indices_.begin_pass(pass, walk, id);
  }
  std::optional<T> produce() override {
    Index index{};
    size_t k = 0;  // the index's (or batch's) place in the sampler's pass
    try {
      if (!indices_.advance(index, &k)) return std::nullopt;
    } catch (...) {
      // A draw that failed has no index: its place in the sampler's pass.
      conveyor::detail::throw_node_error(name(), indices_.drawn());
    }
    // get()'s draws (an augmentation) come from the draw's own seed: its
    // place in the sampler's pass, unique across shards.
    const conveyor::detail::WorkerScope scope(nullptr, item_seed(this->pass_, this->id_, k));
    try {
      if constexpr (kBatches) {
        return dataset_->get_batch(std::span<const size_t>(index));
      } else {
        return dataset_->get(index);
      }
    } catch (...) {
      // The failed item's position: the dataset's index, or the batch's
      // number in the sampler's pass.
      if constexpr (kBatches) {
        conveyor::detail::throw_node_error(name(), k);
      } else {
        conveyor::detail::throw_node_error(name(), index);
      }
    }
  }
  std::string name() const override { return kBatches ? "from_map_dataset(batches)" : "from_map_dataset"; }
  // The sampler's state (and the process generator's, when it draws from
  // it) as the pass began, or, between passes, as the next one will.
  void save_extras(State& nodes, bool in_pass) const override { indices_.save_start(nodes, in_pass, this->id_); }
  // The sampler's indices, without get(): a failed get() was an output too.
  uint64_t skip(uint64_t count, bool clean) override { return indices_.skip(count, clean); }

 private:
  // The sampler's pass, or 0 .. d.size() - 1 without one.
  static std::shared_ptr<Sampler<Index>> index_sampler(D* dataset, std::shared_ptr<Sampler<Index>> sampler) {
    if (sampler) return sampler;
    if constexpr (kBatches) {
      throw ValueError("from_map_dataset: the batch sampler is null");
    } else {
      return std::make_shared<SequentialSampler>(DataSize([dataset] { return static_cast<size_t>(dataset->size()); }));
    }
  }
  // The default sequential pass has nothing to save.
  static typename SamplerSource<Index>::Options index_options(bool given_sampler) {
    return {.save_start = given_sampler, .name = "from_map_dataset"};
  }

  std::shared_ptr<D> dataset_;
  SamplerSource<Index> indices_;  // counted in this node's meter, not its own
  PassContext pass_;
};

template <MapStyleDataset D>
Pipeline<sample_t<D>> from_map_dataset(std::shared_ptr<D> dataset,
                                       std::shared_ptr<Sampler<size_t>> sampler = nullptr) {
  return Pipeline<sample_t<D>>(std::make_unique<MapDatasetSource<D>>(std::move(dataset), std::move(sampler)));
}
template <MapStyleDataset D>
Pipeline<sample_t<D>> from_map_dataset(D& dataset, std::shared_ptr<Sampler<size_t>> sampler = nullptr) {
  return from_map_dataset(std::shared_ptr<D>(std::shared_ptr<D>(), &dataset), std::move(sampler));
}
// Through a batch sampler: d.get_batch(b) for each batch b, a
// std::vector of samples an item (a dataset that fetches a batch at once
// overrides get_batch). Shards take whole batches.
template <MapStyleDataset D>
Pipeline<std::vector<sample_t<D>>> from_map_dataset(std::shared_ptr<D> dataset,
                                                    std::shared_ptr<Sampler<BatchIndices>> batch_sampler) {
  return Pipeline<std::vector<sample_t<D>>>(
      std::make_unique<MapDatasetSource<D, BatchIndices>>(std::move(dataset), std::move(batch_sampler)));
}
template <MapStyleDataset D>
Pipeline<std::vector<sample_t<D>>> from_map_dataset(D& dataset, std::shared_ptr<Sampler<BatchIndices>> batch_sampler) {
  return from_map_dataset(std::shared_ptr<D>(std::shared_ptr<D>(), &dataset), std::move(batch_sampler));
}

// An iterable dataset's stream. The shard reaches the dataset as its
// WorkerInfo (id = shard index, num_workers = shard count), so a dataset
// written for PyTorch's workers splits itself the same way here.
template <IterableStyleDataset D>
class IterableSource final : public Source<sample_t<D>> {
 public:
  using T = sample_t<D>;
  explicit IterableSource(std::shared_ptr<D> dataset) : dataset_(std::move(dataset)) {}
  using Node<T>::reset;
  void reset(const PassContext& pass, conveyor::detail::ResetWalk& walk) override {
    stride_ = detail::take_shard(pass, walk);
    this->start_metering(pass, walk.next_id++);
    pass_ = pass;
    info_ = WorkerInfo{};
    info_.id = static_cast<int>(stride_.first);
    info_.num_workers = static_cast<int>(stride_.step);
    info_.num_ranks = stride_.step > 1 ? static_cast<int>(pass.shard.world_size) : 1;
    // A seed a shard, as PyTorch's base seed + worker id.
    info_.seed = item_seed(pass, this->id_, 0) + stride_.first;
    info_.set_dataset(dataset_.get());
    if constexpr (requires(D& d) { d.set_epoch(pass.epoch); }) dataset_->set_epoch(pass.epoch);
    stream_.reset();
    opened_ = false;
    position_ = 0;
  }
  std::optional<T> produce() override {
    try {
      open();
      if (!stream_) return std::nullopt;
      const conveyor::detail::WorkerScope scope(nullptr, item_seed_now());
      std::optional<T> item = stream_->next();
      if (item) ++position_;
      return item;
    } catch (...) {
      conveyor::detail::throw_node_error(name(), position_);
    }
  }
  std::string name() const override { return "from_iterable"; }
  // Through the stream's own skip() (SampleIterator::skip), when none of
  // the samples passed over failed: one item at a time, each under its
  // seed, so that a skip that reads and draws draws what the pass drew.
  uint64_t skip(uint64_t count, bool clean) override {
    if (!clean) return Source<T>::skip(count, clean);
    uint64_t skipped = 0;
    try {  // a failure names this node and the item, as in produce()
      open();
      if (!stream_) return 0;
      for (; skipped < count; ++skipped, ++position_) {
        const conveyor::detail::WorkerScope scope(nullptr, item_seed_now());
        if (stream_->skip(1) == 0) break;
      }
    } catch (...) {
      conveyor::detail::throw_node_error(name(), position_);
    }
    return skipped;
  }

 private:
  // iter() once a pass, its draws (a shuffle's seed) from a seed of their
  // own: not the process generator's, so pipeline.seed() and a resume in a
  // new process give the same stream. An iter() that throws ends the
  // stream (PyTorch's rule).
  void open() {
    if (opened_) return;
    opened_ = true;
    const conveyor::detail::WorkerScope scope(
        nullptr, item_seed(pass_, this->id_, std::numeric_limits<uint64_t>::max() - stride_.first));
    stream_ = dataset_->iter(&info_);
  }
  // The next item's seed: from its place among every shard's items taken
  // in turn, so no two shards' items share one.
  uint64_t item_seed_now() const { return item_seed(pass_, this->id_, position_ * stride_.step + stride_.first); }

  std::shared_ptr<D> dataset_;
  PassContext pass_;
  detail::Stride stride_;
  WorkerInfo info_;
  std::unique_ptr<SampleIterator<T>> stream_;
  bool opened_ = false;
  uint64_t position_ = 0;
};

template <IterableStyleDataset D>
Pipeline<sample_t<D>> from_iterable(std::shared_ptr<D> dataset) {
  return Pipeline<sample_t<D>>(std::make_unique<IterableSource<D>>(std::move(dataset)));
}
template <IterableStyleDataset D>
Pipeline<sample_t<D>> from_iterable(D& dataset) {
  return from_iterable(std::shared_ptr<D>(std::shared_ptr<D>(), &dataset));
}

}  // namespace conveyor::nodes
