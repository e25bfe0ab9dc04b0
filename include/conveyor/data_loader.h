// conveyor/data_loader.h: DataLoader, torch.utils.data.DataLoader for C++.
//
//   conveyor::DataLoader loader(dataset, {.batch_size = 64, .shuffle = true,
//                                         .num_workers = 8, .seed = 42});
//   for (int epoch = 0; epoch < 10; ++epoch) {
//     loader.set_epoch(epoch);
//     for (auto& batch : loader) train_step(batch);
//   }
//
// Each pass (range-for, or iter()) is one epoch: it draws the epoch's base
// seed from the loader's generator first, then the sampler's order, as
// PyTorch does. Batches come out in sampler order. An exception thrown by the
// dataset or the collate function reaches the consumer as a WorkerError at
// that batch's position; Epoch::next() can go on past it.
//
// Thread-safety: a DataLoader and its epochs are used from one consumer
// thread; the dataset and collate function are called from the loader's
// workers concurrently.
#pragma once

#include <atomic>
#include <chrono>
#include <concepts>
#include <cstddef>
#include <iterator>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <type_traits>
#include <typeinfo>
#include <utility>
#include <vector>

#include "conveyor/collate.h"
#include "conveyor/dataset.h"
#include "conveyor/detail/loader_core.h"
#include "conveyor/detail/loader_plan.h"
#include "conveyor/detail/loader_batches.h"
#include "conveyor/detail/transfer_stage.h"
#include "conveyor/detail/type_name.h"
#include "conveyor/errors.h"
#include "conveyor/generator.h"
#include "conveyor/metrics.h"
#include "conveyor/node.h"
#include "conveyor/options.h"
#include "conveyor/sampler.h"
#include "conveyor/warnings.h"

namespace conveyor {

template <class D, class C = DefaultCollate>
  requires MapStyleDataset<D> || IterableStyleDataset<D>
class DataLoader {
  using Core = detail::LoaderCore<D, C>;

 public:
  using dataset_type = D;
  using sample_type = sample_t<D>;
  using batch_type = typename Core::batch_type;

  // Shares ownership of the dataset.
  explicit DataLoader(std::shared_ptr<D> dataset, LoaderOptions options = {}, C collate_fn = {})
      : options_(std::move(options)) {
    if (!dataset) throw ValueError("DataLoader: dataset must not be null");
    detail::LoaderPlan resolved = plan(*dataset, options_);
    core_ = std::make_shared<Core>(std::move(dataset), std::move(collate_fn), std::move(resolved));
  }

  // Borrows the dataset: it must outlive the loader and every epoch.
  explicit DataLoader(D& dataset, LoaderOptions options = {}, C collate_fn = {})
      : DataLoader(std::shared_ptr<D>(std::shared_ptr<D>(), &dataset), std::move(options),
                   std::move(collate_fn)) {}

  // One pass over the data, Python's iter(loader).
  class Epoch {
   public:
    // The next batch, or std::nullopt at the end. Throws WorkerError for a
    // batch that failed; calling again goes on with the next batch.
    std::optional<batch_type> next() {
      const auto asked = std::chrono::steady_clock::now();
      struct CountWait {  // counts the wait whether next() returns or throws
        const std::chrono::steady_clock::time_point& asked;
        int64_t& total;
        ~CountWait() { total += detail::nanoseconds_since(asked); }
      } count_wait{asked, wait_ns_};
      std::optional<batch_type> batch = source_->next();
      if (batch) note_yielded();
      return batch;
    }

    // Where this epoch's time went so far (see conveyor/metrics.h).
    LoaderMetrics metrics() const {
      LoaderMetrics metrics;
      source_->add_metrics(metrics);
      metrics.batches = yielded_;
      metrics.wait_seconds = static_cast<double>(wait_ns_) * 1e-9;
      metrics.wall_seconds = static_cast<double>(detail::nanoseconds_since(started_)) * 1e-9;
      return metrics;
    }

    // The epoch as a node graph, one row per node, sources first:
    // fetch+collate, then to_device with prefetch_to_device. Print it with
    // conveyor::metrics_table().
    std::vector<NodeMetrics> node_metrics() const {
      std::vector<NodeMetrics> out;
      source_->collect_metrics(out);
      return out;
    }
    // The base seed this epoch drew (PyTorch's _base_seed).
    int64_t base_seed() const noexcept { return base_seed_; }

    Epoch(Epoch&&) noexcept = default;
    Epoch& operator=(Epoch&& other) noexcept {
      if (this != &other) {
        keep_metrics();
        core_ = std::move(other.core_);
        base_seed_ = other.base_seed_;
        source_ = std::move(other.source_);
        transfer_ = std::exchange(other.transfer_, nullptr);
        started_ = other.started_;
        wait_ns_ = other.wait_ns_;
        yielded_ = other.yielded_;
      }
      return *this;
    }
    // Stops the epoch's workers (see WorkerLanes) and leaves its metrics
    // with the loader: DataLoader::last_metrics().
    ~Epoch() { keep_metrics(); }

