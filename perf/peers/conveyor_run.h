// What both conveyor drivers share: the loader's options for the suite, the
// timing protocol (workloads.h's drive()), conveyor's metrics over the timed
// phase, and the JSON line.
#pragma once

#include <conveyor/conveyor.h>

#include <cstdio>
#include <optional>
#include <string>
#include <tuple>

#include "workloads.h"

namespace perf {

// How many samples a batch holds: its first dimension, or that of its first
// part. Overloads for other batch types live with their driver.
template <class T>
size_t batch_length(const conveyor::Array<T>& array) {
  return array.shape().empty() ? 0 : static_cast<size_t>(array.shape()[0]);
}
template <class... Ts>
size_t batch_length(const std::tuple<Ts...>& batch) {
  return batch_length(std::get<0>(batch));
}

struct MetricsSum {
  double fetch = 0, collate = 0, wait = 0, wall = 0, in_flight_weighted = 0;
  int64_t batches = 0;
  size_t window = 0;
  void add(const conveyor::LoaderMetrics& m, double sign) {
    fetch += sign * m.fetch_seconds;
    collate += sign * m.collate_seconds;
    wait += sign * m.wait_seconds;
    wall += sign * m.wall_seconds;
    in_flight_weighted += sign * m.mean_in_flight * static_cast<double>(m.batches);
    batches += (sign > 0 ? 1 : -1) * static_cast<int64_t>(m.batches);
    window = m.window;
  }
};

// Runs `dataset` through conveyor::DataLoader under the suite's protocol and
// prints the JSON line with `peer`, conveyor's metrics and `note`.
template <class D>
int run_conveyor(const Args& args, D& dataset, const std::string& peer, const std::string& note = "") {
  conveyor::LoaderOptions options;
  options.batch_size = args.batch_size;
  options.num_workers = args.workers;
  options.prefetch_factor = args.prefetch_factor;
  options.persistent_workers = args.workers > 0;
  options.seed = 0;
  options.in_order = args.in_order != 0;
  if (!args.scheduling.empty()) {
    options.scheduling = args.scheduling == "work_stealing" ? conveyor::Scheduling::work_stealing
                                                            : conveyor::Scheduling::round_robin;
  }
  conveyor::DataLoader loader(dataset, options);
  using Loader = decltype(loader);
  std::optional<typename Loader::Epoch> epoch;
  MetricsSum sum;
  auto close_epoch = [&] {
    if (epoch) {
      sum.add(epoch->metrics(), +1);
      epoch.reset();
    }
  };
  bool timing = false;
  Result result = drive(
      args,
      [&] {
        if (timing) close_epoch();
        else epoch.reset();
        epoch.emplace(loader.iter());
      },
      [&](size_t& samples) {
        auto batch = epoch->next();
        if (!batch) return false;
        samples = batch_length(*batch);
        return true;
      },
      [&] {
        timing = true;
        // The warm-up epoch's share so far is not the timed phase's.
        if (epoch) sum.add(epoch->metrics(), -1);
      });
  close_epoch();
  result.peer = peer;
  const double stall = sum.wall > 0 ? sum.wait / sum.wall : 0;
  char extra[512];
  std::snprintf(extra, sizeof extra,
                ",\"metrics\":{\"batches\":%lld,\"stall_pct\":%.3f,\"fetch_s\":%.6f,\"collate_s\":%.6f,"
                "\"wait_s\":%.6f,\"wall_s\":%.6f,\"mean_in_flight\":%.3f,\"window\":%zu}%s",
                static_cast<long long>(sum.batches), 100 * stall, sum.fetch, sum.collate, sum.wait,
                sum.wall, sum.batches ? sum.in_flight_weighted / static_cast<double>(sum.batches) : 0.0,
                sum.window, note.c_str());
  result.extra = extra;
  print_result(args, result);
  return 0;
}

}  // namespace perf
