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
#include "conveyor/detail/failure.h"
#include "conveyor/detail/loader_plan.h"
#include "conveyor/errors.h"
#include "conveyor/generator.h"
#include "conveyor/options.h"
#include "conveyor/sampler.h"
#include "conveyor/warnings.h"

namespace conveyor {

namespace detail {

// A collate function that declares `static constexpr bool takes_one_sample =
// true` (like DefaultConvert) is only ever called with single samples.
template <class C>
concept OneSampleCollate = requires {
  requires C::takes_one_sample;
};

// What a collate function C makes of samples of type T: from a vector of
// samples when it takes one (auto-batching), else from a single sample. A
// function taking both serves both modes when it returns the same type.
template <class T, class C>
struct batch_of {
  static constexpr bool kTakesBatch =
      !OneSampleCollate<C> && std::invocable<const C&, std::vector<T>&&>;
  static constexpr bool kTakesSampleAtAll = std::invocable<const C&, T&&>;
  static_assert(kTakesBatch || kTakesSampleAtAll,
                "the collate function must take std::vector<Sample>&& (auto-batching) or "
                "Sample&& (batch_size = std::nullopt)");
  using type = std::remove_cvref_t<typename std::conditional_t<
      kTakesBatch, std::invoke_result<const C&, std::vector<T>&&>,
      std::invoke_result<const C&, T&&>>::type>;

  static constexpr bool sample_result_fits() {
    if constexpr (kTakesSampleAtAll) {
      return std::is_same_v<std::remove_cvref_t<std::invoke_result_t<const C&, T&&>>, type>;
    } else {
      return false;
    }
  }
  static constexpr bool kTakesSample = sample_result_fits();
};

// The seam between the loader and what produces its batches: in the
// consumer's thread (num_workers == 0) or on the engine's workers.
template <class Batch>
class BatchSource {
 public:
  virtual ~BatchSource() = default;
  // The next batch, std::nullopt at the end of the epoch. A failed batch
  // throws WorkerError at its position; the following call goes on after it.
  virtual std::optional<Batch> next() = 0;
};

// Everything an epoch needs from its loader, shared so that an epoch (and
// every task it started) keeps what it uses alive.
template <class D, class C>
struct LoaderCore {
  using sample_type = sample_t<D>;
  using batch_type = typename batch_of<sample_type, C>::type;

  std::shared_ptr<D> dataset;
  C collate;
  LoaderPlan plan;
  // len(loader) of an iterable dataset, once asked; for the "more batches
  // than len()" warning. Consumer thread only.
  std::optional<size_t> reported_length;
  uint64_t epoch = 0;  // set_epoch()'s value; consumer thread only

  // Fetch and collate one map-style batch. `stage` names the step running
  // when an exception leaves.
  batch_type make_batch(std::span<const size_t> indices, const char*& stage) const {
    stage = "fetch";
    if constexpr (batch_of<sample_type, C>::kTakesBatch) {
      if (plan.auto_collation) {
        std::vector<sample_type> samples = fetch(indices);
        stage = "collate";
        return collate(std::move(samples));
      }
    }
    if constexpr (batch_of<sample_type, C>::kTakesSample) {
      sample_type sample = dataset->get(indices.front());
      stage = "collate";
      return collate(std::move(sample));
    }
    throw TypeError("unreachable: the collate function does not fit the plan");
  }

  // Collate what an iterable replica produced.
  batch_type collate_samples(std::vector<sample_type>&& samples) const {
    if constexpr (batch_of<sample_type, C>::kTakesBatch) {
      if (plan.auto_collation) return collate(std::move(samples));
    }
    if constexpr (batch_of<sample_type, C>::kTakesSample) {
      return collate(std::move(samples.front()));
    }
    throw TypeError("unreachable: the collate function does not fit the plan");
  }

  std::vector<sample_type> fetch(std::span<const size_t> indices) const {
    if constexpr (requires { dataset->get_batch(indices); }) {
      return dataset->get_batch(indices);
    } else {
      std::vector<sample_type> samples;
      samples.reserve(indices.size());
      for (size_t index : indices) samples.push_back(dataset->get(index));
      return samples;
    }
  }
};

// num_workers == 0, map-style: fetch and collate in the consumer's thread.
template <class D, class C>
class InlineMapSource final : public BatchSource<typename LoaderCore<D, C>::batch_type> {
 public:
  using batch_type = typename LoaderCore<D, C>::batch_type;

  explicit InlineMapSource(std::shared_ptr<const LoaderCore<D, C>> core)
      : core_(std::move(core)), batches_(core_->plan.index_sampler->iter()) {}

  std::optional<batch_type> next() override {
    if (!batches_->next(indices_)) return std::nullopt;
    const uint64_t seq = next_seq_++;
    const char* stage = "fetch";
    try {
      return core_->make_batch(indices_, stage);
    } catch (...) {
      throw_worker_error(std::current_exception(), FailureContext{-1, seq, indices_, stage});
    }
  }

 private:
  std::shared_ptr<const LoaderCore<D, C>> core_;
  std::unique_ptr<SamplerIterator<BatchIndices>> batches_;
  BatchIndices indices_;
  uint64_t next_seq_ = 0;
};

// num_workers == 0, iterable: one replica in the consumer's thread.
template <class D, class C>
class InlineIterableSource final : public BatchSource<typename LoaderCore<D, C>::batch_type> {
 public:
  using batch_type = typename LoaderCore<D, C>::batch_type;
  using sample_type = typename LoaderCore<D, C>::sample_type;

