// conveyor/nodes/combine.h: several pipelines into one, one into several.
//
//   zip(a, b)                  pairs (a_i, b_i), until either ends
//   mux({a, b, ...})           round-robin, an exhausted source leaves the rotation
//   weighted_mux({...}, w)     each item from source i with probability w_i among
//                              those not exhausted, drawn from the item's seed
//   join({a, b, ...})          whichever source has an item ready first (the
//                              RFC's GreedyJoin: the order depends on timing)
//   fork(p, n, buffer)         n pipelines that each see every item of p (and
//                              every error, in its place), at most `buffer`
//                              items apart (the RFC's Multiply)
#pragma once

#include <algorithm>
#include <bit>
#include <charconv>
#include <cmath>
#include <cstdint>
#include <deque>
#include <exception>
#include <limits>
#include <memory>
#include <mutex>
#include <numeric>
#include <optional>
#include <string>
#include <typeinfo>
#include <utility>
#include <vector>

#include "conveyor/detail/decision_log.h"
#include "conveyor/generator.h"
#include "conveyor/node.h"
#include "conveyor/nodes/stage.h"

namespace conveyor::nodes {

namespace detail {

inline std::string list_inputs(const std::vector<size_t>& inputs) {
  std::string out;
  for (size_t k = 0; k < inputs.size(); ++k) {
    if (k > 0) out += k + 1 == inputs.size() ? " and " : ", ";
    out += std::to_string(inputs[k]);
  }
  return out;
}

// Resets a node's inputs (reset_input(i) for i < inputs) for sharding as
// separate graphs: each input's own most upstream shardable node takes the
// pass's shard, so every input gives this rank and worker its part. (One
// flag for the whole walk let the first input's source take the shard and
// every other input run whole on every rank.) Inputs where some take the
// shard and others cannot (a file lister with no shard() after it) would
// read those others whole on every rank: refused, naming them.
template <class ResetInput>
void reset_inputs_sharded_each(const std::string& node, const PassContext& pass, conveyor::detail::ResetWalk& walk,
                               size_t inputs, ResetInput&& reset_input) {
  std::vector<size_t> sharded, whole;
  // Each input's own: whether timing orders it (a shard() on one input
  // asks about that input alone), then the first such, for downstream.
  std::string ordered_by_timing = std::move(walk.ordered_by_timing);
  for (size_t i = 0; i < inputs; ++i) {
    walk.sharded = false;
    walk.ordered_by_timing.clear();
    reset_input(i);
    (walk.sharded ? sharded : whole).push_back(i);
    if (ordered_by_timing.empty()) ordered_by_timing = std::move(walk.ordered_by_timing);
  }
  walk.sharded = !sharded.empty();
  walk.ordered_by_timing = std::move(ordered_by_timing);
  if (sharded.empty() || whole.empty() || pass.shard.count() == 1) return;
  const bool many_sharded = sharded.size() > 1, many_whole = whole.size() > 1;
  throw ValueError(node + ": input" + (many_sharded ? "s " : " ") + list_inputs(sharded) +
                   (many_sharded ? " take" : " takes") + " the pass's shard (rank " + std::to_string(pass.shard.rank) +
                   " of " + std::to_string(pass.shard.world_size) + ", worker " + std::to_string(pass.shard.worker) +
                   " of " + std::to_string(pass.shard.num_workers) + "), but input" + (many_whole ? "s " : " ") +
                   list_inputs(whole) + (many_whole ? " have" : " has") +
                   " no shardable node and would be read whole by every rank and worker: add shard() after " +
                   (many_whole ? "their sources" : "its source"));
}

// A double as its shortest text that reads back the same ("-1e-09", where
// std::to_string gives "-0.000000").
inline std::string exact(double value) {
  char text[32];
  const auto written = std::to_chars(text, text + sizeof text, value);
  return std::string(text, written.ptr);
}

}  // namespace detail

// fork's "too far ahead of the slowest" error. Unlike a failed item it takes
// no item's place: the consumer's next item is still to come, and the next
// call may get it. zip passes it on without dropping the other input's item
// (a failed item's pair loses both); a resumed pass meets it again where it
// was met (see fork).
class ForkOverflowError : public ValueError {
 public:
  using ValueError::ValueError;
};

template <class A, class B>
class Zip final : public MeteredNode<std::pair<A, B>> {
 public:
  using item_type = std::pair<A, B>;
  Zip(NodePtr<A> a, NodePtr<B> b) : a_(std::move(a)), b_(std::move(b)) {}
  using Node<item_type>::reset;
  void reset(const PassContext& pass, conveyor::detail::ResetWalk& walk) override {
    detail::reset_inputs_sharded_each(name(), pass, walk, 2, [&](size_t i) {
      if (i == 0) {
        a_->reset(pass, walk);
      } else {
        b_->reset(pass, walk);
      }
    });
    this->start_metering(pass, walk.next_id++);
    pending_a_.reset();
    drop_b_ = false;
  }
  std::string name() const override { return "zip"; }
  uint64_t skip(uint64_t count, bool clean) override {
    if (!clean) return MeteredNode<item_type>::skip(count, clean);
    const uint64_t from_a = a_->skip(count, clean);
    return std::min(from_a, b_->skip(from_a, clean));
  }
  void save_extras(State& nodes, bool in_pass) const override {
    a_->save_extras(nodes, in_pass);
    b_->save_extras(nodes, in_pass);
  }

