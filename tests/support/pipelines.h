// Helpers for tests of pipeline nodes.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <conveyor/node.h>

namespace conveyor::testing {

// Every item of one pass, in order.
template <class T>
std::vector<T> one_pass(Pipeline<T>& pipeline) {
  std::vector<T> out;
  for (auto& item : pipeline.pass()) out.push_back(item);
  return out;
}

// A pass's outcomes: items, and errors as "error in NODE at POSITION".
using Outcomes = std::vector<std::string>;

// The next outcome of `pass` (an item, or an error as its node and
// position), false at the end.
template <class Pass>
bool take_one(Pass& pass, Outcomes& out) {
  try {
    std::optional<int64_t> item = pass.next();
    if (!item) return false;
    out.push_back(std::to_string(*item));
  } catch (const conveyor::NodeError& e) {
    out.push_back("error in " + e.node().substr(0, e.node().find('(')) + " at " + std::to_string(e.position()));
  }
  return true;
}

}  // namespace conveyor::testing
