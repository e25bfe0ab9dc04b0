// conveyor/detail/threaded_source.h: the loader's typed half of the threaded
// engine (num_workers > 0).
//
// WorkerPool is the TaskRunner: it turns jobs into batches on the workers and
// holds one result per window slot. It lives for one pass, or for the
// loader's lifetime with persistent_workers. ThreadedSource is one pass on
// the consumer's thread: it draws indices from the sampler, submits them
// (batch k to worker k % num_workers under round_robin, to any worker under
// work_stealing, round-robin over workers still producing for iterable
// datasets), and hands results out in order.
#pragma once

#include <chrono>
#include <cstddef>
#include <exception>
#include <memory>
#include <optional>
#include <utility>
#include <vector>

#include "conveyor/detail/buffer_pool.h"
#include "conveyor/detail/loader_core.h"
#include "conveyor/detail/engine.h"
#include "conveyor/detail/failure.h"
#include "conveyor/errors.h"

namespace conveyor::detail {

template <class Batch>
struct SlotResult {
  std::optional<Batch> batch;
  std::exception_ptr error;
  FailureContext context;
  bool end_of_replica = false;  // iterable: the worker has no more batches this pass
  StageTimes times;
};

template <class D, class C>
class WorkerPool final : public TaskRunner {
 public:
  using Core = LoaderCore<D, C>;
  using batch_type = typename Core::batch_type;
  using sample_type = typename Core::sample_type;

  // `core` owns or outlives the pool.
  explicit WorkerPool(Core& core)
      : core_(core),
        // The pinned pool with pin_memory; otherwise enough idle buffers per
        // size class for a window of batches and the consumer's: a steady
        // loader then never touches the heap.
        buffers_(core.plan.batch_allocator ? core.plan.batch_allocator
                                           : make_recycling_allocator(core.plan.window + 2)),
        results_(core.plan.window) {
    const LoaderPlan& plan = core.plan;
    EngineConfig config;
    config.num_workers = plan.num_workers;
    config.window = plan.window;
    config.in_order = plan.in_order;
    const bool iterable = plan.kind == DatasetKind::iterable;
    config.per_worker_queues = iterable || plan.scheduling == Scheduling::round_robin;
    config.per_batch_generators = plan.scheduling == Scheduling::work_stealing;
    config.persistent = plan.persistent_workers;
    config.timeout = plan.timeout;
    config.worker_prototype.set_dataset(core.dataset.get());
    replicas_.resize(plan.num_workers);
    engine_.emplace(config, *this);
  }

  // The engine stops (and waits for its workers) before results go.
  ~WorkerPool() override { engine_.reset(); }

  Engine& engine() noexcept { return *engine_; }
  SlotResult<batch_type>& result(uint32_t slot) noexcept { return results_[slot]; }

  // One pass at a time may use a persistent pool. Consumer thread only.
  bool leased = false;

  void init_worker(int worker) override {
    if (core_.plan.worker_init_fn) core_.plan.worker_init_fn(worker);
  }

  void run(Job& job, int worker, const std::exception_ptr& init_failure) noexcept override {
    SlotResult<batch_type>& out = results_[job.slot];
    const char* stage = "fetch";
    AllocatorScope recycled(buffers_.get());  // collate writes into recycled memory
    try {
      if (init_failure) {
        stage = "worker_init_fn";
        std::rethrow_exception(init_failure);
      }
      if constexpr (MapStyleDataset<D>) {
        out.batch.emplace(core_.make_batch(job.indices, stage, out.times));
      } else {
        produce_from_replica(job, worker, out, stage);
      }
    } catch (...) {
      out.error = std::current_exception();
      out.context = FailureContext{worker, job.batch_index,
                                   BatchIndices(job.indices.begin(), job.indices.end()), stage};
    }
  }

  void clear(uint32_t slot) noexcept override { results_[slot] = SlotResult<batch_type>{}; }

 private:
  // A worker's replica of an iterable dataset; touched only by that worker's
  // strand.
  struct Replica {
    std::unique_ptr<SampleIterator<sample_type>> iterator;
    uint64_t pass = 0;
    bool exhausted = false;
  };

  void produce_from_replica(Job& job, int worker, SlotResult<batch_type>& out, const char*& stage) {
    if constexpr (IterableStyleDataset<D>) {
      Replica& replica = replicas_[static_cast<size_t>(worker)];
      if (!replica.iterator || replica.pass != job.pass) {
        stage = "iter";
        replica.iterator.reset();
        replica.exhausted = false;
        replica.pass = job.pass;
        replica.iterator = core_.dataset->iter(get_worker_info());
      }
      if (replica.exhausted) {
        out.end_of_replica = true;
        return;
      }
      const LoaderPlan& plan = core_.plan;
      const size_t wanted = plan.auto_collation ? plan.batch_size : 1;
      std::vector<sample_type> samples;
      samples.reserve(wanted);
      stage = "iterate";
      const auto start = std::chrono::steady_clock::now();
      while (samples.size() < wanted) {
        std::optional<sample_type> sample = replica.iterator->next();
        if (!sample) {
          replica.exhausted = true;
          break;
        }
        samples.push_back(std::move(*sample));
      }
      if (samples.empty() || (plan.drop_last && samples.size() < wanted)) {
        replica.exhausted = true;
        out.end_of_replica = true;
        return;
      }
      const auto fetched = std::chrono::steady_clock::now();
      out.times.fetch_ns += nanoseconds_since(start);
      stage = "collate";
      out.batch.emplace(core_.collate_samples(std::move(samples)));
      out.times.collate_ns += nanoseconds_since(fetched);
    } else {
      (void)job, (void)worker, (void)out, (void)stage;
    }
  }

