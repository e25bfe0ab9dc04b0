// Helpers for tests of pipeline nodes.
#pragma once

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

}  // namespace conveyor::testing
