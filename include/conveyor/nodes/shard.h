// conveyor/nodes/shard.h: shard(), an explicit place for the pass's shard:
// of its input it keeps item k when k % count == index. Where no node
// upstream of it is shardable (a file lister runs whole on every rank), it
// takes the shard; otherwise it passes everything. A failed input takes its
// place as an item does: it is the error of the one shard whose item it
// would have been, and the others drop it, so every rank counts the same
// places and a failure on one rank alone moves no item to another.
#pragma once

#include <atomic>
#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "conveyor/nodes/stage.h"

namespace conveyor::nodes {

template <class T>
class Shard final : public MeteredNode<T> {
 public:
  using item_type = T;
  explicit Shard(NodePtr<T> upstream) : upstream_(std::move(upstream)) {}
  using Node<T>::reset;
  void reset(const PassContext& pass, conveyor::detail::ResetWalk& walk) override {
    upstream_->reset(pass, walk);
    const uint64_t id = walk.next_id++;
    this->start_metering(pass, id);
    const State* saved = conveyor::detail::restored_extras(walk, id);
    resumed_past_failure_ = saved && saved->bool_at("others_failed");
    // relaxed: reset runs before the pass's outputs are made (see save_extras)
    others_failed_.store(false, std::memory_order_relaxed);
    index_ = 0;
    count_ = 1;
    if (!walk.sharded) {
      walk.sharded = true;
      index_ = static_cast<uint64_t>(pass.shard.index());
      count_ = static_cast<uint64_t>(pass.shard.count());
      if (count_ > 1 && !walk.ordered_by_timing.empty()) {
        throw ValueError("shard: the pass runs as shard " + std::to_string(index_) + " of " + std::to_string(count_) +
                         ", taken after " + walk.ordered_by_timing +
                         ", which hands items out in the order they finish: each rank would split another "
                         "order, reading some items twice and losing others. Put shard() before it, or keep it "
                         "in order");
      }
    }
    position_ = 0;
  }
  std::string name() const override { return "shard"; }
  // Upstream skips to the count-th item this shard keeps.
  // By arithmetic only where no other shard's failure came before the
  // saved point: this shard's outputs being clean does not say upstream's were.
  uint64_t skip(uint64_t count, bool clean) override {
    if (!clean || resumed_past_failure_) return MeteredNode<T>::skip(count, false);
    if (count == 0) return 0;
    const uint64_t first_kept = position_ + (index_ + count_ - position_ % count_) % count_;
    const uint64_t wanted = first_kept + (count - 1) * count_ + 1 - position_;
    const uint64_t passed = upstream_->skip(wanted, clean);
    const uint64_t end = position_ + passed;
    const uint64_t kept = end > first_kept ? (end - first_kept + count_ - 1) / count_ : 0;
    position_ = end;
    return std::min(count, kept);
  }
  void save_extras(State& nodes, bool in_pass) const override {
    upstream_->save_extras(nodes, in_pass);
    // relaxed: stored before the output made after the failure, which
    // reaches the consumer taking this state through the hand-off that
    // publishes it (a prefetch's window), so a failure before its last
    // output is seen; one seen beyond it only costs a slower resume.
    if (in_pass && others_failed_.load(std::memory_order_relaxed)) {
      State mine = State::object();
      mine.set("others_failed", true);
      // relaxed: written by this pass's reset, before any output (start_metering)
      nodes.set(std::to_string(this->id_.load(std::memory_order_relaxed)), std::move(mine));
    }
  }

 private:
  std::optional<T> produce() override {
    while (true) {
      std::optional<T> item;
      try {
        item = this->meter_.wait([this] { return this->next_of(*upstream_); });
      } catch (const detail::UpstreamPending&) {
        throw;
      } catch (...) {
        if (position_++ % count_ == index_) throw;
        // Another shard's failure: this shard's outputs alone no longer
        // say whether upstream's were clean (skip).
        others_failed_.store(true, std::memory_order_relaxed);  // see save_extras
        continue;
      }
      if (!item) return std::nullopt;
      if (position_++ % count_ == index_) return item;
    }
  }
  void collect_upstream_metrics(std::vector<NodeMetrics>& out) const override { upstream_->collect_metrics(out); }

  NodePtr<T> upstream_;
  uint64_t index_ = 0, count_ = 1, position_ = 0;
  bool resumed_past_failure_ = false;       // the loaded state's pass had dropped another shard's failure
  std::atomic<bool> others_failed_{false};  // this pass has (save_extras)
};

inline auto shard() {
  return []<class T>(Pipeline<T>&& upstream) {
    return Pipeline<T>(std::make_unique<Shard<T>>(std::move(upstream).release()));
  };
}

}  // namespace conveyor::nodes
