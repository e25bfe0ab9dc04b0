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
#include <limits>
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
#include "conveyor/state.h"
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
    // batch that failed; calling again goes on with the next batch. A
    // warning handler that throws (warnings as errors) about a batch has
    // that batch returned and its error thrown by the next call.
    std::optional<batch_type> next() {
      const auto asked = std::chrono::steady_clock::now();
      struct CountWait {  // counts the wait whether next() returns or throws
        const std::chrono::steady_clock::time_point& asked;
        int64_t& total;
        ~CountWait() { total += detail::nanoseconds_since(asked); }
      } count_wait{asked, wait_ns_};
      // A warning the last batch raised (see below), before anything more
      // is fetched.
      if (warning_error_) std::rethrow_exception(std::exchange(warning_error_, nullptr));
      // Initialised from the call, not assigned: no extra move of the batch.
      std::optional<batch_type> batch = [this] {
        try {
          return source_->next();
        } catch (const TimeoutError&) {
          throw;  // no batch was received: the next call waits for the same one
        } catch (...) {
          progress_->commit_received();  // a failed batch is received in its place
          throw;
        }
      }();
      if (batch) {
        progress_->commit_received();
        // A warning handler that throws (warnings as errors) has its error
        // thrown by the next call: this batch is the consumer's, not lost.
        try {
          note_yielded();
        } catch (...) {
          warning_error_ = std::current_exception();
        }
      } else {
        progress_->commit_end();
        // The epoch's time is up to its end, not up to when metrics are
        // read (after validation, say): the first end fixes it.
        if (wall_ns_at_end_ < 0) wall_ns_at_end_ = detail::nanoseconds_since(started_);
      }
      return batch;
    }

    // Where this epoch's time went so far (see conveyor/metrics.h).
    LoaderMetrics metrics() const {
      LoaderMetrics metrics;
      source_->add_metrics(metrics);
      metrics.batches = yielded_;
      metrics.wait_seconds = static_cast<double>(wait_ns_) * 1e-9;
      const int64_t wall_ns = wall_ns_at_end_ >= 0 ? wall_ns_at_end_ : detail::nanoseconds_since(started_);
      metrics.wall_seconds = static_cast<double>(wall_ns) * 1e-9;
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
        end_progress();
        core_ = std::move(other.core_);
        base_seed_ = other.base_seed_;
        progress_ = std::move(other.progress_);
        source_ = std::move(other.source_);
        transfer_ = std::exchange(other.transfer_, nullptr);
        started_ = other.started_;
        wall_ns_at_end_ = other.wall_ns_at_end_;
        wait_ns_ = other.wait_ns_;
        yielded_ = other.yielded_;
        warning_error_ = std::exchange(other.warning_error_, nullptr);
      }
      return *this;
    }
    // Stops the epoch's workers (see WorkerLanes) and leaves its metrics
    // with the loader: DataLoader::last_metrics(). The loader's next state
    // starts the next epoch.
    ~Epoch() {
      keep_metrics();
      end_progress();
    }

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
          std::unique_ptr<detail::LoaderNode<batch_type>> source, std::shared_ptr<detail::EpochProgress> progress)
        : core_(std::move(core)), base_seed_(base_seed), progress_(std::move(progress)), source_(std::move(source)) {
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

    void end_progress() noexcept {
      if (progress_) progress_->live = false;
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
    std::shared_ptr<detail::EpochProgress> progress_;  // what the consumer has received
    std::unique_ptr<detail::LoaderNode<batch_type>> source_;  // the graph's last node
    detail::TransferStage<batch_type>* transfer_ = nullptr;    // within source_, if any
    std::chrono::steady_clock::time_point started_ = std::chrono::steady_clock::now();
    int64_t wall_ns_at_end_ = -1;  // from started_ to the first end next() saw; -1 before
    int64_t wait_ns_ = 0;
    size_t yielded_ = 0;
    std::exception_ptr warning_error_;  // what the last batch's warning threw, for the next call
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
    if (core.pending_resume && core.pending_resume->epoch != core.epoch) {
      throw StateError("this DataLoader resumes epoch " + std::to_string(core.pending_resume->epoch) +
                       " (load_state_dict), but set_epoch(" + std::to_string(core.epoch) +
                       ") asked for another: call set_epoch(" + std::to_string(core.pending_resume->epoch) +
                       "), or load the state again");
    }
    // Where the epoch starts: a state taken during it replays from here.
    auto progress = std::make_shared<detail::EpochProgress>();
    progress->start = epoch_start();
    // The base seed comes first, before the sampler draws (PyTorch's order);
    // persistent workers draw it once, at their first epoch.
    int64_t base_seed = 0;
    if (core.persistent_base_seed) {
      base_seed = *core.persistent_base_seed;
    } else {
      Generator& generator = core.plan.generator ? *core.plan.generator : default_generator();
      base_seed = draw_seed(generator);
    }
    std::optional<detail::LoaderResume> resume = std::exchange(core.pending_resume, std::nullopt);
    if (resume && resume->base_seed && *resume->base_seed != base_seed) {
      throw StateError("load_state_dict: the resumed epoch drew base seed " + std::to_string(base_seed) +
                       " where the saved one drew " + std::to_string(*resume->base_seed) +
                       ": the loader's generator was drawn from between load_state_dict() and iter()");
    }
    const bool drew_persistent_seed = !core.persistent_base_seed && core.plan.persistent_workers;
    if (drew_persistent_seed) core.persistent_base_seed = base_seed;
    core.resume = resume;
    const uint64_t epoch = core.epoch++;
    progress->epoch = epoch;
    progress->base_seed = base_seed;
    std::shared_ptr<detail::EpochProgress> last_progress = std::exchange(core.progress, progress);
    try {
      return Epoch(core_, base_seed, epoch, make_source(), progress);
    } catch (...) {
      // No epoch started (a sampler's iter() threw, a persistent loader's
      // epoch is still live): the loader stands where it stood, and the
      // next iter() is this one again. A resumed epoch still resumes, from
      // the generators and sampler as loaded; otherwise the draws made stay
      // drawn, as in PyTorch.
      progress->live = false;
      core.progress = std::move(last_progress);
      core.epoch = epoch;
      core.resume.reset();
      if (resume) {
        apply_epoch_start(read_epoch_start(progress->start));
        core.pending_resume = std::move(resume);
      } else if (drew_persistent_seed) {
        core.persistent_base_seed.reset();
      }
      throw;
    }
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

  // ---- checkpoints -------------------------------------------------------
  //
  // state_dict(): where the loader stands, as its consumer has received it
  // (never what is prefetched): in the middle of the epoch started last,
  // after the batches next() has returned (failed ones included), or, with
  // no epoch going on, before the next. load_state_dict() into a loader
  // built the same way (a new process, say) makes its next epoch hand out
  // exactly the batches the saved one had not, then the epochs after it, bit
  // for bit. It replays, it does not store: the epoch restarts from its
  // generators as they were when it began, draws the received batches from
  // the sampler again without fetching them, and under round_robin puts each
  // worker's generator where it stood after its last received batch.
  //
  // The state holds the loader's generators (its own, or the process's
  // default_generator() when it has none and when a sampler draws from it),
  // the sampler's state (Sampler::state()), counts, and a fingerprint of what
  // must match: the dataset's type and size, the sampler and its parameters,
  // batching, the schedule, and under round_robin (iterable datasets always)
  // the number of workers. A different num_workers resumes under
  // work_stealing; round_robin refuses it, saying why.
  //
  // What it cannot see: draws from the loader's generator outside the loader
  // (give the loader a seed), and a dataset's own state (set_epoch() is
  // yours to call as before; an iterable dataset's replicas are made anew
  // and passed over with SampleIterator::skip()).
  State state_dict() const {
    const Core& core = *core_;
    const detail::EpochProgress* progress = core.progress.get();
    const bool epoch_live = progress && progress->live && !progress->ended;
    // A loaded state whose epoch has not begun yet: the loader stands
    // exactly there (saved again now, it must not restart that epoch).
    if (!epoch_live && core.pending_resume) return *core.pending_resume_state;
    State state = state_envelope("conveyor.DataLoader", fingerprint());
    if (epoch_live) {
      state.set("next_epoch", progress->epoch);
      state.set("start", progress->start);
      State epoch = detail::position_to_state(progress->position);
      epoch.set("epoch", progress->epoch);
      epoch.set("base_seed", progress->base_seed);
      // In the consumer's thread with nothing copied ahead, the process
      // generator as it is now: the consumer's own draws between batches
      // included.
      if (core.plan.num_workers == 0 && core.plan.scheduling == Scheduling::round_robin &&
          core.plan.prefetch_to_device == 0 && !progress->seek_pending) {
        State now = State::array();
        now.push_back(detail::generator_to_state(checked_position(default_generator(), "the process's")));
        epoch.set("generators", std::move(now));
      }
      state.set("epoch", std::move(epoch));
    } else {
      state.set("next_epoch", core.epoch);
      state.set("start", epoch_start());
      // Persistent round_robin workers carry their generators into the next
      // epoch: where each stands now (the pool is idle between epochs).
      if (core.persistent_pool && core.plan.scheduling == Scheduling::round_robin) {
        State workers = State::array();
        for (const auto& position : core.persistent_pool->generator_positions()) {
          workers.push_back(detail::generator_to_state(checked_position_of(position, "a worker's")));
        }
        state.set("workers", std::move(workers));
      }
    }
    return state;
  }

  // Loads a state_dict() into this loader, whose next iter() then resumes
  // it. Throws StateError when the state is not a DataLoader's, is of
  // another version, or its fingerprint differs (naming the field), and
  // RuntimeError while an epoch of this loader is live.
  void load_state_dict(const State& state) {
    Core& core = *core_;
    if (core.progress && core.progress->live && !core.progress->ended) {
      throw RuntimeError("load_state_dict: an epoch of this DataLoader is still live; finish or destroy it first");
    }
    refuse_other_worker_count(state);
    check_state_envelope(state, "conveyor.DataLoader", fingerprint(), "load_state_dict");
    const uint64_t next_epoch = state.uint_at("next_epoch");
    const EpochStart start = read_epoch_start(state.at("start"));
    std::optional<detail::LoaderResume> resume;
    if (const State* epoch = state.find("epoch")) {
      resume.emplace();
      resume->position = detail::epoch_position_from_state(*epoch);
      resume->base_seed = epoch->int_at("base_seed");
      check_resume(resume->position);
    } else if (const State* workers = state.find("workers")) {
      resume.emplace();
      resume->between_epochs = true;
      for (const State& position : workers->items()) {
        resume->position.generators.push_back(detail::generator_from_state(position));
      }
      if (resume->position.generators.size() != core.plan.num_workers) {
        throw StateError("load_state_dict: the state holds " + std::to_string(resume->position.generators.size()) +
                         " workers' generators for a loader with num_workers=" + std::to_string(core.plan.num_workers));
      }
      // An iterable's replicas start there, before their iter() (whose
      // draws, a shuffle's seed, the epoch keeps), as a persistent pool's
      // next epoch does: set after it, the generator went back over them.
      if (core.plan.kind == detail::DatasetKind::iterable) {
        resume->position.start_generators = resume->position.generators;
      }
    }
    // Everything is read and checked, the generators' texts on scratch
    // engines: now change the loader, the sampler first (its own checks may
    // refuse; nothing has changed then).
    apply_epoch_start(start);
    core.epoch = next_epoch;
    if (resume) resume->epoch = next_epoch;
    core.pending_resume_state = resume ? std::optional<State>(state) : std::nullopt;
    core.pending_resume = std::move(resume);
    core.progress.reset();
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

  // ---- checkpoints ----

  // What a state must match to be loaded here.
  State fingerprint() const {
    const Core& core = *core_;
    const detail::LoaderPlan& plan = core.plan;
    State out = State::object();
    out.set("dataset", detail::type_name(typeid(D)));
    out.set("auto_collation", plan.auto_collation);
    if constexpr (MapStyleDataset<D>) {
      out.set("dataset_size", static_cast<uint64_t>(core.dataset->size()));
      out.set("sampler", plan.index_sampler->fingerprint());
    } else {
      out.set("batch_size", static_cast<uint64_t>(plan.batch_size));
      out.set("drop_last", plan.drop_last);
    }
    const bool round_robin = plan.scheduling == Scheduling::round_robin;
    out.set("scheduling", round_robin ? "round_robin" : "work_stealing");
    // round_robin's draws depend on which worker makes a batch, and an
    // iterable dataset's split on how many replicas there are.
    if (round_robin) out.set("num_workers", static_cast<uint64_t>(plan.num_workers));
    // Persistent workers draw one base seed for all epochs.
    out.set("persistent_workers", plan.persistent_workers);
    // Which generators the state's generator texts belong to.
    out.set("own_generator", plan.generator.has_value());
    out.set("sampler_draws_process_generator",
            plan.index_sampler != nullptr && plan.index_sampler->draws_from_default_generator());
    return out;
  }

  // The generators and sampler as an epoch starts from them.
  State epoch_start() const {
    const Core& core = *core_;
    State start = State::object();
    start.set("generator", generator_text(core.plan.generator ? *core.plan.generator : default_generator()));
    // The process's generator too, where it draws the epoch's data beside
    // a generator of the loader's own: a sampler drawing from it, or the
    // dataset read in the consumer's thread under round_robin (PyTorch's
    // single-process loading). Else a state taken between epochs lost it.
    const bool sampler_draws_process =
        core.plan.index_sampler && core.plan.index_sampler->draws_from_default_generator();
    const bool dataset_draws_process = core.plan.num_workers == 0 && core.plan.scheduling == Scheduling::round_robin;
    if (core.plan.generator && (sampler_draws_process || dataset_draws_process)) {
      start.set("process_generator", generator_text(default_generator()));
    }
    if (core.plan.index_sampler) start.set("sampler", core.plan.index_sampler->state());
    start.set("persistent_base_seed",
              core.persistent_base_seed ? State(*core.persistent_base_seed) : State());
    return start;
  }

  // An epoch_start() read back and checked: what apply_epoch_start() puts
  // back, all of it read before the loader changes (a field read while
  // applying left a refused state half loaded).
  struct EpochStart {
    const State* sampler = nullptr;  // within the state read
    std::string generator;
    std::optional<std::string> process_generator;
    std::optional<int64_t> persistent_base_seed;
  };
  EpochStart read_epoch_start(const State& start) const {
    EpochStart out;
    if (core_->plan.index_sampler) out.sampler = &start.at("sampler");
    out.generator = start.string_at("generator");
    check_generator_text(out.generator, "start.generator");
    if (const State* process = start.find("process_generator")) {
      out.process_generator = process->as_string("process_generator");
      check_generator_text(*out.process_generator, "start.process_generator");
    }
    const State& persistent = start.at("persistent_base_seed");
    if (!persistent.is_null()) out.persistent_base_seed = persistent.as_int("persistent_base_seed");
    return out;
  }

  // Puts the generators, sampler and persistent base seed back as
  // epoch_start() saw them. Only the sampler's load_state() may refuse, and
  // it goes first.
  void apply_epoch_start(const EpochStart& start) {
    Core& core = *core_;
    if (start.sampler) core.plan.index_sampler->load_state(*start.sampler);
    restore_generator(core.plan.generator ? *core.plan.generator : default_generator(), start.generator);
    if (start.process_generator) restore_generator(default_generator(), *start.process_generator);
    core.persistent_base_seed = start.persistent_base_seed;
  }

  static std::string generator_text(const Generator& generator) {
    const std::vector<uint8_t> bytes = generator.get_state();
    return std::string(bytes.begin(), bytes.end());
  }
  static void check_generator_text(const std::string& text, const char* field) {
    try {
      Generator scratch;
      restore_generator(scratch, text);
    } catch (const std::exception& error) {
      throw StateError(std::string("load_state_dict: '") + field + "' is not a generator's state: " + error.what());
    }
  }
  static void restore_generator(Generator& generator, const std::string& text) {
    generator.set_state(std::span(reinterpret_cast<const uint8_t*>(text.data()), text.size()));
  }
  static GeneratorPosition checked_position_of(const std::optional<GeneratorPosition>& position, const char* whose) {
    if (!position) {
      throw RuntimeError(std::string("state_dict: ") + whose +
                         " generator does not count its draws (a torch::Generator's engine?), so its "
                         "place cannot be saved; use conveyor's own Generator");
    }
    return *position;
  }
  static GeneratorPosition checked_position(const Generator& generator, const char* whose) {
    return checked_position_of(generator.position(), whose);
  }

  // round_robin (and iterable datasets) cannot resume with another number
  // of workers: say why, before the fingerprint's plainer message.
  void refuse_other_worker_count(const State& state) const {
    const State* saved = state.find("fingerprint");
    if (!saved || !saved->is_object()) return;
    const State* workers = saved->find("num_workers");
    const detail::LoaderPlan& plan = core_->plan;
    if (!workers || plan.scheduling != Scheduling::round_robin) return;
    const uint64_t saved_workers = workers->as_uint("num_workers");
    if (saved_workers == plan.num_workers) return;
    const std::string counts = "the state was saved with num_workers=" + std::to_string(saved_workers) +
                               " and this loader has num_workers=" + std::to_string(plan.num_workers);
    if (plan.kind == detail::DatasetKind::iterable) {
      throw StateError("load_state_dict: " + counts +
                       ". An iterable dataset is split among its workers' replicas (each reads its own "
                       "part), so another count reads other parts: resume with num_workers=" +
                       std::to_string(saved_workers));
    }
    throw StateError("load_state_dict: " + counts +
                     ". Under round_robin batch k is made by worker k % num_workers, drawing from that "
                     "worker's generator, so another count changes the draws inside the dataset: resume "
                     "with num_workers=" +
                     std::to_string(saved_workers) +
                     ", or train under Scheduling::work_stealing, whose batches draw from their own seeds "
                     "and resume with any num_workers");
  }

  void check_resume(const detail::EpochPosition& position) const {
    const detail::LoaderPlan& plan = core_->plan;
    const bool iterable = plan.kind == detail::DatasetKind::iterable;
    const size_t lanes = plan.num_workers == 0 ? 1 : plan.num_workers;
    if (iterable != !position.lanes.empty() || (iterable && position.lanes.size() != lanes)) {
      throw StateError("load_state_dict: the state's epoch was saved with " + std::to_string(position.lanes.size()) +
                       " replicas, this loader has " + std::to_string(iterable ? lanes : 0));
    }
    // A replica passes over its prefix by skipping prefix x batch_size
    // samples: a product that wraps would skip next to none.
    const uint64_t wanted = plan.auto_collation ? plan.batch_size : 1;
    for (size_t lane = 0; lane < position.lanes.size(); ++lane) {
      uint64_t samples = 0;
      if (__builtin_mul_overflow(position.lanes[lane].prefix, wanted, &samples)) {
        throw StateError("load_state_dict: 'lanes[" + std::to_string(lane) + "].prefix' (" +
                         std::to_string(position.lanes[lane].prefix) + ") batches of " + std::to_string(wanted) +
                         " samples are more samples than a replica can pass over (2^64)");
      }
    }
    // A worker's next batch after one received out of turn is that batch +
    // num_workers: a number that wraps would seed another batch's draws.
    if (!position.batches.beyond.empty() &&
        position.batches.beyond.back() > std::numeric_limits<uint64_t>::max() - plan.num_workers) {
      throw StateError("load_state_dict: 'beyond' lists batch " + std::to_string(position.batches.beyond.back()) +
                       ", past any epoch (batches are counted in 64 bits)");
    }
    const size_t generators = plan.scheduling == Scheduling::round_robin ? lanes : 0;
    if (position.generators.size() > generators) {
      throw StateError("load_state_dict: the state's epoch holds " + std::to_string(position.generators.size()) +
                       " worker generators, this loader has " + std::to_string(generators));
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
