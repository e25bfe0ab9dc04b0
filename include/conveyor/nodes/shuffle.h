// conveyor/nodes/shuffle.h: shuffle(n), a shuffle buffer of n items (as
// WebDataset's and tf.data's): the buffer fills from upstream, and each item
// handed out is a random one from it, replaced by the next upstream item.
// Draws from a generator seeded from (seed, epoch, node): the same order
// for the same pass however the pipeline runs; another order each epoch.
// Memory: n items.
#pragma once

#include <algorithm>
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
  std::string name() const override { return "shuffle(" + std::to_string(buffer_size_) + ")"; }

  using Node<T>::reset;
  void reset(const PassContext& pass, conveyor::detail::ResetWalk& walk) override {
    walk_before_ = walk;  // for skip(): upstream reset again, with the same ids
    Stage<T, T>::reset(pass, walk);
  }

  // Replays the pass's draws on upstream positions, not items: which of
  // the outputs passed over went, and which positions the buffer holds
  // then, in its order. Upstream only skips ahead (to learn where it ends)
  // until the first item is asked for; then it starts the pass again, skips
  // to the oldest held position and pulls from there, keeping what the
  // buffer held (materialize()). Needs no failure among the outputs passed
  // over (a failure would have taken a draw's place). May be called several
  // times before the first next() (a mux skips its sources item by item).
  uint64_t skip(uint64_t count, bool clean) override {
    if (!clean) {
      materialize();
      return Stage<T, T>::skip(count, clean);
    }
    Replay& replay = replay_ ? *replay_ : replay_.emplace();
    // `count` outputs pull at most buffer_size + count - 1 items beyond
    // those pulled: learn how many upstream has, once.
    const uint64_t wanted = replay.pulled + buffer_size_ + count - 1;
    if (!replay.upstream_ended && wanted > replay.available) {
      const uint64_t more = wanted - replay.available;
      const uint64_t got = this->upstream_->skip(more, true);
      replay.available += got;
      replay.upstream_ended = got < more;
    }
    uint64_t outputs = 0;
    while (outputs < count) {
      while (replay.held.size() < buffer_size_) {
        if (replay.pulled == replay.available) {
          replay.found_end = replay.upstream_ended;  // the pull that found the end
          break;
        }
        replay.held.push_back(replay.pulled++);
      }
      if (replay.held.empty()) break;
      const size_t pick = static_cast<size_t>(generator_.random64() % replay.held.size());
      std::swap(replay.held[pick], replay.held.back());
      replay.held.pop_back();
      ++outputs;
    }
    return outputs;
  }
  std::optional<T> produce() override {
    materialize();
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

 protected:
  void start_pass() override {
    buffer_.clear();
    upstream_done_ = false;
    replay_.reset();
    generator_ = Generator(this->seed_of(0));
  }

 private:
  size_t buffer_size_;
  std::vector<T> buffer_;
  bool upstream_done_ = false;
  Generator generator_;
  conveyor::detail::ResetWalk walk_before_;  // the last reset's, before upstream took its ids

  // skip()'s replay on positions, until materialize() makes it items.
  struct Replay {
    std::vector<uint64_t> held;  // positions in the buffer, in its order
    uint64_t pulled = 0;         // positions pulled into it
    uint64_t available = 0;      // positions upstream has skipped over
    bool upstream_ended = false; // upstream had fewer than asked
    bool found_end = false;      // a pull found the end
  };
  std::optional<Replay> replay_;

  void materialize() {
    if (!replay_) return;
    const typename Stage<T, T>::Polling waiting(*this, false);  // all of the replay in one call
    Replay replay = std::move(*replay_);
    replay_.reset();
    conveyor::detail::ResetWalk walk = walk_before_;
    this->upstream_->reset(this->pass_, walk);
    this->position_ = 0;
    buffer_.clear();
    if (replay.held.empty()) {
      this->skip_upstream(replay.pulled, true);
    } else {
      const uint64_t lowest = *std::min_element(replay.held.begin(), replay.held.end());
      // By position - lowest: the slot it goes to, or none (held.size()).
      std::vector<size_t> slot_of(static_cast<size_t>(replay.pulled - lowest), replay.held.size());
      for (size_t slot = 0; slot < replay.held.size(); ++slot) slot_of[static_cast<size_t>(replay.held[slot] - lowest)] = slot;
      this->skip_upstream(lowest, true);
      std::vector<std::optional<T>> slots(replay.held.size());
      for (uint64_t position = lowest; position < replay.pulled; ++position) {
        std::optional<T> item = this->pull();
        if (!item) {
          throw StateError("shuffle: upstream ended at item " + std::to_string(position) +
                           " when a resumed pass pulled it again; it ended later the first time");
        }
        const size_t slot = slot_of[static_cast<size_t>(position - lowest)];
        if (slot < replay.held.size()) slots[slot] = std::move(item);
      }
      buffer_.reserve(replay.held.size());
      for (std::optional<T>& item : slots) buffer_.push_back(std::move(*item));
    }
    upstream_done_ = replay.found_end;
  }
};

inline auto shuffle(size_t buffer_size) {
  return [buffer_size]<class T>(Pipeline<T>&& upstream) {
    return Pipeline<T>(std::make_unique<Shuffle<T>>(std::move(upstream).release(), buffer_size));
  };
}

}  // namespace conveyor::nodes
