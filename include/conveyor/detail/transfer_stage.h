// conveyor/detail/transfer_stage.h: the last stage, on the consumer's thread.
//
// Takes batches in order from the stage before it, queues their device copies
// on the device's copy stream, up to `depth` batches ahead of the consumer,
// and hands each out with its DeviceBatch (device buffers and ready event). No
// host synchronisation on this path: the consumer waits on the event.
//
// The consumer waits for one batch only: the one it asked for. Batches ahead
// are taken when they are ready (try_next), never waited for, so the
// loader's timeout bounds next() however deep the stage is.
//
// Errors keep their place: a batch that failed earlier (a WorkerError) or
// whose copy could not be queued is thrown when its turn comes. Destroying
// the stage mid-copy is safe: host buffers go back to their pool only after
// their copy's event (see buffer_pool.h), scratch device buffers likewise.
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <deque>
#include <exception>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "conveyor/detail/buffer_pool.h"
#include "conveyor/detail/check.h"
#include "conveyor/detail/failure.h"
#include "conveyor/detail/loader_core.h"
#include "conveyor/errors.h"
#include "conveyor/metrics.h"
#include "conveyor/node.h"
#include "conveyor/transfer.h"

namespace conveyor::detail {

template <class Batch>
class TransferStage final : public LoaderNode<Batch> {
 public:
  TransferStage(std::unique_ptr<LoaderNode<Batch>> inner, std::shared_ptr<TransferDevice> device,
                size_t depth)
      : inner_(std::move(inner)), device_(std::move(device)), depth_(depth) {}

  using Node<Batch>::reset;
  // Copies still queued from the last pass are dropped (safely: their
  // memory is freed only after their events).
  void reset(const PassContext& pass, ResetWalk& walk) override {
    pending_.clear();
    current_ = {};
    current_scratch_.clear();
    inner_done_ = false;
    pulled_ = 0;
    handed_out_ = 0;
    takes_.store(0, std::memory_order_relaxed);
    in_flight_sum_.store(0, std::memory_order_relaxed);
    transfer_ns_.store(0, std::memory_order_relaxed);  // no pass runs: no other thread reads
    inner_->reset(pass, walk);
    id_ = walk.next_id++;
  }
  std::string name() const override { return "to_device(" + std::to_string(depth_) + ")"; }

  // As a pipeline node (nodes::to_device): a copy that fails is a NodeError
  // naming the node, not the loader's WorkerError of stage "transfer".
  void name_copy_errors_as_node() noexcept { copy_errors_name_node_ = true; }
  // A resumed pass passed over `count` batches before the first pulled:
  // they count in the positions that errors name.
  void count_skipped(uint64_t count) noexcept { pulled_ += count; }

  std::optional<Batch> next() override {
    if (pending_.empty() && !inner_done_) pull(/*wait=*/true);
    return hand_out();
  }
  // Not waiting: the next batch with its copy queued (the consumer waits on
  // its event), or "not yet" while the stage before has none ready.
  Poll try_next(std::optional<Batch>& out) override {
    if (pending_.empty() && !inner_done_ && !pull(/*wait=*/false) && !inner_done_) return Poll::pending;
    out = hand_out();
    return out ? Poll::ready : Poll::end;
  }

 private:
  std::optional<Batch> hand_out() {
    // Keep up to `depth` batches copying beyond the one handed out now.
    while (!inner_done_ && pending_.size() <= depth_ && pull(/*wait=*/false)) {
    }
    if (pending_.empty()) return std::nullopt;
    // Relaxed, as transfer_ns_: figures for metrics, written on this thread only.
    takes_.store(takes_.load(std::memory_order_relaxed) + 1, std::memory_order_relaxed);
    in_flight_sum_.store(in_flight_sum_.load(std::memory_order_relaxed) + pending_.size(),  // the one taken too
                         std::memory_order_relaxed);
    Entry entry = std::move(pending_.front());
    pending_.pop_front();
    current_ = std::move(entry.device);
    current_scratch_ = std::move(entry.scratch);
    ++handed_out_;
    if (entry.error) std::rethrow_exception(entry.error);
    return std::move(entry.batch);
  }

