// Synchronisation helpers for forcing orders in tests, without sleeps: every
// wait here parks on an atomic until another thread changes it.
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <random>
#include <vector>

namespace conveyor::testing {

// Gate k blocks wait(k) until open(k).
class Gates {
 public:
  explicit Gates(size_t count) : gates_(std::make_unique<std::atomic<int>[]>(count)), count_(count) {}
  void wait(size_t k) {
    while (gates_[k].load(std::memory_order_acquire) == 0) gates_[k].wait(0, std::memory_order_acquire);
  }
  void open(size_t k) {
    gates_[k].store(1, std::memory_order_release);
    gates_[k].notify_all();
  }
  void open_all() {
    for (size_t k = 0; k < count_; ++k) open(k);
  }

 private:
  std::unique_ptr<std::atomic<int>[]> gates_;
  size_t count_;
};

// Counts events and lets a thread wait until at least n happened.
class Counter {
 public:
  void bump() {
    value_.fetch_add(1, std::memory_order_acq_rel);
    value_.notify_all();
  }
  void wait_for(uint64_t n) {
    uint64_t seen = 0;
    while ((seen = value_.load(std::memory_order_acquire)) < n) value_.wait(seen, std::memory_order_acquire);
  }
  uint64_t get() const { return value_.load(std::memory_order_acquire); }

 private:
  std::atomic<uint64_t> value_{0};
};

// Records the order in which things happened, from any thread.
class OrderLog {
 public:
  void record(uint64_t value) {
    {
      std::lock_guard lock(mutex_);
      order_.push_back(value);
    }
    count_.bump();
  }
  std::vector<uint64_t> order() const {
    std::lock_guard lock(mutex_);
    return order_;
  }
  void wait_for(uint64_t n) { count_.wait_for(n); }

 private:
  mutable std::mutex mutex_;
  std::vector<uint64_t> order_;
  Counter count_;
};

// Busy-waits for `nanoseconds`: a random delay that keeps the thread on the
// CPU, to shake out interleavings in stress tests.
inline void spin_delay(uint64_t nanoseconds) {
  const auto until = std::chrono::steady_clock::now() + std::chrono::nanoseconds(nanoseconds);
  while (std::chrono::steady_clock::now() < until) {
  }
}

// Counts live instances; moved-from instances do not count.
struct LiveCounter {
  std::atomic<int64_t> live{0};
  std::atomic<int64_t> peak{0};
  void add() {
    const int64_t now = live.fetch_add(1, std::memory_order_relaxed) + 1;
    int64_t seen = peak.load(std::memory_order_relaxed);
    while (now > seen && !peak.compare_exchange_weak(seen, now, std::memory_order_relaxed)) {
    }
  }
  void remove() { live.fetch_sub(1, std::memory_order_relaxed); }
};

class Tracked {
 public:
  Tracked() = default;
  Tracked(LiveCounter* counter, int64_t value) : counter_(counter), value_(value) { counter_->add(); }
  Tracked(const Tracked& other) : counter_(other.counter_), value_(other.value_) {
    if (counter_) counter_->add();
  }
  Tracked(Tracked&& other) noexcept : counter_(other.counter_), value_(other.value_) {
    other.counter_ = nullptr;
  }
  Tracked& operator=(Tracked other) noexcept {
    std::swap(counter_, other.counter_);
    std::swap(value_, other.value_);
    return *this;
  }
  ~Tracked() {
    if (counter_) counter_->remove();
  }
  int64_t value() const { return value_; }

 private:
  LiveCounter* counter_ = nullptr;
  int64_t value_ = 0;
};

}  // namespace conveyor::testing