 private:
  // A failed item of either input is the pair's error, in the pair's place:
  // the other input's item at that place goes with it, or every later pair
  // would be shifted by one. "Not yet" (UpstreamPending) keeps what was
  // pulled for the next call, and so does a fork's ForkOverflowError, which
  // takes no item's place: it is the pair's output, and the pair is still to
  // come (what is dropped or kept stays so).
  std::optional<item_type> produce() override {
    if (drop_b_) {
      try {
        (void)this->meter_.wait([this] { return this->next_of(*b_); });
      } catch (const detail::UpstreamPending&) {
        throw;
      } catch (const ForkOverflowError&) {
        throw;  // b's item at the failed pair's place is still to drop
      } catch (...) {
        // Its own failure: the pair was reported failed already.
      }
      drop_b_ = false;
    }
    if (!pending_a_) {
      try {
        pending_a_ = this->meter_.wait([this] { return this->next_of(*a_); });
      } catch (const detail::UpstreamPending&) {
        throw;
      } catch (const ForkOverflowError&) {
        throw;
      } catch (...) {
        drop_b_ = true;
        throw;
      }
      if (!pending_a_) return std::nullopt;
    }
    std::optional<B> b;
    try {
      b = this->meter_.wait([this] { return this->next_of(*b_); });
    } catch (const detail::UpstreamPending&) {
      throw;
    } catch (const ForkOverflowError&) {
      throw;  // a's item waits for b's
    } catch (...) {
      pending_a_.reset();
      throw;
    }
    if (!b) return std::nullopt;
    item_type out{std::move(*pending_a_), std::move(*b)};
    pending_a_.reset();
    return out;
  }
  void collect_upstream_metrics(std::vector<NodeMetrics>& out) const override {
    a_->collect_metrics(out);
    b_->collect_metrics(out);
  }

  NodePtr<A> a_;
  NodePtr<B> b_;
  std::optional<A> pending_a_;
  bool drop_b_ = false;  // a's item failed: b's at its place is dropped next
};

template <class A, class B>
Pipeline<std::pair<A, B>> zip(Pipeline<A>&& a, Pipeline<B>&& b) {
  return Pipeline<std::pair<A, B>>(
      std::make_unique<Zip<A, B>>(std::move(a).release(), std::move(b).release()));
}

// What mux, weighted_mux and join share: sources, which are still going,
// and resetting them in order.
template <class T>
class Merge : public MeteredNode<T> {
 public:
  using item_type = T;
  using Node<T>::reset;
  void reset(const PassContext& pass, conveyor::detail::ResetWalk& walk) override {
    detail::reset_inputs_sharded_each(this->name(), pass, walk, sources_.size(),
                                      [&](size_t i) { sources_[i]->reset(pass, walk); });
    this->start_metering(pass, walk.next_id++);
    pass_ = pass;
    past_shard_ = walk.sharded;
    active_.assign(sources_.size(), true);
    active_count_ = sources_.size();
    cursor_ = 0;
    produced_ = 0;
  }
  void save_extras(State& nodes, bool in_pass) const override {
    for (const auto& source : sources_) source->save_extras(nodes, in_pass);
  }

 protected:
  Merge(std::vector<Pipeline<T>>&& sources, const char* node) {
    if (sources.empty()) throw ValueError(std::string(node) + ": needs at least one pipeline to merge, but got none");
    for (auto& source : sources) sources_.push_back(std::move(source).release());
  }
  void collect_upstream_metrics(std::vector<NodeMetrics>& out) const override {
    for (const auto& source : sources_) source->collect_metrics(out);
  }
  std::optional<T> pull(size_t i) {
    return this->meter_.wait([&] { return this->next_of(*sources_[i]); });
  }
  void retire(size_t i) {
    if (active_[i]) {
      active_[i] = false;
      --active_count_;
    }
  }

  std::vector<NodePtr<T>> sources_;
  std::vector<bool> active_;
  size_t active_count_ = 0;
  size_t cursor_ = 0;
  uint64_t produced_ = 0;
  PassContext pass_;
  bool past_shard_ = false;  // the sources took the pass's shard: picks count one shard's items
};

template <class T>
class Mux final : public Merge<T> {
 public:
  explicit Mux(std::vector<Pipeline<T>>&& sources) : Merge<T>(std::move(sources), "mux") {}
  std::string name() const override { return "mux"; }
  // The rotation replayed, each source skipping its turn's item (a failed
  // item took its turn too).
  uint64_t skip(uint64_t count, bool clean) override {
    uint64_t skipped = 0;
    while (skipped < count && this->active_count_ > 0) {
      const size_t i = this->cursor_;
      this->cursor_ = (this->cursor_ + 1) % this->sources_.size();
      if (!this->active_[i]) continue;
      if (this->sources_[i]->skip(1, clean) == 1) {
        ++skipped;
      } else {
        this->retire(i);
      }
    }
    return skipped;
  }

 private:
  std::optional<T> produce() override {
    while (this->active_count_ > 0) {
      const size_t i = this->cursor_;
      this->cursor_ = (this->cursor_ + 1) % this->sources_.size();
      if (!this->active_[i]) continue;
      std::optional<T> item;
      try {
        item = this->pull(i);
      } catch (const detail::UpstreamPending&) {
        this->cursor_ = i;  // not yet: still its turn (a failed item took its turn)
        throw;
      }
      if (item) return item;
      this->retire(i);
    }
    return std::nullopt;
  }
};

template <class T>
Pipeline<T> mux(std::vector<Pipeline<T>> sources) {
  return Pipeline<T>(std::make_unique<Mux<T>>(std::move(sources)));
}

template <class T>
class WeightedMux final : public Merge<T> {
 public:
  WeightedMux(std::vector<Pipeline<T>>&& sources, std::vector<double> weights)
      : Merge<T>(std::move(sources), "weighted_mux"), weights_(std::move(weights)) {
    if (weights_.size() != this->sources_.size()) {
      throw ValueError("weighted_mux: " + std::to_string(weights_.size()) + " weights for " +
                       std::to_string(this->sources_.size()) + " sources");
    }
    double total = 0;
    for (size_t i = 0; i < weights_.size(); ++i) {
      if (!(weights_[i] > 0) || !std::isfinite(weights_[i])) {
        throw ValueError("weighted_mux: weight " + std::to_string(i) + " should be positive and finite, but got " +
                         detail::exact(weights_[i]));
      }
      total += weights_[i];
    }
    // Finite weights whose sum is not (near DBL_MAX): a pick's total would be
    // infinite and every pick the last source's. Scaled by 2^-bit_width(n),
    // their sum is at most DBL_MAX / 2, and a power of two scales every
    // product and difference in pick() without rounding (but for weights
    // near the subnormal range, 1e-300 or so, which beside one near DBL_MAX
    // are never picked anyway). Weights whose sum is finite stay as given:
    // dividing by the sum or the largest would round, and change the picks
    // that seeded passes and saved states were made with.
    if (!std::isfinite(total)) {
      const int shift = static_cast<int>(std::bit_width(weights_.size()));
      for (double& w : weights_) w = std::ldexp(w, -shift);
    }
  }
  std::string name() const override { return "weighted_mux"; }
  // The picks replayed (their seeds are their numbers), each picked source
  // skipping its item.
  uint64_t skip(uint64_t count, bool clean) override {
    uint64_t skipped = 0;
    while (skipped < count && this->active_count_ > 0) {
      const size_t i = pick();
      if (this->sources_[i]->skip(1, clean) == 1) {
        ++skipped;
      } else {
        this->retire(i);
      }
    }
    return skipped;
  }

