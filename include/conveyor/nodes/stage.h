// conveyor/nodes/stage.h: what a node with one upstream shares: its id, its
// pass, the reset walk, the position of the item it pulled last.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <utility>
#include <vector>

#include "conveyor/node.h"

namespace conveyor::nodes {

namespace detail {

// A node's counts and, in a timed pass, its clocks. One thread advances a
// node at a time, so plain integers do.
struct Meter {
  bool timed = false;
  uint64_t in = 0;         // items taken from upstream this pass
  uint64_t out = 0;        // items handed out this pass
  uint64_t skipped = 0;    // items dropped under OnError::skip this pass
  int64_t elapsed_ns = 0;  // in next(), waits included
  int64_t wait_ns = 0;     // of that, in upstream's next()

  void start_pass(bool timed_pass) noexcept { *this = Meter{timed_pass}; }

  // Adds the time from construction to destruction to `total`, whether the
  // timed call returns or throws.
  struct Clock {
    int64_t& total;
    std::chrono::steady_clock::time_point start = std::chrono::steady_clock::now();
    ~Clock() {
      total += std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - start)
                   .count();
    }
  };

  // Runs `produce` (returning std::optional), counting what it gives.
  template <class F>
  auto count(F&& produce) {
    if (!timed) {
      auto item = produce();
      if (item) ++out;
      return item;
    }
    Clock clock{elapsed_ns};
    auto item = produce();
    if (item) ++out;
    return item;
  }
  // Runs `pull` (upstream's next), counting and timing it.
  template <class F>
  auto wait(F&& pull) {
    if (!timed) {
      auto item = pull();
      if (item) ++in;
      return item;
    }
    Clock clock{wait_ns};
    auto item = pull();
    if (item) ++in;
    return item;
  }

  void fill(NodeMetrics& metrics) const noexcept {
    metrics.items_in = in;
    metrics.items_out = out;
    metrics.skipped = skipped;
    metrics.busy_seconds = static_cast<double>(elapsed_ns - wait_ns) * 1e-9;
    metrics.upstream_wait_seconds = static_cast<double>(wait_ns) * 1e-9;
  }
};

}  // namespace detail

// A node counted (and in a timed pass, timed) the same way as every other:
// it makes its items in produce(); next() is the meter's.
template <class Out>
class MeteredNode : public Node<Out> {
 public:
  std::optional<Out> next() final {
    return meter_.count([this] { return produce(); });
  }
  void collect_metrics(std::vector<NodeMetrics>& out) const override {
    collect_upstream_metrics(out);
    NodeMetrics mine;
    mine.name = this->name();
    mine.id = id_;
    meter_.fill(mine);
    add_own_metrics(mine);
    out.push_back(std::move(mine));
  }
  // Items dropped under OnError::skip in this pass.
  uint64_t skipped() const noexcept { return meter_.skipped; }

 protected:
  // The next item, or std::nullopt at the end of the pass.
  virtual std::optional<Out> produce() = 0;
  // Upstream nodes' metrics, sources first (none for a source).
  virtual void collect_upstream_metrics(std::vector<NodeMetrics>&) const {}
  // What a node knows beyond the counts (skipped items, its window).
  virtual void add_own_metrics(NodeMetrics&) const {}
  // Every reset calls this once: the node's id, a fresh meter.
  void start_metering(const PassContext& pass, uint64_t id) noexcept {
    id_ = id;
    meter_.start_pass(pass.timed);
  }
  // For a node's own try_next: counts what it hands out.
  Poll counted(Poll poll) noexcept {
    if (poll == Poll::ready) ++meter_.out;
    return poll;
  }

  uint64_t id_ = 0;
  detail::Meter meter_;
};

// A node with no upstream.
template <class Out>
using Source = MeteredNode<Out>;

// A node reading items of type In from one upstream node, giving Out.
template <class In, class Out>
class Stage : public MeteredNode<Out> {
 public:
  using Node<Out>::reset;
  void reset(const PassContext& pass, conveyor::detail::ResetWalk& walk) override {
    stop_pass();
    upstream_->reset(pass, walk);
    this->start_metering(pass, walk.next_id++);
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
  void collect_upstream_metrics(std::vector<NodeMetrics>& out) const override { upstream_->collect_metrics(out); }

  // The next upstream item, counting positions (the input's, for errors).
  std::optional<In> pull() {
    std::optional<In> item = this->meter_.wait([this] { return upstream_->next(); });
    if (item) ++position_;
    return item;
  }
  // The position of the item pull() returned last.
  uint64_t position() const noexcept { return position_ - 1; }

  NodePtr<In> upstream_;
  PassContext pass_;
  uint64_t position_ = 0;  // items pulled this pass
};

}  // namespace conveyor::nodes
