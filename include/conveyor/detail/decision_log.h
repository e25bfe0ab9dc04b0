// conveyor/detail/decision_log.h: what a node decided by timing, item by
// item, for a checkpoint to replay.
//
// A node whose output depends on timing (join takes whichever source is
// ready; a map with in_order = false hands out whichever item finished) logs
// each choice as it hands an item out. Pipeline::state() copies the log from
// the consumer's thread while the node may go on appending on another (a
// node behind a prefetch runs on the prefetch's strand), so the log is
// append-only and lock-free for one writer and one reader: entries live in
// fixed chunks that never move, and a chunk is published before the size
// that covers it.
//
// Memory: 4 bytes per item handed out this pass, in 64 Ki-entry chunks kept
// across passes (a pass as long as the last allocates nothing).
#pragma once

#include <algorithm>
#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "conveyor/errors.h"
#include "conveyor/state.h"

namespace conveyor::detail {

class DecisionLog {
 public:
  static constexpr size_t kChunkBits = 16;
  static constexpr size_t kChunk = size_t{1} << kChunkBits;
  static constexpr size_t kMaxChunks = 1 << 12;  // 2^28 entries a pass

  DecisionLog() = default;
  DecisionLog(const DecisionLog&) = delete;
  DecisionLog& operator=(const DecisionLog&) = delete;
  ~DecisionLog() {
    for (auto& chunk : chunks_) delete[] chunk.load(std::memory_order_relaxed);
  }

  // The writer, between passes (nothing appends or reads then).
  void clear() noexcept { size_.store(0, std::memory_order_relaxed); }

  // The writer only.
  void append(uint32_t value) {
    const size_t index = size_.load(std::memory_order_relaxed);  // only the writer stores it
    const size_t chunk = index >> kChunkBits;
    if (chunk >= kMaxChunks) throw RuntimeError("a pipeline node's decision log is full (2^28 items in one pass)");
    uint32_t* entries = chunks_[chunk].load(std::memory_order_relaxed);
    if (!entries) {
      entries = new uint32_t[kChunk];
      // Release: a reader that sees the size covering this chunk (acquire
      // below) sees the pointer too; this store pairs with read_all's load.
      chunks_[chunk].store(entries, std::memory_order_release);
    }
    entries[index & (kChunk - 1)] = value;
    // Release: publishes the entry (and its chunk) to read_all's acquire.
    size_.store(index + 1, std::memory_order_release);
  }

  // Any thread, concurrently with append: the entries published so far.
  std::vector<uint32_t> read_all() const {
    // Acquire: pairs with append's release of the size; every entry below it
    // and its chunk pointer are visible.
    const size_t size = size_.load(std::memory_order_acquire);
    std::vector<uint32_t> out;
    out.reserve(size);
    for (size_t i = 0; i < size; i += kChunk) {
      // Relaxed suffices: the acquire of size_ ordered the chunk's release store.
      const uint32_t* entries = chunks_[i >> kChunkBits].load(std::memory_order_relaxed);
      const size_t n = std::min(kChunk, size - i);
      out.insert(out.end(), entries, entries + n);
    }
    return out;
  }

 private:
  std::array<std::atomic<uint32_t*>, kMaxChunks> chunks_{};
  std::atomic<size_t> size_{0};
};

// A resumed pass's saved decisions, which the node follows (its log then
// repeats them as it goes). A state taken before the node has caught up
// saves them whole: they are the pass's decisions as much as the log's.
// Set at reset (possibly on a strand), read by state() from the consumer's
// thread: an atomic shared_ptr to an order that never changes.
class SavedDecisions {
 public:
  void set(std::vector<uint64_t> decisions) {
    decisions_.store(std::make_shared<const std::vector<uint64_t>>(std::move(decisions)));
  }
  void clear() { decisions_.store(nullptr); }
  // The pass's decisions so far: the log, or the saved ones while longer.
  std::vector<uint64_t> with(const DecisionLog& log) const {
    const std::vector<uint32_t> logged = log.read_all();
    const std::shared_ptr<const std::vector<uint64_t>> saved = decisions_.load();
    if (saved && saved->size() > logged.size()) return *saved;
    return {logged.begin(), logged.end()};
  }

 private:
  std::atomic<std::shared_ptr<const std::vector<uint64_t>>> decisions_;
};

// The order a node handing items out as they finish (a map with in_order =
// false) handed its inputs out, by their number among upstream's outputs:
// logged this pass, saved in a state, skipped over by a resumed pass.
class CompletionOrder {
 public:
  // At each reset: `saved` is what a state holds for the node (null: none).
  // `replays`: the node hands the saved order out again when pulled (not
  // only when skipped), so a state taken before it has caught up saves it
  // whole.
  void reset(const State* saved, bool replays) {
    log_.clear();
    order_.clear();
    at_ = 0;
    drop_.clear();
    if (saved) order_ = saved->at("inputs").as_uint_list("inputs");
    if (replays) {
      saved_.set(order_);
    } else {
      saved_.clear();
    }
  }

  // Skips the next `count` saved outputs (a mux skips item by item, so it
  // goes on from the last call). Returns how many the saved order covered,
  // and the prefix of inputs it fills: the node's upstream skips to it, and
  // the inputs handed out beyond it are dropped when pulled (dropped()).
  struct Skipped {
    uint64_t outputs = 0;
    uint64_t prefix = 0;
  };
  Skipped skip(uint64_t count) {
    const size_t end = std::min<size_t>(order_.size(), at_ + count);
    std::vector<uint64_t> delivered(order_.begin(), order_.begin() + static_cast<std::ptrdiff_t>(end));
    std::sort(delivered.begin(), delivered.end());
    Skipped skipped;
    skipped.outputs = end - at_;
    while (skipped.prefix < delivered.size() && delivered[skipped.prefix] == skipped.prefix) ++skipped.prefix;
    drop_.assign(delivered.begin() + static_cast<std::ptrdiff_t>(skipped.prefix), delivered.end());
    for (size_t k = at_; k < end; ++k) log_.append(static_cast<uint32_t>(order_[k]));
    at_ = end;
    return skipped;
  }
  // Handed out before the state was taken: not again.
  bool dropped(uint64_t input) const {
    return !drop_.empty() && std::binary_search(drop_.begin(), drop_.end(), input);
  }
  void handed_out(uint64_t input) { log_.append(static_cast<uint32_t>(input)); }

  // The saved order not yet handed out again (for a node that replays it).
  bool replaying() const noexcept { return at_ < order_.size(); }
  uint64_t next_saved() { return order_[at_++]; }

  // For a state: {"inputs": [...]}.
  State to_state() const {
    State out = State::object();
    out.set("inputs", State::list(saved_.with(log_)));
    return out;
  }

 private:
  DecisionLog log_;
  SavedDecisions saved_;
  std::vector<uint64_t> order_;  // the saved order
  size_t at_ = 0;                // its entries before this are handed out again
  std::vector<uint64_t> drop_;   // sorted
};

}  // namespace conveyor::detail