 private:
  // Each pick draws from the item's own seed: the sequence of picks is the
  // same for the same pass.
  size_t pick() {
    Generator generator = Generator::for_item(item_seed(this->pass_, this->id_, this->produced_++, this->past_shard_));
    double total = 0;
    for (size_t i = 0; i < weights_.size(); ++i) total += this->active_[i] ? weights_[i] : 0;
    double u = uniform(generator) * total;
    size_t picked = 0;
    for (size_t i = 0; i < weights_.size(); ++i) {
      if (!this->active_[i]) continue;
      picked = i;
      if (u < weights_[i]) break;
      u -= weights_[i];
    }
    return picked;
  }
  std::optional<T> produce() override {
    while (this->active_count_ > 0) {
      const size_t i = pick();
      std::optional<T> item;
      try {
        item = this->pull(i);
      } catch (const detail::UpstreamPending&) {
        --this->produced_;  // not yet: the next call draws the same pick
        throw;
      }
      if (item) return item;
      this->retire(i);
    }
    return std::nullopt;
  }

  std::vector<double> weights_;
};

template <class T>
Pipeline<T> weighted_mux(std::vector<Pipeline<T>> sources, std::vector<double> weights) {
  return Pipeline<T>(std::make_unique<WeightedMux<T>>(std::move(sources), std::move(weights)));
}

// Which source each item came from depends on timing, so join logs it
// (DecisionLog: 4 bytes an item this pass) and a state holds the log, run-
// length coded; a resumed pass skips each source by its count.
template <class T>
class Join final : public Merge<T> {
 public:
  explicit Join(std::vector<Pipeline<T>>&& sources) : Merge<T>(std::move(sources), "join") {}
  Poll try_next(std::optional<T>& out) override { return this->counted(poll(out)); }
  std::string name() const override { return "join"; }

  using Node<T>::reset;
  void reset(const PassContext& pass, conveyor::detail::ResetWalk& walk) override {
    Merge<T>::reset(pass, walk);
    if (walk.ordered_by_timing.empty()) walk.ordered_by_timing = name();
    log_.clear();
    replay_.clear();
    replay_at_ = 0;
    if (const State* saved = conveyor::detail::restored_extras(walk, this->id_)) {
      const std::vector<uint64_t> runs = saved->at("sources").as_uint_list("sources");
      if (runs.size() % 2 != 0) {
        throw StateError("load_state: join's 'sources' should hold (source, count) pairs, but it holds " +
                         std::to_string(runs.size()) + " numbers");
      }
      uint64_t total = 0;
      for (size_t r = 0; r < runs.size(); r += 2) {
        if (runs[r] >= this->sources_.size()) {
          throw StateError("load_state: join's state names source " + std::to_string(runs[r]) + " of " +
                           std::to_string(this->sources_.size()));
        }
        // No log holds more (DecisionLog::kMaxEntries): a larger count is a
        // corrupt state, refused before it is expanded.
        if (runs[r + 1] > conveyor::detail::DecisionLog::kMaxEntries - total) {
          throw StateError("load_state: join's state takes " + std::to_string(runs[r + 1]) + " items from source " +
                           std::to_string(runs[r]) + " after " + std::to_string(total) + ", more than a pass's log keeps (" +
                           std::to_string(conveyor::detail::DecisionLog::kMaxEntries) + "): the state is corrupt");
        }
        total += runs[r + 1];
        replay_.insert(replay_.end(), runs[r + 1], static_cast<uint32_t>(runs[r]));
      }
    }
    saved_.set(std::vector<uint64_t>(replay_.begin(), replay_.end()));
  }
  uint64_t skip(uint64_t count, bool clean) override {
    const size_t end = std::min<size_t>(replay_.size(), replay_at_ + count);
    const uint64_t logged = end - replay_at_;
    std::vector<uint64_t> per_source(this->sources_.size(), 0);
    for (size_t k = replay_at_; k < end; ++k) ++per_source[replay_[k]];
    for (size_t i = 0; i < per_source.size(); ++i) {
      if (per_source[i] > 0 && this->sources_[i]->skip(per_source[i], clean) < per_source[i]) {
        throw StateError("load_state: join's source " + std::to_string(i) + " ended before the " +
                         std::to_string(per_source[i]) + " items the state took from it");
      }
    }
    for (size_t k = replay_at_; k < end; ++k) log_.append(replay_[k]);
    if (end > replay_at_) follow(replay_[end - 1]);
    replay_at_ = end;
    return logged + (count > logged ? Merge<T>::skip(count - logged, clean) : 0);
  }
  void save_extras(State& nodes, bool in_pass) const override {
    if (!in_pass) return Merge<T>::save_extras(nodes, in_pass);  // the next pass decides afresh
    std::vector<uint64_t> runs;
    for (const uint64_t source : saved_.with(log_)) {
      if (!runs.empty() && runs[runs.size() - 2] == source) {
        ++runs.back();
      } else {
        runs.push_back(source);
        runs.push_back(1);
      }
    }
    State mine = State::object();
    mine.set("sources", State::list(runs));
    nodes.set(std::to_string(this->id_), std::move(mine));
    Merge<T>::save_extras(nodes, in_pass);
  }

