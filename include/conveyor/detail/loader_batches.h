// conveyor/detail/loader_batches.h: the loader's fetch+collate stage, one
// piece of code with workers or without.
//
//   from_sampler ─► LoaderBatches ─► (TransferStage) ─► consumer
//
// The epoch's graph: nodes::SamplerSource ("from_sampler", map-style
// datasets: the batch sampler's indices), LoaderBatches ("fetch+collate")
// and, with prefetch_to_device, TransferStage ("to_device"), reset once per
// epoch with its base seed. An iterable dataset has no sampler: its
// replicas are fetch+collate's own, one per worker.
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
#include <deque>
#include <exception>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "conveyor/detail/buffer_pool.h"
#include "conveyor/detail/check.h"
#include "conveyor/detail/engine.h"
#include "conveyor/detail/failure.h"
#include "conveyor/detail/loader_core.h"
#include "conveyor/detail/loader_state.h"
#include "conveyor/detail/seeds.h"
#include "conveyor/detail/sequenced_window.h"
#include "conveyor/detail/worker_scope.h"
#include "conveyor/errors.h"
#include "conveyor/generator.h"
#include "conveyor/nodes/sources.h"
#include "conveyor/worker_info.h"

namespace conveyor::detail {

template <class Batch>
struct SlotResult {
  uint64_t batch_index = 0;  // the batch's place in the epoch (written by the worker)
  std::optional<Batch> batch;
  std::exception_ptr error;
  FailureContext context;
  // Iterable: the worker has no more batches this pass (with `error` when
  // its iter() or worker_init_fn failed: that worker counts as exhausted).
  bool end_of_replica = false;
  StageTimes times;
  // round_robin: the generator that made the batch, after it (a resume
  // sets it back there).
  std::optional<GeneratorPosition> generator;
  // Iterable: the batch's number within its replica (see TakeRecord).
  uint64_t ordinal = 0;
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

// How many draws a seek may replay before the generator is rebased where it
// lands (PendingSeek::apply): MT19937 regenerates its 624 words once per
// 624 draws, so a few microseconds at most.
inline constexpr uint64_t kRebaseAfterDraws = 4096;

// A resumed pass's generator to set back where its consumer left it, once
// whatever replays the pass's start has drawn (empty: nothing to do).
struct PendingSeek {
  Generator* generator = nullptr;
  std::optional<GeneratorPosition>* to = nullptr;
  // Iterable: where the pass began it, before the replica replays.
  std::optional<GeneratorPosition>* start = nullptr;
  void apply() {
    if (!to || !*to) return;
    // Where the replica's start left it: nothing received since (or nothing
    // drawn). What the replica drew as it started again (its iter() seeding
    // a shuffle) is what the consumer's pass drew there: a seek back to the
    // start would make it draw the same numbers twice.
    if (started_at && **to == *started_at) {
      to->reset();
      return;
    }
    const uint64_t replayed = (*to)->draws;
    generator->seek(*std::exchange(*to, std::nullopt));
    // Past kRebaseAfterDraws the generator is rebased here (its state made
    // its origin), so the positions noted from now on count from this point.
    // A persistent worker seeks every epoch to where the last one left it:
    // without the rebase each seek went back to the first epoch's origin,
    // and MT19937's discard() replayed all the draws since, epoch after
    // epoch (1.7% of W5's CPU after 30 short epochs, growing). Below it the
    // position stays as it is: one counted from a seed is compact in a
    // checkpoint (a state's origin writes out 624 words).
    if (replayed > kRebaseAfterDraws) generator->set_state(generator->get_state());
  }
  void apply_start() {
    if (!start || !*start) return;
    started_at = **start;
    generator->seek(*std::exchange(*start, std::nullopt));
  }
  std::optional<GeneratorPosition> started_at = std::nullopt;  // what apply_start() set
};

// One job into one batch, on whichever thread runs it.
template <class D, class C>
class BatchWork {
 public:
  using Core = LoaderCore<D, C>;
  using batch_type = typename Core::batch_type;
  using sample_type = typename Core::sample_type;

  // `core` owns or outlives the work; one replica per worker (iterable).
  BatchWork(Core& core, size_t workers) : core_(core), replicas_(workers), skips_(workers) {}

  void init_worker(int worker) {
    if (core_.plan.worker_init_fn) core_.plan.worker_init_fn(worker);
  }

