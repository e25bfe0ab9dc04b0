// conveyor/detail/loader_plan.h: LoaderOptions checked and resolved once into
// the immutable plan the rest of the loader reads.
#pragma once

#include <chrono>
#include <cstddef>
#include <functional>
#include <memory>
#include <optional>

#include "conveyor/buffer.h"
#include "conveyor/options.h"
#include "conveyor/sampler.h"

namespace conveyor::detail {

enum class DatasetKind { map, iterable };

struct LoaderPlan {
  DatasetKind kind = DatasetKind::map;
  // Batches are collated from vectors of samples (else: one sample at a time).
  bool auto_collation = true;
  // Iterable datasets: samples per batch (auto_collation only).
  size_t batch_size = 1;
  bool drop_last = false;
  // Map-style: the batches of indices (batches of one without auto_collation).
  std::shared_ptr<Sampler<BatchIndices>> index_sampler;
  // The loader's generator; nullopt draws from default_generator().
  std::optional<Generator> generator;
  size_t num_workers = 0;
  // Reorder window: prefetch_factor * num_workers slots (0 without workers).
  size_t window = 0;
  std::chrono::nanoseconds timeout{0};  // zero: wait forever
  bool persistent_workers = false;
  bool in_order = true;
  // pin_memory with a device: the pinned pool collate allocates from, and the
  // device; prefetch_to_device copies run that many batches ahead.
  std::shared_ptr<BufferAllocator> batch_allocator;
  std::shared_ptr<TransferDevice> transfer_device;
  size_t prefetch_to_device = 0;
  // round_robin for iterable datasets, whatever the option said.
  Scheduling scheduling = Scheduling::work_stealing;
  std::function<void(int)> worker_init_fn;
};

// What a loader accepts at most: worker threads, and batches in flight in a
// reorder window (prefetch_factor * num_workers) or ahead on the device.
inline constexpr size_t kMaxWorkers = 1024;
inline constexpr size_t kMaxWindow = size_t{1} << 20;

// Checks `options` in PyTorch's order, with PyTorch's messages (ValueError),
// and builds the default samplers. `map_size` reads a map-style dataset's
// size; the default samplers call it at every pass, as Python reads len().
LoaderPlan plan_loader(const LoaderOptions& options, DatasetKind kind, DataSize map_size);

}  // namespace conveyor::detail
