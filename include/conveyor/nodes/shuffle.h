// conveyor/nodes/shuffle.h: shuffle(n), a shuffle buffer of n items (as
// WebDataset's and tf.data's): the buffer fills from upstream, and each item
// handed out is a random one from it, replaced by the next upstream item.
// Draws from a generator seeded from (seed, epoch, node): the same order
// for the same pass however the pipeline runs; another order each epoch.
// Memory: n items.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <limits>
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
    walk_before_ = walk;  // for materialize(): upstream reset again, with the same ids
    walk_before_.restart = true;
    Stage<T, T>::reset(pass, walk);
    if (const State* saved = conveyor::detail::restored_extras(walk, this->id_)) {
      learned(saved->uint_at("upstream_items"), saved->bool_at("ended"));
    }
  }

  // Replays the pass's draws on upstream positions, not items: which of
  // the outputs passed over went, and which positions the buffer holds
  // then, in its order. Upstream is not touched until the first item is
  // asked for: then it skips to the oldest held position and pulls from
  // there, keeping what the buffer held (materialize()). The state says
  // how far upstream went, and where it ended if it had: a replay beyond
  // that (a state without it) learns where upstream ends by skipping ahead,
  // and materialize() then starts upstream's pass over. Needs no failure
  // among the outputs passed over (a failure would have taken a draw's
  // place). May be called several times before the first next() (a mux
  // skips its sources item by item).
  uint64_t skip(uint64_t count, bool clean) override {
    if (!clean) {
      materialize();
      return Stage<T, T>::skip(count, clean);
    }
    Replay& replay = replay_ ? *replay_ : replay_.emplace();
    if (known_upstream_.ended) replay.upstream_items = known_upstream_.items;
    if (count == 0) return 0;
    // `count` outputs pull up to that many positions beyond those pulled.
    // Saturating: a buffer of SIZE_MAX (shuffle everything) or a state's
    // huge count would wrap to a small number, and the replay would then
    // push positions past upstream's unlearned end until memory ran out.
    uint64_t wanted = 0;
    if (__builtin_add_overflow(replay.pulled, buffer_size_ - replay.held.size(), &wanted) ||
        __builtin_add_overflow(wanted, count - 1, &wanted)) {
      wanted = std::numeric_limits<uint64_t>::max();
    }
    if (!replay.upstream_items && wanted > known_upstream_.items) {
      const uint64_t more = wanted - replay.probed;
      const uint64_t got = this->upstream_->skip(more, true);
      replay.probed += got;
      learned(replay.probed, got < more);
      if (known_upstream_.ended) replay.upstream_items = known_upstream_.items;
    }
    uint64_t outputs = 0;
    while (outputs < count) {
      while (replay.held.size() < buffer_size_) {
        if (replay.upstream_items && replay.pulled == *replay.upstream_items) {
          replay.found_end = true;  // the pull that found the end
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
  // How far upstream went, and whether it ended: a resumed pass then need
  // not learn it by starting upstream over.
  void save_extras(State& nodes, bool in_pass) const override {
    // relaxed: stored after each fill, before the output drawn next, and
    // that output reaches the consumer taking this state through the
    // hand-off that publishes it (a prefetch's window): the state sees at
    // least the positions its consumer's outputs were drawn from.
    const uint64_t seen = upstream_seen_.load(std::memory_order_relaxed);
    if (in_pass && seen > 0) {
      State mine = State::object();
      mine.set(conveyor::detail::kHintOnly, true);
      mine.set("upstream_items", seen / 2);
      mine.set("ended", seen % 2 == 1);
      nodes.set(std::to_string(this->id_), std::move(mine));
    }
    Stage<T, T>::save_extras(nodes, in_pass);
  }
  std::optional<T> produce() override {
    materialize();
    if (!upstream_done_ && buffer_.size() < buffer_size_) {
      while (buffer_.size() < buffer_size_) {
        std::optional<T> item = this->pull();
        if (!item) {
          upstream_done_ = true;
          break;
        }
        buffer_.push_back(std::move(*item));
      }
      learned(this->position_, upstream_done_);
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
    known_upstream_ = {};
    upstream_seen_.store(0, std::memory_order_relaxed);  // relaxed: see save_extras
    replay_.reset();
    generator_ = Generator(this->seed_of(0));
  }

 private:
  size_t buffer_size_;
  std::vector<T> buffer_;
  bool upstream_done_ = false;
  // What this pass knows of upstream: it has `items` items at least, or
  // exactly if `ended` (from pulls, a replay's skipping ahead, a state).
  struct Known {
    uint64_t items = 0;
    bool ended = false;
  };
  Known known_upstream_;
  // known_upstream_.items times two, plus one if ended: read by save_extras() on
  // the consumer's thread.
  std::atomic<uint64_t> upstream_seen_{0};
  Generator generator_;
  conveyor::detail::ResetWalk walk_before_;  // the last reset's, before upstream took its ids

  // skip()'s replay on positions, until materialize() makes it items.
  struct Replay {
    std::vector<uint64_t> held;  // positions in the buffer, in its order
    uint64_t pulled = 0;         // positions pulled into it
    std::optional<uint64_t> upstream_items;  // where upstream ends, once known
    uint64_t probed = 0;         // positions upstream skipped over to learn it
    bool found_end = false;      // a pull found the end
  };
  std::optional<Replay> replay_;

  void learned(uint64_t items, bool ended) {
    if (known_upstream_.ended) return;
    known_upstream_.items = std::max(known_upstream_.items, items);
    known_upstream_.ended = ended;
    upstream_seen_.store(known_upstream_.items * 2 + (ended ? 1 : 0), std::memory_order_relaxed);  // relaxed: see save_extras
  }

  void materialize() {
    if (!replay_) return;
    const typename Stage<T, T>::Polling waiting(*this, false);  // all of the replay in one call
    Replay replay = std::move(*replay_);
    replay_.reset();
    if (replay.probed > 0) {  // upstream's pass from its start again
      conveyor::detail::ResetWalk walk = walk_before_;
      this->upstream_->reset(this->pass_, walk);
      this->position_ = 0;
    }
    buffer_.clear();
    if (replay.held.empty()) {
      if (this->skip_upstream(replay.pulled, true) < replay.pulled) upstream_ended_early(this->position_);
    } else {
      const uint64_t lowest = *std::min_element(replay.held.begin(), replay.held.end());
      // By position - lowest: the slot it goes to, or none (held.size()).
      std::vector<size_t> slot_of(static_cast<size_t>(replay.pulled - lowest), replay.held.size());
      for (size_t slot = 0; slot < replay.held.size(); ++slot) slot_of[static_cast<size_t>(replay.held[slot] - lowest)] = slot;
      if (this->skip_upstream(lowest, true) < lowest) upstream_ended_early(this->position_);
      std::vector<std::optional<T>> slots(replay.held.size());
      for (uint64_t position = lowest; position < replay.pulled; ++position) {
        std::optional<T> item = this->pull();
        if (!item) upstream_ended_early(position);
        const size_t slot = slot_of[static_cast<size_t>(position - lowest)];
        if (slot < replay.held.size()) slots[slot] = std::move(item);
      }
      buffer_.reserve(replay.held.size());
      for (std::optional<T>& item : slots) buffer_.push_back(std::move(*item));
    }
    upstream_done_ = replay.found_end;
    // An end the replay took from a state is checked: a state from another
    // pipeline, or an edited one, would otherwise hand out items again and
    // lose the rest. An end learned by skipping upstream answers at once.
    if (upstream_done_ && this->pull()) {
      throw StateError("shuffle: the state says upstream ended after " +
                       std::to_string(replay.pulled) +
                       " items, but it has more: the state is not this pipeline's");
    }
  }
  [[noreturn]] static void upstream_ended_early(uint64_t position) {
    throw StateError("shuffle: upstream ended at item " + std::to_string(position) +
                     " when a resumed pass pulled it again; it ended later the first time");
  }
};

inline auto shuffle(size_t buffer_size) {
  return [buffer_size]<class T>(Pipeline<T>&& upstream) {
    return Pipeline<T>(std::make_unique<Shuffle<T>>(std::move(upstream).release(), buffer_size));
  };
}

}  // namespace conveyor::nodes
