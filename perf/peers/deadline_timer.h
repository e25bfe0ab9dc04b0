// W3-async's latency source: ONE thread completing requests at their
// deadlines (the stand-in for a remote store answering after 1 ms), so that
// N requests in flight cost one thread, not N sleeping ones.
//
//   DeadlineTimer timer;
//   timer.complete_at(now + 1ms, std::move(completion), value);
//
// Each request completes at or after its deadline, never before; ties in
// submission order. The thread asks for 1 ns of timer slack, as W3's
// sleeping workers do, so a wake-up is not deferred by the kernel's default
// 50 us.
//
// The stand-in should cost the client as little as a remote store would, so
// neither side holds the lock for more than a push or a swap: submitters
// append to `incoming_`; the thread takes the whole vector at once and keeps
// its queue to itself. With one latency the deadlines arrive in order and
// the queue is a FIFO (O(1) per request); an earlier one is inserted in its
// place.
#pragma once

#include <conveyor/nodes/async.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <mutex>
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
    bool sooner;
    {
      std::lock_guard lock(mutex_);
      incoming_.push_back(Entry{deadline, std::move(done), std::move(value)});
      // The thread sleeps until sleeping_until_ (max when idle); only a
      // deadline before that needs it awake, which with one latency is the
      // first request after an empty queue.
      sooner = deadline < sleeping_until_;
      if (sooner) sleeping_until_ = deadline;
    }
    if (sooner) wake_.notify_one();
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
    conveyor::nodes::Completion<T> done;
    T value;
  };

  // Moves what was submitted into the thread's own queue, in deadline order.
  void take_incoming(std::deque<Entry>& queue, std::vector<Entry>& batch) {
    for (Entry& entry : batch) {
      if (queue.empty() || !(entry.deadline < queue.back().deadline)) {
        queue.push_back(std::move(entry));
      } else {  // an earlier deadline than one already queued: after its equals
        auto place = std::upper_bound(queue.begin(), queue.end(), entry.deadline,
                                      [](Clock::time_point d, const Entry& e) { return d < e.deadline; });
        queue.insert(place, std::move(entry));
      }
    }
    batch.clear();
  }

  void loop() {
    tight_timer_slack();
    std::deque<Entry> queue;   // this thread's alone
    std::vector<Entry> batch;  // swapped with incoming_
    std::unique_lock lock(mutex_);
    while (true) {
      batch.swap(incoming_);
      const bool stopping = stopping_;
      lock.unlock();
      take_incoming(queue, batch);
      if (stopping) return;  // what is left is dropped (its completions fail, unwanted)

      // Everything due now, completed without the lock.
      const auto now = Clock::now();
      int64_t late = 0;
      uint64_t completed = 0;
      while (!queue.empty() && queue.front().deadline <= now) {
        Entry& entry = queue.front();
        late += std::chrono::duration_cast<std::chrono::nanoseconds>(now - entry.deadline).count();
        entry.done(std::move(entry.value));
        queue.pop_front();
        ++completed;
      }

      lock.lock();
      completed_ += completed;
      late_ns_ += late;
      if (!incoming_.empty() || stopping_) continue;
      if (completed) continue;  // time passed while delivering: look again before sleeping
      sleeping_until_ = queue.empty() ? Clock::time_point::max() : queue.front().deadline;
      if (queue.empty()) {
        wake_.wait(lock, [&] { return !incoming_.empty() || stopping_; });
      } else {
        const auto deadline = sleeping_until_;
        wake_.wait_until(lock, deadline, [&] { return sleeping_until_ < deadline || stopping_; });
      }
      sleeping_until_ = Clock::time_point::min();  // awake: a submitter need not wake it
    }
  }

  mutable std::mutex mutex_;
  std::condition_variable wake_;
  std::vector<Entry> incoming_;  // guarded by mutex_
  Clock::time_point sleeping_until_ = Clock::time_point::min();
  uint64_t completed_ = 0;
  int64_t late_ns_ = 0;
  bool stopping_ = false;
  std::thread thread_;  // last: starts once the rest is built
};

}  // namespace perf
