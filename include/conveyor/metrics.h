// conveyor/metrics.h: what an epoch spent where. DataLoader::Epoch::metrics().
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <string>

namespace conveyor {

struct LoaderMetrics {
  uint64_t batches = 0;          // handed to the consumer
  double fetch_seconds = 0;      // in get / get_batch / replicas, summed over workers
  double collate_seconds = 0;    // in the collate function, summed over workers
  double transfer_seconds = 0;   // queueing device copies, on the consumer's thread
  double wait_seconds = 0;       // the consumer blocked in next()
  double wall_seconds = 0;       // from the epoch's start to its end (to now, while it runs)
  double mean_in_flight = 0;     // batches in the window when the consumer asked
  size_t window = 0;             // prefetch_factor x num_workers (0 without workers)

  // The share of the epoch the consumer spent waiting for data.
  double stall_fraction() const { return wall_seconds > 0 ? wait_seconds / wall_seconds : 0; }

  // One line for logs.
  std::string summary() const {
    char line[256];
    std::snprintf(line, sizeof line,
                  "%llu batches in %.3f s: fetch %.3f s, collate %.3f s, transfer %.3f s (worker "
                  "time); consumer stall %.1f%%; window %.1f/%zu in flight",
                  static_cast<unsigned long long>(batches), wall_seconds, fetch_seconds,
                  collate_seconds, transfer_seconds, 100 * stall_fraction(), mean_in_flight, window);
    return line;
  }
};

}  // namespace conveyor
