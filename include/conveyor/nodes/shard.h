// conveyor/nodes/shard.h: shard(), an explicit place for the pass's shard:
// of its input it keeps item k when k % count == index. Where no node
// upstream of it is shardable (a file lister runs whole on every rank), it
// takes the shard; otherwise it passes everything.
#pragma once

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
    this->start_metering(pass, walk.next_id++);
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
  uint64_t skip(uint64_t count, bool clean) override {
    if (!clean) return MeteredNode<T>::skip(count, clean);
    if (count == 0) return 0;
    const uint64_t first_kept = position_ + (index_ + count_ - position_ % count_) % count_;
    const uint64_t wanted = first_kept + (count - 1) * count_ + 1 - position_;
    const uint64_t passed = upstream_->skip(wanted, clean);
    const uint64_t end = position_ + passed;
    const uint64_t kept = end > first_kept ? (end - first_kept + count_ - 1) / count_ : 0;
    position_ = end;
    return std::min(count, kept);
  }
  void save_extras(State& nodes, bool in_pass) const override { upstream_->save_extras(nodes, in_pass); }

 private:
  std::optional<T> produce() override {
    while (std::optional<T> item = this->meter_.wait([this] { return this->next_of(*upstream_); })) {
      if (position_++ % count_ == index_) return item;
    }
    return std::nullopt;
  }
  void collect_upstream_metrics(std::vector<NodeMetrics>& out) const override { upstream_->collect_metrics(out); }

  NodePtr<T> upstream_;
  uint64_t index_ = 0, count_ = 1, position_ = 0;
};

inline auto shard() {
  return []<class T>(Pipeline<T>&& upstream) {
    return Pipeline<T>(std::make_unique<Shard<T>>(std::move(upstream).release()));
  };
}

}  // namespace conveyor::nodes
