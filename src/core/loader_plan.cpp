#include "conveyor/detail/loader_plan.h"

#include <sched.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <thread>
#include <utility>

#include "conveyor/detail/buffer_pool.h"
#include "conveyor/errors.h"
#include "conveyor/warnings.h"

namespace conveyor::detail {
namespace {

// A sampler's indices as batches of one: the index sampler when
// auto-batching is off, so every path hands the engine BatchIndices.
class SingletonBatches final : public Sampler<BatchIndices> {
 public:
  explicit SingletonBatches(std::shared_ptr<Sampler<size_t>> sampler)
      : sampler_(std::move(sampler)) {}
  size_t size() const override { return sampler_->size(); }
  void set_epoch(uint64_t epoch) override { sampler_->set_epoch(epoch); }
  std::string name() const override { return sampler_->name(); }
  State state() const override { return sampler_->state(); }
  void load_state(const State& state) override { sampler_->load_state(state); }
  State fingerprint() const override { return sampler_->fingerprint(); }
  bool draws_from_default_generator() const override { return sampler_->draws_from_default_generator(); }
  std::unique_ptr<SamplerIterator<BatchIndices>> iter() override {
    class Iterator final : public SamplerIterator<BatchIndices> {
     public:
      explicit Iterator(std::unique_ptr<SamplerIterator<size_t>> inner) : inner_(std::move(inner)) {}
      bool next(BatchIndices& out) override {
        size_t index = 0;
        if (!inner_->next(index)) return false;
        out.assign(1, index);
        return true;
      }

     private:
      std::unique_ptr<SamplerIterator<size_t>> inner_;
    };
    return std::make_unique<Iterator>(sampler_->iter());
  }

 private:
  std::shared_ptr<Sampler<size_t>> sampler_;
};

// CPUs this process may run on (PyTorch: len(os.sched_getaffinity(0))).
size_t usable_cpus() {
#ifdef __linux__
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof set, &set) == 0) return static_cast<size_t>(CPU_COUNT(&set));
#endif
  return std::max(1u, std::thread::hardware_concurrency());
}

// PyTorch's _check_worker_number_rationality, at construction: more workers
// than CPUs may be what an I/O-bound loader wants, but it should be a choice.
void check_worker_count(size_t workers) {
  const size_t cpus = usable_cpus();
  if (workers <= cpus) return;
  warn_once("This DataLoader will create " + std::to_string(workers) +
       " worker threads in total. Our suggested max number of worker in current system is " +
       std::to_string(cpus) +
       ", which is smaller than what this DataLoader is going to create. Please be aware that "
       "excessive worker creation might get DataLoader running slow or even freeze, lower the "
       "worker number to avoid potential slowness/freeze if necessary.");
}

}  // namespace

