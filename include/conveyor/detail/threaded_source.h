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

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <exception>
#include <memory>
#include <optional>
#include <utility>
#include <vector>

#include "conveyor/detail/buffer_pool.h"
#include "conveyor/detail/engine.h"
#include "conveyor/detail/failure.h"
#include "conveyor/detail/loader_core.h"
#include "conveyor/errors.h"

namespace conveyor::detail {

template <class Batch>
struct SlotResult {
  std::optional<Batch> batch;
  std::exception_ptr error;
  FailureContext context;
  // Iterable: the worker has no more batches this pass (with `error` when
  // its iter() or worker_init_fn failed: that worker counts as exhausted).
  bool end_of_replica = false;
  StageTimes times;
};

// The reorder window a pool gets: prefetch_factor x num_workers, but no more
// slots than a map-style epoch has batches (at least one per worker), so a
// small dataset does not pay for a huge prefetch_factor.
inline size_t window_for(const LoaderPlan& plan) {
  if (plan.kind != DatasetKind::map) return plan.window;
  const size_t batches = plan.index_sampler->size();
  return std::min(plan.window, std::max(batches, plan.num_workers));
}

template <class D, class C>
class WorkerPool final : public TaskRunner {
 public:
  using Core = LoaderCore<D, C>;
  using batch_type = typename Core::batch_type;
  using sample_type = typename Core::sample_type;