    // With prefetch_to_device: the device copy of the batch next() returned
    // last (its buffers in transfer_traits order and its ready event). Empty
    // otherwise.
    const DeviceBatch& device() const noexcept {
      static const DeviceBatch kNone;
      return transfer_ ? transfer_->current() : kNone;
    }

   private:
    friend class DataLoader;
    // Builds the epoch's graph on `source` (fetch+collate) and starts its
    // pass, whose seed is the epoch's base seed.
    Epoch(std::shared_ptr<Core> core, int64_t base_seed, uint64_t epoch,
          std::unique_ptr<detail::LoaderNode<batch_type>> source)
        : core_(std::move(core)), base_seed_(base_seed), source_(std::move(source)) {
      if (core_->plan.prefetch_to_device > 0) {
        auto stage = std::make_unique<detail::TransferStage<batch_type>>(
            std::move(source_), core_->plan.transfer_device, core_->plan.prefetch_to_device);
        transfer_ = stage.get();
        source_ = std::move(stage);
      }
      PassContext pass;
      pass.epoch = epoch;
      pass.seed = static_cast<uint64_t>(base_seed);
      source_->reset(pass);
    }

    void keep_metrics() noexcept {
      if (!source_ || !core_) return;  // moved from
      try {
        core_->last_metrics = metrics();
      } catch (...) {
        // Metrics are a report: losing one never stops a loader.
      }
    }

    // PyTorch's warning for an IterableDataset that yields more than its
    // len() said, at every item past it. It counts what the loader hands out:
    // batches, or samples when batch_size is None.
    void note_yielded() {
      ++yielded_;
      const std::optional<size_t>& reported = core_->reported_length;
      if (!reported || yielded_ <= *reported) return;
      std::string message = "Length of IterableDataset " + detail::type_name(typeid(D)) +
                            " was reported to be " + std::to_string(*reported) +
                            " (when accessing len(dataloader)), but " + std::to_string(yielded_) +
                            (core_->plan.auto_collation ? " batches" : " samples") +
                            " have been fetched. ";
      if (core_->plan.num_workers > 0) {
        message +=
            "For multiprocessing data-loading, this could be caused by not properly "
            "configuring the IterableDataset replica at each worker.";
      }
      warn(message);
    }

    std::shared_ptr<Core> core_;
    int64_t base_seed_;
    std::unique_ptr<detail::LoaderNode<batch_type>> source_;  // the graph's last node
    detail::TransferStage<batch_type>* transfer_ = nullptr;    // within source_, if any
    std::chrono::steady_clock::time_point started_ = std::chrono::steady_clock::now();
    int64_t wait_ns_ = 0;
    size_t yielded_ = 0;
  };

  // Range-for support: an input iterator over one epoch. If ++ throws, the
  // iterator becomes end(); to go on past failed batches use iter()/next().
  // The batch lives in one place for the whole epoch (no allocation per
  // batch).
  class iterator {
   public:
    using value_type = batch_type;
    using difference_type = std::ptrdiff_t;
    using iterator_concept = std::input_iterator_tag;

    iterator() = default;
    batch_type& operator*() const { return **current_; }
    batch_type* operator->() const { return &**current_; }
    iterator& operator++() {
      // The batch handed out before goes first: the consumer holds one batch
      // at a time, as the window's bound counts. Its home stays.
      if (current_) current_->reset();
      std::optional<batch_type> next = epoch_->next();
      if (!next) return *this;
      if (!current_) current_ = std::make_unique<std::optional<batch_type>>();
      current_->emplace(std::move(*next));
      return *this;
    }
    void operator++(int) { ++*this; }
    friend bool operator==(const iterator& it, std::default_sentinel_t) noexcept {
      return !it.current_ || !it.current_->has_value();
    }

    // The epoch behind the loop: its metrics so far, its base seed.
    const Epoch& epoch() const noexcept { return *epoch_; }

   private:
    friend class DataLoader;
    explicit iterator(Epoch epoch) : epoch_(std::make_unique<Epoch>(std::move(epoch))) { ++*this; }
    std::unique_ptr<Epoch> epoch_;
    // On the heap, not a std::optional member: GCC 12 reports optional<Batch>
    // members of inlined iterators as maybe-uninitialized in users' -Werror
    // builds. Allocated once per epoch.
    std::unique_ptr<std::optional<batch_type>> current_;
  };

  // Starts an epoch. With persistent_workers only one epoch may be live at a
  // time (RuntimeError otherwise); without, each epoch has its own workers.
  Epoch iter() {
    Core& core = *core_;
    // The base seed comes first, before the sampler draws (PyTorch's order);
    // persistent workers draw it once, at their first epoch.
    int64_t base_seed = 0;
    if (core.persistent_base_seed) {
      base_seed = *core.persistent_base_seed;
    } else {
      Generator& generator = core.plan.generator ? *core.plan.generator : default_generator();
      base_seed = draw_seed(generator);
      if (core.plan.persistent_workers) core.persistent_base_seed = base_seed;
    }
    const uint64_t epoch = core.epoch++;
    return Epoch(core_, base_seed, epoch, make_source());
  }
  iterator begin() { return iterator(iter()); }
  std::default_sentinel_t end() const noexcept { return {}; }

