// conveyor/nodes/repeat.h: how many items, how many times.
//
//   take(n)       the first n items of each pass
//   repeat(k)     upstream k times over in one pass (each time a new
//                 sub-pass: shuffles and augmentations differ; a round with
//                 nothing in it is just empty); repeat() for ever
//                 (torchdata's Cycler), whose pass ends at a round with no
//                 item in it (errors alone included), or it would spin
//   cache()       the first complete pass is kept in memory and replayed by
//                 later passes without touching upstream (a pass left early
//                 keeps nothing: the next one reads upstream again). What
//                 it keeps is its shard's: a pass under another shard
//                 fills it again. Epochs and seeds do not: a replay is the
//                 filling pass's items, whatever the pass (repeat's rounds
//                 each have a seed of their own). A
//                 parallel map or prefetch after it reads ahead of the
//                 consumer, so a pass the consumer leaves early (take, zip)
//                 may complete the cache with that node and not without it:
//                 cache where passes are read whole.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <limits>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
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
    const uint64_t version = begin_change();
    // Known before upstream takes its ids, and the same in every process:
    // the rounds' seeds do not depend on which reset came first.
    round_key_ = walk.next_id;
    pass_ = pass;
    round_ = 0;
    round_seen_.store(0, std::memory_order_relaxed);  // relaxed: inside a change (see save_extras)
    empty_round_ = true;
    set_previous(nullptr);
    {
      std::lock_guard lock(rounds_mutex_);
      finished_rounds_.clear();
    }
    // What a state saved for upstream nodes is of the round it was in (and
    // of the one before it): given to those rounds only (start_round).
    std::shared_ptr<const State> restoring = std::exchange(walk.restoring, nullptr);
    walk_at_start_ = walk;
    walk_at_start_.restart = false;  // the rounds after the first are new passes upstream
    upstream_->reset(round_pass(0), walk);
    this->start_metering(pass, walk.next_id++);
    walk.restoring = restoring;  // for the nodes after this one
    resume_ = {};
    if (restoring) {
      const State* mine = restoring->find(std::to_string(this->id_));
      resume_.round = mine ? mine->uint_at("round") : 0;
      resume_.round_saved = mine != nullptr;
      resume_.current = restoring;
      if (const State* previous = mine ? mine->find("previous") : nullptr) {
        resume_.previous = std::make_shared<const State>(*previous);
      }
      resume_.upstream_saved = upstream_saved(*restoring, walk_at_start_.next_id, this->id_);
      if (restoring_for(0)) start_round(0);  // again, now with what round 0 saved
    }
    end_change(version);
  }
  // Round by round, as produce() goes. For repeat() for ever, a round that
  // gave only errors ends the pass as an empty one does (produce() saw no
  // item in it), but a skip counts errors as outputs: where errors may be
  // among them, the outputs are pulled as produce() pulls them (upstream's
  // skip() may not follow a next() in a round, so the whole way).
  uint64_t skip(uint64_t count, bool clean) override {
    skipping_ = true;
    const struct Done {
      bool& flag;
      ~Done() { flag = false; }
    } done{skipping_};
    uint64_t skipped = 0;
    if (!clean) {
      skipped = Node<T>::skip(count, clean);
    } else {
      while (round_ < times_ && skipped < count) {
        const uint64_t n = upstream_->skip(count - skipped, clean);
        skipped += n;
        if (n > 0) empty_round_ = false;
        if (skipped == count) break;
        if (ends_pass()) break;  // nothing in a whole round of repeat(): the end
        if (!next_round()) break;
      }
    }
    // Upstream saved its decisions in a round at least two after this one:
    // those of the rounds between are gone.
    if (resume_.upstream_saved && resume_.round > round_ + 1) {
      throw StateError("load_state: " + name() + " had run " + std::to_string(resume_.round - round_) +
                       " rounds ahead of the consumer when the state was taken, and what upstream decided by "
                       "timing in the rounds between is not kept; take the state again");
    }
    return skipped;
  }
  // This round's and the last round's decisions upstream, and which round.
  void save_extras(State& nodes, bool in_pass) const override {
    if (!in_pass) return upstream_->save_extras(nodes, in_pass);
    while (true) {
      // acquire: pairs with end_change()'s release store: what the change
      // wrote is visible.
      const uint64_t version = version_.load(std::memory_order_acquire);
      if (version % 2 != 0) {  // a round is starting on another thread
        std::this_thread::yield();
        continue;
      }
      State current = State::object();
      upstream_->save_extras(current, in_pass);
      const std::shared_ptr<const State> previous = get_previous();
      const uint64_t round = round_seen_.load(std::memory_order_relaxed);  // relaxed: checked by the version
      // acquire fence: pairs with begin_change()'s release fence: if a read
      // above saw a change's writes, the version below is that change's.
      std::atomic_thread_fence(std::memory_order_acquire);
      if (version_.load(std::memory_order_relaxed) != version) continue;  // relaxed: after the fence
      State mine = State::object();
      mine.set("round", round);
      if (previous) mine.set("previous", *previous);
      nodes.set(std::to_string(this->id_), std::move(mine));
      for (const auto& [key, value] : current.members()) nodes.set(key, value);
      return;
    }
  }
  std::optional<T> produce() override {
    while (round_ < times_) {
      std::optional<T> item = this->meter_.wait([this] { return this->next_of(*upstream_); });
      if (item) {
        empty_round_ = false;
        return item;
      }
      if (ends_pass()) return std::nullopt;
      if (!next_round()) break;
    }
    return std::nullopt;
  }
  std::string name() const override {
    return times_ == kForever ? "repeat()" : "repeat(" + std::to_string(times_) + ")";
  }

  static constexpr uint64_t kForever = std::numeric_limits<uint64_t>::max();

 private:
  // Upstream's counts and times over the pass: each round's reset starts
  // its nodes' meters over, so the rounds before this one are added in.
  void collect_upstream_metrics(std::vector<NodeMetrics>& out) const override {
    const size_t first = out.size();
    std::lock_guard lock(rounds_mutex_);
    upstream_->collect_metrics(out);
    add_metrics(out, first, finished_rounds_);
  }
  // Adds `rounds` (one entry per upstream node, sources first) to out[first...].
  static void add_metrics(std::vector<NodeMetrics>& out, size_t first, const std::vector<NodeMetrics>& rounds) {
    for (size_t i = 0; i < rounds.size() && first + i < out.size(); ++i) {
      NodeMetrics& into = out[first + i];
      into.items_in += rounds[i].items_in;
      into.items_out += rounds[i].items_out;
      into.skipped += rounds[i].skipped;
      into.busy_seconds += rounds[i].busy_seconds;
      into.upstream_wait_seconds += rounds[i].upstream_wait_seconds;
      into.downstream_wait_seconds += rounds[i].downstream_wait_seconds;
    }
  }

  // The round just finished had no item: the end of a repeat() for ever's
  // pass (an upstream with nothing in it would make it spin for ever). A
  // finite repeat goes through all its rounds, an empty one being empty.
  bool ends_pass() const noexcept { return times_ == kForever && empty_round_; }

  // Round r of pass p runs upstream as its own pass: epoch r, a seed drawn
  // from p's.
  PassContext round_pass(uint64_t round) const {
    PassContext sub = pass_;
    // Position ~0: never an item's, so no upstream node's item seed.
    sub.seed = item_seed(pass_, round_key_, ~uint64_t{0});
    sub.epoch = round;
    return sub;
  }

  // The next round, if any: the finished round's decisions are kept for a
  // state taken while the consumer is still in it.
  bool next_round() {
    if (round_ + 1 >= times_) {
      round_ = times_;  // ended: produce() asks upstream no more
      return false;
    }
    // This node is never behind its consumer: a skip for a state past the
    // round the state saved counts more items than those rounds hold (and
    // would otherwise go round after round, for ever with times = inf).
    if (skipping_ && resume_.round_saved && round_ >= resume_.round) {
      throw StateError("load_state: " + name() + " was in round " + std::to_string(resume_.round) +
                       " when the state was taken, but the consumer's count of items received "
                       "goes past the end of that round: the data is not what it was, or the "
                       "state is not this pipeline's");
    }
    const uint64_t version = begin_change();
    State finished = State::object();
    upstream_->save_extras(finished, true);
    set_previous(std::make_shared<const State>(std::move(finished)));
    ++round_;
    empty_round_ = true;
    {
      // The finished round's metrics are kept before its reset clears them,
      // and a metrics() reader sees them either there or here, not both.
      std::lock_guard lock(rounds_mutex_);
      std::vector<NodeMetrics> finished;
      upstream_->collect_metrics(finished);
      if (finished_rounds_.empty()) {
        finished_rounds_ = std::move(finished);
      } else {
        add_metrics(finished_rounds_, 0, finished);
      }
      start_round(round_);
    }
    end_change(version);
    return true;
  }
  void start_round(uint64_t round) {
    conveyor::detail::ResetWalk walk = walk_at_start_;  // the same ids, the same shard
    walk.restoring = restoring_for(round);
    upstream_->reset(round_pass(round), walk);
    round_seen_.store(round, std::memory_order_relaxed);  // relaxed: inside a change (see save_extras)
  }
  std::shared_ptr<const State> restoring_for(uint64_t round) const {
    if (!resume_.current) return nullptr;
    if (round == resume_.round) return resume_.current;
    if (round + 1 == resume_.round) return resume_.previous;
    return nullptr;
  }
  // Does `saved` hold anything but hints for upstream's nodes (ids [first, end))?
  static bool upstream_saved(const State& saved, uint64_t first, uint64_t end) {
    for (uint64_t id = first; id < end; ++id) {
      const State* extras = saved.find(std::to_string(id));
      if (extras && !extras->contains(conveyor::detail::kHintOnly)) return true;
    }
    return false;
  }

  // A seqlock around what save_extras() reads, for a state taken on the
  // consumer's thread while this node starts a round on another.
  uint64_t begin_change() {
    const uint64_t version = version_.load(std::memory_order_relaxed) + 1;  // relaxed: only this thread stores it
    version_.store(version, std::memory_order_relaxed);  // odd: a change is under way
    // release fence: a reader whose copy saw any write after it sees the
    // odd version (or a later one) when it looks again.
    std::atomic_thread_fence(std::memory_order_release);
    return version;
  }
  void end_change(uint64_t version) {
    // release: pairs with save_extras()'s acquire load of the version.
    version_.store(version + 1, std::memory_order_release);
  }

  struct Resume {
    uint64_t round = 0;
    std::shared_ptr<const State> current;   // the saved round's
    std::shared_ptr<const State> previous;  // the round's before it
    bool upstream_saved = false;
    bool round_saved = false;  // `round` is the state's, not a default
  };

  NodePtr<T> upstream_;
  uint64_t times_;
  PassContext pass_;
  conveyor::detail::ResetWalk walk_at_start_;
  uint64_t round_key_ = 0;
  uint64_t round_ = 0;
  bool empty_round_ = true;
  bool skipping_ = false;  // skip() is going on, for a resumed pass
  Resume resume_;
  std::atomic<uint64_t> version_{0};
  std::atomic<uint64_t> round_seen_{0};
  // The last round's decisions, set where the node runs and read by
  // state(): under a mutex (taken once a round and once a state).
  void set_previous(std::shared_ptr<const State> previous) {
    std::lock_guard lock(previous_mutex_);
    previous_ = std::move(previous);
  }
  std::shared_ptr<const State> get_previous() const {
    std::lock_guard lock(previous_mutex_);
    return previous_;
  }
  mutable std::mutex previous_mutex_;
  std::shared_ptr<const State> previous_;
  // Upstream's metrics summed over the pass's finished rounds; written where
  // the node runs, read by metrics() on the consumer's thread.
  mutable std::mutex rounds_mutex_;
  std::vector<NodeMetrics> finished_rounds_;
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
    // What the cache holds is another shard's, or not what the state being
    // restored had (its pass was the filling one, or another pass filled
    // it): dropped, the pass goes on as it would in a new pipeline. A
    // restart within the pass (a shuffle's) keeps what the pass began with.
    if (complete_ && (!same_shard(filling_pass_.shard, pass.shard) ||
                      (walk.restoring && !walk.restart && !holds_as_saved(walk)))) {
      drop();
    }
    // A resumed pipeline whose saved cache was complete fills it as the pass
    // that filled it did, then replays it.
    if (!complete_ && walk.restoring) fill_as_saved(pass, walk);
    replaying_ = complete_;
    if (replaying_) {
      // Upstream is not reset: downstream ids and sharding stay as they were.
      walk.next_id += upstream_ids_;
      walk.sharded = walk.sharded || sharded_upstream_;
      if (walk.ordered_by_timing.empty()) walk.ordered_by_timing = ordered_upstream_;
    } else {
      filling_.clear();
      upstream_->reset(pass, walk);
      upstream_ids_ = walk.next_id - first_upstream_id;
      sharded_upstream_ = walk.sharded;
      ordered_upstream_ = walk.ordered_by_timing;
      filling_pass_ = pass;
    }
    {
      std::lock_guard lock(filled_mutex_);
      filled_at_reset_ = filled_;
    }
    this->start_metering(pass, walk.next_id++);
  }
  std::optional<T> produce() override {
    if (replaying_) {
      if (position_ == filling_.size()) return std::nullopt;
      return filling_[position_++];
    }
    std::optional<T> item = this->meter_.wait([this] { return this->next_of(*upstream_); });
    if (!item) {
      // What upstream drew and decided by timing in the filling pass (a
      // RandomSampler's start, an unordered map's order), for a new process
      // to fill the cache with the same items in the same order.
      State upstream_at_fill = State::object();
      upstream_->save_extras(upstream_at_fill, /*in_pass=*/true);
      upstream_at_fill_ = std::make_shared<const State>(std::move(upstream_at_fill));
      complete_ = true;
      publish_filled();
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
  // A complete cache says which pass filled it (its epoch, seed and shard)
  // and what upstream decided in it: a new process resuming after that pass
  // fills it the same way. In a pass, as of its reset: a state of the
  // filling pass (nothing saved here) resumes it item by item (its failed
  // items count; the cache holds none of them), in this pipeline too.
  void save_extras(State& nodes, bool in_pass) const override {
    std::shared_ptr<const Filled> filled;
    {
      std::lock_guard lock(filled_mutex_);
      filled = in_pass ? filled_at_reset_ : filled_;
    }
    if (filled) {
      State mine = State::object();
      mine.set("filled_in_epoch", filled->pass.epoch);
      mine.set("filled_with_seed", filled->pass.seed);
      mine.set("filled_in_shard", shard_state(filled->pass.shard));
      if (filled->upstream) mine.set("upstream_at_fill", *filled->upstream);
      nodes.set(std::to_string(this->id_), std::move(mine));
    }
    upstream_->save_extras(nodes, in_pass);
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
    // Filled under another shard (the state was taken between passes, after
    // a re-shard): the live pipeline's next pass fills it again, so does this.
    const State* shard = saved->find("filled_in_shard");
    if (shard && *shard != shard_state(pass.shard)) return;
    PassContext filling = pass;
    filling.epoch = saved->uint_at("filled_in_epoch");
    filling.seed = saved->uint_at("filled_with_seed");
    conveyor::detail::ResetWalk fill_walk = walk;
    // Upstream as the filling pass drew and decided (absent in a state
    // saved before it was kept: upstream then draws anew).
    const State* upstream_at_fill = saved->find("upstream_at_fill");
    upstream_at_fill_ = upstream_at_fill ? std::make_shared<const State>(*upstream_at_fill) : nullptr;
    fill_walk.restoring = upstream_at_fill_;
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
    ordered_upstream_ = fill_walk.ordered_by_timing;
    filling_pass_ = filling;
    complete_ = true;
    publish_filled();
  }
  // Does the complete cache hold what the state `walk` restores says it
  // held: the same filling pass (epoch, seed, shard), with upstream
  // deciding alike? Nothing saved for this node: the state's pass filled
  // the cache (or nothing had filled it), so this one must fill it again.
  bool holds_as_saved(const conveyor::detail::ResetWalk& walk) const {
    // This node's id, as a replay takes it (upstream's ids come first).
    const State* saved = conveyor::detail::restored_extras(walk, walk.next_id + upstream_ids_);
    if (!saved) return false;
    if (saved->uint_at("filled_in_epoch") != filling_pass_.epoch) return false;
    if (saved->uint_at("filled_with_seed") != filling_pass_.seed) return false;
    const State* shard = saved->find("filled_in_shard");  // absent in older states
    if (shard && *shard != shard_state(filling_pass_.shard)) return false;
    const State* upstream = saved->find("upstream_at_fill");
    if (!upstream || !upstream_at_fill_) return !upstream && !upstream_at_fill_;
    return *upstream == *upstream_at_fill_;
  }
  // Forgets what the cache holds: this pass fills it again.
  void drop() {
    complete_ = false;
    filling_.clear();
    upstream_at_fill_ = nullptr;
    std::lock_guard lock(filled_mutex_);
    filled_ = nullptr;
  }
  static bool same_shard(const ShardSpec& a, const ShardSpec& b) noexcept {
    return a.rank == b.rank && a.world_size == b.world_size && a.worker == b.worker &&
           a.num_workers == b.num_workers;
  }
  static State shard_state(const ShardSpec& shard) {
    State out = State::object();
    out.set("rank", shard.rank);
    out.set("world_size", shard.world_size);
    out.set("worker", shard.worker);
    out.set("num_workers", shard.num_workers);
    return out;
  }
  // Where the cache completes, which may be a strand's thread.
  void publish_filled() {
    auto filled = std::make_shared<const Filled>(Filled{filling_pass_, upstream_at_fill_});
    std::lock_guard lock(filled_mutex_);
    filled_ = std::move(filled);
  }

  NodePtr<T> upstream_;
  std::vector<T> filling_;  // the items of the first pass, complete once complete_
  bool complete_ = false;
  bool replaying_ = false;
  PassContext filling_pass_;  // the pass that filled (or fills) the cache
  std::shared_ptr<const State> upstream_at_fill_;  // upstream's extras as the filling pass ended
  struct Filled {
    PassContext pass;
    std::shared_ptr<const State> upstream;
  };
  // Set where the cache completes and copied at each reset; read by
  // save_extras() on the consumer's thread.
  mutable std::mutex filled_mutex_;
  std::shared_ptr<const Filled> filled_;
  std::shared_ptr<const Filled> filled_at_reset_;
  size_t position_ = 0;
  uint64_t upstream_ids_ = 0;  // how many ids upstream takes
  bool sharded_upstream_ = false;
  std::string ordered_upstream_;  // upstream's ResetWalk::ordered_by_timing
};

inline auto cache() {
  return []<class T>(Pipeline<T>&& upstream) {
    return Pipeline<T>(std::make_unique<Cache<T>>(std::move(upstream).release()));
  };
}

}  // namespace conveyor::nodes
