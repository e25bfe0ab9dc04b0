// conveyor/nodes/repeat.h: how many items, how many times.
//
//   take(n)       the first n items of each pass
//   repeat(k)     upstream k times over in one pass (each time a new
//                 sub-pass: shuffles and augmentations differ); repeat()
//                 for ever (torchdata's Cycler)
//   cache()       the first complete pass is kept in memory and replayed by
//                 later passes without touching upstream (a pass left early
//                 keeps nothing: the next one reads upstream again). A
//                 parallel map or prefetch after it reads ahead of the
//                 consumer, so a pass the consumer leaves early (take, zip)
//                 may complete the cache with that node and not without it:
//                 cache where passes are read whole.
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "conveyor/nodes/stage.h"

namespace conveyor::nodes {

template <class T>
class Take final : public Stage<T, T> {
 public:
  using item_type = T;
  Take(NodePtr<T> upstream, uint64_t count) : Stage<T, T>(std::move(upstream)), count_(count) {}
  std::optional<T> produce() override {
    if (this->position_ >= count_) return std::nullopt;
    return this->pull();
  }
  std::string name() const override { return "take(" + std::to_string(count_) + ")"; }
  uint64_t skip(uint64_t count, bool clean) override {
    if (!clean) return Stage<T, T>::skip(count, clean);
    return this->skip_upstream(std::min(count, count_ - std::min(count_, this->position_)), clean);
  }

 private:
  uint64_t count_;
};

inline auto take(uint64_t count) {
  return [count]<class T>(Pipeline<T>&& upstream) {
    return Pipeline<T>(std::make_unique<Take<T>>(std::move(upstream).release(), count));
  };
}

template <class T>
class Repeat final : public MeteredNode<T> {
 public:
  using item_type = T;
  Repeat(NodePtr<T> upstream, uint64_t times) : upstream_(std::move(upstream)), times_(times) {}
  using Node<T>::reset;
  void reset(const PassContext& pass, conveyor::detail::ResetWalk& walk) override {
    walk_at_start_ = walk;
    // Later rounds start afresh: what a state saved for upstream nodes is of
    // the round it was in, and a resumed pass replays rounds from the first.
    walk_at_start_.restoring = nullptr;
    pass_ = pass;
    round_ = 0;
    empty_round_ = true;
    upstream_->reset(round_pass(0), walk);
    this->start_metering(pass, walk.next_id++);
  }
  // Round by round, as produce() goes.
  uint64_t skip(uint64_t count, bool clean) override {
    uint64_t skipped = 0;
    while (round_ < times_ && skipped < count) {
      const uint64_t n = upstream_->skip(count - skipped, clean);
      skipped += n;
      if (n > 0) empty_round_ = false;
      if (skipped == count) break;
      if (empty_round_) break;  // nothing in a whole round: the end
      if (++round_ == times_) break;
      empty_round_ = true;
      conveyor::detail::ResetWalk walk = walk_at_start_;
      upstream_->reset(round_pass(round_), walk);
    }
    return skipped;
  }
  void save_extras(State& nodes) const override { upstream_->save_extras(nodes); }
  std::optional<T> produce() override {
    while (round_ < times_) {
      std::optional<T> item = this->meter_.wait([this] { return upstream_->next(); });
      if (item) {
        empty_round_ = false;
        return item;
      }
      // An upstream with nothing in it would make repeat() spin for ever.
      if (empty_round_) return std::nullopt;
      if (++round_ == times_) break;
      empty_round_ = true;
      conveyor::detail::ResetWalk walk = walk_at_start_;  // the same ids, the same shard
      upstream_->reset(round_pass(round_), walk);
    }
    return std::nullopt;
  }
  std::string name() const override {
    return times_ == kForever ? "repeat()" : "repeat(" + std::to_string(times_) + ")";
  }

  static constexpr uint64_t kForever = std::numeric_limits<uint64_t>::max();

 private:
  // Round r of pass p runs upstream as its own pass: epoch r, a seed drawn
  // from p's.
  void collect_upstream_metrics(std::vector<NodeMetrics>& out) const override { upstream_->collect_metrics(out); }

  PassContext round_pass(uint64_t round) const {
    PassContext sub = pass_;
    sub.seed = item_seed(pass_, this->id_, 0);
    sub.epoch = round;
    return sub;
  }

