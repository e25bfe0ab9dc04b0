// Helpers for tests of pipeline nodes.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <conveyor/node.h>
#include <conveyor/state.h>

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

// A pass of `make()` (a pipeline with its seed set) stopped after `stop`
// outcomes, then a fresh `make()` resumed from its state (through JSON, as
// a checkpoint goes) to the end: together a whole pass's outcomes, when
// the resume is exact.
template <class Make>
Outcomes stopped_and_resumed(const Make& make, size_t stop) {
  Outcomes got;
  State saved;
  {
    auto pipeline = make();
    auto pass = pipeline.pass();
    while (got.size() < stop && take_one(pass, got)) {
    }
    saved = pipeline.state();
  }
  auto pipeline = make();
  pipeline.load_state(State::from_json(saved.to_json()));
  auto pass = pipeline.pass();
  while (take_one(pass, got)) {
  }
  return got;
}

}  // namespace conveyor::testing
