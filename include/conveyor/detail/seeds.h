// conveyor/detail/seeds.h: the seeds that make draws independent of the
// number of workers.
#pragma once

#include <cstdint>

namespace conveyor::detail {

// The seed of batch `batch_index`'s generator under work_stealing (and, with
// the node folded into the base, of a pipeline item's): the same for any
// number of workers, 0 included.
uint64_t work_stealing_seed(int64_t base_seed, uint64_t epoch, uint64_t batch_index);

}  // namespace conveyor::detail
