// conveyor/datasets.h: datasets built from other datasets, as in
// torch.utils.data: Subset, ConcatDataset, ChainDataset, StackDataset,
// random_split; and VectorDataset, samples held in memory.
#pragma once

#include <algorithm>
#include <array>
#include <atomic>
#include <functional>
#include <type_traits>
#include <cstddef>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "conveyor/data_error.h"
#include "conveyor/dataset.h"
#include "conveyor/errors.h"
#include "conveyor/generator.h"

namespace conveyor {

// Samples held in a vector. get() copies the sample out.
template <class T>
class VectorDataset final : public Dataset<T> {
 public:
  explicit VectorDataset(std::vector<T> samples) : samples_(std::move(samples)) {}
  size_t size() const override { return samples_.size(); }
  T get(size_t index) override {
    if (index >= samples_.size()) {
      throw IndexError("index " + std::to_string(index) + " is out of range for a dataset of size " +
                       std::to_string(samples_.size()));
    }
    return samples_[index];
  }

 private:
  std::vector<T> samples_;
};

// The samples of `dataset` at `indices`, in that order.
template <class T>
class Subset final : public Dataset<T> {
 public:
  Subset(std::shared_ptr<Dataset<T>> dataset, std::vector<size_t> indices)
      : dataset_(std::move(dataset)), indices_(std::move(indices)) {}

  size_t size() const override { return indices_.size(); }
  T get(size_t index) override { return dataset_->get(map(index)); }
  std::vector<T> get_batch(std::span<const size_t> indices) override {
    std::vector<size_t> mapped(indices.size());
    for (size_t i = 0; i < indices.size(); ++i) mapped[i] = map(indices[i]);
    return dataset_->get_batch(mapped);
  }

  const std::vector<size_t>& indices() const noexcept { return indices_; }
  const std::shared_ptr<Dataset<T>>& dataset() const noexcept { return dataset_; }

 private:
  size_t map(size_t index) const {
    if (index >= indices_.size()) {
      throw IndexError("Subset index " + std::to_string(index) + " is out of range (size " +
                       std::to_string(indices_.size()) + ")");
    }
    return indices_[index];
  }

  std::shared_ptr<Dataset<T>> dataset_;
  std::vector<size_t> indices_;
};

// Several datasets end to end.
template <class T>
class ConcatDataset final : public Dataset<T> {
 public:
  explicit ConcatDataset(std::vector<std::shared_ptr<Dataset<T>>> datasets)
      : datasets_(std::move(datasets)) {
    if (datasets_.empty()) throw ValueError("datasets should not be an empty iterable");
    size_t total = 0;
    for (const auto& dataset : datasets_) {
      total += dataset->size();
      cumulative_sizes_.push_back(total);
    }
  }

  size_t size() const override { return cumulative_sizes_.back(); }
  T get(size_t index) override {
    const auto [which, local] = locate(index);
    return datasets_[which]->get(local);
  }

  const std::vector<size_t>& cumulative_sizes() const noexcept { return cumulative_sizes_; }

 private:
  std::pair<size_t, size_t> locate(size_t index) const {
    if (index >= size()) {
      throw IndexError("index " + std::to_string(index) +
                       " is out of range for a ConcatDataset of size " + std::to_string(size()));
    }
    // bisect_right: the first dataset whose cumulative size exceeds index.
    const auto it = std::upper_bound(cumulative_sizes_.begin(), cumulative_sizes_.end(), index);
    const auto which = static_cast<size_t>(it - cumulative_sizes_.begin());
    return {which, which == 0 ? index : index - cumulative_sizes_[which - 1]};
  }

  std::vector<std::shared_ptr<Dataset<T>>> datasets_;
  std::vector<size_t> cumulative_sizes_;
};

// Several iterable datasets one after the other. Each worker chains its own
// replicas of each.
template <class T>
class ChainDataset final : public IterableDataset<T> {
 public:
  explicit ChainDataset(std::vector<std::shared_ptr<IterableDataset<T>>> datasets)
      : datasets_(std::move(datasets)) {}

