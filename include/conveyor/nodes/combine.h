// conveyor/nodes/combine.h: several pipelines into one, one into several.
//
//   zip(a, b)                  pairs (a_i, b_i), until either ends
//   mux({a, b, ...})           round-robin, an exhausted source leaves the rotation
//   weighted_mux({...}, w)     each item from source i with probability w_i among
//                              those not exhausted, drawn from the item's seed
//   join({a, b, ...})          whichever source has an item ready first (the
//                              RFC's GreedyJoin: the order depends on timing)
//   fork(p, n, buffer)         n pipelines that each see every item of p, at
//                              most `buffer` items apart (the RFC's Multiply)
#pragma once

#include <algorithm>
#include <cstdint>
#include <deque>
#include <limits>
#include <memory>
#include <numeric>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "conveyor/generator.h"
#include "conveyor/node.h"
#include "conveyor/nodes/stage.h"

namespace conveyor::nodes {

template <class A, class B>
class Zip final : public MeteredNode<std::pair<A, B>> {
 public:
  using item_type = std::pair<A, B>;
  Zip(NodePtr<A> a, NodePtr<B> b) : a_(std::move(a)), b_(std::move(b)) {}
  using Node<item_type>::reset;
  void reset(const PassContext& pass, conveyor::detail::ResetWalk& walk) override {
    a_->reset(pass, walk);
    b_->reset(pass, walk);
    this->start_metering(pass, walk.next_id++);
    pending_a_.reset();
  }
  std::string name() const override { return "zip"; }

 private:
  std::optional<item_type> produce() override {
    if (!pending_a_) {
      pending_a_ = this->meter_.wait([this] { return a_->next(); });
      if (!pending_a_) return std::nullopt;
    }
    // An error here keeps a's item for the next call.
    std::optional<B> b = this->meter_.wait([this] { return b_->next(); });
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
    for (auto& source : sources_) source->reset(pass, walk);
    this->start_metering(pass, walk.next_id++);
    pass_ = pass;
    active_.assign(sources_.size(), true);
    active_count_ = sources_.size();
    cursor_ = 0;
    produced_ = 0;
  }

 protected:
  explicit Merge(std::vector<Pipeline<T>>&& sources) {
    if (sources.empty()) throw ValueError("a merge of pipelines needs at least one");
    for (auto& source : sources) sources_.push_back(std::move(source).release());
  }
  void collect_upstream_metrics(std::vector<NodeMetrics>& out) const override {
    for (const auto& source : sources_) source->collect_metrics(out);
  }
  std::optional<T> pull(size_t i) {
    return this->meter_.wait([&] { return sources_[i]->next(); });
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
};

template <class T>
class Mux final : public Merge<T> {
 public:
  explicit Mux(std::vector<Pipeline<T>>&& sources) : Merge<T>(std::move(sources)) {}
  std::string name() const override { return "mux"; }