 public:
  // The device copy of the batch next() returned last.
  const DeviceBatch& current() const noexcept { return current_; }
  // Keeps that copy's scratch device buffers (those outside the pinned pool)
  // alive for as long as the holder wants; nullptr when it has none.
  std::shared_ptr<void> hold_current_scratch() const {
    if (current_scratch_.empty()) return nullptr;
    return std::make_shared<std::vector<std::shared_ptr<Scratch>>>(current_scratch_);
  }

  void add_metrics(LoaderMetrics& metrics) const override {
    inner_->add_metrics(metrics);
    metrics.transfer_seconds += static_cast<double>(transfer_ns_.load(std::memory_order_relaxed)) * 1e-9;
  }
  // Time queueing copies (on the consumer's thread) counts as busy; the
  // window is the batches copying ahead plus the one handed out.
  void collect_metrics(std::vector<NodeMetrics>& out) const override {
    inner_->collect_metrics(out);
    NodeMetrics mine{name(), id_};
    mine.items_in = pulled_;
    mine.items_out = handed_out_;
    mine.busy_seconds = static_cast<double>(transfer_ns_.load(std::memory_order_relaxed)) * 1e-9;
    mine.window = depth_ + 1;
    mine.mean_in_flight = mean_in_flight();
    out.push_back(std::move(mine));
  }

  // Batches copying or copied and not yet handed out, counting the one being
  // handed out, averaged over the hand-outs of this pass.
  double mean_in_flight() const noexcept {
    const uint64_t takes = takes_.load(std::memory_order_relaxed);
    return takes ? static_cast<double>(in_flight_sum_.load(std::memory_order_relaxed)) / static_cast<double>(takes)
                 : 0;
  }

 private:
  // A device buffer the stage allocated for memory outside the pinned pool;
  // freed once its copy is done, the consumer has moved on, and the work
  // kept on it (DeviceBatch::keep_until) has completed. It holds the host
  // memory too: a batch dropped before its copy ran (the pool's own buffers
  // wait for their copy on release; this memory has no such guard) would
  // otherwise be freed under the copy engine.
  struct Scratch {
    std::shared_ptr<TransferDevice> device;
    void* memory = nullptr;
    std::shared_ptr<void> host_owner;  // empty when the batch type gives none
    TransferEvent copied;
    std::shared_ptr<DeviceCopyUses> uses;  // its batch's kept work
    ~Scratch() {
      if (!memory) return;
      copied.synchronize_before_release("a device buffer");
      if (uses) {
        for (const TransferEvent& use : uses->events()) use.synchronize_before_release("a device buffer");
      }
      device->free_device(memory);
    }
  };

  struct Entry {
    std::optional<Batch> batch;
    std::exception_ptr error;
    DeviceBatch device;
    std::vector<std::shared_ptr<Scratch>> scratch;
  };

  // Takes the next batch from the stage before and queues its copies; false
  // when, not waiting, none was ready. A TimeoutError leaves as it is (the
  // batch is still coming); any other error takes the batch's place.
  bool pull(bool wait) {
    Entry entry;
    try {
      if (wait) {
        entry.batch = inner_->next();
      } else if (inner_->try_next(entry.batch) == Poll::pending) {
        return false;
      }
    } catch (const TimeoutError&) {
      throw;  // only a waiting pull times out, and nothing is pending then
    } catch (...) {
      entry.error = std::current_exception();  // already a WorkerError, in order
    }
    if (!entry.error && !entry.batch) {
      inner_done_ = true;
      return false;
    }
    const uint64_t index = pulled_++;
    if (entry.error) {
      pending_.push_back(std::move(entry));
      return true;
    }
    const auto start = std::chrono::steady_clock::now();
    try {
      queue_copies(entry);
      // Relaxed: a figure for metrics, paired with no other access; this
      // thread is its only writer.
      transfer_ns_.store(transfer_ns_.load(std::memory_order_relaxed) + nanoseconds_since(start),
                         std::memory_order_relaxed);
    } catch (...) {
      try {
        if (copy_errors_name_node_) throw_node_error(name(), index);
        throw_worker_error(std::current_exception(), FailureContext{-1, index, {}, "transfer"});
      } catch (...) {
        entry.error = std::current_exception();
      }
      entry.batch.reset();
    }
    pending_.push_back(std::move(entry));
    return true;
  }