  // `core` owns or outlives the pool.
  explicit WorkerPool(Core& core)
      : core_(core),
        window_(window_for(core.plan)),
        results_(window_) {
    const LoaderPlan& plan = core.plan;
    EngineConfig config;
    config.num_workers = plan.num_workers;
    config.window = window_;
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
  size_t window() const noexcept { return window_; }

  // One pass at a time may use a persistent pool. Consumer thread only.
  bool leased = false;

  void init_worker(int worker) override {
    if (core_.plan.worker_init_fn) core_.plan.worker_init_fn(worker);
  }

  void run(Job& job, int worker, const std::exception_ptr& init_failure) noexcept override {
    SlotResult<batch_type>& out = results_[job.slot];
    const char* stage = "fetch";
    try {
      if constexpr (MapStyleDataset<D>) {
        if (init_failure) {
          stage = "worker_init_fn";
          std::rethrow_exception(init_failure);
        }
        out.batch.emplace(core_.make_batch(job.indices, stage, out.times));
      } else {
        produce_from_replica(job, worker, init_failure, out, stage);
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

  void produce_from_replica(Job& job, int worker, const std::exception_ptr& init_failure,
                            SlotResult<batch_type>& out, const char*& stage) {
    if constexpr (IterableStyleDataset<D>) {
      Replica& replica = replicas_[static_cast<size_t>(worker)];
      if (replica.pass != job.pass) {
        // A new pass: a new replica. A worker whose init or iter() fails
        // reports it once, then counts as exhausted (PyTorch's rule): the
        // epoch ends however often a consumer goes on past errors.
        replica = Replica{nullptr, job.pass, /*exhausted=*/true};
        out.end_of_replica = true;
        if (init_failure) {
          stage = "worker_init_fn";
          std::rethrow_exception(init_failure);
        }
        stage = "iter";
        replica.iterator = core_.dataset->iter(get_worker_info());
        replica.exhausted = false;
        out.end_of_replica = false;
      }
      if (replica.exhausted) {
        out.end_of_replica = true;
        return;
      }
      const LoaderPlan& plan = core_.plan;
      const size_t wanted = plan.auto_collation ? plan.batch_size : 1;
      stage = "iterate";
      const auto start = std::chrono::steady_clock::now();
      std::vector<sample_type> samples = Core::take_samples(*replica.iterator, wanted, replica.exhausted);
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
      (void)job, (void)worker, (void)init_failure, (void)out, (void)stage;
    }
  }

  Core& core_;
  size_t window_;
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
    // The sampler's iter() may throw: before the lease, which only the
    // destructor gives back.
    if (core_->plan.kind == DatasetKind::map) batches_ = core_->plan.index_sampler->iter();
    pool_->leased = true;
    engine_.begin_epoch(base_seed, epoch);
    const size_t workers = core_->plan.num_workers;
    active_.assign(workers, true);
    active_count_ = workers;
  }

  // Cancels what is queued, waits for what runs, frees every slot. Never
  // throws. After a timeout, with a dataset the loader co-owns, it does not
  // wait: the pool (and what its stuck task uses) is handed to a thread that
  // waits for the task and then frees it all.
  ~ThreadedSource() override {
    if (timed_out_ && core_->owns_dataset && engine_.stats().in_flight > 0) {
      if (core_->persistent_pool == pool_) core_->persistent_pool.reset();  // the next pass starts afresh
      finish_in_background([pool = std::move(pool_), core = std::move(core_)]() mutable {
        pool->engine().cancel();
        pool.reset();  // stops the engine: before the core it reads
        core.reset();
      });
      return;
    }
    engine_.cancel();
    pool_->leased = false;
  }

  std::optional<batch_type> next() override {
    const auto deadline = engine_.deadline_from_now();  // one timeout for the whole request
    std::optional<batch_type> batch;
    while (true) {
      fill();
      if (nothing_in_flight()) return std::nullopt;
      count_wait();
      ReadyBatch ready;
      try {
        ready = engine_.wait_ready(deadline);
      } catch (const TimeoutError&) {
        timed_out_ = true;
        throw;
      }
      if (take(ready, batch)) return batch;
    }
  }

  Poll try_next(std::optional<batch_type>& out) override {
    while (true) {
      fill();
      if (nothing_in_flight()) return Poll::end;
      ReadyBatch ready;
      if (!engine_.try_ready(ready)) return Poll::pending;
      count_wait();
      if (take(ready, out)) return Poll::ready;
    }
  }

  void add_metrics(LoaderMetrics& metrics) const override {
    metrics.fetch_seconds += static_cast<double>(times_.fetch_ns) * 1e-9;
    metrics.collate_seconds += static_cast<double>(times_.collate_ns) * 1e-9;
    metrics.mean_in_flight = waits_ ? static_cast<double>(in_flight_sum_) / static_cast<double>(waits_) : 0;
    metrics.window = pool_ ? pool_->window() : 0;
  }

 private:
  // True at the end of the epoch (it ends on a count). A sampler error is
  // thrown here, in its place: after every batch drawn before it.
  bool nothing_in_flight() {
    if (engine_.stats().in_flight > 0) return false;
    if (sampler_error_) std::rethrow_exception(std::exchange(sampler_error_, nullptr));
    return true;
  }

  void count_wait() {
    in_flight_sum_ += engine_.stats().in_flight;
    ++waits_;
  }

  // Takes a finished job's result off the window. True when it is a batch
  // (now in `out`); false when the job had none (a worker's replica ended).
  // Throws a failed batch's error in its place.
  bool take(const ReadyBatch& ready, std::optional<batch_type>& out) {
    SlotResult<batch_type> result = std::move(pool_->result(ready.slot));
    times_.fetch_ns += result.times.fetch_ns;
    times_.collate_ns += result.times.collate_ns;
    pool_->clear(ready.slot);
    engine_.release(ready);
    if (result.end_of_replica) {
      const auto worker = static_cast<size_t>(ready.worker);
      if (active_[worker]) {
        active_[worker] = false;
        --active_count_;
      }
    }
    fill();  // keep the workers busy while the consumer uses this batch
    if (result.error) throw_worker_error(result.error, std::move(result.context));
    if (!result.batch) return false;
    out = std::move(result.batch);
    return true;
  }

  // Submits work until the window is full or the pass has nothing more. A
  // sampler that throws stops the submitting; its error waits for its turn
  // (nothing_in_flight()), and the next request asks the sampler again.
  void fill() {
    const size_t workers = core_->plan.num_workers;
    while (engine_.has_room()) {
      if (core_->plan.kind == DatasetKind::map) {
        if (sampler_done_ || sampler_error_) return;
        try {
          if (!batches_->next(indices_)) {
            sampler_done_ = true;
            return;
          }
        } catch (...) {
          sampler_error_ = std::current_exception();
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
  std::exception_ptr sampler_error_;  // thrown by the sampler, not yet by next()
  uint64_t submitted_ = 0;
  bool timed_out_ = false;    // a wait ran into the timeout this pass
  StageTimes times_;          // summed from the results taken
  uint64_t in_flight_sum_ = 0;
  uint64_t waits_ = 0;
  std::vector<bool> active_;  // iterable: workers still producing
  size_t active_count_ = 0;
  size_t next_worker_ = 0;
};

}  // namespace conveyor::detail
