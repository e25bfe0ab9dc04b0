// conveyor/detail/loader_core.h: what a DataLoader's epochs share (dataset,
// collate function, resolved plan) and how a batch is made from samples.
#pragma once

#include <algorithm>
#include <chrono>
#include <concepts>
#include <cstddef>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "conveyor/collate.h"
#include "conveyor/dataset.h"
#include "conveyor/buffer.h"
#include "conveyor/detail/buffer_pool.h"
#include "conveyor/detail/failure.h"
#include "conveyor/detail/seeds.h"
#include "conveyor/detail/worker_scope.h"
#include "conveyor/detail/loader_plan.h"
#include "conveyor/detail/loader_state.h"
#include "conveyor/errors.h"
#include "conveyor/metrics.h"
#include "conveyor/node.h"
#include "conveyor/sampler.h"

namespace conveyor::detail {


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

// Where a batch's time went (nanoseconds).
struct StageTimes {
  int64_t fetch_ns = 0;
  int64_t collate_ns = 0;
};

inline int64_t nanoseconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - start)
      .count();
}

// A node of a DataLoader's epoch graph (fetch+collate, then to_device): a
// Node whose share of the loader's metrics adds up to LoaderMetrics. Its
// next() throws a failed batch's WorkerError at its position (the following
// call goes on after it) and waits at most the loader's timeout in all
// (TimeoutError); try_next() never waits for a worker.
template <class Batch>
class LoaderNode : public Node<Batch> {
 public:
  // Adds this node's share, and its upstream's, to `metrics`.
  virtual void add_metrics(LoaderMetrics& /*metrics*/) const {}
};

// How many samples to reserve room for when up to `wanted` may come: a
// huge batch_size must not allocate before the samples exist.
inline size_t reserve_for_batch(size_t wanted) { return std::min<size_t>(wanted, 1024); }

// Everything an epoch needs from its loader, shared so that an epoch (and
// every task it started) keeps what it uses alive.
template <class D, class C>
class WorkerPool;

template <class D, class C>
struct LoaderCore {
  using sample_type = sample_t<D>;
  using batch_type = typename batch_of<sample_type, C>::type;

  LoaderCore(std::shared_ptr<D> dataset_in, C collate_in, LoaderPlan plan_in)
      : dataset(std::move(dataset_in)),
        collate(std::move(collate_in)),
        plan(std::move(plan_in)),
        // A borrowed dataset comes in a shared_ptr that owns nothing.
        owns_dataset(dataset.use_count() > 0),
        // The pinned pool with pin_memory; otherwise enough idle buffers per
        // size class for a window of batches and the consumer's, kept for
        // the loader's life: a steady loader, with or without workers,
        // writes its batches into warm memory and never touches the heap.
        batch_memory(plan.batch_allocator ? plan.batch_allocator
                                          : make_recycling_allocator(plan.window + 2)),
        sample_memory(make_sample_heap()) {}

  std::shared_ptr<D> dataset;
  C collate;
  LoaderPlan plan;
  // The loader shares ownership of the dataset (else the user lends it):
  // then an epoch abandoned behind a stuck sample need not wait for it.
  bool owns_dataset;
  // Where collate writes batches (see make_batch).
  std::shared_ptr<BufferAllocator> batch_memory;
  // Where Arrays a batch's task makes outside collate come from (samples,
  // transforms' outputs): large ones from oneTBB's scalable heap, which
  // keeps freed blocks for the next batch. glibc gives them back to the
  // kernel as the batch frees them, and the next batch page-faults them in
  // again: 192 KiB samples ran 3-5x slower that way (make_sample_heap).
  std::shared_ptr<BufferAllocator> sample_memory;
  // len(loader) of an iterable dataset, once asked; for the "more batches
  // than len()" warning. Consumer thread only.
  std::optional<size_t> reported_length;
  // The epoch the next pass runs as: set_epoch()'s value, else one more than
  // the last. Consumer thread only.
  uint64_t epoch = 0;
  // What the last epoch that ended (or was dropped) spent where. Consumer
  // thread only.
  std::optional<LoaderMetrics> last_metrics;
  // persistent_workers: the base seed drawn by the first pass, and the pool
  // every pass reuses. Consumer thread only. Declared last: the pool's
  // workers stop before anything else here goes.
  std::optional<int64_t> persistent_base_seed;
  // Checkpoints, consumer thread only: what the epoch started last has
  // handed its consumer (DataLoader::state_dict), and what load_state_dict
  // left for the next iter() to resume (pending_resume), then for that
  // epoch's fetch+collate to pass over (resume).
  std::shared_ptr<EpochProgress> progress;
  std::optional<LoaderResume> pending_resume;
  // The state pending_resume was read from: state_dict() until it is used.
  std::optional<State> pending_resume_state;
  std::optional<LoaderResume> resume;
  std::shared_ptr<WorkerPool<D, C>> persistent_pool;