 private:
  // A resumed pass whose outputs a node downstream takes again by pulling
  // (a filter, say): they come from the saved sources in the saved order.
  std::optional<T> replay() {
    const size_t i = replay_[replay_at_++];
    follow(i);
    std::optional<T> item;
    try {
      item = this->pull(i);
    } catch (...) {
      log_.append(static_cast<uint32_t>(i));
      throw;
    }
    if (!item) {
      throw StateError("load_state: join's source " + std::to_string(i) +
                       " ends before the items the saved pass took from it");
    }
    log_.append(static_cast<uint32_t>(i));
    return item;
  }

  std::optional<T> produce() override {
    if (replay_at_ < replay_.size()) return replay();
    std::optional<T> out;
    while (this->active_count_ > 0) {
      const Poll polled = poll(out);
      if (polled == Poll::ready) return out;
      if (polled == Poll::end) return std::nullopt;
      // Nothing ready anywhere: wait on the next source in the rotation.
      const size_t i = next_active();
      std::optional<T> item;
      try {
        item = this->pull(i);
      } catch (...) {
        log_.append(static_cast<uint32_t>(i));  // a failed item came from there too
        throw;
      }
      if (item) {
        log_.append(static_cast<uint32_t>(i));
        return item;
      }
      this->retire(i);
    }
    return std::nullopt;
  }
  Poll poll(std::optional<T>& out) {
    if (replay_at_ < replay_.size()) {
      out = replay();
      return Poll::ready;
    }
    for (size_t tried = 0; tried < this->sources_.size() && this->active_count_ > 0; ++tried) {
      const size_t i = next_active();
      Poll poll = Poll::pending;
      try {
        poll = this->sources_[i]->try_next(out);
      } catch (...) {
        log_.append(static_cast<uint32_t>(i));
        throw;
      }
      if (poll == Poll::ready) {
        log_.append(static_cast<uint32_t>(i));
        this->meter_.in.add(1);  // a pull past the meter's wait()
        return Poll::ready;
      }
      if (poll == Poll::end) this->retire(i);
    }
    return this->active_count_ > 0 ? Poll::pending : Poll::end;
  }
  // The rotation goes on after the source of the last output, as it did
  // in the saved pass (each output sets it there: next_active).
  void follow(size_t source) { this->cursor_ = (source + 1) % this->sources_.size(); }
  size_t next_active() {
    while (!this->active_[this->cursor_]) this->cursor_ = (this->cursor_ + 1) % this->sources_.size();
    const size_t i = this->cursor_;
    this->cursor_ = (this->cursor_ + 1) % this->sources_.size();
    return i;
  }

  conveyor::detail::DecisionLog log_;  // this pass: the source of each output
  conveyor::detail::SavedDecisions saved_;
  std::vector<uint32_t> replay_;       // a resumed pass: the saved log
  size_t replay_at_ = 0;               // its entries skipped so far
};

template <class T>
Pipeline<T> join(std::vector<Pipeline<T>> sources) {
  return Pipeline<T>(std::make_unique<Join<T>>(std::move(sources)));
}

// fork: the consumers share the upstream and a buffer of the items not every
// consumer has taken yet (at most `buffer` items). The consumers may be
// advanced from several threads (each behind its own prefetch or parallel
// map): they take turns at upstream and the buffer under one mutex, held
// while upstream makes an item (a consumer that finds its item buffered
// waits for that pull).
//
// A consumer that gets further ahead of the slowest than the buffer allows
// is a ForkOverflowError (a ValueError): in one thread it would otherwise
// wait for ever. It takes no item's place: the consumer stays where it is,
// its next item is still to come, and a later call (once the others have
// taken from the buffer) gets it. So no consumer misses an item it should
// see, the buffer never holds more than its limit, and zip, which passes
// this error on without dropping the other input's item, keeps its pairs
// aligned. A checkpoint counts the error as an output (every error is, for
// the consumer's Pipeline): each consumer's state holds where it met these
// errors (before which of its items, how many times) and how far it had
// taken, and a resumed pass meets them again there and meets no new one
// before that point, so its outputs are the saved pass's, one for one.
// Size the buffer above what runs ahead between a consumer and the point
// where the branches are taken in step: behind prefetch(n) on each branch
// of a zip, a branch's strand may be n + 1 items ahead of the other
// branch's, whichever thread is scheduled first, so a buffer of n + 2 or
// more; a parallel map on a branch pulls up to its window ahead the same way.
//
// Passes: the first consumer reset into a new pass resets upstream, and the
// others join that pass when they are reset, with the same seed, epoch
// and shard as the first (else a ValueError naming both). A consumer still in the last
// pass takes nothing from the new one: one with items left there (cut off
// mid-pass) gets a StateError naming who started the new pass, one that had
// taken every item gets the end. (Resetting a graph resets its branches one
// after another, and a branch's prefetch cancels its strand, and drops what
// it got, before the branch is reset.) An upstream whose reset threw is
// reset again by the next consumer reset, whichever that is, and nothing is
// taken from it meanwhile.
//
// Upstream's nodes are numbered in the walk of the consumer that starts the
// pass, from where the fork sits in that consumer's graph: their seeds (a
// shuffle's order) and the keys of what they save follow that. Start the
// consumers in the same order each time. A state taken when upstream was
// numbered from another place than where this pass numbers it would hand
// its saved decisions to the wrong nodes (items handed out twice, others
// lost): it is refused, naming both places. (Numbering upstream apart
// from every consumer would need a name for the fork that both the program
// and a resumed process agree on; its nodes' names alone are not one: two
// forks over different files of one shape would shuffle alike.)
//
// Resuming far into a pass holds what the consumers were apart when the
// state was taken where they are reset together and then skipped (one
// graph over the branches: a zip, mux or join of them). Consumers in
// pipelines of their own, each resumed by its own pass(), hold upstream's
// items up to the first one's place until the others have skipped too.
//
// A consumer destroyed mid-pass leaves the fork: the others no longer wait
// for it to take what they have.
template <class T>
class ForkState {
 public:
  ForkState(NodePtr<T> upstream, size_t consumers, size_t buffer)
      : upstream_(std::move(upstream)),
        taken_(consumers, 0),
        passes_(consumers, 0),
        cut_(consumers),
        overflows_(consumers),
        left_(consumers, false),
        buffer_(buffer),
        buffer_limit_(buffer) {}

