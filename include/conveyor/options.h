// conveyor/options.h: the DataLoader's options, PyTorch's set plus
// conveyor's scheduling choices.
//
// Designated initialisers must follow the declaration order below:
//   {.batch_size = 64, .shuffle = true, .num_workers = 8,
//    .prefetch_factor = 2, .pin_memory = true, .seed = 42}
// Every member has a default initialiser, so partial designated
// initialisers compile cleanly under -Wextra. Invalid combinations throw ValueError at construction with the message
// PyTorch gives for the same mistake.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>

#include "conveyor/generator.h"
#include "conveyor/sampler.h"
#include "conveyor/transfer.h"

namespace conveyor {

// How batches of a map-style dataset are assigned to workers, and where the
// random draws inside the dataset (default_generator()) come from.
// Iterable datasets always run PyTorch's way: one replica per worker, batches
// taken round-robin, each worker drawing from its own stream.
enum class Scheduling {
  // The default. Any free worker takes the next batch, and each batch's
  // default_generator() is a Generator::for_item (xoshiro256**, cheap to
  // seed) seeded from (base_seed, epoch, batch), also
  // without workers: augmentations are the same for any num_workers, 0
  // included, and a slow batch never idles the others (LibTorch's C++
  // loader shares one queue the same way). The sampler's order is PyTorch's
  // either way; only draws inside the dataset differ from PyTorch's workers.
  work_stealing,
  // PyTorch's workers exactly: batch k runs on worker k % num_workers, each
  // worker fetches its batches in order, worker w's default_generator() is
  // the stream seeded base_seed + w (the process's generator without
  // workers), so draws inside a dataset equal PyTorch's. A straggler holds up
  // the batches queued behind it on its worker.
  round_robin,
};

struct LoaderOptions {
  // Samples per batch; std::nullopt turns auto-batching off (each sample is
  // handed out alone, through a collate function that takes one sample).
  std::optional<int64_t> batch_size = 1;
  // Reshuffle every epoch (a RandomSampler over the dataset).
  bool shuffle = false;
  // Where indices come from; mutually exclusive with shuffle.
  std::shared_ptr<Sampler<size_t>> sampler{};
  // Where whole batches of indices come from; mutually exclusive with
  // batch_size, shuffle, sampler and drop_last.
  std::shared_ptr<Sampler<BatchIndices>> batch_sampler{};
  // Worker threads; 0 loads in the consumer's thread.
  int num_workers = 0;
  // Batches in flight per worker: the reorder window holds
  // prefetch_factor * num_workers batches.
  int prefetch_factor = 2;
  // Keep workers, their threads and state alive across epochs.
  bool persistent_workers = false;
  // Collate batches straight into page-locked memory from transfer_device
  // (without a device: a warning, and ordinary memory, as PyTorch does).
  bool pin_memory = false;
  std::string pin_memory_device{};
  // Where pinned batches go: conveyor::cuda::select_transfer_device(), or
  // make_host_standin_device() for tests.
  std::shared_ptr<TransferDevice> transfer_device{};
  // Batches copied to the device ahead of the consumer (0: none). Each is
  // handed out with its device copy and ready event (Epoch::device()).
  int prefetch_to_device = 0;
  // Drop the last, incomplete batch.
  bool drop_last = false;
  // Seconds next() may wait for a batch before throwing TimeoutError; 0 waits
  // forever. Needs num_workers > 0 (without workers nothing runs to wait for).
  double timeout = 0;
  // Called once on each worker (with its id) before it loads anything.
  std::function<void(int)> worker_init_fn{};
  // Draws the loader's base seed each epoch and, with shuffle, the order.
  std::optional<Generator> generator{};
  // Shorthand for generator = Generator(seed).
  std::optional<uint64_t> seed{};
  // Hand batches out in sampler order (true) or as soon as each is ready.
  bool in_order = true;
  Scheduling scheduling = Scheduling::work_stealing;
};

}  // namespace conveyor
