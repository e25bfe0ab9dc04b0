// W3-async's latency source: ONE thread completing requests at their
// deadlines from a min-heap (the stand-in for a remote store answering after
// 1 ms), so that N requests in flight cost one thread, not N sleeping ones.
//
//   DeadlineTimer timer;
//   timer.complete_at(now + 1ms, std::move(completion), value);
//
// Each request completes at or after its deadline, never before. The thread
// asks for 1 ns of timer slack, as W3's sleeping workers do, so a wake-up is
// not deferred by the kernel's default 50 us.
#pragma once

#include <conveyor/nodes/async.h>

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <queue>
#include <thread>
#include <utility>
#include <vector>

#include "workloads.h"

namespace perf {

template <class T>
class DeadlineTimer {
 public:
  DeadlineTimer() : thread_([this] { loop(); }) {}
  ~DeadlineTimer() {
    {
      std::lock_guard lock(mutex_);
      stopping_ = true;
    }
    wake_.notify_one();
    thread_.join();
  }

  void complete_at(Clock::time_point deadline, conveyor::nodes::Completion<T> done, T value) {
    bool earliest;
    {
      std::lock_guard lock(mutex_);
      earliest = heap_.empty() || deadline < heap_.top().deadline;
      heap_.push(Entry{deadline, sequence_++, std::move(done), std::move(value)});
    }
    // Only a new earliest deadline changes how long the thread sleeps: with
    // a fixed latency that is the first request after an empty heap.
    if (earliest) wake_.notify_one();
  }

  // How late completions were, on average, after their deadline (us).
  double mean_lateness_us() const {
    std::lock_guard lock(mutex_);
    return completed_ ? static_cast<double>(late_ns_) / static_cast<double>(completed_) / 1000.0 : 0;
  }
  uint64_t completed() const {
    std::lock_guard lock(mutex_);
    return completed_;
  }

 private:
  struct Entry {
    Clock::time_point deadline;
    uint64_t sequence;  // ties complete in submission order
    mutable conveyor::nodes::Completion<T> done;  // moved out of the heap's top (const) when due
    mutable T value;
    bool operator>(const Entry& other) const {
      return deadline != other.deadline ? deadline > other.deadline : sequence > other.sequence;
    }
  };

  void loop() {
    tight_timer_slack();
    std::vector<std::pair<conveyor::nodes::Completion<T>, T>> due;
    std::unique_lock lock(mutex_);
    while (true) {
      if (heap_.empty()) {
        if (stopping_) return;
        wake_.wait(lock);
        continue;
      }
      const auto now = Clock::now();
      if (heap_.top().deadline > now) {
        if (stopping_) return;  // what is left is dropped (its completions fail, unwanted)
        const auto deadline = heap_.top().deadline;  // a copy: a push while we wait may move the heap
        wake_.wait_until(lock, deadline);
        continue;
      }
      // Everything due now, completed outside the lock.
      int64_t late = 0;
      while (!heap_.empty() && heap_.top().deadline <= now) {
        late += std::chrono::duration_cast<std::chrono::nanoseconds>(now - heap_.top().deadline).count();
        due.emplace_back(std::move(heap_.top().done), std::move(heap_.top().value));
        heap_.pop();
      }
      completed_ += due.size();
      late_ns_ += late;
      lock.unlock();
      for (auto& [done, value] : due) done(std::move(value));
      due.clear();
      lock.lock();
    }
  }

  mutable std::mutex mutex_;
  std::condition_variable wake_;
  std::priority_queue<Entry, std::vector<Entry>, std::greater<>> heap_;
  uint64_t sequence_ = 0;
  uint64_t completed_ = 0;
  int64_t late_ns_ = 0;
  bool stopping_ = false;
  std::thread thread_;  // last: starts once the rest is built
};

}  // namespace perf