  void reset(size_t consumer, const PassContext& pass, conveyor::detail::ResetWalk& walk) {
    const std::lock_guard lock(mutex_);
    const uint64_t first_id = walk.next_id;
    // The first consumer into a new pass resets upstream, and so does any
    // consumer after upstream's reset threw.
    if (passes_[consumer] == pass_ || upstream_unreset_) {
      // Started over by one consumer (ResetWalk::restart): a consumer
      // sharing the pass and not started over with it has lost its items.
      restarted_by_ = std::nullopt;
      for (size_t other = 0; other < passes_.size(); ++other) {
        if (other == consumer || left_[other] || passes_[other] != pass_) continue;
        if (walk.restart) restarted_by_ = consumer;
        // Cut off mid-pass: it had items left in the pass that ends here.
        if (!(ended_ && taken_[other] == base_ + items_.size())) cut_[other] = Cut{consumer, taken_[other]};
      }
      ++pass_;
      // Until upstream's reset returns, no consumer is in pass_ (each
      // takes nothing) and the next reset resets upstream again.
      upstream_unreset_ = true;
      items_.clear();
      base_ = 0;
      std::fill(taken_.begin(), taken_.end(), 0);
      for (Overflows& overflows : overflows_) overflows = Overflows{};
      ended_ = false;
      upstream_->reset(pass, walk);
      upstream_unreset_ = false;
      numbered_by_ = consumer;
      started_with_ = pass;
      upstream_first_id_ = first_id;
      upstream_ids_ = walk.next_id - first_id;
      sharded_ = walk.sharded;
      ordered_by_timing_ = walk.ordered_by_timing;
    } else {
      refuse_another_context(consumer, pass);
      walk.next_id += upstream_ids_;
      walk.sharded = walk.sharded || sharded_;
      if (walk.ordered_by_timing.empty()) walk.ordered_by_timing = ordered_by_timing_;
    }
    passes_[consumer] = pass_;
    cut_[consumer] = std::nullopt;
  }

  // A consumer joining the pass takes what upstream draws under the
  // context of the consumer that started it: joining with another seed,
  // epoch or shard would hand it items it did not ask for, unannounced.
  // Refused before it joins, so the pass stays the others'.
  void refuse_another_context(size_t consumer, const PassContext& pass) const {
    const PassContext& started = started_with_;
    const auto describe = [](const PassContext& c) {
      return "seed " + std::to_string(c.seed) + ", epoch " + std::to_string(c.epoch) + ", shard " +
             std::to_string(c.shard.rank) + "/" + std::to_string(c.shard.world_size) + " worker " +
             std::to_string(c.shard.worker) + "/" + std::to_string(c.shard.num_workers);
    };
    const bool same_shard = pass.shard.rank == started.shard.rank && pass.shard.world_size == started.shard.world_size &&
                            pass.shard.worker == started.shard.worker &&
                            pass.shard.num_workers == started.shard.num_workers;
    if (pass.seed == started.seed && pass.epoch == started.epoch && same_shard) return;
    throw ValueError("fork[" + std::to_string(consumer) + "]: its pass has " + describe(pass) + ", but fork[" +
                     std::to_string(numbered_by_) + "] started the fork's pass with " + describe(started) +
                     ": a fork's consumers share one pass of upstream; give every consumer's pipeline the same "
                     "seed(), set_epoch() and shard()");
  }

  // The consumer's node is gone: the others take on without it.
  void leave(size_t consumer) noexcept {
    const std::lock_guard lock(mutex_);
    left_[consumer] = true;
    drop_taken_by_all();
  }

  // After reset(): what a resumed pass's state saved for this consumer
  // (save_extras), or nullptr for a pass from its start.
  void restore(size_t consumer, const State* saved) {
    const std::lock_guard lock(mutex_);
    Overflows& overflows = overflows_[consumer];
    overflows = Overflows{};
    if (!saved) return;
    const std::string who = "load_state: fork[" + std::to_string(consumer) + "]'s state";
    // Where upstream was numbered from when the state was taken (states
    // from before this was saved do not say).
    if (const State* from = saved->find("upstream_from")) {
      const std::vector<uint64_t> place = from->as_uint_list("upstream_from");
      if (place.size() != 2) throw StateError(who + "'s 'upstream_from' should hold (consumer, id): the state is corrupt");
      if (place[1] != upstream_first_id_) {
        // Refused. Where this consumer's reset began the pass and no other
        // has joined it, the next consumer reset numbers upstream again,
        // from its own graph. A pass others are in stays theirs (marked
        // unreset, it would end for them unannounced).
        bool others_in_pass = false;
        for (size_t other = 0; other < passes_.size(); ++other) {
          others_in_pass = others_in_pass || (other != consumer && !left_[other] && passes_[other] == pass_);
        }
        if (numbered_by_ == consumer && !others_in_pass) upstream_unreset_ = true;
        throw StateError(who + " was taken when consumer " + std::to_string(place[0]) +
                         " started the pass, its upstream numbered from node " + std::to_string(place[1]) +
                         ", but consumer " + std::to_string(numbered_by_) + " started this one, numbering it from node " +
                         std::to_string(upstream_first_id_) +
                         ": upstream's seeds and saved decisions would go to other nodes; start consumer " +
                         std::to_string(place[0]) + "'s pass first, as when the state was taken");
      }
    }
    std::vector<uint64_t> runs = saved->at("overflows").as_uint_list("overflows");
    const uint64_t at = saved->uint_at("at");
    if (runs.size() % 2 != 0) {
      throw StateError(who + " should hold (position, count) pairs, but it holds " + std::to_string(runs.size()) +
                       " numbers");
    }
    for (size_t r = 0; r < runs.size(); r += 2) {
      if ((r > 0 && runs[r] <= runs[r - 2]) || runs[r] > at || runs[r + 1] == 0) {
        throw StateError(who + " names overflow errors out of order, none, or past where it had taken (" +
                         std::to_string(at) + " items): the state is corrupt");
      }
    }
    overflows.replay = std::move(runs);
    overflows.quiet_until = at;
  }

