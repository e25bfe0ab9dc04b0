// A transfer device for tests: wraps another (the host stand-in), counts
// what it allocates and can fail a copy or a device allocation on demand.
#pragma once

#include <atomic>
#include <memory>
#include <stdexcept>
#include <string>

#include <conveyor/transfer.h>

namespace conveyor::testing {

// Wraps a device: counts what it allocates, optionally fails, optionally
// holds copies at a gate (its own in-order stream thread).
class TestDevice final : public conveyor::TransferDevice {
 public:
  explicit TestDevice(std::shared_ptr<conveyor::TransferDevice> inner) : inner_(std::move(inner)) {}

  std::string name() const override { return "test(" + inner_->name() + ")"; }
  void* allocate_pinned(size_t bytes) override {
    pinned_allocations.fetch_add(1);
    live_pinned.fetch_add(1);
    return inner_->allocate_pinned(bytes);
  }
  void free_pinned(void* memory) noexcept override {
    live_pinned.fetch_sub(1);
    inner_->free_pinned(memory);
  }
  void* allocate_device(size_t bytes) override {
    if (fail_device_allocation.load()) throw std::runtime_error("out of device memory (test)");
    device_allocations.fetch_add(1);
    live_device.fetch_add(1);
    return inner_->allocate_device(bytes);
  }
  void free_device(void* memory) noexcept override {
    live_device.fetch_sub(1);
    inner_->free_device(memory);
  }
  void copy_to_device(void* device, const void* host, size_t bytes) override {
    const int n = copies.fetch_add(1);
    if (fail_copy_number.load() == n) throw std::runtime_error("copy engine fault (test)");
    inner_->copy_to_device(device, host, bytes);
  }
  conveyor::TransferEvent record() override { return inner_->record(); }

  std::atomic<int> pinned_allocations{0}, live_pinned{0};
  std::atomic<int> device_allocations{0}, live_device{0};
  std::atomic<int> copies{0};
  std::atomic<int> fail_copy_number{-1};
  std::atomic<bool> fail_device_allocation{false};

 private:
  std::shared_ptr<conveyor::TransferDevice> inner_;
};

}  // namespace conveyor::testing