  // len(loader): batches per epoch. For an iterable dataset that reports no
  // size, throws TypeError.
  size_t size() const {
    const detail::LoaderPlan& plan = core_->plan;
    if (plan.kind == detail::DatasetKind::map) return plan.index_sampler->size();
    std::optional<size_t> samples;
    if constexpr (IterableStyleDataset<D>) samples = core_->dataset->size();
    if (!samples) {
      throw TypeError("object of type '" + detail::type_name(typeid(D)) + "' has no len()");
    }
    size_t length = *samples;
    if (plan.auto_collation) {
      length = plan.drop_last ? length / plan.batch_size
                              : (length + plan.batch_size - 1) / plan.batch_size;
    }
    core_->reported_length = length;
    return length;
  }

  // Tells the sampler (DistributedSampler reshuffles by it) and the
  // work-stealing seeds which epoch the next pass is. Without it, passes
  // count 0, 1, 2...
  void set_epoch(uint64_t epoch) {
    core_->epoch = epoch;
    if (core_->plan.index_sampler) core_->plan.index_sampler->set_epoch(epoch);
    if constexpr (requires(D& d) { d.set_epoch(epoch); }) core_->dataset->set_epoch(epoch);
  }

  // What the last epoch spent where, once it has ended or been dropped (a
  // range-for's epoch ends with its loop); nullopt before any has.
  const std::optional<LoaderMetrics>& last_metrics() const noexcept { return core_->last_metrics; }

  const LoaderOptions& options() const noexcept { return options_; }
  D& dataset() const noexcept { return *core_->dataset; }

 private:
  static detail::LoaderPlan plan(const D& dataset, const LoaderOptions& options) {
    detail::LoaderPlan plan;
    if constexpr (MapStyleDataset<D>) {
      // Read at every pass, as PyTorch reads len(dataset) at each epoch. The
      // loader's core keeps the dataset alive as long as the samplers.
      plan = detail::plan_loader(options, detail::DatasetKind::map,
                                 [&dataset] { return static_cast<size_t>(dataset.size()); });
    } else {
      plan = detail::plan_loader(options, detail::DatasetKind::iterable, [] { return size_t{0}; });
    }
    using Fit = detail::batch_of<sample_type, C>;
    if (plan.auto_collation && !Fit::kTakesBatch) {
      throw TypeError(
          "this collate function takes one sample, but the loader batches samples "
          "(batch_size or batch_sampler is set); set batch_size = std::nullopt or pass a "
          "collate function that takes std::vector<Sample>&&");
    }
    if (!plan.auto_collation && !Fit::kTakesSample) {
      throw TypeError(
          "batch_size=None disables auto-batching, so the collate function receives one sample "
          "at a time, but this one takes std::vector<Sample>&&; use conveyor::DefaultConvert "
          "or a function of one sample");
    }
    return plan;
  }

  // The epoch's fetch+collate node: on the workers, or in this thread.
  std::unique_ptr<detail::LoaderNode<batch_type>> make_source() {
    Core& core = *core_;
    if (core.plan.num_workers > 0) {
      using Pool = detail::WorkerPool<D, C>;
      std::shared_ptr<Pool> pool;
      if (core.plan.persistent_workers) {
        if (!core.persistent_pool) core.persistent_pool = std::make_shared<Pool>(core);
        pool = core.persistent_pool;
      } else {
        pool = std::make_shared<Pool>(core);
      }
      using Lanes = detail::WorkerLanes<D, C>;
      return std::make_unique<detail::LoaderBatches<D, C, Lanes>>(
          core_, std::make_unique<Lanes>(core_, std::move(pool)));
    }
    using Lanes = detail::InlineLanes<D, C>;
    return std::make_unique<detail::LoaderBatches<D, C, Lanes>>(core_, std::make_unique<Lanes>(core_));
  }

  LoaderOptions options_;
  std::shared_ptr<Core> core_;
};

template <class D>
DataLoader(std::shared_ptr<D>) -> DataLoader<D>;
template <class D>
DataLoader(std::shared_ptr<D>, LoaderOptions) -> DataLoader<D>;
template <class D, class C>
DataLoader(std::shared_ptr<D>, LoaderOptions, C) -> DataLoader<D, C>;
template <class D>
DataLoader(D&) -> DataLoader<D>;
template <class D>
DataLoader(D&, LoaderOptions) -> DataLoader<D>;
template <class D, class C>
DataLoader(D&, LoaderOptions, C) -> DataLoader<D, C>;

}  // namespace conveyor
