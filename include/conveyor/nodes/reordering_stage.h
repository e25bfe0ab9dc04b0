// conveyor/nodes/reordering_stage.h: what the maps with work in flight
// (map with workers, async_map and read_files_async) share: the count of
// inputs pulled, and with in_order = false the order outputs were handed
// out in, which a checkpoint saves and a resumed pass replays.
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>
#include <utility>

#include "conveyor/data_error.h"
#include "conveyor/detail/decision_log.h"
#include "conveyor/node.h"
#include "conveyor/nodes/stage.h"

namespace conveyor::nodes::detail {

template <class In, class Out>
class ReorderingStage : public Stage<In, Out> {
 public:
  using Node<Out>::reset;
  void reset(const PassContext& pass, conveyor::detail::ResetWalk& walk) override {
    Stage<In, Out>::reset(pass, walk);
    if (!in_order_ && walk.ordered_by_timing.empty()) walk.ordered_by_timing = this->name();
    replay_inputs_.ahead.clear();
    order_.reset(conveyor::detail::restored_extras(walk, this->id_), /*replays=*/true);
  }

  // In order, one output per input: upstream skips without the function
  // running (a failed item was an output too), unless failures are dropped.
  // With in_order = false the outputs were the inputs the saved log lists:
  // upstream skips the prefix they cover, and the rest are dropped when
  // pulled again.
  uint64_t skip(uint64_t count, bool clean) override {
    if (in_order_) {
      if (on_error_ == OnError::skip || !clean) return Stage<In, Out>::skip(count, clean);
      const uint64_t skipped = this->skip_upstream(count, clean);
      inputs_ += skipped;
      return skipped;
    }
    const conveyor::detail::CompletionOrder::Skipped skipped = order_.skip(count);
    if (skipped.prefix > inputs_) this->pass_over_upstream(skipped.prefix - inputs_, clean);
    inputs_ = std::max(inputs_, skipped.prefix);
    return skipped.outputs + (count > skipped.outputs ? Stage<In, Out>::skip(count - skipped.outputs, clean) : 0);
  }
  // With in_order = false: the inputs handed out, in their order.
  void save_extras(State& nodes, bool in_pass) const override {
    if (in_pass && !in_order_) nodes.set(std::to_string(this->id_), order_.to_state());
    Stage<In, Out>::save_extras(nodes, in_pass);
  }

 protected:
  ReorderingStage(NodePtr<In> upstream, bool in_order, OnError on_error)
      : Stage<In, Out>(std::move(upstream)), in_order_(in_order), on_error_(on_error) {}

  uint64_t inputs_ = 0;  // upstream's outputs pulled this pass, failures included
  // in_order = false: the order inputs were handed out in (timing's), and
  // a resumed pass's saved one.
  conveyor::detail::CompletionOrder order_;
  // Pulled during a replay before their turn, by input.
  conveyor::detail::ReplayInputs<In> replay_inputs_;

 private:
  bool in_order_;
  OnError on_error_;
};

}  // namespace conveyor::nodes::detail
