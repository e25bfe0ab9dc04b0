// conveyor/detail/loader_batches.h: the loader's fetch+collate stage, one
// piece of code with workers or without.
//
//   sampler ─► LoaderBatches ─► (TransferStage) ─► consumer
//
// The epoch's graph: LoaderBatches ("fetch+collate") and, with
// prefetch_to_device, TransferStage ("to_device") are LoaderNodes, reset
// once per epoch with its base seed.
//                  │
//            Lanes: WorkerLanes   (num_workers > 0) the engine's workers,
//                                 through a SequencedWindow
//                   InlineLanes   (num_workers == 0) the consumer's thread,
//                                 one batch when it is asked for
//
// BatchWork turns one job into a batch: a map-style batch from its indices,
// an iterable one from its worker's replica. LoaderBatches is one pass on the
// consumer's thread: it draws indices from the sampler, gives batch k to
// worker k % num_workers (round_robin) or any worker (work_stealing), or
// cycles over the replicas still producing (iterable datasets), and hands
// batches out in order. What differs without workers is only where a job
// runs, and that it runs when the consumer asks, not ahead (PyTorch's
// single-process loading: no sample is read before its batch is wanted).
#pragma once

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <exception>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "conveyor/detail/buffer_pool.h"
#include "conveyor/detail/check.h"
#include "conveyor/detail/engine.h"
#include "conveyor/detail/failure.h"
#include "conveyor/detail/loader_core.h"
#include "conveyor/detail/seeds.h"
#include "conveyor/detail/sequenced_window.h"
#include "conveyor/detail/worker_scope.h"
#include "conveyor/errors.h"
#include "conveyor/generator.h"
#include "conveyor/worker_info.h"

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

// One batch's job as the loader sees it: the runtime's Job knows only its
// place in the pass.
struct BatchJob {
  uint64_t batch_index = 0;  // position within the epoch
  uint64_t pass = 0;         // counts passes: a new pass restarts the replicas
  std::span<const size_t> indices;  // map-style: the samples
};

// The reorder window a pool gets: prefetch_factor x num_workers, but no more
// slots than a map-style epoch has batches (at least one per worker), so a
// small dataset does not pay for a huge prefetch_factor.
inline size_t window_for(const LoaderPlan& plan) {
  if (plan.kind != DatasetKind::map) return plan.window;
  const size_t batches = plan.index_sampler->size();
  return std::min(plan.window, std::max(batches, plan.num_workers));
}

// One job into one batch, on whichever thread runs it.
template <class D, class C>
class BatchWork {
 public:
  using Core = LoaderCore<D, C>;
  using batch_type = typename Core::batch_type;
  using sample_type = typename Core::sample_type;

  // `core` owns or outlives the work; one replica per worker (iterable).
  BatchWork(Core& core, size_t workers) : core_(core), replicas_(workers) {}

  void init_worker(int worker) {
    if (core_.plan.worker_init_fn) core_.plan.worker_init_fn(worker);
  }

