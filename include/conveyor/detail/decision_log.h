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

#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "conveyor/errors.h"

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

}  // namespace conveyor::detail
