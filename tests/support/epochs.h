// Walking an epoch that may throw WorkerErrors along the way.
#pragma once

#include <conveyor/errors.h>

#include <string>
#include <vector>

namespace conveyor::testing {

// Goes through `epoch` to its end: each batch is recorded as describe(batch),
// each WorkerError as "error@<batch seq>" after check(error) looks at it.
template <class Epoch, class Describe, class Check>
std::vector<std::string> walk_epoch(Epoch& epoch, Describe describe, Check check) {
  std::vector<std::string> events;
  while (true) {
    try {
      auto batch = epoch.next();
      if (!batch) break;
      events.push_back(describe(*batch));
    } catch (const WorkerError& error) {
      check(error);
      events.push_back("error@" + std::to_string(error.context().batch_seq));
    }
  }
  return events;
}

}  // namespace conveyor::testing