  explicit InlineIterableSource(std::shared_ptr<const LoaderCore<D, C>> core)
      : core_(std::move(core)), replica_(core_->dataset->iter(nullptr)) {}

  std::optional<batch_type> next() override {
    if (exhausted_) return std::nullopt;
    const LoaderPlan& plan = core_->plan;
    const size_t wanted = plan.auto_collation ? plan.batch_size : 1;
    const uint64_t seq = next_seq_++;
    const char* stage = "iterate";
    try {
      std::vector<sample_type> samples;
      samples.reserve(wanted);
      while (samples.size() < wanted) {
        std::optional<sample_type> sample = replica_->next();
        if (!sample) {
          exhausted_ = true;
          break;
        }
        samples.push_back(std::move(*sample));
      }
      if (samples.empty() || (plan.drop_last && samples.size() < wanted)) return std::nullopt;
      stage = "collate";
      return core_->collate_samples(std::move(samples));
    } catch (...) {
      throw_worker_error(std::current_exception(), FailureContext{-1, seq, {}, stage});
    }
  }

 private:
  std::shared_ptr<const LoaderCore<D, C>> core_;
  std::unique_ptr<SampleIterator<sample_type>> replica_;
  bool exhausted_ = false;
  uint64_t next_seq_ = 0;
};

}  // namespace detail

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
    auto core = std::make_shared<Core>();
    core->dataset = std::move(dataset);
    core->collate = std::move(collate_fn);
    core->plan = plan(*core->dataset, options_);
    core_ = std::move(core);
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
      std::optional<batch_type> batch = source_->next();
      if (batch) note_yielded();
      return batch;
    }
    // The base seed this epoch drew (PyTorch's _base_seed).
    int64_t base_seed() const noexcept { return base_seed_; }

   private:
    friend class DataLoader;
    Epoch(std::shared_ptr<Core> core, int64_t base_seed,
          std::unique_ptr<detail::BatchSource<batch_type>> source)
        : core_(std::move(core)), base_seed_(base_seed), source_(std::move(source)) {}

    void note_yielded() {
      ++yielded_;
      const std::optional<size_t>& reported = core_->reported_length;
      if (reported && yielded_ > *reported && !warned_) {
        warned_ = true;
        std::string message = "Length of IterableDataset was reported to be " +
                              std::to_string(*reported) +
                              " (when accessing len(dataloader)), but " +
                              std::to_string(yielded_) + " samples have been fetched. ";
        if (core_->plan.num_workers > 0) {
          message +=
              "For multiprocessing data-loading, this could be caused by not properly "
              "configuring the IterableDataset replica at each worker.";
        }
        warn(message);
      }
    }

    std::shared_ptr<Core> core_;
    int64_t base_seed_;
    std::unique_ptr<detail::BatchSource<batch_type>> source_;
    size_t yielded_ = 0;
    bool warned_ = false;
  };

  // Range-for support: an input iterator over one epoch. If ++ throws, the
  // iterator becomes end(); to go on past failed batches use iter()/next().
  class iterator {
   public:
    using value_type = batch_type;
    using difference_type = std::ptrdiff_t;
    using iterator_concept = std::input_iterator_tag;

    iterator() = default;
    batch_type& operator*() const { return *current_; }
    batch_type* operator->() const { return &*current_; }
    iterator& operator++() {
      current_.reset();
      current_ = epoch_->next();
      return *this;
    }
    void operator++(int) { ++*this; }
    friend bool operator==(const iterator& it, std::default_sentinel_t) noexcept {
      return !it.current_.has_value();
    }

   private:
    friend class DataLoader;
    explicit iterator(Epoch epoch) : epoch_(std::make_unique<Epoch>(std::move(epoch))) { ++*this; }
    std::unique_ptr<Epoch> epoch_;
    mutable std::optional<batch_type> current_;
  };

  Epoch iter() {
    Core& core = *core_;
    // The base seed comes first, before the sampler draws (PyTorch's order).
    Generator& generator = core.plan.generator ? *core.plan.generator : default_generator();
    const int64_t base_seed = draw_seed(generator);
    return Epoch(core_, base_seed, make_source());
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
      throw TypeError(std::string("object of type '") + typeid(D).name() + "' has no len()");
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
  // work-stealing seeds which epoch the next pass is.
  void set_epoch(uint64_t epoch) {
    core_->epoch = epoch;
    if (core_->plan.index_sampler) core_->plan.index_sampler->set_epoch(epoch);
  }

  const LoaderOptions& options() const noexcept { return options_; }
  D& dataset() const noexcept { return *core_->dataset; }

 private:
  static detail::LoaderPlan plan(const D& dataset, const LoaderOptions& options) {
    detail::LoaderPlan plan;
    if constexpr (MapStyleDataset<D>) {
      plan = detail::plan_loader(options, detail::DatasetKind::map, dataset.size());
    } else {
      plan = detail::plan_loader(options, detail::DatasetKind::iterable, 0);
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

  std::unique_ptr<detail::BatchSource<batch_type>> make_source() {
    if (core_->plan.num_workers > 0) {
      throw ValueError("num_workers > 0 needs the threaded engine, which this build lacks yet");
    }
    if constexpr (MapStyleDataset<D>) {
      return std::make_unique<detail::InlineMapSource<D, C>>(core_);
    } else {
      return std::make_unique<detail::InlineIterableSource<D, C>>(core_);
    }
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
