// conveyor/nodes/stage.h: what a node with one upstream shares: its id, its
// pass, the reset walk, the position of the item it pulled last.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <utility>
#include <vector>

#include "conveyor/node.h"

namespace conveyor::nodes {

namespace detail {

// A metric with one writer (the thread advancing its node) that metrics()
// may read from another thread mid-pass (a node behind a prefetch runs on
// the prefetch's strand). Relaxed: the value is only ever read for itself,
// nothing is published through it; add() is a load and a store, not a
// read-modify-write, as the writer is alone.
template <class T>
class Counter {
 public:
  void add(T delta) noexcept { value_.store(value_.load(std::memory_order_relaxed) + delta, std::memory_order_relaxed); }
  T get() const noexcept { return value_.load(std::memory_order_relaxed); }
  void clear() noexcept { value_.store(0, std::memory_order_relaxed); }

 private:
  std::atomic<T> value_{0};
};

// A node's counts and, in a timed pass, its clocks.
struct Meter {
  // Written by reset, read where the node runs and by metrics(): a reset in
  // the middle of the consumer's pass (repeat's rounds) may run on a strand.
  std::atomic<bool> timed{false};
  Counter<uint64_t> in;         // items taken from upstream this pass
  Counter<uint64_t> out;        // items handed out this pass
  Counter<uint64_t> skipped;    // items dropped under OnError::skip this pass
  Counter<int64_t> elapsed_ns;  // in next(), waits included
  Counter<int64_t> wait_ns;     // of that, in upstream's next()
  Counter<int64_t> downstream_ns;  // between handing an item out and the next call
  // When next() last returned an item this pass (timed passes; the thread
  // advancing the node only). Zero before the first.
  std::chrono::steady_clock::time_point handed_out_at{};

  void start_pass(bool timed_pass) noexcept {
    timed = timed_pass;
    in.clear();
    out.clear();
    skipped.clear();
    elapsed_ns.clear();
    wait_ns.clear();
    downstream_ns.clear();
    handed_out_at = {};
  }

  // Adds the time from construction to destruction to `total`, whether the
  // timed call returns or throws; with `end`, keeps the time it ended there.
  struct Clock {
    Counter<int64_t>& total;
    std::chrono::steady_clock::time_point* end = nullptr;
    std::chrono::steady_clock::time_point start = std::chrono::steady_clock::now();
    ~Clock() {
      const auto now = std::chrono::steady_clock::now();
      total.add(std::chrono::duration_cast<std::chrono::nanoseconds>(now - start).count());
      if (end) *end = now;
    }
  };

  // Runs `produce` (returning std::optional), counting what it gives.
  template <class F>
  auto count(F&& produce) {
    if (!timed) {
      auto item = produce();
      if (item) out.add(1);
      return item;
    }
    const auto last_out = handed_out_at;
    Clock clock{elapsed_ns, &handed_out_at};  // its start is when the consumer came back
    if (last_out != std::chrono::steady_clock::time_point{}) {
      downstream_ns.add(std::chrono::duration_cast<std::chrono::nanoseconds>(clock.start - last_out).count());
    }
    auto item = produce();
    if (item) out.add(1);
    return item;
  }
  // Runs `pull` (upstream's next), counting and timing it.
  template <class F>
  auto wait(F&& pull) {
    if (!timed) {
      auto item = pull();
      if (item) in.add(1);
      return item;
    }
    Clock clock{wait_ns};
    auto item = pull();
    if (item) in.add(1);
    return item;
  }