  // Upstream's metrics appear once, under the first consumer.
  void collect_upstream_metrics(size_t consumer, std::vector<NodeMetrics>& out) const {
    if (consumer == 0) upstream_->collect_metrics(out);
  }
  // Every consumer's state holds upstream's: a resumed consumer resets
  // upstream if it is the first into the pass, whichever that is. Under
  // the mutex: upstream is advanced under it, maybe on another thread.
  // In a pass, the consumer's own (under `id`, its node's): where it met
  // overflow errors, how far it had taken, and where upstream was numbered
  // from.
  void save_extras(size_t consumer, uint64_t id, State& nodes, bool in_pass) const {
    const std::lock_guard lock(mutex_);
    upstream_->save_extras(nodes, in_pass);
    if (!in_pass || passes_[consumer] != pass_ || upstream_unreset_) return;
    // A consumer of a resumed pass not yet back at its saved place (its
    // skip waiting on another's, or behind a node that had pulled ahead)
    // stood at that place in the saved pass, with the overflow errors met
    // there still to come: saved as they were, or a state taken now and
    // resumed would measure the buffer from too far back and drop those
    // errors.
    const Overflows& overflows = overflows_[consumer];
    std::vector<uint64_t> runs = overflows.thrown;
    for (size_t r = overflows.replay_at; r < overflows.replay.size(); r += 2) {
      const uint64_t count = overflows.replay[r + 1] - (r == overflows.replay_at ? overflows.replayed : 0);
      if (count == 0) continue;
      if (!runs.empty() && runs[runs.size() - 2] == overflows.replay[r]) {
        runs.back() += count;
      } else {
        runs.push_back(overflows.replay[r]);
        runs.push_back(count);
      }
    }
    State mine = State::object();
    mine.set("overflows", State::list(runs));
    mine.set("at", std::max(taken_[consumer], overflows.quiet_until));
    mine.set("upstream_from", State::list(std::vector<uint64_t>{numbered_by_, upstream_first_id_}));
    nodes.set(std::to_string(id), std::move(mine));
  }

  // A resumed consumer passes over the items it had taken. Where another
  // consumer of the pass was resumed too and has yet to pass over its own
  // (a zip of the fork's branches, reset one after the other and then
  // skipped), the skip only moves the consumer's place, as far as the saved
  // pass had taken items: upstream is pulled when some consumer next takes,
  // and what every consumer is past by then is dropped as it comes, never
  // buffered (zip(fork[0], fork[1]) resumed at item 100,000 held 100,000
  // items before this). A consumer placed past an end that upstream turns
  // out to have earlier than the saved pass did is told so on its next take
  // (a StateError, as a pass too short for its state is). Past where the
  // saved pass had taken, and else, the items are taken as next() takes
  // them, so the count returned is what upstream holds (a batch's skip, a
  // shuffle's probe learn its end from it), buffered for the consumers still
  // to take them, past the buffer's limit: the consumers' saved places may
  // be further apart than it allows until every one has skipped.
  uint64_t skip(size_t consumer, uint64_t count) {
    const std::lock_guard lock(mutex_);
    uint64_t skipped = another_still_to_skip(consumer) ? move_place(consumer, count) : 0;
    const size_t limit = std::exchange(buffer_limit_, std::numeric_limits<size_t>::max());
    try {
      while (skipped < count) {
        try {
          if (!take(consumer, false)) break;
        } catch (const PlacedPastTheEnd&) {
          throw;  // the pass is not the saved one
        } catch (...) {
          // A failed item (or an overflow error met there) is taken in its
          // place, as next() would hand it out.
        }
        ++skipped;
      }
    } catch (...) {
      buffer_limit_ = limit;
      throw;
    }
    buffer_limit_ = limit;
    return skipped;
  }

  // `polling`: a consumer's try_next(): upstream's try_next() is asked, and
  // "not yet" leaves everything as it was (UpstreamPending).
  // Polling never waits on the mutex: another consumer may hold it across
  // a slow upstream pull, and try_next() must not wait on another thread.
  // "Not yet" then, even with this consumer's item buffered: its next
  // poll takes it.
  std::optional<T> next(size_t consumer, bool polling = false) {
    std::unique_lock lock(mutex_, std::defer_lock);
    if (!polling) {
      lock.lock();
    } else if (!lock.try_lock()) {
      throw detail::UpstreamPending{};
    }
    return take(consumer, polling);
  }