LoaderPlan plan_loader(const LoaderOptions& options, DatasetKind kind, DataSize map_size) {
  if (options.num_workers < 0) {
    throw ValueError(
        "num_workers option should be non-negative; use num_workers=0 to disable "
        "multiprocessing.");
  }
  if (static_cast<size_t>(options.num_workers) > kMaxWorkers) {
    throw ValueError("num_workers option should be at most " + std::to_string(kMaxWorkers) +
                     " (each worker is a thread), but got num_workers=" +
                     std::to_string(options.num_workers));
  }
  if (options.timeout < 0 || std::isnan(options.timeout)) {
    throw ValueError("timeout option should be non-negative");
  }
  if (options.num_workers == 0 && options.prefetch_factor != 2) {
    throw ValueError(
        "prefetch_factor option could only be specified in multiprocessing.let num_workers > 0 "
        "to enable multiprocessing.");
  }
  if (options.prefetch_factor <= 0) {  // Python: a bare assert
    throw ValueError("prefetch_factor option should be positive, but got prefetch_factor=" +
                     std::to_string(options.prefetch_factor));
  }
  const size_t window = static_cast<size_t>(options.num_workers) * static_cast<size_t>(options.prefetch_factor);
  if (window > kMaxWindow) {
    throw ValueError("prefetch_factor option asks for prefetch_factor * num_workers = " +
                     std::to_string(options.prefetch_factor) + " * " +
                     std::to_string(options.num_workers) + " = " + std::to_string(window) +
                     " batches in flight, more than the " + std::to_string(kMaxWindow) +
                     " a reorder window holds; lower prefetch_factor");
  }
  if (options.persistent_workers && options.num_workers == 0) {
    throw ValueError("persistent_workers option needs num_workers > 0");
  }
  if (kind == DatasetKind::iterable) {
    if (options.shuffle) {
      throw ValueError(
          "DataLoader with IterableDataset: expected unspecified shuffle option, but got "
          "shuffle=True");
    }
    if (options.sampler) {
      throw ValueError(
          "DataLoader with IterableDataset: expected unspecified sampler option, but got "
          "sampler=<" + options.sampler->name() + ">");
    }
    if (options.batch_sampler) {
      throw ValueError(
          "DataLoader with IterableDataset: expected unspecified batch_sampler option, but got "
          "batch_sampler=<" + options.batch_sampler->name() + ">");
    }
  }
  if (options.sampler && options.shuffle) {
    throw ValueError("sampler option is mutually exclusive with shuffle");
  }
  // Plain values, not std::optional: GCC 12 misreads optional copies as
  // maybe-uninitialized here.
  bool batching = options.batch_size.has_value();
  const int64_t batch_size = options.batch_size.value_or(0);
  bool drop_last = options.drop_last;
  if (options.batch_sampler) {
    if (!batching || batch_size != 1 || options.shuffle || options.sampler || drop_last) {
      throw ValueError(
          "batch_sampler option is mutually exclusive with batch_size, shuffle, sampler, and "
          "drop_last");
    }
    batching = false;
    drop_last = false;
  } else if (!batching && drop_last) {
    throw ValueError(
        "batch_size=None option disables auto-batching and is mutually exclusive with drop_last");
  }

  LoaderPlan plan;
  plan.kind = kind;
  plan.drop_last = drop_last;
  if (options.generator) plan.generator = options.generator;
  if (options.seed) plan.generator = Generator(*options.seed);
  plan.auto_collation = options.batch_sampler != nullptr || batching;

  if (kind == DatasetKind::map) {
    std::shared_ptr<Sampler<size_t>> sampler = options.sampler;
    if (!sampler) {
      if (options.shuffle) {
        sampler = std::make_shared<RandomSampler>(map_size, false, std::nullopt, plan.generator);
      } else {
        sampler = std::make_shared<SequentialSampler>(map_size);
      }
    }
    if (options.batch_sampler) {
      plan.index_sampler = options.batch_sampler;
    } else if (batching) {
      plan.index_sampler = std::make_shared<BatchSampler>(sampler, batch_size, drop_last);
    } else {
      plan.index_sampler = std::make_shared<SingletonBatches>(sampler);
    }
  } else if (batching) {
    if (batch_size <= 0) {
      throw ValueError("batch_size should be a positive integer value, but got batch_size=" +
                       std::to_string(batch_size));
    }
    plan.batch_size = static_cast<size_t>(batch_size);
  }

  // conveyor's own checks, after PyTorch's: options PyTorch would refuse
  // get PyTorch's message first.
  if (options.num_workers == 0 && options.timeout > 0) {
    // PyTorch asserts timeout == 0 when its single-process iterator starts.
    throw ValueError("timeout option (" + std::to_string(options.timeout) +
                     ") needs num_workers > 0: without workers, next() makes the batch itself and has no one to "
                     "wait for; set timeout=0 or num_workers > 0");
  }
  if (options.prefetch_to_device < 0 || static_cast<size_t>(options.prefetch_to_device) > kMaxWindow) {
    throw ValueError("prefetch_to_device option should be in [0, " + std::to_string(kMaxWindow) +
                     "], but got prefetch_to_device=" + std::to_string(options.prefetch_to_device));
  }
  if (options.prefetch_to_device > 0 && !options.pin_memory) {
    throw ValueError("prefetch_to_device needs pin_memory=True: device copies start from pinned memory");
  }
  if (options.generator && options.seed) {
    throw ValueError("generator and seed options are mutually exclusive: seed=S is shorthand "
                     "for generator=Generator(S)");
  }

  plan.num_workers = static_cast<size_t>(options.num_workers);
  plan.window = window;
  check_worker_count(plan.num_workers);
  // Clamped so that an enormous timeout cannot overflow the nanosecond count.
  plan.timeout = std::chrono::duration_cast<std::chrono::nanoseconds>(
      std::chrono::duration<double>(std::min(options.timeout, 1e9)));
  plan.persistent_workers = options.persistent_workers;
  plan.in_order = options.in_order;
  if (!options.pin_memory_device.empty() && !options.pin_memory) {
    warn(  // PyTorch's words
        "pin memory device is set and pin_memory flag is not used then device pinned memory won't be "
        "usedplease set pin_memory to true, if you need to use the device pin memory");
  }
  if (options.pin_memory) {
    if (!options.transfer_device) {
      warn("'pin_memory' argument is set as true but no accelerator is found, then device pinned "
           "memory won't be used. (Give LoaderOptions::transfer_device, e.g. "
           "conveyor::cuda::select_transfer_device().)");
    } else {
      plan.transfer_device = options.transfer_device;
      plan.prefetch_to_device = static_cast<size_t>(options.prefetch_to_device);
      // Enough idle buffers per size class for the window, the batches
      // copying ahead and the consumer's: the pool never grows per batch.
      plan.batch_allocator =
          make_pinned_allocator(plan.transfer_device, plan.window + plan.prefetch_to_device + 2);
    }
  }
  // An iterable dataset's batches come from per-worker replicas in
  // PyTorch's rotation; nothing there to steal, and each replica draws from
  // its worker's stream.
  plan.scheduling = kind == DatasetKind::iterable ? Scheduling::round_robin : options.scheduling;
  plan.worker_init_fn = options.worker_init_fn;
  return plan;
}

}  // namespace conveyor::detail
