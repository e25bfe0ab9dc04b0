// conveyor/nodes/shuffle.h: shuffle(n), a shuffle buffer of n items (as
// WebDataset's and tf.data's): the buffer fills from upstream, and each item
// handed out is a random one from it, replaced by the next upstream item.
// Draws from a generator seeded from (seed, epoch, node): the same order
// for the same pass however the pipeline runs; another order each epoch.
// Memory: n items.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "conveyor/generator.h"
#include "conveyor/nodes/stage.h"

namespace conveyor::nodes {

template <class T>
class Shuffle final : public Stage<T, T> {
 public:
  using item_type = T;
  Shuffle(NodePtr<T> upstream, size_t buffer_size)
      : Stage<T, T>(std::move(upstream)), buffer_size_(buffer_size) {
    if (buffer_size_ == 0) throw ValueError("shuffle: buffer_size should be a positive integer value, but got 0");
  }
  std::optional<T> produce() override {
    while (!upstream_done_ && buffer_.size() < buffer_size_) {
      std::optional<T> item = this->pull();
      if (!item) {
        upstream_done_ = true;
        break;
      }
      buffer_.push_back(std::move(*item));
    }
    if (buffer_.empty()) return std::nullopt;
    const size_t pick = static_cast<size_t>(generator_.random64() % buffer_.size());
    std::swap(buffer_[pick], buffer_.back());
    T out = std::move(buffer_.back());
    buffer_.pop_back();
    return out;
  }
  std::string name() const override { return "shuffle(" + std::to_string(buffer_size_) + ")"; }

 protected:
  void start_pass() override {
    buffer_.clear();
    upstream_done_ = false;
    generator_ = Generator(item_seed(this->pass_, this->id_, 0));
  }

 private:
  size_t buffer_size_;
  std::vector<T> buffer_;
  bool upstream_done_ = false;
  Generator generator_;
};

inline auto shuffle(size_t buffer_size) {
  return [buffer_size]<class T>(Pipeline<T>&& upstream) {
    return Pipeline<T>(std::make_unique<Shuffle<T>>(std::move(upstream).release(), buffer_size));
  };
}

}  // namespace conveyor::nodes