 private:
  std::optional<T> take(size_t consumer, bool polling) {
    // A consumer not yet reset into the pass another one started (its
    // prefetch still running out the last pass) takes nothing from it.
    if (passes_[consumer] != pass_ || upstream_unreset_) {
      if (restarted_by_) {
        throw StateError("fork: consumer " + std::to_string(*restarted_by_) +
                         " started its pass over alone (a shuffle behind it resuming from a state that does not say "
                         "where its upstream ended), and consumer " + std::to_string(consumer) +
                         " shared that pass; take the state again with this conveyor");
      }
      if (const std::optional<Cut>& cut = cut_[consumer]) {
        throw StateError("fork: consumer " + std::to_string(cut->by) + " started a new pass while consumer " +
                         std::to_string(consumer) + " was " + std::to_string(cut->taken) +
                         " items into the last one; start every consumer's pass together");
      }
      return std::nullopt;
    }
    uint64_t& taken = taken_[consumer];
    Overflows& overflows = overflows_[consumer];
    // A resumed pass: the overflow errors the saved one met, where it met them.
    if (replay_overflow_due(consumer)) throw overflow(consumer, buffer_);
    // Placed ahead of upstream by a skip (move_place): upstream catches up,
    // keeping only what another consumer is still to take.
    while (taken > base_ + items_.size()) {
      if (ended_) {
        const uint64_t placed = std::exchange(taken, base_ + items_.size());
        drop_taken_by_all();
        throw PlacedPastTheEnd("load_state: fork[" + std::to_string(consumer) + "]'s state had taken " +
                               std::to_string(placed) + " items of its pass, but upstream ended after " +
                               std::to_string(taken) + ": the data is not what it was");
      }
      pull(polling);
      drop_taken_by_all();
    }
    if (taken == base_ + items_.size()) {
      if (ended_) return std::nullopt;
      // Before where a resumed pass's consumer had taken, only the saved
      // overflow errors: the buffer may hold more meanwhile.
      if (taken >= overflows.quiet_until) {
        const uint64_t ahead = taken - std::min(taken, slowest_as_saved());
        if (ahead >= buffer_limit_) throw overflow(consumer, ahead);
      }
      if (!pull(polling)) return std::nullopt;
    }
    const Entry& entry = items_[static_cast<size_t>(taken - base_)];
    std::optional<T> out;
    std::exception_ptr error = entry.error;
    if (!error) out = *entry.item;
    ++taken;
    drop_taken_by_all();
    if (error) rethrow_own_copy(error);
    return out;
  }

  // Appends upstream's next item (or the error thrown in its place) to the
  // buffer; false, and the fork ended, at upstream's end.
  bool pull(bool polling) {
    Entry entry;
    try {
      if (!polling) {
        entry.item = upstream_->next();
      } else if (upstream_->try_next(entry.item) == Poll::pending) {
        throw detail::UpstreamPending{};
      }
    } catch (const detail::UpstreamPending&) {
      throw;
    } catch (...) {
      // An upstream error is an entry: every consumer meets it in its place.
      entry.error = std::current_exception();
    }
    if (!entry.item && !entry.error) {
      ended_ = true;
      return false;
    }
    items_.push_back(std::move(entry));
    return true;
  }

  // The consumer's next output is an overflow error its resumed pass's
  // saved one met here: counted as met, and true.
  bool replay_overflow_due(size_t consumer) {
    Overflows& overflows = overflows_[consumer];
    if (overflows.replay_at >= overflows.replay.size() || overflows.replay[overflows.replay_at] != taken_[consumer]) {
      return false;
    }
    if (++overflows.replayed == overflows.replay[overflows.replay_at + 1]) {
      overflows.replay_at += 2;
      overflows.replayed = 0;
    }
    return true;
  }

  // Another consumer of this pass was resumed and has not yet passed over
  // what its state had taken (its skip is still to come, or it is taking
  // again what a node behind it had pulled ahead).
  bool another_still_to_skip(size_t consumer) const {
    if (upstream_unreset_) return false;
    for (size_t other = 0; other < taken_.size(); ++other) {
      if (other != consumer && !left_[other] && passes_[other] == pass_ &&
          taken_[other] < overflows_[other].quiet_until) {
        return true;
      }
    }
    return false;
  }

  // skip() without pulling: the consumer's place moves past up to `count`
  // outputs, an overflow error the saved pass met counting as one, as
  // take() would meet them, and no further than items the saved pass had
  // (the furthest consumer's state) or the fork has pulled: those exist, if
  // upstream is what it was.
  uint64_t move_place(size_t consumer, uint64_t count) {
    uint64_t known = base_ + items_.size();
    for (size_t c = 0; c < taken_.size(); ++c) {
      if (!left_[c] && passes_[c] == pass_) known = std::max(known, overflows_[c].quiet_until);
    }
    uint64_t& taken = taken_[consumer];
    uint64_t skipped = 0;
    for (; skipped < count; ++skipped) {
      if (replay_overflow_due(consumer)) {
        (void)overflow(consumer, buffer_);  // counted where the saved pass met it
        continue;
      }
      if (taken >= known) break;
      ++taken;
    }
    drop_taken_by_all();
    return skipped;
  }

  // Where the slowest consumer stands, as the saved pass had it where the
  // pass was resumed: one not yet back at its saved place (its skip still
  // to come, or behind a fork whose lazy skip has not pulled it there) stood
  // at that place in the saved pass, from the state on. Measured from where
  // it stands now, the buffer looked fuller than in the saved pass, and a
  // resumed pass met overflow errors the saved one had not (a fork fed by
  // another fork's consumer).
  uint64_t slowest_as_saved() const noexcept {
    uint64_t slowest = std::numeric_limits<uint64_t>::max();
    for (size_t c = 0; c < taken_.size(); ++c) {
      if (left_[c]) continue;
      const uint64_t saved_place = passes_[c] == pass_ ? overflows_[c].quiet_until : 0;
      slowest = std::min(slowest, std::max(taken_[c], saved_place));
    }
    return slowest;
  }

  // Drops what every consumer still in the fork has taken (one not yet
  // reset into the pass has taken nothing).
  void drop_taken_by_all() noexcept {
    uint64_t slowest = std::numeric_limits<uint64_t>::max();
    for (size_t c = 0; c < taken_.size(); ++c) {
      if (!left_[c]) slowest = std::min(slowest, taken_[c]);
    }
    slowest = std::min(slowest, base_ + items_.size());
    while (base_ < slowest) {
      items_.pop_front();
      ++base_;
    }
  }