  NodePtr<T> upstream_;
  uint64_t times_;
  PassContext pass_;
  conveyor::detail::ResetWalk walk_at_start_;
  uint64_t round_ = 0;
  bool empty_round_ = true;
};

inline auto repeat(uint64_t times = Repeat<int>::kForever) {
  return [times]<class T>(Pipeline<T>&& upstream) {
    return Pipeline<T>(std::make_unique<Repeat<T>>(std::move(upstream).release(), times));
  };
}

template <class T>
class Cache final : public MeteredNode<T> {
 public:
  using item_type = T;
  explicit Cache(NodePtr<T> upstream) : upstream_(std::move(upstream)) {}
  using Node<T>::reset;
  void reset(const PassContext& pass, conveyor::detail::ResetWalk& walk) override {
    position_ = 0;
    const uint64_t first_upstream_id = walk.next_id;
    // A resumed pipeline whose saved cache was complete fills it as the pass
    // that filled it did, then replays it.
    if (!complete_ && walk.restoring) fill_as_saved(pass, walk);
    replaying_ = complete_;
    if (replaying_) {
      // Upstream is not reset: downstream ids and sharding stay as they were.
      walk.next_id += upstream_ids_;
      walk.sharded = walk.sharded || sharded_upstream_;
    } else {
      filling_.clear();
      upstream_->reset(pass, walk);
      upstream_ids_ = walk.next_id - first_upstream_id;
      sharded_upstream_ = walk.sharded;
      filling_pass_ = pass;
    }
    complete_at_reset_ = complete_;
    this->start_metering(pass, walk.next_id++);
  }
  std::optional<T> produce() override {
    if (replaying_) {
      if (position_ == filling_.size()) return std::nullopt;
      return filling_[position_++];
    }
    std::optional<T> item = this->meter_.wait([this] { return upstream_->next(); });
    if (!item) {
      complete_ = true;
      return std::nullopt;
    }
    filling_.push_back(*item);
    return item;
  }
  std::string name() const override { return "cache"; }
  uint64_t skip(uint64_t count, bool clean) override {
    if (!replaying_) return MeteredNode<T>::skip(count, clean);
    const uint64_t skipped = std::min<uint64_t>(count, filling_.size() - position_);
    position_ += static_cast<size_t>(skipped);
    return skipped;
  }
  // A complete cache says which pass filled it: a new process resuming
  // after that pass fills it the same way. Read as of the last reset (the
  // consumer's thread), not as the pass goes on.
  void save_extras(State& nodes) const override {
    if (complete_at_reset_) {
      State mine = State::object();
      mine.set("filled_in_epoch", filling_pass_.epoch);
      mine.set("filled_with_seed", filling_pass_.seed);
      nodes.set(std::to_string(this->id_), std::move(mine));
    }
    upstream_->save_extras(nodes);
  }

 private:
  void collect_upstream_metrics(std::vector<NodeMetrics>& out) const override { upstream_->collect_metrics(out); }

  // This node's id comes after upstream's, which a first reset learns.
  void fill_as_saved(const PassContext& pass, const conveyor::detail::ResetWalk& walk) {
    conveyor::detail::ResetWalk probe = walk;
    probe.restoring = nullptr;
    upstream_->reset(pass, probe);
    const State* saved = conveyor::detail::restored_extras(walk, probe.next_id);
    if (!saved) return;
    PassContext filling = pass;
    filling.epoch = saved->uint_at("filled_in_epoch");
    filling.seed = saved->uint_at("filled_with_seed");
    conveyor::detail::ResetWalk fill_walk = walk;
    fill_walk.restoring = nullptr;
    upstream_->reset(filling, fill_walk);
    filling_.clear();
    while (true) {
      try {
        std::optional<T> item = upstream_->next();
        if (!item) break;
        filling_.push_back(std::move(*item));
      } catch (...) {
        // A failed item was never cached.
      }
    }
    upstream_ids_ = fill_walk.next_id - walk.next_id;
    sharded_upstream_ = fill_walk.sharded;
    filling_pass_ = filling;
    complete_ = true;
  }

  NodePtr<T> upstream_;
  std::vector<T> filling_;  // the items of the first pass, complete once complete_
  bool complete_ = false;
  bool replaying_ = false;
  bool complete_at_reset_ = false;
  PassContext filling_pass_;  // the pass that filled (or fills) the cache
  size_t position_ = 0;
  uint64_t upstream_ids_ = 0;  // how many ids upstream takes
  bool sharded_upstream_ = false;
};

inline auto cache() {
  return []<class T>(Pipeline<T>&& upstream) {
    return Pipeline<T>(std::make_unique<Cache<T>>(std::move(upstream).release()));
  };
}

}  // namespace conveyor::nodes
