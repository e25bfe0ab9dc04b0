// conveyor/nodes/map.h: item-wise transforms.
//
//   map(f)          f(item) for each item (f may draw from default_generator():
//                   each item's draws are seeded from its position)
//   filter(p)       the items for which p(item) is true
//   flat_map(f)     every element of the range f(item) returns, in order
// (p and f draw the same way: from the item's seed)
//
// With OnError::skip an item whose f throws is dropped and counted
// (skipped()); with OnError::raise (default) next() throws a NodeError and
// the following call goes on.
#pragma once

#include <cstdint>
#include <optional>
#include <ranges>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "conveyor/data_error.h"
#include "conveyor/detail/worker_scope.h"
#include "conveyor/nodes/stage.h"

namespace conveyor::nodes {

template <class In, class F>
class Map final : public Stage<In, std::remove_cvref_t<std::invoke_result_t<F&, In&&>>> {
 public:
  using Out = std::remove_cvref_t<std::invoke_result_t<F&, In&&>>;
  using item_type = Out;
  Map(NodePtr<In> upstream, F f, OnError on_error)
      : Stage<In, Out>(std::move(upstream)), f_(std::move(f)), on_error_(on_error) {}

  std::optional<Out> produce() override {
    while (std::optional<In> item = this->pull()) {
      // Draws inside f come from the item's own generator, seeded from its
      // position: the same however the pipeline runs.
      const conveyor::detail::WorkerScope scope(nullptr, this->seed_of(this->position()));
      try {
        return f_(std::move(*item));
      } catch (...) {
        if (on_error_ == OnError::raise) conveyor::detail::throw_node_error(name(), this->position());
        this->meter_.skipped.add(1);
      }
    }
    return std::nullopt;
  }
  std::string name() const override { return on_error_ == OnError::skip ? "map(on_error=skip)" : "map"; }
  // One output per input, without running f (a failed item was an output
  // too), unless failures are dropped (OnError::skip).
  uint64_t skip(uint64_t count, bool clean) override {
    if (on_error_ == OnError::skip || !clean) return Stage<In, Out>::skip(count, clean);
    return this->skip_upstream(count, clean);
  }

 private:
  F f_;
  OnError on_error_;
};

template <class F>
auto map(F f, OnError on_error = OnError::raise) {
  return [f = std::move(f), on_error]<class T>(Pipeline<T>&& upstream) mutable {
    using Node = Map<T, F>;
    return Pipeline<typename Node::Out>(std::make_unique<Node>(std::move(upstream).release(), std::move(f), on_error));
  };
}

template <class T, class P>
class Filter final : public Stage<T, T> {
 public:
  using item_type = T;
  Filter(NodePtr<T> upstream, P predicate) : Stage<T, T>(std::move(upstream)), predicate_(std::move(predicate)) {}
  std::optional<T> produce() override {
    while (std::optional<T> item = this->pull()) {
      bool keep = false;
      const conveyor::detail::WorkerScope scope(nullptr, this->seed_of(this->position()));
      try {
        keep = predicate_(static_cast<const T&>(*item));
      } catch (...) {
        conveyor::detail::throw_node_error(name(), this->position());
      }
      if (keep) return item;
    }
    return std::nullopt;
  }
  std::string name() const override { return "filter"; }

 private:
  P predicate_;
};

template <class P>
auto filter(P predicate) {
  return [predicate = std::move(predicate)]<class T>(Pipeline<T>&& upstream) mutable {
    return Pipeline<T>(std::make_unique<Filter<T, P>>(std::move(upstream).release(), std::move(predicate)));
  };
}

// The elements of the range f(item) returns, one by one.
template <class In, class F>
class FlatMap final
    : public Stage<In, std::ranges::range_value_t<std::remove_cvref_t<std::invoke_result_t<F&, In&&>>>> {
 public:
  using Range = std::remove_cvref_t<std::invoke_result_t<F&, In&&>>;
  using Out = std::ranges::range_value_t<Range>;
  using item_type = Out;
  FlatMap(NodePtr<In> upstream, F f) : Stage<In, Out>(std::move(upstream)), f_(std::move(f)) {}

  std::optional<Out> produce() override {
    while (true) {
      if (current_) {
        // A lazy range draws as it is read: from its item's generator too,
        // going on where f left it.
        const conveyor::detail::WorkerScope scope(nullptr, &*generator_);
        try {
          // Advanced only now, when the next element is asked for: an
          // advance that throws (a filter view's predicate) must not take
          // the element read before it down with it.
          if (advance_) {
            advance_ = false;
            ++it_;
          }
          if (it_ != std::ranges::end(*current_)) {
            Out out = std::move(*it_);
            advance_ = true;
            return out;
          }
        } catch (...) {
          // A lazy range that throws as it is read: the item's error, named,
          // and the rest of its range dropped (read again, the same element
          // would throw for ever).
          drop_range();
          conveyor::detail::throw_node_error(name(), this->position());
        }
      }
      drop_range();
      input_ = this->pull();
      if (!input_) return std::nullopt;
      generator_.emplace(Generator::for_item(this->seed_of(this->position())));
      const conveyor::detail::WorkerScope scope(nullptr, &*generator_);
      try {
        current_.emplace(f_(std::move(*input_)));
        it_ = std::ranges::begin(*current_);
      } catch (...) {
        drop_range();
        conveyor::detail::throw_node_error(name(), this->position());
      }
    }
  }
  std::string name() const override { return "flat_map"; }

 protected:
  void start_pass() override { drop_range(); }

 private:
  void drop_range() noexcept {
    current_.reset();  // first: it may view the input
    input_.reset();
    advance_ = false;
  }

  F f_;
  // The item f was given lives as long as its range: a range that views
  // its argument (v | views::transform(g)) reads it as it goes.
  std::optional<In> input_;
  std::optional<Range> current_;
  std::ranges::iterator_t<Range> it_{};
  bool advance_ = false;  // it_'s element was handed out: step past it first
  std::optional<Generator> generator_;  // current_'s item's
};

template <class F>
auto flat_map(F f) {
  return [f = std::move(f)]<class T>(Pipeline<T>&& upstream) mutable {
    using Node = FlatMap<T, F>;
    return Pipeline<typename Node::Out>(std::make_unique<Node>(std::move(upstream).release(), std::move(f)));
  };
}

// Each element of each (vector-like) item: batch()'s inverse.
inline auto unbatch() {
  return flat_map([]<class Items>(Items&& items) { return std::forward<Items>(items); });
}

}  // namespace conveyor::nodes