  // Makes the batch of `job` into `out`, or records why it could not.
  // `worker` is -1 in the consumer's thread (replica 0, no worker info).
  void run(const BatchJob& job, SlotResult<batch_type>& out, int worker,
           const std::exception_ptr& init_failure) noexcept {
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

 private:
  // A worker's replica of an iterable dataset; touched only by that worker's
  // strand.
  struct Replica {
    std::unique_ptr<SampleIterator<sample_type>> iterator;
    uint64_t pass = 0;
    bool exhausted = false;
  };

  void produce_from_replica(const BatchJob& job, int worker, const std::exception_ptr& init_failure,
                            SlotResult<batch_type>& out, const char*& stage) {
    if constexpr (IterableStyleDataset<D>) {
      Replica& replica = replicas_[static_cast<size_t>(std::max(worker, 0))];
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
        // No worker info in the consumer's thread, even inside another
        // loader's worker.
        replica.iterator = core_.dataset->iter(worker < 0 ? nullptr : get_worker_info());
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
  std::vector<Replica> replicas_;  // by worker
};

// The engine's workers and their window. Lives for one pass, or for the
// loader's lifetime with persistent_workers. PyTorch's worker semantics live
// here, not in the runtime: each worker's WorkerInfo (seed = base seed + id)
// and generator, seeded once per pass (once in all when persistent), and
// under work_stealing a generator per batch from (base seed, epoch, batch).
template <class D, class C>
class WorkerPool final : public SequencedWindow<SlotResult<typename LoaderCore<D, C>::batch_type>, BatchIndices>::Work {
 public:
  using Core = LoaderCore<D, C>;
  using batch_type = typename Core::batch_type;
  using Window = SequencedWindow<SlotResult<batch_type>, BatchIndices>;

  // `core` owns or outlives the pool.
  explicit WorkerPool(Core& core)
      : work_(core, core.plan.num_workers),
        per_batch_generators_(core.plan.scheduling == Scheduling::work_stealing),
        persistent_(core.plan.persistent_workers),
        workers_(core.plan.num_workers) {
    const LoaderPlan& plan = core.plan;
    for (size_t w = 0; w < workers_.size(); ++w) {
      workers_[w].info.set_dataset(core.dataset.get());
      workers_[w].info.id = static_cast<int>(w);
      workers_[w].info.num_workers = static_cast<int>(plan.num_workers);
    }
    EngineConfig config;
    config.num_workers = plan.num_workers;
    config.window = window_for(plan);
    config.in_order = plan.in_order;
    const bool iterable = plan.kind == DatasetKind::iterable;
    config.per_worker_queues = iterable || plan.scheduling == Scheduling::round_robin;
    config.timeout = plan.timeout;
    window_.emplace(config, *this, /*executor=*/nullptr, InputsAfterTake::keep);
  }

  // The workers stop before the replicas they use go.
  ~WorkerPool() override { window_.reset(); }

  Window& window() noexcept { return *window_; }

  // Starts a pass (consumer thread, nothing in flight): workers are seeded
  // base_seed + id, their generators afresh unless persistent and seeded
  // before (PyTorch seeds a worker once). Workers read all of this after
  // taking a job, which the consumer queues after writing it.
  void begin_pass(int64_t base_seed, uint64_t epoch) {
    window_->begin_pass();
    base_seed_ = base_seed;
    epoch_ = epoch;
    ++pass_;
    for (size_t w = 0; w < workers_.size(); ++w) {
      Worker& worker = workers_[w];
      worker.info.seed = static_cast<uint64_t>(base_seed) + w;
      if (pass_ == 1 || !persistent_) worker.generator = Generator(worker.info.seed);
    }
  }

  // One pass at a time may use a persistent pool. Consumer thread only.
  bool leased = false;

 private:
  // A worker's identity. Touched by the runtime's worker `id` only: a lane's
  // jobs never overlap; on the shared lane (work_stealing) the info is read
  // only and the generator serves worker_init_fn alone, which the runtime
  // runs once per worker.
  struct Worker {
    WorkerInfo info;
    Generator generator;
  };

  void init_worker(int worker) override {
    Worker& mine = workers_[static_cast<size_t>(worker)];
    WorkerScope scope(&mine.info, &mine.generator);
    work_.init_worker(worker);
  }
  void run(Job& job, BatchIndices& indices, SlotResult<batch_type>& out, int worker,
           const std::exception_ptr& init_failure) noexcept override {
    Worker& mine = workers_[static_cast<size_t>(worker)];
    std::optional<WorkerScope> scope;
    if (per_batch_generators_) {
      scope.emplace(&mine.info, work_stealing_seed(base_seed_, epoch_, job.index));
    } else {
      scope.emplace(&mine.info, &mine.generator);
    }
    work_.run(BatchJob{job.index, pass_, indices}, out, worker, init_failure);
  }

  BatchWork<D, C> work_;
  const bool per_batch_generators_;
  const bool persistent_;
  std::vector<Worker> workers_;  // by worker id
  // The pass's, written by begin_pass() before its jobs are queued.
  int64_t base_seed_ = 0;
  uint64_t epoch_ = 0;
  uint64_t pass_ = 0;
  std::optional<Window> window_;  // last: stopped first
};

// Where LoaderBatches' jobs run: WorkerLanes or InlineLanes. Each has
//   runs_ahead()   workers compute ahead of the consumer, up to the window;
//                  in the consumer's thread a job runs only when asked for
//   count()        workers (iterable: replicas); window()
//   has_room(), in_flight(), submit(worker, indices)
//   take(deadline), try_take()   the next finished job: moved out of the
//                  window, or (inline) a reference to the one just made
//   deadline_from_now()
// Static, not virtual: the inline loader hands out millions of tiny batches
// a second (W0), and each of these is called once or twice per batch.
template <class Batch>
using LanesTaken = WindowTaken<SlotResult<Batch>>;

// num_workers > 0: a pool's window, leased for the pass.
template <class D, class C>
class WorkerLanes {
 public:
  using Core = LoaderCore<D, C>;
  using Pool = WorkerPool<D, C>;
  using batch_type = typename Core::batch_type;
  using Taken = LanesTaken<batch_type>;

  WorkerLanes(std::shared_ptr<Core> core, std::shared_ptr<Pool> pool)
      : core_(std::move(core)), pool_(std::move(pool)), window_(pool_->window()) {
    if (pool_->leased) {
      throw RuntimeError(
          "this DataLoader has persistent_workers=True and another epoch is still live; a "
          "persistent loader runs one epoch at a time: finish or destroy the previous one first");
    }
    pool_->leased = true;
  }

  // Drops what the last pass left in flight (waiting for what runs) and
  // starts the next: its seeds, its replicas.
  void begin_pass(int64_t base_seed, uint64_t epoch) {
    window_.cancel();
    pool_->begin_pass(base_seed, epoch);
  }

  // Cancels what is queued, waits for what runs, frees every slot. Never
  // throws. After a timeout, with a dataset the loader co-owns, it does not
  // wait: the pool (and what its stuck task uses) is handed to a thread that
  // waits for the task and then frees it all.
  ~WorkerLanes() {
    if (timed_out_ && core_->owns_dataset && window_.in_flight() > 0) {
      if (core_->persistent_pool == pool_) core_->persistent_pool.reset();  // the next pass starts afresh
      finish_in_background([pool = std::move(pool_), core = std::move(core_)]() mutable {
        pool->window().cancel();
        pool.reset();  // stops the workers: before the core they read
        core.reset();
      });
      return;
    }
    window_.cancel();
    pool_->leased = false;
  }

  bool runs_ahead() const noexcept { return true; }
  size_t count() const noexcept { return core_->plan.num_workers; }
  size_t window() const noexcept { return window_.window(); }
  bool has_room() const noexcept { return window_.has_room(); }
  size_t in_flight() const noexcept { return window_.in_flight(); }
  void submit(int worker, std::span<const size_t> indices) {
    window_.next_input().assign(indices.begin(), indices.end());  // the slot's vector: no allocation once warm
    window_.submit(worker);
  }
  Taken take(std::chrono::steady_clock::time_point deadline) {
    try {
      return window_.take(deadline);
    } catch (const TimeoutError&) {
      timed_out_ = true;
      throw;
    }
  }
  std::optional<Taken> try_take() { return window_.try_take(); }
  std::chrono::steady_clock::time_point deadline_from_now() const noexcept {
    return window_.deadline_from_now();
  }

 private:
  std::shared_ptr<Core> core_;
  std::shared_ptr<Pool> pool_;
  typename Pool::Window& window_;
  bool timed_out_ = false;  // a wait ran into the timeout this pass
};

// num_workers == 0: each job runs in the consumer's thread when submitted,
// which LoaderBatches does only once the consumer asks for its batch. Under
// work_stealing the job draws from its batch's own generator, as it would on
// a worker: the same augmentations for any num_workers, 0 included.
// Otherwise it draws from the process's default generator, as in PyTorch.
template <class D, class C>
class InlineLanes {
 public:
  using Core = LoaderCore<D, C>;
  using batch_type = typename Core::batch_type;
  using Taken = LanesTaken<batch_type>;

  explicit InlineLanes(std::shared_ptr<Core> core) : core_(std::move(core)), work_(*core_, 1) {
    made_.lane = 0;  // the only lane
  }

  void begin_pass(int64_t base_seed, uint64_t epoch) {
    base_seed_ = base_seed;
    epoch_ = epoch;
    ++pass_;  // a new replica at the pass's first job
    next_batch_ = 0;
    held_ = false;
  }

  bool runs_ahead() const noexcept { return false; }
  size_t count() const noexcept { return 1; }
  size_t window() const noexcept { return 0; }
  bool has_room() const noexcept { return !held_; }
  size_t in_flight() const noexcept { return held_ ? 1 : 0; }
  void submit(int /*worker*/, std::span<const size_t> indices) {
    const BatchJob job{next_batch_++, pass_, indices};
    std::optional<WorkerScope> scope;
    if (core_->plan.scheduling == Scheduling::work_stealing) {
      scope.emplace(nullptr, work_stealing_seed(base_seed_, epoch_, job.batch_index));
    }
    // One result, reused: what the last take left in it (a moved-from
    // batch, an error) is cleared here; a context only matters with an error.
    SlotResult<batch_type>& out = made_.payload;
    out.batch.reset();
    out.error = nullptr;
    out.end_of_replica = false;
    out.times = {};
    work_.run(job, out, /*worker=*/-1, nullptr);
    made_.index = job.batch_index;
    held_ = true;
  }
  // The made job, in place: LoaderBatches moves the batch out of it (one
  // move per batch, as when a job made it straight into the return value).
  Taken& take(std::chrono::steady_clock::time_point) {
    CONVEYOR_CHECK(held_, "inline take with no batch made");
    held_ = false;
    return made_;
  }
  Taken* try_take() { return &take({}); }
  std::chrono::steady_clock::time_point deadline_from_now() const noexcept {
    return std::chrono::steady_clock::time_point::max();
  }

 private:
  std::shared_ptr<Core> core_;
  BatchWork<D, C> work_;
  int64_t base_seed_ = 0;
  uint64_t epoch_ = 0;
  uint64_t pass_ = 0;
  uint64_t next_batch_ = 0;
  Taken made_;         // the last job's result
  bool held_ = false;  // made_ holds a job not yet taken
};

// fetch+collate: the epoch graph's source node, driven from the consumer's
// thread. A pass's seed is the epoch's base seed.
template <class D, class C, class Lanes>
class LoaderBatches final : public LoaderNode<typename LoaderCore<D, C>::batch_type> {
 public:
  using Core = LoaderCore<D, C>;
  using batch_type = typename Core::batch_type;
  using Taken = LanesTaken<batch_type>;

  LoaderBatches(std::shared_ptr<Core> core, std::unique_ptr<Lanes> lanes)
      : core_(std::move(core)), lanes_(std::move(lanes)) {}

  using Node<batch_type>::reset;
  // The sampler's iter() runs here, after the lanes are leased: a throwing
  // iter() gives the lease back as the lanes go.
  void reset(const PassContext& pass, ResetWalk& walk) override {
    id_ = walk.next_id++;
    lanes_->begin_pass(static_cast<int64_t>(pass.seed), pass.epoch);
    batches_.reset();
    sampler_done_ = false;
    sampler_error_ = nullptr;
    submitted_ = 0;
    handed_out_ = 0;
    times_ = {};
    in_flight_sum_ = 0;
    waits_ = 0;
    active_.assign(lanes_->count(), true);
    active_count_ = lanes_->count();
    next_worker_ = 0;
    if (core_->plan.kind == DatasetKind::map) batches_ = core_->plan.index_sampler->iter();
  }

  std::string name() const override {
    if (!lanes_->runs_ahead()) return "fetch+collate";
    return "fetch+collate(" + std::to_string(lanes_->count()) + " workers)";
  }

  std::optional<batch_type> next() override {
    const auto deadline = lanes_->deadline_from_now();  // one timeout for the whole request
    std::optional<batch_type> batch;
    while (true) {
      fill();
      if (nothing_in_flight()) return std::nullopt;
      count_wait(lanes_->in_flight());
      auto&& taken = lanes_->take(deadline);  // by value from the window, by reference inline
      if (take(taken, batch)) return batch;
    }
  }

  Poll try_next(std::optional<batch_type>& out) override {
    while (true) {
      fill();
      if (nothing_in_flight()) return Poll::end;
      auto taken = lanes_->try_take();  // std::optional<Taken>, or Taken* in this thread
      if (!taken) return Poll::pending;
      count_wait(lanes_->in_flight() + 1);  // counting the one just taken
      if (take(*taken, out)) return Poll::ready;
    }
  }

  void add_metrics(LoaderMetrics& metrics) const override {
    metrics.fetch_seconds += static_cast<double>(times_.fetch_ns) * 1e-9;
    metrics.collate_seconds += static_cast<double>(times_.collate_ns) * 1e-9;
    if (!lanes_->runs_ahead()) return;  // no window without workers
    metrics.mean_in_flight = mean_in_flight();
    metrics.window = lanes_->window();
  }
  // In: jobs handed to the lanes (the sampler's batches of indices, or
  // requests to a replica); out: batches and failed batches handed on.
  void collect_metrics(std::vector<NodeMetrics>& out) const override {
    NodeMetrics mine{name(), id_};
    mine.items_in = submitted_;
    mine.items_out = handed_out_;
    mine.busy_seconds = static_cast<double>(times_.fetch_ns + times_.collate_ns) * 1e-9;
    if (lanes_->runs_ahead()) {
      mine.window = lanes_->window();
      mine.mean_in_flight = mean_in_flight();
    }
    out.push_back(std::move(mine));
  }

 private:
  // True at the end of the epoch (it ends on a count). A sampler error is
  // thrown here, in its place: after every batch drawn before it.
  bool nothing_in_flight() {
    if (lanes_->in_flight() > 0) return false;
    if (sampler_error_) std::rethrow_exception(std::exchange(sampler_error_, nullptr));
    return true;
  }

  void count_wait(size_t in_flight) {
    in_flight_sum_ += in_flight;
    ++waits_;
  }
  double mean_in_flight() const {
    return waits_ ? static_cast<double>(in_flight_sum_) / static_cast<double>(waits_) : 0;
  }

  // True when the job made a batch (now in `out`); false when it had none
  // (a worker's replica ended). Throws a failed batch's error in its place.
  // `taken`: a finished job moved out of the window, or the inline lanes'
  // result in place.
  bool take(Taken& taken, std::optional<batch_type>& out) {
    SlotResult<batch_type>& result = taken.payload;
    times_.fetch_ns += result.times.fetch_ns;
    times_.collate_ns += result.times.collate_ns;
    if (result.end_of_replica) {
      const auto worker = static_cast<size_t>(taken.lane);
      if (active_[worker]) {
        active_[worker] = false;
        --active_count_;
      }
    }
    if (lanes_->runs_ahead()) fill();  // keep the workers busy while the consumer uses this batch
    if (!result.error && !result.batch) return false;
    ++handed_out_;
    if (result.error) throw_worker_error(result.error, std::move(result.context));
    out = std::move(result.batch);
    return true;
  }

  // Submits work until the lanes are full or the pass has nothing more. A
  // sampler that throws stops the submitting; its error waits for its turn
  // (nothing_in_flight()), and the next request asks the sampler again.
  void fill() {
    const size_t workers = lanes_->count();
    while (lanes_->has_room()) {
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
        lanes_->submit(worker, indices_);
        ++submitted_;
      } else {
        if (active_count_ == 0) return;
        // The next worker in the cycle that still produces (PyTorch's
        // _worker_queue_idx_cycle).
        while (!active_[next_worker_]) next_worker_ = (next_worker_ + 1) % workers;
        lanes_->submit(static_cast<int>(next_worker_), {});
        ++submitted_;
        next_worker_ = (next_worker_ + 1) % workers;
      }
    }
  }

  std::shared_ptr<Core> core_;
  std::unique_ptr<SamplerIterator<BatchIndices>> batches_;
  BatchIndices indices_;  // the sampler's scratch, reused for every batch
  bool sampler_done_ = false;
  std::exception_ptr sampler_error_;  // thrown by the sampler, not yet by next()
  uint64_t id_ = 0;
  uint64_t submitted_ = 0;
  uint64_t handed_out_ = 0;
  StageTimes times_;  // summed from the results taken
  uint64_t in_flight_sum_ = 0;
  uint64_t waits_ = 0;
  std::vector<bool> active_;  // iterable: workers still producing
  size_t active_count_ = 0;
  size_t next_worker_ = 0;
  // Last: the lanes stop (and give the pool back) before the sampler goes.
  std::unique_ptr<Lanes> lanes_;
};

}  // namespace conveyor::detail
