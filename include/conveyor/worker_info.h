// conveyor/worker_info.h: what a dataset learns about the worker running it.
#pragma once

#include <cstdint>
#include <typeinfo>

#include "conveyor/errors.h"

namespace conveyor {

// torch.utils.data.get_worker_info()'s fields. `seed` is base_seed + id, the
// seed PyTorch gives worker `id`; the worker's conveyor::default_generator()
// starts from it.
struct WorkerInfo {
  int id = 0;
  int num_workers = 0;
  uint64_t seed = 0;
  // conveyor's own: how many ranks the num_workers shares span. A pipeline
  // sharded by ShardSpec hands its rank x worker share to an iterable
  // dataset as one worker of world_size x num_workers; a DataLoader's
  // workers span one rank (1).
  int num_ranks = 1;

  // The loader's dataset, as its concrete type D. Throws TypeError when the
  // dataset is not a D.
  template <class D>
  D& dataset() const {
    if (dataset_type_ == nullptr || *dataset_type_ != typeid(D)) {
      throw TypeError(std::string("WorkerInfo::dataset<") + typeid(D).name() +
                      ">(): the loader's dataset is a " +
                      (dataset_type_ ? dataset_type_->name() : "(none)"));
    }
    return *static_cast<D*>(dataset_);
  }

  // Set by the loader.
  template <class D>
  void set_dataset(D* dataset) noexcept {
    dataset_ = dataset;
    dataset_type_ = &typeid(D);
  }

 private:
  void* dataset_ = nullptr;
  const std::type_info* dataset_type_ = nullptr;
};

// The WorkerInfo of the worker running the calling code, or nullptr on any
// other thread (the consumer's, with num_workers == 0), as PyTorch returns None.
const WorkerInfo* get_worker_info() noexcept;

}  // namespace conveyor