  void fill(NodeMetrics& metrics) const noexcept {
    metrics.items_in = in.get();
    metrics.items_out = out.get();
    metrics.skipped = skipped.get();
    const int64_t waited = wait_ns.get();
    metrics.busy_seconds = static_cast<double>(std::max<int64_t>(0, elapsed_ns.get() - waited)) * 1e-9;
    metrics.upstream_wait_seconds = static_cast<double>(waited) * 1e-9;
    metrics.downstream_wait_seconds = static_cast<double>(downstream_ns.get()) * 1e-9;
  }
};

// Thrown by a pull inside a try_next() when upstream has nothing ready yet.
// It unwinds the node's produce() to its try_next(), which answers
// Poll::pending. A node keeps what it has gathered in its members across a
// throwing pull, as it must for an upstream error, so the next call goes on
// where this one stopped. A produce() that catches everything around a
// pull lets this through first (or restores what it changed and rethrows).
// (One exception per waiting node and poll: the price of every node's
// produce() staying one straight function.)
struct UpstreamPending {};

}  // namespace detail

// A node counted (and in a timed pass, timed) the same way as every other:
// it makes its items in produce(); next() is the meter's. Its try_next()
// runs produce() with each pull asking upstream's try_next(), so a serial
// node never waits behind an async one.
template <class Out>
class MeteredNode : public Node<Out> {
 public:
  std::optional<Out> next() final {
    return meter_.count([this] { return produce(); });
  }
  Poll try_next(std::optional<Out>& out) override {
    const Polling polling(*this, true);
    try {
      out = next();
    } catch (const detail::UpstreamPending&) {
      return Poll::pending;
    }
    return out ? Poll::ready : Poll::end;
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
  uint64_t skipped() const noexcept { return meter_.skipped.get(); }

 protected:
  // The next item, or std::nullopt at the end of the pass.
  virtual std::optional<Out> produce() = 0;
  // Upstream nodes' metrics, sources first (none for a source).
  virtual void collect_upstream_metrics(std::vector<NodeMetrics>&) const {}
  // What a node knows beyond the counts (skipped items, its window).
  virtual void add_own_metrics(NodeMetrics&) const {}
  // Every reset calls this once: the node's id, a fresh meter.
  void start_metering(const PassContext& pass, uint64_t id) noexcept {
    // relaxed: a reset in the middle of the consumer's pass (repeat's rounds,
    // on a strand) rewrites the same id while metrics() may read it; nothing
    // is published through it.
    id_.store(id, std::memory_order_relaxed);
    meter_.start_pass(pass.timed);
  }
  // For a node's own try_next: counts what it hands out.
  Poll counted(Poll poll) noexcept {
    if (poll == Poll::ready) meter_.out.add(1);
    return poll;
  }

  // Upstream's next item: waited for in next(); in try_next(), what
  // upstream has now, or UpstreamPending.
  template <class U>
  std::optional<U> next_of(Node<U>& upstream) {
    if (!polling_) return upstream.next();
    std::optional<U> item;
    if (upstream.try_next(item) == Poll::pending) throw detail::UpstreamPending{};
    return item;
  }
  // Sets polling_ for a scope. With `on` false: a section that must not stop
  // halfway (a resumed pass's replay) pulls waiting, even inside try_next().
  class Polling {
   public:
    Polling(MeteredNode& node, bool on) noexcept : node_(node), was_(node.polling_) { node.polling_ = on; }
    ~Polling() { node_.polling_ = was_; }
    Polling(const Polling&) = delete;
    Polling& operator=(const Polling&) = delete;

   private:
    MeteredNode& node_;
    bool was_;
  };
  bool polling() const noexcept { return polling_; }

  std::atomic<uint64_t> id_{0};  // given by each reset (ResetWalk's order)
  detail::Meter meter_;

 private:
  bool polling_ = false;  // inside try_next(): pulls do not wait
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
    past_shard_ = walk.sharded;
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

 public:
  void save_extras(State& nodes, bool in_pass) const override { upstream_->save_extras(nodes, in_pass); }

 protected:
  // Passes over `count` upstream items as if pulled (Node::skip): for a node
  // whose outputs map to its inputs by arithmetic. With `clean`, every one
  // is an item, so positions count them all.
  uint64_t skip_upstream(uint64_t count, bool clean) {
    const uint64_t skipped = upstream_->skip(count, clean);
    position_ += skipped;
    return skipped;
  }
  // The same where failures may be among them: pulled and dropped, so that
  // positions count items only, as pull() does.
  void pass_over_upstream(uint64_t count, bool clean) {
    if (clean) {
      skip_upstream(count, clean);
      return;
    }
    for (uint64_t k = 0; k < count; ++k) {
      try {
        if (!pull()) return;
      } catch (...) {
        // It failed there the first time too, and that failure was handed out.
      }
    }
  }

  // The next upstream item, counting positions (the input's, for errors).
  std::optional<In> pull() {
    std::optional<In> item = this->meter_.wait([this] { return this->next_of(*upstream_); });
    if (item) ++position_;
    return item;
  }
  // The position of the item pull() returned last.
  uint64_t position() const noexcept { return position_ - 1; }
  // The seed of this node's item `position` in this pass (item_seed).
  uint64_t seed_of(uint64_t position) const noexcept { return item_seed(pass_, this->id_, position, past_shard_); }

  NodePtr<In> upstream_;
  PassContext pass_;
  bool past_shard_ = false;  // upstream applied the pass's shard: positions count one shard's items
  uint64_t position_ = 0;    // items pulled this pass
};

}  // namespace conveyor::nodes