  // Throws a consumer an exception object of its own. Consumers run on
  // different threads (one behind a prefetch), and one object rethrown to all
  // of them is freed by whichever lets it go last, ordered only by libstdc++'s
  // reference count: correct, but ThreadSanitizer cannot see that count (the
  // library is not instrumented) and reports the free as a race with the
  // other consumer's reads. A NodeError, what every node throws, is made anew
  // from the shared one's text, here under the fork's mutex (as is every read
  // of the shared one; not a copy: std::runtime_error's copy shares its
  // counted message). Its nested original stays shared. Any other exception
  // is rethrown as is.
  [[noreturn]] static void rethrow_own_copy(const std::exception_ptr& error) {
    std::string what;
    std::string node;
    uint64_t position = 0;
    std::exception_ptr original;
    try {
      std::rethrow_exception(error);
    } catch (const NodeError& e) {
      if (typeid(e) != typeid(NodeError)) throw;
      what = e.what();
      node = e.node();
      position = e.position();
      original = e.original();
    }
    // A NodeError nests the exception in flight: the original, or none.
    if (!original) throw NodeError(what, std::move(node), position);
    try {
      std::rethrow_exception(original);
    } catch (...) {
      throw NodeError(what, std::move(node), position);
    }
  }

  // The consumer's overflow error, counted where it stands (its state's
  // "overflows"): `ahead` items ahead of the slowest.
  ForkOverflowError overflow(size_t consumer, size_t ahead) {
    std::vector<uint64_t>& thrown = overflows_[consumer].thrown;
    const uint64_t at = taken_[consumer];
    if (!thrown.empty() && thrown[thrown.size() - 2] == at) {
      ++thrown.back();
    } else {
      thrown.push_back(at);
      thrown.push_back(1);
    }
    return ForkOverflowError("fork: consumer " + std::to_string(consumer) + " is " + std::to_string(ahead) +
                             " items ahead of the slowest, the buffer's limit; take from the others or raise it "
                             "(its next item, " + std::to_string(at) +
                             ", is still to come: this error takes no item's place)");
  }

  // A consumer a skip placed past upstream's end (move_place).
  struct PlacedPastTheEnd : StateError {
    using StateError::StateError;
  };
  // An upstream item, or the error upstream threw in its place.
  struct Entry {
    std::optional<T> item;
    std::exception_ptr error;
  };
  // A consumer cut off mid-pass by another's new pass.
  struct Cut {
    size_t by;       // the consumer that started the new pass
    uint64_t taken;  // the items it had taken in the last one
  };
  // A consumer's overflow errors in this pass, as (position, count) runs:
  // `count` errors met before its item `position`.
  struct Overflows {
    std::vector<uint64_t> thrown;  // this pass's, replayed ones included
    std::vector<uint64_t> replay;  // a resumed pass's, from its state
    size_t replay_at = 0;          // replay's next run
    uint64_t replayed = 0;         // of that run, met so far
    uint64_t quiet_until = 0;      // a resumed pass: no new overflow error before this item
  };
  NodePtr<T> upstream_;
  std::deque<Entry> items_;  // items base_ .. base_ + size - 1
  uint64_t base_ = 0;
  std::vector<uint64_t> taken_;   // by consumer: items taken this pass
  std::vector<uint64_t> passes_;  // by consumer: passes started
  std::vector<std::optional<Cut>> cut_;  // by consumer: cut off in its pass (passes_ < pass_)
  std::vector<Overflows> overflows_;     // by consumer
  std::vector<bool> left_;               // by consumer: its node is gone (leave)
  uint64_t pass_ = 0;
  bool upstream_unreset_ = false;  // upstream's last reset threw: the pass has not begun
  uint64_t numbered_by_ = 0;        // the consumer whose walk numbered upstream this pass
  PassContext started_with_;        // and the context it reset upstream with
  uint64_t upstream_first_id_ = 0;  // from this id
  uint64_t upstream_ids_ = 0;
  bool sharded_ = false;
  std::string ordered_by_timing_;  // upstream's ResetWalk::ordered_by_timing
  bool ended_ = false;
  std::optional<size_t> restarted_by_;  // the consumer that started this pass over alone
  const size_t buffer_;                 // the limit fork() was given
  size_t buffer_limit_;                 // the limit now (none while a resumed consumer skips)
  // Around upstream and everything above, for consumers on several threads
  // (uncontended, one lock an item, where they share one thread).
  mutable std::mutex mutex_;
};

template <class T>
class ForkOutput final : public MeteredNode<T> {
 public:
  using item_type = T;
  ForkOutput(std::shared_ptr<ForkState<T>> state, size_t consumer) : state_(std::move(state)), consumer_(consumer) {}
  ~ForkOutput() override { state_->leave(consumer_); }
  ForkOutput(const ForkOutput&) = delete;
  ForkOutput& operator=(const ForkOutput&) = delete;
  using Node<T>::reset;
  void reset(const PassContext& pass, conveyor::detail::ResetWalk& walk) override {
    state_->reset(consumer_, pass, walk);
    this->start_metering(pass, walk.next_id++);
    state_->restore(consumer_, conveyor::detail::restored_extras(walk, this->id_));
  }
  std::string name() const override { return "fork[" + std::to_string(consumer_) + "]"; }
  uint64_t skip(uint64_t count, bool) override { return state_->skip(consumer_, count); }
  void save_extras(State& nodes, bool in_pass) const override {
    state_->save_extras(consumer_, this->id_.load(std::memory_order_relaxed), nodes, in_pass);
  }

 private:
  // Its items in are those it takes from the shared buffer.
  std::optional<T> produce() override {
    std::optional<T> item = state_->next(consumer_, this->polling());
    if (item) this->meter_.in.add(1);
    return item;
  }
  void collect_upstream_metrics(std::vector<NodeMetrics>& out) const override {
    state_->collect_upstream_metrics(consumer_, out);
  }

  std::shared_ptr<ForkState<T>> state_;
  size_t consumer_;
};

template <class T>
std::vector<Pipeline<T>> fork(Pipeline<T>&& upstream, size_t consumers, size_t buffer) {
  if (consumers == 0) throw ValueError("fork: needs at least one consumer");
  if (buffer == 0) throw ValueError("fork: buffer should be at least 1, but got 0");
  auto state = std::make_shared<ForkState<T>>(std::move(upstream).release(), consumers, buffer);
  std::vector<Pipeline<T>> outputs;
  for (size_t i = 0; i < consumers; ++i) outputs.emplace_back(std::make_unique<ForkOutput<T>>(state, i));
  return outputs;
}

}  // namespace conveyor::nodes
