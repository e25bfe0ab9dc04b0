// conveyor/nodes/transfer.h: the loader's transfer stage as nodes.
//
//   ... | nodes::collate() | nodes::pin_memory(device) | nodes::to_device(device, 2)
//
// pin_memory(device): the collate nodes upstream of it write their batches
//     into page-locked memory from a recycling pool on `device` (the loader's
//     pin_memory: a batch is written once, straight into the memory it is
//     copied from). Memory made elsewhere (by a dataset, a map) stays where
//     it is, and to_device copies it through a scratch device buffer.
// to_device(device, depth): queues each item's copies on the device's copy
//     stream, up to `depth` items ahead of the consumer, and hands out
//     OnDevice<T>: the host item, its device copy (buffers by host buffer,
//     in transfer_traits order) and the event that completes with the copy.
//     No host synchronisation: make your stream wait on `device.ready`, and
//     for work that still reads the copy once the item is dropped, call
//     `device.keep_until(event)` (conveyor/transfer.h).
//
// Devices: conveyor::cuda::make_device() (target conveyor::cuda), or
// make_host_standin_device() where there is no GPU.
#pragma once

#include <cstddef>
#include <exception>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "conveyor/buffer.h"
#include "conveyor/detail/buffer_pool.h"
#include "conveyor/detail/check.h"
#include "conveyor/detail/transfer_stage.h"
#include "conveyor/errors.h"
#include "conveyor/metrics.h"
#include "conveyor/nodes/stage.h"
#include "conveyor/transfer.h"

namespace conveyor::nodes {

// An item and its copy on the device.
template <class T>
struct OnDevice {
  T host;                        // keeps the host memory (and pool buffers) alive
  DeviceBatch device;            // device buffers, the `ready` event
  std::shared_ptr<void> scratch;  // device buffers outside the pool, freed with the item
};

template <class T>
class PinMemory final : public Stage<T, T> {
 public:
  using item_type = T;
  PinMemory(NodePtr<T> upstream, std::shared_ptr<TransferDevice> device, size_t max_free_per_class)
      : Stage<T, T>(std::move(upstream)), device_(std::move(device)), max_free_per_class_(max_free_per_class) {
    if (!device_) throw ValueError("pin_memory: the device is null");
  }
  // Upstream goes first: collate nodes there allocate from pool_ through a
  // plain pointer (PassContext::batch_memory), possibly on a prefetch's
  // strand still running; the base class would destroy them after pool_.
  ~PinMemory() override { this->upstream_.reset(); }
  using Node<T>::reset;
  void reset(const PassContext& pass, conveyor::detail::ResetWalk& walk) override {
    if (!pool_) pool_ = conveyor::detail::make_pinned_allocator(device_, max_free_per_class_);  // lazily
    PassContext pinned = pass;
    pinned.batch_memory = pool_.get();
    Stage<T, T>::reset(pinned, walk);
  }
  std::string name() const override { return "pin_memory"; }
  uint64_t skip(uint64_t count, bool clean) override {
    if (!clean) return Stage<T, T>::skip(count, clean);
    return this->skip_upstream(count, clean);
  }

 private:
  std::optional<T> produce() override { return this->pull(); }

  std::shared_ptr<TransferDevice> device_;
  size_t max_free_per_class_;
  std::shared_ptr<BufferAllocator> pool_;  // outlives the items: their buffers hold it
};

inline auto pin_memory(std::shared_ptr<TransferDevice> device, size_t max_free_per_class = 8) {
  return [device = std::move(device), max_free_per_class]<class T>(Pipeline<T>&& upstream) {
    return Pipeline<T>(std::make_unique<PinMemory<T>>(std::move(upstream).release(), device, max_free_per_class));
  };
}

template <class T>
class ToDevice final : public Stage<T, OnDevice<T>> {
 public:
  using item_type = OnDevice<T>;
  ToDevice(NodePtr<T> upstream, std::shared_ptr<TransferDevice> device, size_t depth)
      : Stage<T, OnDevice<T>>(std::move(upstream)), device_(std::move(device)), depth_(depth) {
    if (!device_) throw ValueError("to_device: the device is null");
    if (depth_ > (size_t{1} << 20)) {
      throw ValueError("to_device: depth should be in [0, 1048576], but got " + std::to_string(depth_));
    }
  }
  std::string name() const override { return "to_device(" + std::to_string(depth_) + ")"; }
  // One copy an item: a resumed pass passes over upstream's items uncopied
  // (and unmade, where upstream can skip them too). Called at the pass's
  // start, before the stage holds anything.
  uint64_t skip(uint64_t count, bool clean) override {
    const uint64_t skipped =
        clean ? this->skip_upstream(count, clean) : Stage<T, OnDevice<T>>::skip(count, clean);
    // Errors name the item's place in the whole pass, resumed or not.
    if (clean && stage_) stage_->count_skipped(skipped);
    return skipped;
  }
  // Not waiting: upstream's try_next() feeds the transfer stage.
  Poll try_next(std::optional<OnDevice<T>>& out) override {
    std::optional<T> host;
    const Poll poll = stage_->try_next(host);
    if (poll == Poll::ready) out = OnDevice<T>{std::move(*host), stage_->current(), stage_->hold_current_scratch()};
    return this->counted(poll);
  }

 protected:
  // Copies queued for the last pass are dropped with the stage (safely:
  // their memory is freed only after their events).
  void start_pass() override {
    stage_ = std::make_unique<conveyor::detail::TransferStage<T>>(std::make_unique<Upstream>(*this), device_, depth_);
    stage_->name_copy_errors_as_node();
  }
  void add_own_metrics(NodeMetrics& metrics) const override {
    metrics.window = depth_ + 1;
    if (!stage_) return;
    LoaderMetrics transfer;
    stage_->add_metrics(transfer);
    metrics.busy_seconds = transfer.transfer_seconds;  // queueing the copies, on the consumer's thread
    metrics.mean_in_flight = stage_->mean_in_flight();
  }

 private:
  // The transfer stage's view of this node's upstream: pulls count as the
  // node's input. Made for one pass, after this node reset its upstream.
  class Upstream final : public conveyor::detail::LoaderNode<T> {
   public:
    explicit Upstream(ToDevice& node) : node_(node) {}
    using Node<T>::reset;
    void reset(const PassContext&, conveyor::detail::ResetWalk&) override {
      CONVEYOR_CHECK(false, "to_device's stage is made per pass and never reset");
    }
    std::string name() const override { return node_.upstream_->name(); }
    std::optional<T> next() override { return node_.pull(); }
    Poll try_next(std::optional<T>& out) override {
      const Poll poll = node_.upstream_->try_next(out);
      if (poll == Poll::ready) {
        ++node_.position_;
        node_.meter_.in.add(1);
      }
      return poll;
    }

   private:
    ToDevice& node_;
  };

  std::optional<OnDevice<T>> produce() override {
    std::optional<T> host = stage_->next();
    if (!host) return std::nullopt;
    return OnDevice<T>{std::move(*host), stage_->current(), stage_->hold_current_scratch()};
  }

  std::shared_ptr<TransferDevice> device_;
  size_t depth_;
  std::unique_ptr<conveyor::detail::TransferStage<T>> stage_;
};

inline auto to_device(std::shared_ptr<TransferDevice> device, size_t depth = 2) {
  return [device = std::move(device), depth]<class T>(Pipeline<T>&& upstream) {
    return Pipeline<OnDevice<T>>(std::make_unique<ToDevice<T>>(std::move(upstream).release(), device, depth));
  };
}

}  // namespace conveyor::nodes