 private:
  std::optional<T> produce() override {
    while (this->active_count_ > 0) {
      const size_t i = this->cursor_;
      this->cursor_ = (this->cursor_ + 1) % this->sources_.size();
      if (!this->active_[i]) continue;
      if (std::optional<T> item = this->pull(i)) return item;
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
      : Merge<T>(std::move(sources)), weights_(std::move(weights)) {
    if (weights_.size() != this->sources_.size()) {
      throw ValueError("weighted_mux: " + std::to_string(weights_.size()) + " weights for " +
                       std::to_string(this->sources_.size()) + " sources");
    }
    for (double w : weights_) {
      if (!(w > 0) || w == std::numeric_limits<double>::infinity()) {
        throw ValueError("weighted_mux: weights should be positive and finite, but got " + std::to_string(w));
      }
    }
  }
  std::string name() const override { return "weighted_mux"; }

 private:
  std::optional<T> produce() override {
    while (this->active_count_ > 0) {
      // Each pick draws from the item's own seed: the sequence of picks is
      // the same for the same pass.
      Generator generator = Generator::for_item(item_seed(this->pass_, this->id_, this->produced_++));
      double total = 0;
      for (size_t i = 0; i < weights_.size(); ++i) total += this->active_[i] ? weights_[i] : 0;
      double u = uniform(generator) * total;
      size_t pick = 0;
      for (size_t i = 0; i < weights_.size(); ++i) {
        if (!this->active_[i]) continue;
        pick = i;
        if (u < weights_[i]) break;
        u -= weights_[i];
      }
      if (std::optional<T> item = this->pull(pick)) return item;
      this->retire(pick);
    }
    return std::nullopt;
  }

  std::vector<double> weights_;
};

template <class T>
Pipeline<T> weighted_mux(std::vector<Pipeline<T>> sources, std::vector<double> weights) {
  return Pipeline<T>(std::make_unique<WeightedMux<T>>(std::move(sources), std::move(weights)));
}

template <class T>
class Join final : public Merge<T> {
 public:
  explicit Join(std::vector<Pipeline<T>>&& sources) : Merge<T>(std::move(sources)) {}
  Poll try_next(std::optional<T>& out) override { return this->counted(poll(out)); }
  std::string name() const override { return "join"; }

 private:
  std::optional<T> produce() override {
    std::optional<T> out;
    while (this->active_count_ > 0) {
      const Poll polled = poll(out);
      if (polled == Poll::ready) return out;
      if (polled == Poll::end) return std::nullopt;
      // Nothing ready anywhere: wait on the next source in the rotation.
      const size_t i = next_active();
      if (std::optional<T> item = this->pull(i)) return item;
      this->retire(i);
    }
    return std::nullopt;
  }
  Poll poll(std::optional<T>& out) {
    for (size_t tried = 0; tried < this->sources_.size() && this->active_count_ > 0; ++tried) {
      const size_t i = next_active();
      const Poll poll = this->sources_[i]->try_next(out);
      if (poll == Poll::ready) return Poll::ready;
      if (poll == Poll::end) this->retire(i);
    }
    return this->active_count_ > 0 ? Poll::pending : Poll::end;
  }
  size_t next_active() {
    while (!this->active_[this->cursor_]) this->cursor_ = (this->cursor_ + 1) % this->sources_.size();
    const size_t i = this->cursor_;
    this->cursor_ = (this->cursor_ + 1) % this->sources_.size();
    return i;
  }
};

template <class T>
Pipeline<T> join(std::vector<Pipeline<T>> sources) {
  return Pipeline<T>(std::make_unique<Join<T>>(std::move(sources)));
}

// fork: the consumers share the upstream and a buffer of the items not every
// consumer has taken yet (at most `buffer` items). A consumer that gets
// further ahead of the slowest than that is an error: in one thread it
// would otherwise wait for ever.
template <class T>
class ForkState {
 public:
  ForkState(NodePtr<T> upstream, size_t consumers, size_t buffer)
      : upstream_(std::move(upstream)), taken_(consumers, 0), passes_(consumers, 0), buffer_limit_(buffer) {}

  void reset(size_t consumer, const PassContext& pass, conveyor::detail::ResetWalk& walk) {
    const uint64_t first_id = walk.next_id;
    if (passes_[consumer] == pass_) {  // the first consumer into a new pass resets upstream
      ++pass_;
      upstream_->reset(pass, walk);
      upstream_ids_ = walk.next_id - first_id;
      sharded_ = walk.sharded;
      items_.clear();
      base_ = 0;
      std::fill(taken_.begin(), taken_.end(), 0);
      ended_ = false;
    } else {
      walk.next_id += upstream_ids_;
      walk.sharded = walk.sharded || sharded_;
    }
    passes_[consumer] = pass_;
  }

  // Upstream's metrics appear once, under the first consumer.
  void collect_upstream_metrics(size_t consumer, std::vector<NodeMetrics>& out) const {
    if (consumer == 0) upstream_->collect_metrics(out);
  }

  std::optional<T> next(size_t consumer) {
    uint64_t& taken = taken_[consumer];
    if (taken == base_ + items_.size()) {
      if (ended_) return std::nullopt;
      if (items_.size() >= buffer_limit_) {
        throw ValueError("fork: consumer " + std::to_string(consumer) + " is " + std::to_string(items_.size()) +
                         " items ahead of the slowest, the buffer's limit; take from the others or raise it");
      }
      std::optional<T> item = upstream_->next();
      if (!item) {
        ended_ = true;
        return std::nullopt;
      }
      items_.push_back(std::move(*item));
    }
    T out = items_[static_cast<size_t>(taken - base_)];
    ++taken;
    // Drop what every consumer has taken.
    const uint64_t slowest = *std::min_element(taken_.begin(), taken_.end());
    while (base_ < slowest) {
      items_.pop_front();
      ++base_;
    }
    return out;
  }

 private:
  NodePtr<T> upstream_;
  std::deque<T> items_;  // items base_ .. base_ + size - 1
  uint64_t base_ = 0;
  std::vector<uint64_t> taken_;   // by consumer: items taken this pass
  std::vector<uint64_t> passes_;  // by consumer: passes started
  uint64_t pass_ = 0;
  uint64_t upstream_ids_ = 0;
  bool sharded_ = false;
  bool ended_ = false;
  size_t buffer_limit_;
};

template <class T>
class ForkOutput final : public MeteredNode<T> {
 public:
  using item_type = T;
  ForkOutput(std::shared_ptr<ForkState<T>> state, size_t consumer) : state_(std::move(state)), consumer_(consumer) {}
  using Node<T>::reset;
  void reset(const PassContext& pass, conveyor::detail::ResetWalk& walk) override {
    state_->reset(consumer_, pass, walk);
    this->start_metering(pass, walk.next_id++);
  }
  std::string name() const override { return "fork[" + std::to_string(consumer_) + "]"; }

 private:
  std::optional<T> produce() override { return state_->next(consumer_); }
  void collect_upstream_metrics(std::vector<NodeMetrics>& out) const override {
    state_->collect_upstream_metrics(consumer_, out);
  }

  std::shared_ptr<ForkState<T>> state_;
  size_t consumer_;
};

template <class T>
std::vector<Pipeline<T>> fork(Pipeline<T>&& upstream, size_t consumers, size_t buffer) {
  if (consumers == 0) throw ValueError("fork: needs at least one consumer");
  auto state = std::make_shared<ForkState<T>>(std::move(upstream).release(), consumers, buffer);
  std::vector<Pipeline<T>> outputs;
  for (size_t i = 0; i < consumers; ++i) outputs.emplace_back(std::make_unique<ForkOutput<T>>(state, i));
  return outputs;
}

}  // namespace conveyor::nodes