  // A pool buffer whose twin a copy was queued into: where its last copy
  // is kept, and a hold on the buffer.
  struct TwinCopied {
    TransferEvent* last_copy = nullptr;
    std::shared_ptr<void> owner;
  };

  void queue_copies(Entry& entry) {
    std::vector<TwinCopied> twins_copied;
    auto uses = std::make_shared<DeviceCopyUses>();
    try {
      queue_each_copy(entry, uses, twins_copied);
      entry.device.ready = device_->record();
    } catch (...) {
      // The copies queued before the failure may still run: what they read
      // and write is released after them, or, if not even that can be
      // asked of the device, never.
      TransferEvent fence;
      bool fenced = true;
      try {
        fence = device_->record();
      } catch (...) {
        fenced = false;
      }
      // With no fence, what the copies use is held for good: the pool would
      // free a block and its twin under the copy (a default event counts as
      // done), and a scratch buffer would free its memory.
      for (TwinCopied& twin : twins_copied) {
        *twin.last_copy = fence;
        if (!fenced) hold_forever(std::move(twin.owner));
      }
      for (auto& scratch : entry.scratch) {
        scratch->copied = fence;
        if (!fenced) hold_forever(scratch);
      }
      throw;
    }
    entry.device.uses = std::move(uses);
    for (TwinCopied& twin : twins_copied) *twin.last_copy = entry.device.ready;
    for (auto& scratch : entry.scratch) scratch->copied = entry.device.ready;
  }

  void queue_each_copy(Entry& entry, const std::shared_ptr<DeviceCopyUses>& uses,
                       std::vector<TwinCopied>& twins_copied) {
    transfer_traits<Batch>::for_each_buffer(
        *entry.batch, [&](void* host, size_t bytes, const std::shared_ptr<void>& owner) {
          void* target = nullptr;
          if (std::optional<DeviceTwin> twin = device_twin_of(owner)) {
            const auto offset = static_cast<size_t>(static_cast<const std::byte*>(host) -
                                                    static_cast<const std::byte*>(twin->host_base));
            CONVEYOR_CHECK(offset + bytes <= twin->capacity, "a buffer beyond its pool block");
            target = static_cast<std::byte*>(twin->device) + offset;
            // Work kept on the twin's last copy may still read it.
            if (*twin->last_uses) {
              for (const TransferEvent& use : (*twin->last_uses)->events()) device_->wait_for(use);
            }
            *twin->last_uses = uses;
            twins_copied.push_back(TwinCopied{twin->last_copy, owner});
          } else {
            auto scratch = std::make_shared<Scratch>();
            scratch->device = device_;
            scratch->memory = device_->allocate_device(bytes);
            scratch->host_owner = owner;
            scratch->uses = uses;
            target = scratch->memory;
            entry.scratch.push_back(std::move(scratch));
          }
          device_->copy_to_device(target, host, bytes);
          entry.device.buffers.push_back(DeviceBuffer{host, target, bytes});
        });
  }

  std::unique_ptr<LoaderNode<Batch>> inner_;
  std::shared_ptr<TransferDevice> device_;
  size_t depth_;
  uint64_t id_ = 0;
  bool inner_done_ = false;
  uint64_t pulled_ = 0;      // from the stage before, errors included
  bool copy_errors_name_node_ = false;
  uint64_t handed_out_ = 0;  // by next(), errors included
  // Read by metrics while a prefetch downstream may run this stage on its
  // thread (see add_metrics): atomic, relaxed, a figure ordering nothing.
  std::atomic<int64_t> transfer_ns_{0};
  std::atomic<uint64_t> takes_{0};          // hand-outs this pass (as transfer_ns_)
  std::atomic<uint64_t> in_flight_sum_{0};  // pending batches at each, the one taken included
  std::deque<Entry> pending_;  // copies queued, not handed out yet
  DeviceBatch current_;
  std::vector<std::shared_ptr<Scratch>> current_scratch_;
};

}  // namespace conveyor::detail