  Core& core_;
  std::shared_ptr<BufferAllocator> buffers_;
  std::vector<SlotResult<batch_type>> results_;  // by slot; see the engine's contract
  std::vector<Replica> replicas_;                // by worker
  std::optional<Engine> engine_;                 // last: stopped first
};

template <class D, class C>
class ThreadedSource final : public BatchSource<typename LoaderCore<D, C>::batch_type> {
 public:
  using Core = LoaderCore<D, C>;
  using Pool = WorkerPool<D, C>;
  using batch_type = typename Core::batch_type;

  ThreadedSource(std::shared_ptr<Core> core, std::shared_ptr<Pool> pool, int64_t base_seed,
                 uint64_t epoch)
      : core_(std::move(core)), pool_(std::move(pool)), engine_(pool_->engine()) {
    if (pool_->leased) {
      throw RuntimeError(
          "this DataLoader has persistent_workers=True and another epoch is still live; a "
          "persistent loader runs one epoch at a time: finish or destroy the previous one first");
    }
    pool_->leased = true;
    engine_.begin_epoch(base_seed, epoch);
    const size_t workers = core_->plan.num_workers;
    active_.assign(workers, true);
    active_count_ = workers;
    if (core_->plan.kind == DatasetKind::map) batches_ = core_->plan.index_sampler->iter();
  }

  // Cancels what is queued, waits for what runs, frees every slot. Never throws.
  ~ThreadedSource() override {
    engine_.cancel();
    pool_->leased = false;
  }

  std::optional<batch_type> next() override {
    while (true) {
      fill();
      const size_t in_flight = engine_.stats().in_flight;
      if (in_flight == 0) return std::nullopt;  // the epoch ends on a count
      in_flight_sum_ += in_flight;
      ++waits_;
      const ReadyBatch ready = engine_.wait_ready();
      SlotResult<batch_type> result = std::move(pool_->result(ready.slot));
      times_.fetch_ns += result.times.fetch_ns;
      times_.collate_ns += result.times.collate_ns;
      pool_->clear(ready.slot);
      engine_.release(ready);
      fill();  // keep the workers busy while the consumer uses this batch
      if (result.end_of_replica) {
        if (active_[static_cast<size_t>(ready.worker)]) {
          active_[static_cast<size_t>(ready.worker)] = false;
          --active_count_;
        }
        continue;
      }
      if (result.error) throw_worker_error(result.error, std::move(result.context));
      return std::move(result.batch);
    }
  }

  void add_metrics(LoaderMetrics& metrics) const override {
    metrics.fetch_seconds += static_cast<double>(times_.fetch_ns) * 1e-9;
    metrics.collate_seconds += static_cast<double>(times_.collate_ns) * 1e-9;
    metrics.mean_in_flight = waits_ ? static_cast<double>(in_flight_sum_) / static_cast<double>(waits_) : 0;
    metrics.window = core_->plan.window;
  }

 private:
  // Submits work until the window is full or the pass has nothing more.
  void fill() {
    const size_t workers = core_->plan.num_workers;
    while (engine_.has_room()) {
      if (core_->plan.kind == DatasetKind::map) {
        if (sampler_done_) return;
        if (!batches_->next(indices_)) {
          sampler_done_ = true;
          return;
        }
        const int worker = core_->plan.scheduling == Scheduling::round_robin
                               ? static_cast<int>(submitted_ % workers)
                               : -1;
        engine_.submit(worker, indices_);
        ++submitted_;
      } else {
        if (active_count_ == 0) return;
        // The next worker in the cycle that still produces (PyTorch's
        // _worker_queue_idx_cycle).
        while (!active_[next_worker_]) next_worker_ = (next_worker_ + 1) % workers;
        engine_.submit(static_cast<int>(next_worker_), {});
        next_worker_ = (next_worker_ + 1) % workers;
      }
    }
  }

  std::shared_ptr<Core> core_;
  std::shared_ptr<Pool> pool_;
  Engine& engine_;
  std::unique_ptr<SamplerIterator<BatchIndices>> batches_;
  BatchIndices indices_;  // the sampler's scratch, reused for every batch
  bool sampler_done_ = false;
  uint64_t submitted_ = 0;
  StageTimes times_;          // summed from the results taken
  uint64_t in_flight_sum_ = 0;
  uint64_t waits_ = 0;
  std::vector<bool> active_;  // iterable: workers still producing
  size_t active_count_ = 0;
  size_t next_worker_ = 0;
};

}  // namespace conveyor::detail