  std::unique_ptr<SampleIterator<T>> iter(const WorkerInfo* worker) override {
    return make_sample_iterator<T>(
        [datasets = datasets_, worker, which = size_t{0},
         current = std::unique_ptr<SampleIterator<T>>()]() mutable -> std::optional<T> {
          while (which < datasets.size()) {
            if (!current) {
              current = datasets[which]->iter(worker);
              if (!current) {  // reported once; the chain goes on with the next part
                ++which;
                throw TypeError("ChainDataset: part " + std::to_string(which - 1) +
                                "'s iter() returned no iterator (nullptr)");
              }
            }
            if (std::optional<T> sample = current->next()) return sample;
            current.reset();
            ++which;
          }
          return std::nullopt;
        });
  }

  // The sum of the parts' sizes, when every part knows its size.
  std::optional<size_t> size() const override {
    size_t total = 0;
    for (const auto& dataset : datasets_) {
      const std::optional<size_t> part = dataset->size();
      if (!part) return std::nullopt;
      total += *part;
    }
    return total;
  }

  // Each part hears of the epoch (a part that shuffles by epoch, such as
  // TarShardDataset's shuffle_shards, would otherwise keep epoch 0's order).
  void set_epoch(uint64_t epoch) override {
    for (const auto& dataset : datasets_) dataset->set_epoch(epoch);
  }

 private:
  std::vector<std::shared_ptr<IterableDataset<T>>> datasets_;
};

// Sample i of each dataset, as a tuple (datasets of equal sizes).
template <class... Ts>
class StackDataset final : public Dataset<std::tuple<Ts...>> {
 public:
  explicit StackDataset(std::shared_ptr<Dataset<Ts>>... datasets)
      : datasets_(std::move(datasets)...) {
    const auto sizes =
        std::apply([](const auto&... d) { return std::array{d->size()...}; }, datasets_);
    size_ = sizes[0];
    for (size_t s : sizes) {
      if (s != size_) throw ValueError("Size mismatch between datasets");
    }
  }

  size_t size() const override { return size_; }
  std::tuple<Ts...> get(size_t index) override {
    return std::apply([index](auto&... dataset) { return std::tuple<Ts...>(dataset->get(index)...); },
                      datasets_);
  }

