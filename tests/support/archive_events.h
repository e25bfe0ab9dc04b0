// The archives untar's members come from, as a pass yields them.
#pragma once

#include <conveyor/data_error.h>

#include <string>
#include <vector>

namespace conveyor::testing {

// One entry per run of members from the same archive, and "error" for each
// DataError, which `check` looks at first; to the pass's end.
template <class Pass, class Check>
std::vector<std::string> archive_events(Pass& pass, Check check) {
  std::vector<std::string> events;
  while (true) {
    try {
      auto member = pass.next();
      if (!member) return events;
      if (events.empty() || events.back() != member->archive) events.push_back(member->archive);
    } catch (const DataError& e) {
      check(e);
      events.push_back("error");
    }
  }
}

}  // namespace conveyor::testing