  // A resumed pass (iterable): replica r passes over the batches its
  // consumer received before the state was taken. Written by the consumer
  // before the pass's first job; read by the replica's strand.
  void skip_in_replicas(const LoaderResume* resume) {
    for (size_t r = 0; r < replicas_.size(); ++r) {
      Skip& skip = skips_[r];
      const bool resumed = resume && r < resume->position.lanes.size();
      skip.received = resumed ? resume->position.lanes[r] : ReceivedSet{};
      skip.failed = resumed && resume->position.lane_failures[r] > 0;
    }
  }

  // Makes the batch of `job` into `out`, or records why it could not.
  // `worker` is -1 in the consumer's thread (replica 0, no worker info).
  // `seek`: map-style, before the batch; iterable, once the replica is made
  // and has passed over what its consumer received (both draw).
  // Inlined into the consumer's-thread lanes, where a batch of a few tiny
  // samples takes a few hundred instructions (W0): a call boundary here
  // cost 8% of them.
  [[gnu::always_inline]] inline void run(const BatchJob& job, SlotResult<batch_type>& out, int worker,
                                         const std::exception_ptr& init_failure,
           PendingSeek seek = {}) noexcept {
    const char* stage = "fetch";
    // Samples that are plain numbers allocate nothing worth keeping, and W0's
    // batches are a few hundred instructions: no scope (two calls) for them.
    std::optional<AllocatorScope> task_memory;  // collate installs its own inside
    if constexpr (!std::is_arithmetic_v<sample_type>) task_memory.emplace(core_.sample_memory.get());
    try {
      if constexpr (MapStyleDataset<D>) {
        seek.apply();
        if (init_failure) {
          stage = "worker_init_fn";
          std::rethrow_exception(init_failure);
        }
        out.batch.emplace(core_.make_batch(job.indices, stage, out.times));
      } else {
        produce_from_replica(job, worker, init_failure, out, stage, seek);
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
    uint64_t next_ordinal = 0;  // the number of the batch it makes next
  };
  // What a resumed replica passes over (skip_in_replicas).
  struct Skip {
    ReceivedSet received;
    bool failed = false;  // some of them failed
  };

  // Passes over `count` batches as the first pass made them: by the
  // iterator's skip() when none of them failed; else batch by batch, each
  // failing where it failed before (what a failed batch consumed is
  // consumed again). Returns how many there were: fewer when the replica
  // ended first (a state not of this epoch; the consumer says so).
  uint64_t pass_over(Replica& replica, uint64_t count, size_t wanted, bool failed) const {
    if (count == 0) return 0;
    const bool drop_last = core_.plan.drop_last;
    if (!failed) {
      const uint64_t samples = count * wanted;  // load_state_dict refuses a prefix where this wraps
      const uint64_t skipped = replica.iterator->skip(samples);
      if (skipped == samples) return count;
      replica.exhausted = true;
      // The last batch may be short: a batch all the same, unless dropped.
      return skipped / wanted + (!drop_last && skipped % wanted != 0 ? 1 : 0);
    }
    uint64_t passed = 0;
    for (; passed < count && !replica.exhausted; ++passed) {
      try {
        const std::vector<sample_type> samples = Core::take_samples(*replica.iterator, wanted, replica.exhausted);
        if (samples.empty() || (drop_last && samples.size() < wanted)) {  // as produce_from_replica ends
          replica.exhausted = true;
          break;
        }
      } catch (...) {
        // It failed here the first time too.
      }
    }
    return passed;
  }

  void produce_from_replica(const BatchJob& job, int worker, const std::exception_ptr& init_failure,
                            SlotResult<batch_type>& out, const char*& stage, PendingSeek& seek) {
    if constexpr (IterableStyleDataset<D>) {
      Replica& replica = replicas_[static_cast<size_t>(std::max(worker, 0))];
      if (replica.pass != job.pass) {
        // A new pass: a new replica. A worker whose init or iter() fails
        // reports it once, then counts as exhausted (PyTorch's rule): the
        // epoch ends however often a consumer goes on past errors.
        // Should iter() fail, that failure is the replica's one batch.
        replica = Replica{nullptr, job.pass, /*exhausted=*/true, /*next_ordinal=*/1};
        out.end_of_replica = true;
        if (init_failure) {
          stage = "worker_init_fn";
          std::rethrow_exception(init_failure);
        }
        stage = "iter";
        seek.apply_start();
        // No worker info in the consumer's thread, even inside another
        // loader's worker.
        replica.iterator = core_.dataset->iter(worker < 0 ? nullptr : get_worker_info());
        if (!replica.iterator) {  // as a failed iter(): reported once, then exhausted
          throw TypeError("iter() returned no iterator (nullptr)" +
                          (worker < 0 ? std::string() : " for worker " + std::to_string(worker)) +
                          "; a worker with nothing to read returns an empty iterator");
        }
        replica.exhausted = false;
        replica.next_ordinal = 0;
        out.end_of_replica = false;
        // A resumed pass: over the batches received in turn, then the
        // generator to where it stood after them.
        const Skip& skip = skips_[static_cast<size_t>(std::max(worker, 0))];
        stage = "iterate";
        replica.next_ordinal = pass_over(replica, skip.received.prefix, wanted_samples(), skip.failed);
        seek.apply();
      }
      const size_t wanted = wanted_samples();
      // ... and over each received out of turn, the generator after it.
      const Skip& skip = skips_[static_cast<size_t>(std::max(worker, 0))];
      while (!replica.exhausted && skip.received.contains(replica.next_ordinal)) {
        stage = "iterate";
        if (pass_over(replica, 1, wanted, true) == 0) break;
        const OptionalPosition* after = skip.received.generator_after(replica.next_ordinal);
        if (after && *after && seek.generator) seek.generator->seek(**after);
        ++replica.next_ordinal;
      }
      out.ordinal = replica.next_ordinal;
      if (replica.exhausted) {
        out.end_of_replica = true;
        return;
      }
      ++replica.next_ordinal;
      stage = "iterate";
      const auto start = std::chrono::steady_clock::now();
      std::vector<sample_type> samples = Core::take_samples(*replica.iterator, wanted, replica.exhausted);
      if (samples.empty() || (core_.plan.drop_last && samples.size() < wanted)) {
        replica.exhausted = true;
        out.end_of_replica = true;
        out.ordinal = --replica.next_ordinal;  // no batch after all: the count it made
        return;
      }
      const auto fetched = std::chrono::steady_clock::now();
      out.times.fetch_ns += nanoseconds_since(start);
      stage = "collate";
      out.batch.emplace(core_.collate_samples(std::move(samples)));
      out.times.collate_ns += nanoseconds_since(fetched);
    } else {
      (void)job, (void)worker, (void)init_failure, (void)out, (void)stage, (void)seek;
    }
  }

  size_t wanted_samples() const { return core_.plan.auto_collation ? core_.plan.batch_size : 1; }

  Core& core_;
  std::vector<Replica> replicas_;  // by worker
  std::vector<Skip> skips_;        // by worker
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
    config.job_number = [this](uint64_t job) { return batch_of(job); };
    window_.emplace(config, *this, /*executor=*/nullptr, InputsAfterTake::keep);
  }

  // The workers stop before the replicas they use go.
  ~WorkerPool() override { window_.reset(); }

  Window& window() noexcept { return *window_; }

  // Starts a pass (consumer thread, nothing in flight): workers are seeded
  // base_seed + id, their generators afresh unless persistent and seeded
  // before (PyTorch seeds a worker once). Workers read all of this after
  // taking a job, which the consumer queues after writing it.
  //
  // Checkpoints (round_robin): `progress` gets each worker's generator as
  // the pass begins it; a persistent worker's is rebased (its state made
  // its origin), so a position never counts more than one pass of draws. A
  // resumed pass sets each worker's generator to where its consumer left it,
  // at the worker's first job (after worker_init_fn, which may draw).
  void begin_pass(int64_t base_seed, uint64_t epoch, EpochProgress& progress, const LoaderResume* resume) {
    window_->begin_pass();
    base_seed_ = base_seed;
    epoch_ = epoch;
    ++pass_;
    std::vector<OptionalPosition>& generators = progress.position.generators;
    generators.assign(per_batch_generators_ ? 0 : workers_.size(), std::nullopt);
    std::vector<OptionalPosition>& starts = progress.position.start_generators;
    starts.assign(generators.size(), std::nullopt);
    for (size_t w = 0; w < workers_.size(); ++w) {
      Worker& worker = workers_[w];
      worker.seek_start.reset();
      worker.first_position.reset();
      worker.info.seed = static_cast<uint64_t>(base_seed) + w;
      if (pass_ == 1 || !persistent_) {
        worker.generator = Generator(worker.info.seed);
      } else if (!per_batch_generators_) {
        worker.generator.set_state(worker.generator.get_state());
        generators[w] = worker.generator.position();
      }
      // A persistent worker that has not run since a resume set its place
      // keeps it for its first job (after worker_init_fn, which draws once).
      if (!persistent_ || pass_ == 1 || !worker.seek_to) {
        worker.seek_to.reset();
      } else if (!per_batch_generators_) {
        generators[w] = worker.seek_to;
        // An iterable's replica starts there: before its iter(), whose
        // draws (a shuffle's seed) the pass keeps, not after it.
        if constexpr (IterableStyleDataset<D>) worker.seek_start = std::exchange(worker.seek_to, std::nullopt);
      }
      if (!per_batch_generators_) starts[w] = generators[w];
      const std::vector<OptionalPosition>* saved = resume ? &resume->position.generators : nullptr;
      if (saved && w < saved->size() && (*saved)[w]) {
        worker.seek_to = (*saved)[w];
        if (!per_batch_generators_) generators[w] = worker.seek_to;
      }
      const std::vector<OptionalPosition>* saved_starts = resume ? &resume->position.start_generators : nullptr;
      if (saved_starts && w < saved_starts->size() && !per_batch_generators_) {
        worker.seek_start = (*saved_starts)[w];
        starts[w] = worker.seek_start;
      }
    }
    // The batches a resumed pass does not make again (map-style: the
    // consumer submits the others in order).
    skipped_prefix_ = 0;
    skipped_beyond_.clear();
    if (resume) {
      skipped_prefix_ = resume->position.batches.prefix;
      skipped_beyond_ = resume->position.batches.beyond;
    }
    // Map-style batches received out of turn are not made again: the same
    // worker's next batch starts where one left its generator (by batch).
    seek_before_.clear();
    if (resume && !per_batch_generators_ && !workers_.empty()) {
      const ReceivedSet& received = resume->position.batches;
      for (size_t i = 0; i < received.beyond.size(); ++i) {
        if (received.beyond_generators[i]) {
          seek_before_.emplace_back(received.beyond[i] + workers_.size(), *received.beyond_generators[i]);
        }
      }
    }
    work_.skip_in_replicas(resume);
  }

  // Where each worker's generator goes on from into the next pass: between
  // passes, when no job runs (a persistent pool's state between epochs).
  // Consumer thread only.
  std::vector<std::optional<GeneratorPosition>> generator_positions() const {
    std::vector<std::optional<GeneratorPosition>> positions;
    for (const Worker& worker : workers_) {
      positions.push_back(worker.seek_to ? worker.seek_to : worker.generator.position());
    }
    return positions;
  }

  // The pass is over (finished or left: the consumer's thread, after its
  // jobs were cancelled or waited for). Persistent round_robin workers carry
  // their generators into the next pass from where the consumer's last batch
  // from each left it (else where the pass began it): batches made ahead and
  // never received (an epoch left early) draw nothing that lasts, so the
  // next epoch is the same however far the workers had run ahead, and the
  // same after a resume. Applied at the worker's next job, after
  // worker_init_fn.
  void rewind_to_received(const EpochPosition& at) {
    if (!persistent_ || per_batch_generators_) return;
    for (size_t w = 0; w < workers_.size(); ++w) {
      Worker& worker = workers_[w];
      OptionalPosition latest = w < at.generators.size() ? at.generators[w] : std::nullopt;
      if (at.lanes.empty()) {
        const ReceivedSet& received = at.batches;
        for (size_t i = 0; i < received.beyond.size(); ++i) {
          if (received.beyond[i] % workers_.size() == w && received.beyond_generators[i]) {
            latest = received.beyond_generators[i];  // sorted: the last wins
          }
        }
      } else if (w < at.lanes.size() && !at.lanes[w].beyond_generators.empty()) {
        latest = at.lanes[w].beyond_generators.back();
      }
      if (!latest) latest = worker.first_position;
      if (latest) worker.seek_to = std::move(latest);
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
    std::optional<GeneratorPosition> seek_to;  // a resumed pass: where its first job puts the generator
    std::optional<GeneratorPosition> seek_start;  // iterable, a resumed pass: see PendingSeek::start
    // The generator as the worker's first job of the pass found it (written
    // by the worker, read by the consumer between passes).
    std::optional<GeneratorPosition> first_position;
  };

  void init_worker(int worker) override {
    Worker& mine = workers_[static_cast<size_t>(worker)];
    WorkerScope scope(&mine.info, &mine.generator);
    work_.init_worker(worker);
  }
  void run(Job& job, BatchIndices& indices, SlotResult<batch_type>& out, int worker,
           const std::exception_ptr& init_failure) noexcept override {
    Worker& mine = workers_[static_cast<size_t>(worker)];
    out.batch_index = batch_of(job.index);
    std::optional<WorkerScope> scope;
    if (per_batch_generators_) {
      scope.emplace(&mine.info, work_stealing_seed(base_seed_, epoch_, out.batch_index));
    } else {
      if (!mine.first_position) mine.first_position = mine.generator.position();
      scope.emplace(&mine.info, &mine.generator);
      // A resumed pass: this worker's previous batch was received out of
      // turn and is not made again; its generator goes where that batch
      // left it (this batch's place, not the pass's).
      if (!seek_before_.empty()) {
        const auto it = std::lower_bound(seek_before_.begin(), seek_before_.end(), out.batch_index,
                                         [](const auto& entry, uint64_t batch) { return entry.first < batch; });
        if (it != seek_before_.end() && it->first == out.batch_index) mine.seek_to = it->second;
      }
    }
    (void)job;
    work_.run(BatchJob{out.batch_index, pass_, indices}, out, worker, init_failure,
              PendingSeek{&mine.generator, &mine.seek_to, &mine.seek_start});
    if (!per_batch_generators_) out.generator = mine.generator.position();
  }

  BatchWork<D, C> work_;
  const bool per_batch_generators_;
  const bool persistent_;
  std::vector<Worker> workers_;  // by worker id
  // A resumed pass (round_robin): by batch, where its worker's generator
  // starts it; sorted. Written by begin_pass, read by the workers.
  std::vector<std::pair<uint64_t, GeneratorPosition>> seek_before_;
  // A resumed pass: the batches it does not make (all below the prefix, and
  // those listed, sorted). Written by begin_pass, read by the workers.
  uint64_t skipped_prefix_ = 0;
  std::vector<uint64_t> skipped_beyond_;

  // The epoch's batch that the pass's job `job` makes: the job-th batch not
  // skipped (iterable: the job's number).
  uint64_t batch_of(uint64_t job) const noexcept {
    uint64_t batch = skipped_prefix_ + job;
    for (const uint64_t skipped : skipped_beyond_) {
      if (skipped > batch) break;
      ++batch;
    }
    return batch;
  }
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
  // starts the next: its seeds, its replicas, where a resume left them.
  void begin_pass(int64_t base_seed, uint64_t epoch, EpochProgress& progress, const LoaderResume* resume) {
    window_.cancel();
    pool_->begin_pass(base_seed, epoch, progress, resume);
    progress_ = &progress;
  }

  // Cancels what is queued, waits for what runs, frees every slot. Never
  // throws. Right after a timeout (no batch came since), with a dataset the
  // loader co-owns, it does not wait: the pool (and what its stuck task
  // uses) is handed to a thread that waits for the task and then frees it
  // all.
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
    if (progress_) pool_->rewind_to_received(progress_->position);
    pool_->leased = false;
  }

  bool runs_ahead() const noexcept { return true; }
  void seek_generator() noexcept {}  // workers set their own (WorkerPool::begin_pass)
  size_t count() const noexcept { return core_->plan.num_workers; }
  size_t window() const noexcept { return window_.window(); }
  bool has_room() const noexcept { return window_.has_room(); }
  size_t in_flight() const noexcept { return window_.in_flight(); }
  // `batch_index`: the pool knows it from the job's number (see
  // WorkerPool::batch_of): a write into the slot's payload here would take
  // its cache line from the worker about to fill it (6% of W0 at W = 1).
  void submit(int worker, uint64_t /*batch_index*/, std::span<const size_t> indices) {
    window_.next_input().assign(indices.begin(), indices.end());  // the slot's vector: no allocation once warm
    window_.submit(worker);
  }
  Taken take(std::chrono::steady_clock::time_point deadline) {
    try {
      Taken taken = window_.take(deadline);
      timed_out_ = false;  // the job waited for came: nothing is known to be stuck
      return taken;
    } catch (const TimeoutError&) {
      timed_out_ = true;
      throw;
    }
  }
  std::optional<Taken> try_take() {
    std::optional<Taken> taken = window_.try_take();
    if (taken) timed_out_ = false;
    return taken;
  }
  std::chrono::steady_clock::time_point deadline_from_now() const noexcept {
    return window_.deadline_from_now();
  }

 private:
  std::shared_ptr<Core> core_;
  std::shared_ptr<Pool> pool_;
  typename Pool::Window& window_;
  bool timed_out_ = false;  // the last wait ran into the timeout
  // The pass's (owned by fetch+collate, which outlives these lanes).
  const EpochProgress* progress_ = nullptr;
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
  // A resumed pass left before it made a batch leaves the process generator
  // where the saved one had it.
  ~InlineLanes() {
    if (seek_to_) default_generator().seek(*seek_to_);
  }

  // Under round_robin the dataset draws from the process's generator, which
  // `progress` follows (slot 0) from the pass's start: rebased there, so a
  // position counts one pass of draws. A resumed pass sets it back where
  // its consumer left it (seek_generator(), once the sampler has replayed).
  void begin_pass(int64_t base_seed, uint64_t epoch, EpochProgress& progress, const LoaderResume* resume) {
    base_seed_ = base_seed;
    epoch_ = epoch;
    ++pass_;  // a new replica at the pass's first job
    held_ = false;
    round_robin_ = core_->plan.scheduling == Scheduling::round_robin;
    std::vector<OptionalPosition>& generators = progress.position.generators;
    generators.clear();
    progress.position.start_generators.clear();
    seek_to_.reset();
    seek_start_.reset();
    if (round_robin_) {
      Generator& process = default_generator();
      process.set_state(process.get_state());
      generators.assign(1, process.position());
      progress.position.start_generators = generators;
      if (resume && !resume->position.start_generators.empty() && resume->position.start_generators[0]) {
        seek_start_ = resume->position.start_generators[0];
        progress.position.start_generators[0] = seek_start_;
      }
      if (resume && !resume->position.generators.empty() && resume->position.generators[0]) {
        seek_to_ = resume->position.generators[0];
        generators[0] = seek_to_;
        progress.seek_pending = true;
        progress_ = &progress;
      }
    }
    work_.skip_in_replicas(resume);
  }
  // The process generator back where the consumer left it: called once the
  // batches received before are drawn again from the sampler.
  void seek_generator() {
    if (!seek_to_) return;
    default_generator().seek(*std::exchange(seek_to_, std::nullopt));
    progress_->seek_pending = false;
  }

  bool runs_ahead() const noexcept { return false; }
  size_t count() const noexcept { return 1; }
  size_t window() const noexcept { return 0; }
  bool has_room() const noexcept { return !held_; }
  size_t in_flight() const noexcept { return held_ ? 1 : 0; }
  void submit(int /*worker*/, uint64_t batch_index, std::span<const size_t> indices) {
    const BatchJob job{batch_index, pass_, indices};
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
    out.batch_index = batch_index;
    PendingSeek seek;  // map-style: seek_generator(), before the sampler draws
    if constexpr (IterableStyleDataset<D>) seek = PendingSeek{&default_generator(), &seek_to_, &seek_start_};
    work_.run(job, out, /*worker=*/-1, nullptr, seek);
    if (progress_ && !seek_to_) progress_->seek_pending = false;
    out.generator.reset();
    if (round_robin_) out.generator = default_generator().position();
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
  Taken made_;         // the last job's result
  bool held_ = false;  // made_ holds a job not yet taken
  bool round_robin_ = false;
  std::optional<GeneratorPosition> seek_to_;  // a resumed pass: see seek_generator()
  std::optional<GeneratorPosition> seek_start_;  // iterable, a resumed pass: see PendingSeek::start
  EpochProgress* progress_ = nullptr;         // the pass's, while seek_to_ is set
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
      : core_(std::move(core)), lanes_(std::move(lanes)) {
    // The sampler's epoch is set_epoch()'s (PyTorch's), and its start is
    // saved with the loader's generators (DataLoader::epoch_start).
    if (core_->plan.kind == DatasetKind::map) {
      sampler_ = std::make_unique<nodes::SamplerSource<BatchIndices>>(
          core_->plan.index_sampler, nodes::SamplerSource<BatchIndices>::Options{
                                         .follow_pass_epoch = false, .save_start = false, .name = "from_sampler"});
    }
  }

  using Node<batch_type>::reset;
  // The sampler's iter() runs here, after the lanes are leased: a throwing
  // iter() gives the lease back as the lanes go. A pass the loader resumes
  // (core.resume) passes over what its consumer had received.
  void reset(const PassContext& pass, ResetWalk& walk) override {
    const uint64_t sampler_id = sampler_ ? walk.next_id++ : 0;  // ids in the data's order
    id_ = walk.next_id++;
    progress_ = core_->progress;
    resume_ = std::exchange(core_->resume, std::nullopt);
    const bool iterable = core_->plan.kind == DatasetKind::iterable;
    progress_->begin(iterable ? lanes_->count() : 0, lanes_->count(), core_->plan.prefetch_to_device > 0);
    lanes_->begin_pass(static_cast<int64_t>(pass.seed), pass.epoch, *progress_, resume_ ? &*resume_ : nullptr);
    next_batch_ = 0;
    sampler_done_ = false;
    sampler_error_ = nullptr;
    replay_error_ = nullptr;
    sampler_errors_received_ = {};
    if (resume_) sampler_errors_received_.assign(resume_->position.sampler_errors_at.begin(),
                                                 resume_->position.sampler_errors_at.end());
    submitted_ = 0;
    handed_out_ = 0;
    times_ = {};
    in_flight_sum_ = 0;
    waits_ = 0;
    active_.assign(lanes_->count(), true);
    active_count_ = lanes_->count();
    next_worker_ = 0;
    if (resume_ && !resume_->between_epochs) {
      // What the consumer had received stays received: a second state in
      // this epoch holds it too. The generators are the pass's own, set above.
      // (A state between epochs holds no position in one: the pass's own,
      // begun above, stands.)
      std::vector<OptionalPosition> generators = std::move(progress_->position.generators);
      progress_->position = resume_->position;
      progress_->position.generators = std::move(generators);
      if (iterable) {
        next_worker_ = resume_->position.next_lane;
        for (size_t lane = 0; lane < active_.size(); ++lane) {
          if (resume_->position.lane_done(lane)) {
            active_[lane] = false;
            --active_count_;
          }
        }
      }
    }
    if (sampler_) {
      sampler_->reset_as(pass, walk, sampler_id);
      if (resume_) replay_received_prefix();
    }
  }

  // A resumed pass draws the batches its consumer had received in turn
  // from the sampler now, not when first asked: a consumer that leaves the
  // epoch at once still leaves the generators where the saved one did.
  void replay_received_prefix() {
    const uint64_t prefix = resume_->position.batches.prefix;
    while (next_batch_ < prefix) {
      bool drawn = false;
      try {
        drawn = sampler_->advance(indices_);
      } catch (...) {
        if (pass_over_received_sampler_error()) continue;
        sampler_error_ = std::current_exception();
        return;
      }
      if (!drawn) {
        // From iter(), which fails: the loader keeps the state to resume,
        // as after any iter() that fails.
        sampler_done_ = true;
        std::rethrow_exception(past_the_sampler());
      }
      ++next_batch_;  // one at a time: a sampler that throws leaves the count drawn before it
    }
    lanes_->seek_generator();
  }
  // A resumed pass whose sampler ended at next_batch_: a batch received
  // past that end is not of this epoch (the pass would end silently short).
  // The error, or null.
  std::exception_ptr past_the_sampler() const {
    const ReceivedSet& received = resume_->position.batches;
    const std::string gave = ", past the end of the epoch: its sampler gave " + std::to_string(next_batch_) + " batches";
    if (next_batch_ < received.prefix) {
      return std::make_exception_ptr(StateError("load_state_dict: 'batches.prefix' (" +
                                                std::to_string(received.prefix) + ") is" + gave.substr(1)));
    }
    if (!received.beyond.empty() && received.beyond.back() >= next_batch_) {
      return std::make_exception_ptr(StateError("load_state_dict: 'batches.beyond' lists batch " +
                                                std::to_string(received.beyond.back()) + gave));
    }
    return nullptr;
  }
  // Iterable, a resumed pass: replica `lane` ended after `made` batches; a
  // batch received from it at or past that is not of this epoch. The error,
  // or null.
  std::exception_ptr past_the_replica(size_t lane, uint64_t made) const {
    if (lane >= resume_->position.lanes.size()) return nullptr;  // a state between epochs
    const ReceivedSet& received = resume_->position.lanes[lane];
    const std::string key = "load_state_dict: 'lanes[" + std::to_string(lane) + "].";
    const std::string it_made = ", past the end of that replica's epoch: it made " + std::to_string(made) + " batches";
    if (received.prefix > made) {
      return std::make_exception_ptr(
          StateError(key + "prefix' (" + std::to_string(received.prefix) + ") is" + it_made.substr(1)));
    }
    if (!received.beyond.empty() && received.beyond.back() >= made) {
      return std::make_exception_ptr(
          StateError(key + "beyond' lists batch " + std::to_string(received.beyond.back()) + it_made));
    }
    return nullptr;
  }
  // A sampler error of a resumed pass that its consumer had received: the
  // sampler is asked again, as the consumer's next request did then.
  bool pass_over_received_sampler_error() {
    std::deque<uint64_t>& received = sampler_errors_received_;
    while (!received.empty() && received.front() < next_batch_) received.pop_front();  // it failed there no more
    if (received.empty() || received.front() != next_batch_) return false;
    received.pop_front();
    return true;
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
  // requests to a replica); out: batches and failed batches handed on. A
  // resumed pass draws the batches received before the state again without
  // counting them; the sampler's out then counts the ones received out of
  // turn too, which fetch+collate drops (they are not made again).
  void collect_metrics(std::vector<NodeMetrics>& out) const override {
    if (sampler_) sampler_->collect_metrics(out);
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
    if (sampler_error_) {
      progress_->note_sampler_error(next_batch_);
      std::rethrow_exception(std::exchange(sampler_error_, nullptr));
    }
    // Last, with every batch made handed out: a consumer (to_device's
    // stage) has received each of them before this error.
    if (replay_error_) std::rethrow_exception(std::exchange(replay_error_, nullptr));
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
  [[gnu::always_inline]] inline bool take(Taken& taken, std::optional<batch_type>& out) {
    SlotResult<batch_type>& result = taken.payload;
    times_.fetch_ns += result.times.fetch_ns;
    times_.collate_ns += result.times.collate_ns;
    const bool output = result.error || result.batch;
    progress_->note_taken(TakeRecord{result.batch_index, result.ordinal, std::max(taken.lane, 0), output,
                                     result.error != nullptr, result.end_of_replica},
                          std::move(result.generator));
    if (result.end_of_replica) {
      const auto worker = static_cast<size_t>(taken.lane);
      if (active_[worker]) {
        active_[worker] = false;
        --active_count_;
      }
      if (resume_ && !output && !replay_error_) replay_error_ = past_the_replica(worker, result.ordinal);
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
        // A resumed pass: the generators go back where its consumer left
        // them once the batches it received are drawn again (not fetched).
        if (resume_ && next_batch_ == resume_->position.batches.prefix) lanes_->seek_generator();
        try {
          if (!sampler_->next_into(indices_)) {
            sampler_done_ = true;
            if (resume_) replay_error_ = past_the_sampler();
            return;
          }
        } catch (...) {
          if (pass_over_received_sampler_error()) continue;
          sampler_error_ = std::current_exception();
          return;
        }
        const uint64_t batch_index = next_batch_++;
        if (resume_ && resume_->position.batches.contains(batch_index)) continue;
        const int worker = core_->plan.scheduling == Scheduling::round_robin
                               ? static_cast<int>(batch_index % workers)
                               : -1;
        lanes_->submit(worker, batch_index, indices_);
        ++submitted_;
      } else {
        if (active_count_ == 0) return;
        // The next worker in the cycle that still produces (PyTorch's
        // _worker_queue_idx_cycle).
        while (!active_[next_worker_]) next_worker_ = (next_worker_ + 1) % workers;
        lanes_->submit(static_cast<int>(next_worker_), submitted_, {});
        ++submitted_;
        next_worker_ = (next_worker_ + 1) % workers;
      }
    }
  }

  std::shared_ptr<Core> core_;
  std::shared_ptr<EpochProgress> progress_;  // the pass's: what the consumer has received
  std::optional<LoaderResume> resume_;        // a resumed pass: what it passes over
  // Map-style: the graph's first node, driven from fill() (next_into: no
  // allocation per batch).
  std::unique_ptr<nodes::SamplerSource<BatchIndices>> sampler_;
  uint64_t next_batch_ = 0;  // map-style: the sampler's batches drawn this pass
  BatchIndices indices_;  // the sampler's scratch, reused for every batch
  bool sampler_done_ = false;
  std::exception_ptr sampler_error_;  // thrown by the sampler, not yet by next()
  // A resumed pass: its state's position is past the end of the epoch (past
  // the sampler's, or a replica's); thrown by next() at the end.
  std::exception_ptr replay_error_;
  std::deque<uint64_t> sampler_errors_received_;  // a resumed pass: where its consumer got sampler errors, ahead
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
