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
// across passes (a pass as long as the last allocates nothing), and at most
// kMaxEntries a pass (256 MiB): past that the log stops and a state of the
// pass is refused (read_all throws), while the pass itself goes on.
//
// A node may clear its log in the middle of the consumer's pass (repeat()
// starts a round; a shuffle resets its upstream) while state() reads it.
// The size and a generation share one atomic word, so a reader sees a size
// of one generation; clear() starts the next generation before a release
// fence, and read_all looks at the word again after its copy (a seqlock):
// a copy that saw any entry written after a clear retries.
#pragma once

#include <algorithm>
#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "conveyor/errors.h"
#include "conveyor/state.h"

namespace conveyor::detail {

class DecisionLog {
 public:
  static constexpr size_t kChunkBits = 16;
  static constexpr size_t kChunk = size_t{1} << kChunkBits;
  static constexpr size_t kMaxChunks = 1 << 10;
  static constexpr size_t kMaxEntries = kChunk * kMaxChunks;  // 2^26 items a pass

  // `max_entries` (at most kMaxEntries): a smaller log for tests.
  explicit DecisionLog(size_t max_entries = kMaxEntries) : max_entries_(std::min(max_entries, kMaxEntries)) {}
  DecisionLog(const DecisionLog&) = delete;
  DecisionLog& operator=(const DecisionLog&) = delete;
  ~DecisionLog() {
    // relaxed: the destructor runs after every reader and writer is done.
    for (auto& chunk : chunks_) delete[] chunk.load(std::memory_order_relaxed);
  }

  // The writer, at a reset (a reader may be copying the old entries).
  void clear() noexcept {
    const uint64_t word = word_.load(std::memory_order_relaxed);  // relaxed: only the writer stores it
    // relaxed, then the release fence: every later write (this pass's
    // entries and sizes) comes after the fence, so a reader whose copy saw
    // one sees this generation when it looks again (read_all's fence).
    word_.store(((word >> 32) + 1) << 32, std::memory_order_relaxed);
    std::atomic_thread_fence(std::memory_order_release);
  }

  // The writer only. Past kMaxEntries the log is full: entries are dropped.
  void append(uint32_t value) {
    const uint64_t word = word_.load(std::memory_order_relaxed);  // relaxed: only the writer stores it
    const size_t index = static_cast<size_t>(word & kSizeMask);
    if (index > max_entries_) return;
    if (index == max_entries_) {
      word_.store(word + 1, std::memory_order_relaxed);  // full; relaxed: no entry is published by it
      return;
    }
    const size_t chunk = index >> kChunkBits;
    std::atomic<uint32_t>* entries = chunks_[chunk].load(std::memory_order_relaxed);  // relaxed: the writer's own
    if (!entries) {
      entries = new std::atomic<uint32_t>[kChunk];
      // release: pairs with read_all's acquire load of the pointer.
      chunks_[chunk].store(entries, std::memory_order_release);
    }
    entries[index & (kChunk - 1)].store(value, std::memory_order_relaxed);  // published by the word below
    // release: publishes the entry to read_all's acquire load of the word.
    word_.store(word + 1, std::memory_order_release);
  }

  // Any thread, concurrently with append and clear: the entries of one
  // generation. Throws StateError when the log is full.
  std::vector<uint32_t> read_all() const {
    std::vector<uint32_t> out;
    while (true) {
      // acquire: pairs with append's release store: the entries below the
      // size are visible.
      const uint64_t word = word_.load(std::memory_order_acquire);
      const size_t size = static_cast<size_t>(word & kSizeMask);
      if (size > max_entries_) {
        throw StateError("state: a node whose order depends on timing (a join, or a map with in_order = false) "
                         "handed out more than " + std::to_string(max_entries_) +
                         " items in this pass, more than its decision log keeps: the pass cannot be "
                         "checkpointed past that point (in_order = true, or shorter passes, can)");
      }
      out.clear();
      out.reserve(size);
      for (size_t i = 0; i < size; i += kChunk) {
        // acquire: pairs with append's release store of the pointer.
        const std::atomic<uint32_t>* entries = chunks_[i >> kChunkBits].load(std::memory_order_acquire);
        const size_t n = std::min(kChunk, size - i);
        // relaxed: made visible by the acquire of the word above.
        for (size_t k = 0; k < n; ++k) out.push_back(entries[k].load(std::memory_order_relaxed));
      }
      // acquire fence: pairs with clear()'s release fence: if the copy saw a
      // write made after a clear, the load below sees its generation.
      std::atomic_thread_fence(std::memory_order_acquire);
      // relaxed: ordered by the fence above.
      if ((word_.load(std::memory_order_relaxed) >> 32) == (word >> 32)) return out;
    }
  }

