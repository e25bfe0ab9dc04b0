// conveyor/nodes/batch.h: grouping items.
//
//   batch(n, drop_last)     std::vector of n items (the last shorter, or
//                           dropped with drop_last)
//   collate(fn)             fn(std::vector<T>&&) of each batch; default:
//                           default_collate (conveyor/collate.h)
//   padded_batch(n, pad)    Arrays of different shapes, padded with `pad` to
//                           the largest extent in each dimension: [n, ...]
//
// An error from upstream in the middle of a batch leaves the items already
// gathered in place: the batch goes on filling at the next call.
#pragma once

#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "conveyor/array.h"
#include "conveyor/buffer.h"
#include "conveyor/collate.h"
#include "conveyor/detail/worker_scope.h"
#include "conveyor/nodes/stage.h"

namespace conveyor::nodes {

template <class T>
class Batch final : public Stage<T, std::vector<T>> {
 public:
  using item_type = std::vector<T>;
  Batch(NodePtr<T> upstream, size_t size, bool drop_last)
      : Stage<T, std::vector<T>>(std::move(upstream)), size_(size), drop_last_(drop_last) {
    if (size_ == 0) throw ValueError("batch: size should be a positive integer value, but got 0");
  }
  std::optional<std::vector<T>> produce() override {
    while (items_.size() < size_) {
      std::optional<T> item = this->pull();  // an upstream error leaves items_ as it is
      if (!item) break;
      items_.push_back(std::move(*item));
    }
    if (items_.empty() || (drop_last_ && items_.size() < size_)) {
      items_.clear();
      return std::nullopt;
    }
    std::vector<T> out = std::move(items_);
    items_.clear();
    items_.reserve(std::min<size_t>(size_, 1024));
    return out;
  }
  // drop_last changes which items come out: in the name, so in a state's
  // fingerprint too.
  std::string name() const override {
    return "batch(" + std::to_string(size_) + (drop_last_ ? ", drop_last=true)" : ")");
  }
  // `size` items a batch when none failed (a failed item would not have
  // been in its batch). Saturating: a size near 2^64 ("all in one batch")
  // must not wrap round.
  uint64_t skip(uint64_t count, bool clean) override {
    if (!clean) return Stage<T, std::vector<T>>::skip(count, clean);
    const uint64_t size = size_;
    const uint64_t wanted = count > UINT64_MAX / size ? UINT64_MAX : count * size;
    const uint64_t items = this->skip_upstream(wanted, clean);
    const uint64_t batches = items / size + (!drop_last_ && items % size != 0 ? 1 : 0);
    return std::min(count, batches);
  }

 protected:
  void start_pass() override { items_.clear(); }

 private:
  size_t size_;
  bool drop_last_;
  std::vector<T> items_;
};

inline auto batch(size_t size, bool drop_last = false) {
  return [size, drop_last]<class T>(Pipeline<T>&& upstream) {
    return Pipeline<std::vector<T>>(std::make_unique<Batch<T>>(std::move(upstream).release(), size, drop_last));
  };
}

template <class Items, class Fn>
class Collate final : public Stage<Items, std::remove_cvref_t<std::invoke_result_t<const Fn&, Items&&>>> {
 public:
  using Out = std::remove_cvref_t<std::invoke_result_t<const Fn&, Items&&>>;
  using item_type = Out;
  Collate(NodePtr<Items> upstream, Fn fn) : Stage<Items, Out>(std::move(upstream)), fn_(std::move(fn)) {}
  std::optional<Out> produce() override {
    std::optional<Items> items = this->pull();
    if (!items) return std::nullopt;
    // Into the pinned pool below a pin_memory, on whichever thread runs this.
    std::optional<conveyor::detail::AllocatorScope> memory;
    if (this->pass_.batch_memory) memory.emplace(this->pass_.batch_memory);
    // A collate that draws (a mixup) draws from the batch's own seed.
    const conveyor::detail::WorkerScope scope(nullptr, this->seed_of(this->position()));
    try {
      return fn_(std::move(*items));
    } catch (...) {
      conveyor::detail::throw_node_error(name(), this->position());
    }
  }
  std::string name() const override { return "collate"; }
  uint64_t skip(uint64_t count, bool clean) override {
    if (!clean) return Stage<Items, Out>::skip(count, clean);
    return this->skip_upstream(count, clean);
  }

 private:
  Fn fn_;
};

template <class Fn = DefaultCollate>
auto collate(Fn fn = {}) {
  return [fn = std::move(fn)]<class T>(Pipeline<T>&& upstream) mutable {
    using Node = Collate<T, Fn>;
    return Pipeline<typename Node::Out>(std::make_unique<Node>(std::move(upstream).release(), std::move(fn)));
  };
}

namespace detail {
// Pads every array to the largest extent in each dimension and stacks them.
template <class U>
Array<U> pad_and_stack(std::vector<Array<U>>&& arrays, U pad) {
  const size_t rank = arrays.front().shape().size();
  std::vector<int64_t> extents(rank, 0);
  for (size_t i = 0; i < arrays.size(); ++i) {
    // Shape [] like a scalar but no element: padding would invent one, as
    // stacking would (stack_arrays refuses it too).
    if (arrays[i].dim() == 0 && arrays[i].numel() == 0) {
      throw ValueError("padded_batch: item " + std::to_string(i) +
                       " is an empty Array() (shape [] without an element); there is nothing to pad");
    }
    if (arrays[i].shape().size() != rank) {
      throw ValueError("padded_batch: every item needs " + std::to_string(rank) + " dimensions, but item " +
                       std::to_string(i) + " has shape " + shape_string(arrays[i].shape()));
    }
    for (size_t d = 0; d < rank; ++d) extents[d] = std::max(extents[d], arrays[i].shape()[d]);
  }
  std::vector<int64_t> shape{static_cast<int64_t>(arrays.size())};
  shape.insert(shape.end(), extents.begin(), extents.end());
  Array<U> out(shape);
  const size_t per_item = out.numel() / arrays.size();
  std::fill(out.data(), out.data() + out.numel(), pad);
  for (size_t i = 0; i < arrays.size(); ++i) {
    // Copy row by row along the last dimension: item index -> padded index.
    const Array<U>& item = arrays[i];
    const size_t count = item.numel();
    const size_t row = rank == 0 ? 1 : static_cast<size_t>(item.shape().back());
    U* base = out.data() + i * per_item;
    for (size_t start = 0; row > 0 && start < count; start += row) {
      size_t offset = 0, stride = 1, rest = start;
      for (size_t d = rank; d-- > 0;) {
        const auto extent = static_cast<size_t>(item.shape()[d]);
        offset += (rest % extent) * stride;
        rest /= extent;
        stride *= static_cast<size_t>(extents[d]);
      }
      std::copy(item.data() + start, item.data() + start + row, base + offset);
    }
  }
  return out;
}
}  // namespace detail

template <class U>
auto padded_batch(size_t size, U pad, bool drop_last = false) {
  return [size, pad, drop_last](Pipeline<Array<U>>&& upstream) {
    return std::move(upstream) | batch(size, drop_last) |
           collate([pad](std::vector<Array<U>>&& items) { return detail::pad_and_stack(std::move(items), pad); });
  };
}

}  // namespace conveyor::nodes