 private:
  std::tuple<std::shared_ptr<Dataset<Ts>>...> datasets_;
  size_t size_ = 0;
};

// A map-style dataset whose samples pass through `fn` (a decode, a
// transform): sample i is fn(dataset.get(i)). `fn` runs on many workers at
// once; random draws in it should use default_generator(), the worker's.
template <class D, class F>
class MappedDataset final
    : public Dataset<std::remove_cvref_t<std::invoke_result_t<const F&, sample_t<D>&&>>> {
 public:
  using sample_type = std::remove_cvref_t<std::invoke_result_t<const F&, sample_t<D>&&>>;
  MappedDataset(std::shared_ptr<D> dataset, F fn) : dataset_(std::move(dataset)), fn_(std::move(fn)) {}
  size_t size() const override { return dataset_->size(); }
  sample_type get(size_t index) override { return fn_(dataset_->get(index)); }
  D& inner() const noexcept { return *dataset_; }

 private:
  std::shared_ptr<D> dataset_;
  F fn_;
};

// An iterable dataset whose samples pass through `fn`. With OnError::skip, a
// sample whose `fn` throws DataError is dropped and counted in skipped();
// any other exception propagates.
template <class D, class F>
class MappedIterable final
    : public IterableDataset<std::remove_cvref_t<std::invoke_result_t<const F&, sample_t<D>&&>>> {
 public:
  using sample_type = std::remove_cvref_t<std::invoke_result_t<const F&, sample_t<D>&&>>;
  MappedIterable(std::shared_ptr<D> dataset, F fn, OnError on_error)
      : dataset_(std::move(dataset)), fn_(std::move(fn)), on_error_(on_error) {}

  std::unique_ptr<SampleIterator<sample_type>> iter(const WorkerInfo* worker) override {
    return make_sample_iterator<sample_type>(
        [this, inner = dataset_->iter(worker)]() mutable -> std::optional<sample_type> {
          while (auto sample = inner->next()) {
            if (on_error_ == OnError::raise) return fn_(std::move(*sample));
            try {
              return fn_(std::move(*sample));
            } catch (const DataError&) {
              // Relaxed: a statistic, read after the epoch.
              skipped_.fetch_add(1, std::memory_order_relaxed);
            }
          }
          return std::nullopt;
        });
  }
  std::optional<size_t> size() const override { return dataset_->size(); }
  void set_epoch(uint64_t epoch) override { dataset_->set_epoch(epoch); }

  // Samples dropped under OnError::skip, all epochs together.
  uint64_t skipped() const noexcept { return skipped_.load(std::memory_order_relaxed); }
  D& inner() const noexcept { return *dataset_; }

 private:
  std::shared_ptr<D> dataset_;
  F fn_;
  OnError on_error_;
  std::atomic<uint64_t> skipped_{0};
};

// map(dataset, fn): MappedDataset or MappedIterable, by the dataset's kind.
template <MapStyleDataset D, class F>
std::shared_ptr<MappedDataset<D, F>> map(std::shared_ptr<D> dataset, F fn) {
  return std::make_shared<MappedDataset<D, F>>(std::move(dataset), std::move(fn));
}
template <IterableStyleDataset D, class F>
std::shared_ptr<MappedIterable<D, F>> map(std::shared_ptr<D> dataset, F fn,
                                          OnError on_error = OnError::raise) {
  return std::make_shared<MappedIterable<D, F>>(std::move(dataset), std::move(fn), on_error);
}

namespace detail {
// random_split's lengths: fractions (summing to 1) become counts, remainder
// spread round-robin from index 0; counts must sum to `dataset_size`.
std::vector<size_t> resolve_split_lengths(size_t dataset_size, std::span<const double> lengths);
}  // namespace detail

// torch.utils.data.random_split: non-overlapping Subsets of the given
// lengths (counts, or fractions summing to 1), drawn from one randperm.
template <class T>
std::vector<std::shared_ptr<Subset<T>>> random_split(std::shared_ptr<Dataset<T>> dataset,
                                                     std::span<const double> lengths,
                                                     Generator& generator = default_generator()) {
  const std::vector<size_t> counts = detail::resolve_split_lengths(dataset->size(), lengths);
  const std::vector<size_t> order = randperm(dataset->size(), generator);
  std::vector<std::shared_ptr<Subset<T>>> parts;
  size_t offset = 0;
  for (size_t count : counts) {
    parts.push_back(std::make_shared<Subset<T>>(
        dataset, std::vector<size_t>(order.begin() + static_cast<std::ptrdiff_t>(offset),
                                     order.begin() + static_cast<std::ptrdiff_t>(offset + count))));
    offset += count;
  }
  return parts;
}

template <class T>
std::vector<std::shared_ptr<Subset<T>>> random_split(std::shared_ptr<Dataset<T>> dataset,
                                                     std::initializer_list<double> lengths,
                                                     Generator& generator = default_generator()) {
  return random_split(std::move(dataset), std::span<const double>(lengths.begin(), lengths.size()),
                      generator);
}

template <class T>
std::vector<std::shared_ptr<Subset<T>>> random_split(std::shared_ptr<Dataset<T>> dataset,
                                                     const std::vector<size_t>& lengths,
                                                     Generator& generator = default_generator()) {
  const std::vector<double> as_double(lengths.begin(), lengths.end());
  return random_split(std::move(dataset), std::span<const double>(as_double), generator);
}

}  // namespace conveyor
