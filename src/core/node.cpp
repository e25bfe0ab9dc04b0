#include "conveyor/node.h"

#include <string>

#include "conveyor/detail/engine.h"

namespace conveyor {

void ShardSpec::validate() const {
  if (world_size < 1) throw ValueError("ShardSpec: world_size should be >= 1, but got " + std::to_string(world_size));
  if (rank < 0 || rank >= world_size) {
    throw ValueError("ShardSpec: rank should be in [0, " + std::to_string(world_size - 1) + "], but got " +
                     std::to_string(rank));
  }
  if (num_workers < 1) {
    throw ValueError("ShardSpec: num_workers should be >= 1, but got " + std::to_string(num_workers));
  }
  if (worker < 0 || worker >= num_workers) {
    throw ValueError("ShardSpec: worker should be in [0, " + std::to_string(num_workers - 1) + "], but got " +
                     std::to_string(worker));
  }
}

uint64_t item_seed(const PassContext& pass, uint64_t node_id, uint64_t position) noexcept {
  // The work-stealing batch seed's mix, with the node folded into the base.
  return detail::work_stealing_seed(static_cast<int64_t>(pass.seed ^ (node_id * 0x9e3779b97f4a7c15ULL)),
                                    pass.epoch, position);
}

namespace detail {

void throw_node_error(const std::string& node, uint64_t position) {
  try {
    throw;
  } catch (const NodeError&) {
    throw;  // named where it happened, further upstream
  } catch (const std::exception& error) {
    throw NodeError("Caught exception in pipeline node '" + node + "' at item " + std::to_string(position) +
                        ": " + error.what(),
                    node, position);
  } catch (...) {
    throw NodeError("Caught exception in pipeline node '" + node + "' at item " + std::to_string(position) +
                        ": an exception of a type not derived from std::exception",
                    node, position);
  }
}

}  // namespace detail
}  // namespace conveyor
