// conveyor/nodes/stage.h: what a node with one upstream shares: its id, its
// pass, the reset walk, the position of the item it pulled last.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <utility>

#include "conveyor/node.h"

namespace conveyor::nodes {

// A node reading items of type In from one upstream node, giving Out.
template <class In, class Out>
class Stage : public Node<Out> {
 public:
  using Node<Out>::reset;
  void reset(const PassContext& pass, detail::ResetWalk& walk) override {
    stop_pass();
    upstream_->reset(pass, walk);
    id_ = walk.next_id++;
    pass_ = pass;
    position_ = 0;
    start_pass();
  }

 protected:
  explicit Stage(NodePtr<In> upstream) : upstream_(std::move(upstream)) {}
  // Before anything of a new pass is touched: a node with work in flight
  // stops it here (its tasks read the pass and the id).
  virtual void stop_pass() {}
  // A new pass begins: drop what the last one held.
  virtual void start_pass() {}

  // The next upstream item, counting positions (the input's, for errors).
  std::optional<In> pull() {
    std::optional<In> item = upstream_->next();
    if (item) ++position_;
    return item;
  }
  // The position of the item pull() returned last.
  uint64_t position() const noexcept { return position_ - 1; }

  NodePtr<In> upstream_;
  uint64_t id_ = 0;
  PassContext pass_;
  uint64_t position_ = 0;  // items pulled this pass
};

}  // namespace conveyor::nodes
