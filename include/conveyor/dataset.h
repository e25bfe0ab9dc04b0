// conveyor/dataset.h: the two kinds of dataset a loader reads.
//
// Map-style: size() and get(i), like a Python Dataset with __len__ and
// __getitem__; get_batch(indices) may fetch a whole batch at once (PyTorch's
// __getitems__). Iterable-style: iter(worker) hands each worker its own
// stream of samples, like an IterableDataset's __iter__.
//
// The loader accepts the base classes below or any type with the same
// members (see the MapStyleDataset / IterableStyleDataset concepts): derive
// for convenience, or keep your type final and free of virtual calls.
#pragma once

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <type_traits>
#include <utility>
#include <vector>

#include "conveyor/worker_info.h"

namespace conveyor {

// A map-style dataset. get() and get_batch() are called from many worker
// threads at once and must be thread-safe.
template <class T>
class Dataset {
 public:
  using sample_type = T;
  virtual ~Dataset() = default;

  virtual size_t size() const = 0;
  virtual T get(size_t index) = 0;

  // Fetches a batch. Override when one call can do better than a loop of
  // get() (one read for many records, a vectorised decode).
  virtual std::vector<T> get_batch(std::span<const size_t> indices) {
    std::vector<T> samples;
    samples.reserve(indices.size());
    for (size_t index : indices) samples.push_back(get(index));
    return samples;
  }
};

// One replica's stream of samples. next() returns std::nullopt at the end.
// A replica is only ever advanced by one thread at a time.
template <class T>
class SampleIterator {
 public:
  virtual ~SampleIterator() = default;
  virtual std::optional<T> next() = 0;
  // Passes over up to `count` samples and returns how many there were. A
  // loader resuming from a state calls it to get back to where its consumer
  // was; override it where a sample can be passed over without being made
  // (a record's header read, its payload not decoded).
  virtual uint64_t skip(uint64_t count) {
    uint64_t skipped = 0;
    while (skipped < count && next()) ++skipped;
    return skipped;
  }
};

// An iterable-style dataset. iter() is called once per worker per epoch with
// that worker's WorkerInfo, or with nullptr when the loader has no workers;
// split the data by worker->id there, as a PyTorch IterableDataset does with
// get_worker_info().
template <class T>
class IterableDataset {
 public:
  using sample_type = T;
  virtual ~IterableDataset() = default;

  virtual std::unique_ptr<SampleIterator<T>> iter(const WorkerInfo* worker) = 0;

  // The number of samples, if known (Python's optional __len__).
  virtual std::optional<size_t> size() const { return std::nullopt; }

  // Called by DataLoader::set_epoch before the epoch's replicas are made:
  // per-epoch shuffles (of shards, say) key on it.
  virtual void set_epoch(uint64_t /*epoch*/) {}
};

// A SampleIterator over a callable returning std::optional<T>.
template <class T, class Next>
class FunctionSampleIterator final : public SampleIterator<T> {
 public:
  explicit FunctionSampleIterator(Next next) : next_(std::move(next)) {}
  std::optional<T> next() override { return next_(); }

 private:
  Next next_;
};

template <class T, class Next>
std::unique_ptr<SampleIterator<T>> make_sample_iterator(Next next) {
  return std::make_unique<FunctionSampleIterator<T, Next>>(std::move(next));
}

// ---- what the loader accepts ------------------------------------------------

template <class D>
concept MapStyleDataset = requires(D& dataset, const D& const_dataset, size_t index) {
  { const_dataset.size() } -> std::convertible_to<size_t>;
  dataset.get(index);
};

template <class D>
concept IterableStyleDataset = requires(D& dataset, const WorkerInfo* worker) {
  { *dataset.iter(worker) };
  { dataset.iter(worker)->next() };
} && !MapStyleDataset<D>;

namespace detail {
template <class D>
struct sample_of;
template <MapStyleDataset D>
struct sample_of<D> {
  using type = std::remove_cvref_t<decltype(std::declval<D&>().get(size_t{}))>;
};
template <IterableStyleDataset D>
struct sample_of<D> {
  using type = typename std::remove_cvref_t<decltype(
      std::declval<D&>().iter(nullptr)->next())>::value_type;
};
}  // namespace detail

template <class D>
using sample_t = typename detail::sample_of<D>::type;

}  // namespace conveyor
