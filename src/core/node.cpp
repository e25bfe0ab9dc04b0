#include "conveyor/node.h"

#include <algorithm>
#include <cstdio>
#include <limits>
#include <string>
#include <vector>

#include "conveyor/detail/engine.h"
#include "conveyor/detail/seeds.h"

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
  // count() and index() in int64, and a worker's WorkerInfo (id, num_workers) in int.
  constexpr int64_t kMaxShards = std::numeric_limits<int>::max();
  if (world_size > kMaxShards / num_workers) {
    throw ValueError("ShardSpec: world_size x num_workers should be at most " + std::to_string(kMaxShards) +
                     ", but got " + std::to_string(world_size) + " x " + std::to_string(num_workers));
  }
}

std::shared_ptr<detail::Executor> detail::walk_executor(ResetWalk& walk) {
  if (!walk.executor) walk.executor = std::make_shared<Executor>();
  return walk.executor;
}

uint64_t item_seed(const PassContext& pass, uint64_t node_id, uint64_t position, bool past_shard) noexcept {
  // The work-stealing batch seed's mix, with the node (and past the shard
  // point, the shard) folded into the base. One shard: no fold, so a pass
  // draws as it did before shards were counted.
  uint64_t base = pass.seed ^ (node_id * 0x9e3779b97f4a7c15ULL);
  if (past_shard && pass.shard.count() > 1) {
    base ^= (static_cast<uint64_t>(pass.shard.index()) + 1) * 0xbf58476d1ce4e5b9ULL;
  }
  return detail::work_stealing_seed(static_cast<int64_t>(base), pass.epoch, position);
}

std::string metrics_table(const std::vector<NodeMetrics>& nodes) {
  size_t name_width = 4;
  for (const NodeMetrics& node : nodes) name_width = std::max(name_width, node.name.size());
  // The name column is appended, not formatted: a name of any length keeps
  // its row whole. The numbers fit the fixed buffer.
  std::string table;
  const auto name_column = [&](const std::string& name) {
    table += name;
    table.append(name_width - name.size(), ' ');
  };
  char line[256];
  // Waits: for upstream's items, and for downstream to ask (see NodeMetrics).
  name_column("node");
  std::snprintf(line, sizeof line, " %12s %12s %9s %10s %11s %11s %7s %9s\n", "items in", "items out", "skipped",
                "busy s", "up wait s", "down wait s", "window", "in flight");
  table += line;
  for (const NodeMetrics& node : nodes) {
    name_column(node.name);
    std::snprintf(line, sizeof line, " %12llu %12llu %9llu %10.3f %11.3f %11.3f",
                  static_cast<unsigned long long>(node.items_in), static_cast<unsigned long long>(node.items_out),
                  static_cast<unsigned long long>(node.skipped), node.busy_seconds, node.upstream_wait_seconds,
                  node.downstream_wait_seconds);
    table += line;
    if (node.window > 0) {
      std::snprintf(line, sizeof line, " %7zu %9.2f", node.window, node.mean_in_flight);
      table += line;
    }
    table += '\n';
  }
  return table;
}

namespace detail {

void throw_node_error(const std::string& node, uint64_t position) {
  try {
    throw;
  } catch (const std::exception& error) {
    // A NodeError too: every caller's try holds only its own node's work
    // (f, the dataset, a decode), never a pull from upstream, so a NodeError
    // here came out of user code that runs a pipeline of its own, and its
    // node and position are that inner pipeline's, not this one's.
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