  // Fetch and collate one map-style batch. `stage` names the step running
  // when an exception leaves; `times` gets the time of each. Collate (only
  // collate: not what the dataset allocates) writes into `batch_memory`;
  // the caller installs `sample_memory` for the rest.
  batch_type make_batch(std::span<const size_t> indices, const char*& stage, StageTimes& times) const {
    const auto start = std::chrono::steady_clock::now();
    stage = "fetch";
    if constexpr (batch_of<sample_type, C>::kTakesBatch) {
      if (plan.auto_collation) {
        std::vector<sample_type> samples = fetch(indices);
        const auto fetched = std::chrono::steady_clock::now();
        times.fetch_ns += nanoseconds_since(start);
        stage = "collate";
        AllocatorScope collate_memory(batch_memory.get());
        batch_type batch = collate(std::move(samples));
        times.collate_ns += nanoseconds_since(fetched);
        return batch;
      }
    }
    if constexpr (batch_of<sample_type, C>::kTakesSample) {
      sample_type sample = dataset->get(indices.front());
      const auto fetched = std::chrono::steady_clock::now();
      times.fetch_ns += nanoseconds_since(start);
      stage = "collate";
      AllocatorScope collate_memory(batch_memory.get());
      batch_type batch = collate(std::move(sample));
      times.collate_ns += nanoseconds_since(fetched);
      return batch;
    }
    throw TypeError("unreachable: the collate function does not fit the plan");
  }

  // Collate what an iterable replica produced.
  batch_type collate_samples(std::vector<sample_type>&& samples) const {
    AllocatorScope collate_memory(batch_memory.get());
    if constexpr (batch_of<sample_type, C>::kTakesBatch) {
      if (plan.auto_collation) return collate(std::move(samples));
    }
    if constexpr (batch_of<sample_type, C>::kTakesSample) {
      return collate(std::move(samples.front()));
    }
    throw TypeError("unreachable: the collate function does not fit the plan");
  }

  // Up to `wanted` samples from an iterable replica; fewer at its end.
  // Sets `exhausted` when the replica has no more.
  static std::vector<sample_type> take_samples(SampleIterator<sample_type>& replica, size_t wanted,
                                               bool& exhausted) {
    std::vector<sample_type> samples;
    samples.reserve(reserve_for_batch(wanted));
    while (samples.size() < wanted) {
      std::optional<sample_type> sample = replica.next();
      if (!sample) {
        exhausted = true;
        break;
      }
      samples.push_back(std::move(*sample));
    }
    return samples;
  }

  std::vector<sample_type> fetch(std::span<const size_t> indices) const {
    if constexpr (requires { dataset->get_batch(indices); }) {
      std::vector<sample_type> samples = dataset->get_batch(indices);
      if (samples.size() != indices.size()) {
        // A sample would appear from nowhere or vanish without a trace.
        throw ValueError("get_batch returned " + std::to_string(samples.size()) + " samples for " +
                         std::to_string(indices.size()) +
                         " indices; it must return one sample per index, in order");
      }
      return samples;
    } else {
      std::vector<sample_type> samples;
      samples.reserve(indices.size());
      for (size_t index : indices) samples.push_back(dataset->get(index));
      return samples;
    }
  }
};

}  // namespace conveyor::detail