 private:
  static constexpr uint64_t kSizeMask = 0xffffffffu;
  std::array<std::atomic<std::atomic<uint32_t>*>, kMaxChunks> chunks_{};
  const size_t max_entries_;
  std::atomic<uint64_t> word_{0};  // generation << 32 | size (max_entries_ + 1: full)
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
    if (saved) {
      order_ = saved->at("inputs").as_uint_list("inputs");
      check_saved_order(order_);
    }
    if (replays) {
      saved_.set(order_);
    } else {
      saved_.clear();
    }
  }

  // A logged order names each input once, and none further ahead of the
  // outputs than a window holds (at most 2^20 items): anything else would
  // lose items, or buffer upstream without bound, before failing.
  static void check_saved_order(const std::vector<uint64_t>& order) {
    constexpr uint64_t kMostAhead = uint64_t{1} << 20;
    std::vector<uint64_t> sorted = order;
    std::sort(sorted.begin(), sorted.end());
    for (size_t k = 0; k < sorted.size(); ++k) {
      if (k > 0 && sorted[k] == sorted[k - 1]) {
        throw StateError("load_state: a saved order names input " + std::to_string(sorted[k]) +
                         " twice: the state is corrupt");
      }
      if (sorted[k] >= sorted.size() + kMostAhead) {
        throw StateError("load_state: a saved order of " + std::to_string(sorted.size()) + " inputs names input " +
                         std::to_string(sorted[k]) + ", further ahead than any window: the state is corrupt");
      }
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

// What a resumed out-of-order node (a parallel or async map) pulls while it
// hands the saved order out again: the inputs that came before their turn,
// kept by input number (as many as the saved order was ahead of input
// order: at most a window) until their turn, or until the replay is over
// and fill() admits what is left, first.
template <class In>
struct ReplayInputs {
  struct Pending {
    std::optional<In> item;
    std::exception_ptr error;  // upstream's, thrown at the input's turn
    uint64_t position = 0;
  };
  std::map<uint64_t, Pending> ahead;

  // Pulls until input `wanted` (order.next_saved()) has come and returns it,
  // removed. `inputs` counts upstream's outputs pulled this pass, failures
  // included; pull() returns the next (nullopt at the end) and position()
  // its position. Inputs the saved order drops are not kept. StateError
  // when upstream ends before `wanted` or the order names it twice.
  template <class Pull, class Position>
  Pending take(uint64_t wanted, uint64_t& inputs, const CompletionOrder& order, const std::string& node, Pull&& pull,
               Position&& position) {
    while (inputs <= wanted) {
      const uint64_t input = inputs;
      Pending pending;
      try {
        pending.item = pull();
        if (!pending.item) {
          throw StateError("load_state: " + node + "'s input " + std::to_string(wanted) +
                           " was handed out before the state was taken, but upstream ends before it now");
        }
      } catch (const StateError&) {
        throw;
      } catch (...) {
        pending.error = std::current_exception();
      }
      ++inputs;
      pending.position = position();
      if (!order.dropped(input)) ahead.emplace(input, std::move(pending));
    }
    auto it = ahead.find(wanted);
    if (it == ahead.end()) {
      throw StateError("load_state: " + node + "'s saved order names input " + std::to_string(wanted) + " twice");
    }
    Pending pending = std::move(it->second);
    ahead.erase(it);
    return pending;
  }

  // The saved order's next input (its number into `wanted`), as take()
  // pulls it. An upstream failure there is handed out in its place: logged
  // and rethrown (named where it was raised).
  template <class Pull, class Position>
  Pending take_next_saved(CompletionOrder& order, uint64_t& wanted, uint64_t& inputs, const std::string& node,
                          Pull&& pull, Position&& position) {
    wanted = order.next_saved();
    Pending pending = take(wanted, inputs, order, node, std::forward<Pull>(pull), std::forward<Position>(position));
    if (pending.error) {
      order.handed_out(wanted);
      std::rethrow_exception(pending.error);
    }
    return pending;
  }
};

}  // namespace conveyor::detail
