// conveyor/nodes/parallel.h: nodes that run on threads of their own.
//
//   map(f, {.workers = 8, .in_order = true})   f on `workers` threads, up
//        to `window` items in flight (default max(64, 2 x workers)); in input order,
//        or as each finishes with in_order = false. f's draws come from the
//        item's own seed: the items are the same for any number of workers.
//   prefetch(n)   keeps up to n items of upstream produced ahead of the
//        consumer, on a thread of its own (upstream is only ever advanced by
//        that one thread at a time).
//
// Both run on conveyor's engine (moodycamel queues, the sequence-numbered
// window) in one oneTBB arena per graph, which holds every parallel node's
// threads (ExecutorShare): memory is bounded by the window, the hand-off
// takes no mutex, a pass left early cancels what is queued and waits for
// what runs. Upstream is pulled on the caller's thread (map) or on the
// node's strand (prefetch), never by two threads at once. An error keeps
// its place: next() throws it where the item would have been.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <exception>
#include <map>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "conveyor/buffer.h"
#include "conveyor/data_error.h"
#include "conveyor/detail/buffer_pool.h"
#include "conveyor/detail/decision_log.h"
#include "conveyor/detail/engine.h"
#include "conveyor/detail/sequenced_window.h"
#include "conveyor/detail/worker_scope.h"
#include "conveyor/nodes/map.h"
#include "conveyor/nodes/reordering_stage.h"
#include "conveyor/nodes/stage.h"

namespace conveyor::nodes {

struct MapOptions {
  // Threads running f; 0 runs it in the caller's thread (the serial map).
  int workers = 0;
  // Items in flight; 0: max(64, 2 x workers). Items are usually samples:
  // a deep window lets the consumer take a run of ready items without
  // parking, where a window of a few items made every item a wake-up (W5
  // as a node graph: 1.6x the samples/s with 64 instead of 2 at W = 1).
  // Lower it for large items: memory is bounded by window items.
  int window = 0;
  // Hand items out in input order (true) or as each finishes.
  bool in_order = true;
  // raise: next() throws a NodeError at the item's place; skip: the item is
  // dropped and counted.
  OnError on_error = OnError::raise;
};

namespace detail {

// One item's result in the window: what the worker made of it, or why not.
template <class T>
struct Result {
  std::optional<T> value;
  std::exception_ptr error;
  uint64_t position = 0;  // the input item's
  uint64_t input = 0;     // map: its number among upstream's outputs, failures included
  bool end = false;       // prefetch: upstream had no more
  int64_t busy_ns = 0;    // timed passes: the worker's time on it
};

// How full a window was each time its consumer took an item.
struct Occupancy {
  Counter<uint64_t> takes;
  Counter<uint64_t> in_flight_sum;
  void add(size_t in_flight) noexcept {
    takes.add(1);
    in_flight_sum.add(in_flight);
  }
  void clear() noexcept {
    takes.clear();
    in_flight_sum.clear();
  }
  double mean() const noexcept {
    const uint64_t n = takes.get();
    return n ? static_cast<double>(in_flight_sum.get()) / static_cast<double>(n) : 0;
  }
};

template <class F>
int64_t timed_ns(F&& f) {
  const auto start = std::chrono::steady_clock::now();
  f();
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - start).count();
}

// A parallel node's share of its graph's executor: its threads are reserved
// at its first reset, when the graph's walk hands the executor round, so
// that every node's are counted before the first window starts the arena.
// A node joining after that (a graph reset anew once running) gets an arena
// of its own.
class ExecutorShare {
 public:
  void join(conveyor::detail::ResetWalk& walk, int threads) {
    if (joined_) return;
    joined_ = true;
    std::shared_ptr<conveyor::detail::Executor> executor = conveyor::detail::walk_executor(walk);
    if (executor->reserve(static_cast<size_t>(threads))) executor_ = std::move(executor);
  }
  // The graph's executor, or nullptr for an arena of the node's own.
  const std::shared_ptr<conveyor::detail::Executor>& get() const noexcept { return executor_; }

 private:
  bool joined_ = false;
  std::shared_ptr<conveyor::detail::Executor> executor_;
};

inline conveyor::detail::EngineConfig engine_config(int workers, int window, bool in_order, bool strand) {
  conveyor::detail::EngineConfig config;
  config.num_workers = static_cast<size_t>(workers);
  config.window = static_cast<size_t>(window);
  config.in_order = in_order;
  config.per_worker_queues = strand;  // a strand: one lane, its jobs one at a time in order
  return config;
}

}  // namespace detail

template <class In, class F>
class ParallelMap final
    : public detail::ReorderingStage<In, std::remove_cvref_t<std::invoke_result_t<const F&, In&&>>>,
      private conveyor::detail::SequencedWindow<
          detail::Result<std::remove_cvref_t<std::invoke_result_t<const F&, In&&>>>, std::optional<In>>::Work {
 public:
  using Out = std::remove_cvref_t<std::invoke_result_t<const F&, In&&>>;
  using item_type = Out;

 private:
  using Base = detail::ReorderingStage<In, Out>;
  using Base::inputs_;
  using Base::order_;
  using Base::replay_inputs_;

 public:
  ParallelMap(NodePtr<In> upstream, F f, MapOptions options)
      : Base(std::move(upstream), options.in_order, options.on_error), f_(std::move(f)), options_(options) {
    if (options_.workers < 1 || options_.workers > 1024) {
      throw ValueError("map: workers should be in [1, 1024], but got " + std::to_string(options_.workers));
    }
    if (options_.window == 0) options_.window = std::max(64, 2 * options_.workers);
    if (options_.window < 1 || options_.window > (1 << 20)) {
      throw ValueError("map: window should be in [1, 1048576], but got " + std::to_string(options_.window));
    }
  }
  ~ParallelMap() override { window_.reset(); }  // its workers run f_

  using Node<Out>::reset;
  // Skips and checkpoints as every reordering map (ReorderingStage).
  void reset(const PassContext& pass, conveyor::detail::ResetWalk& walk) override {
    Base::reset(pass, walk);
    executor_.join(walk, options_.workers);
  }

  std::optional<Out> produce() override {
    std::optional<Out> out;
    while (order_.replaying()) {
      if (replay(out)) return out;
    }
    while (true) {
      fill();
      if (window().in_flight() == 0) return std::nullopt;
      if (take(window().take(), out)) return out;
    }
  }
  Poll try_next(std::optional<Out>& out) override { return this->counted(poll(out)); }
  // How it runs (workers) and what its outputs depend on (order, errors).
  std::string name() const override {
    return "map(workers=" + std::to_string(options_.workers) + (options_.in_order ? "" : ", in_order=false") +
           (options_.on_error == OnError::skip ? ", on_error=skip" : "") + ")";
  }

 protected:
  // In-flight items read pass_ and id_ (their seeds): cancelled before the
  // reset writes them.
  void stop_pass() override {
    if (window_) window_->cancel();
  }
  void start_pass() override {
    upstream_done_ = false;
    upstream_error_ = nullptr;
    inputs_ = 0;
    occupancy_.clear();
    worker_busy_ns_.clear();
  }
  // busy: the workers' time in f, summed; the window's mean occupancy.
  void add_own_metrics(NodeMetrics& metrics) const override {
    metrics.busy_seconds = static_cast<double>(worker_busy_ns_.get()) * 1e-9;
    metrics.window = static_cast<size_t>(options_.window);
    metrics.mean_in_flight = occupancy_.mean();
  }

 private:
  using Window = conveyor::detail::SequencedWindow<detail::Result<Out>, std::optional<In>>;

  Poll poll(std::optional<Out>& out) {
    while (order_.replaying()) {
      if (replay(out)) return Poll::ready;
    }
    while (true) {
      bool upstream_pending = false;
      {
        const typename Base::Polling polling(*this, true);
        upstream_pending = fill();
      }
      if (window().in_flight() == 0) return upstream_pending ? Poll::pending : Poll::end;
      std::optional<typename Window::Taken> taken = window().try_take();
      if (!taken) return Poll::pending;
      if (take(std::move(*taken), out)) return Poll::ready;
    }
  }

  Window& window() {
    if (!window_) {  // lazily: nothing starts before the first pass asks
      // Arrays f makes come from oneTBB's scalable heap: made on a worker
      // and freed on the consumer's thread, glibc's would take its arena
      // lock for each (W5's decode ran at 19 us an item on a worker, 10 us
      // serially); the recycling pool's queues cost 11% of W5's CPU.
      item_memory_ = conveyor::detail::make_scalable_heap();
      conveyor::detail::EngineConfig config =
          detail::engine_config(options_.workers, options_.window, options_.in_order, false);
      // A consumer that must park sleeps until half the window is done: it
      // then takes a run of items per wake-up (W5's per-sample graph at W=2
      // on 2 vCPUs: 172k -> 193k samples/s; see EngineConfig::wake_after).
      config.wake_after = static_cast<size_t>(options_.window) / 2;
      window_.emplace(std::move(config), static_cast<typename Window::Work&>(*this), executor_.get());
      window_->begin_pass();
    }
    return *window_;
  }

  // Pulls upstream on this thread and submits until the window is full. An
  // upstream error stops the pulling; it is thrown once the items before it
  // are out (its place): here, at once, when none is in flight. (Returning
  // instead left the caller an empty window, which reads as the end of the
  // pass: the error and every item after it were lost.) Inside try_next(),
  // stops at an upstream with nothing ready yet and returns true.
  bool fill() {
    // What a replay pulled ahead of its turn goes first, in input order.
    auto& ahead = replay_inputs_.ahead;
    while (!ahead.empty() && !upstream_error_ && window().has_room()) {
      auto first = ahead.begin();
      if (first->second.error) {
        upstream_error_ = first->second.error;
        upstream_error_input_ = first->first;
      } else {
        window().next_input().emplace(std::move(*first->second.item));
        window().next_payload().position = first->second.position;
        window().next_payload().input = first->first;
        window().submit();
      }
      ahead.erase(first);
    }
    while (ahead.empty() && !upstream_done_ && !upstream_error_ && window().has_room()) {
      std::optional<In> item;
      const uint64_t input = inputs_;
      try {
        item = this->pull();
      } catch (const detail::UpstreamPending&) {
        return true;
      } catch (...) {
        ++inputs_;
        if (order_.dropped(input)) continue;
        upstream_error_ = std::current_exception();
        upstream_error_input_ = input;
        break;
      }
      if (!item) {
        upstream_done_ = true;
        return false;
      }
      ++inputs_;
      if (order_.dropped(input)) continue;
      // What f leaves of the input is freed when its result is taken, on
      // this thread, which made it (glibc's per-thread cache takes it back
      // cheaply; a batch of samples f only reads is all of it).
      window().next_input().emplace(std::move(*item));
      window().next_payload().position = this->position();
      window().next_payload().input = input;
      window().submit();
    }
    if (!upstream_error_ || window().in_flight() > 0) return false;
    if (!options_.in_order) order_.handed_out(upstream_error_input_);
    std::rethrow_exception(std::exchange(upstream_error_, nullptr));
  }

  // A resumed pass with in_order = false whose outputs a node downstream
  // takes again by pulling (a filter, say): they come in the saved order,
  // each made on this thread when its turn comes. Inputs pulled before
  // their turn wait in replay_inputs_ (as many as the saved order was ahead of
  // input order: at most a window); fill() submits what is left of them
  // first once the replay is over. True with an item in `out`.
  bool replay(std::optional<Out>& out) {
    uint64_t wanted = 0;
    auto pending = replay_inputs_.take_next_saved(order_, wanted, inputs_, name(), [this] { return this->pull(); },
                                                  [this] { return this->position(); });
    const conveyor::detail::WorkerScope scope(nullptr, this->seed_of(pending.position));
    std::exception_ptr error;
    auto apply = [&] {
      try {
        out.emplace(std::as_const(f_)(std::move(*pending.item)));
      } catch (...) {
        error = std::current_exception();
      }
    };
    if (this->pass_.timed) {
      worker_busy_ns_.add(detail::timed_ns(apply));  // f's time, on this thread as on a worker
    } else {
      apply();
    }
    if (error) {
      // Logged only as handed out (take()): a skipped item is not, or a
      // later state would count it as received.
      if (options_.on_error == OnError::skip) {
        this->meter_.skipped.add(1);
        return false;
      }
      order_.handed_out(wanted);
      try {
        std::rethrow_exception(error);
      } catch (...) {
        conveyor::detail::throw_node_error(name(), pending.position);
      }
    }
    order_.handed_out(wanted);
    return true;
  }

  bool take(typename Window::Taken&& taken, std::optional<Out>& out) {
    occupancy_.add(window().in_flight() + 1);  // counting the one just taken
    detail::Result<Out>& result = taken.payload;
    worker_busy_ns_.add(result.busy_ns);
    if (result.error) {
      if (options_.on_error == OnError::skip) {
        this->meter_.skipped.add(1);
        return false;
      }
      if (!options_.in_order) order_.handed_out(result.input);
      try {
        std::rethrow_exception(result.error);
      } catch (...) {
        conveyor::detail::throw_node_error(name(), result.position);
      }
    }
    if (!options_.in_order) order_.handed_out(result.input);
    out = std::move(result.value);
    return true;
  }

  // ---- on the engine's workers ----
  void run(conveyor::detail::Job&, std::optional<In>& input, detail::Result<Out>& out, int,
           const std::exception_ptr&) noexcept override {
    const conveyor::detail::WorkerScope scope(nullptr, this->seed_of(out.position));
    conveyor::detail::AllocatorScope memory(item_memory_.get());
    auto apply = [&] {
      try {
        out.value.emplace(std::as_const(f_)(std::move(*input)));  // f runs on many threads
      } catch (...) {
        out.error = std::current_exception();
      }
    };
    if (this->pass_.timed) {
      out.busy_ns = detail::timed_ns(apply);
    } else {
      apply();
    }
  }

  F f_;
  MapOptions options_;
  bool upstream_done_ = false;
  std::exception_ptr upstream_error_;
  uint64_t upstream_error_input_ = 0;
  detail::Occupancy occupancy_;
  detail::Counter<int64_t> worker_busy_ns_;  // timed passes: summed from the results taken, and replay()'s
  std::shared_ptr<BufferAllocator> item_memory_;  // set before the window starts
  detail::ExecutorShare executor_;
  std::optional<Window> window_;  // last: stopped first
};

template <class T>
class Prefetch final : public Node<T>, private conveyor::detail::SequencedWindow<detail::Result<T>>::Work {
 public:
  using item_type = T;
  Prefetch(NodePtr<T> upstream, int depth) : upstream_(std::move(upstream)), depth_(depth) {
    if (depth_ < 1 || depth_ > (1 << 20)) {
      throw ValueError("prefetch: depth should be in [1, 1048576], but got " + std::to_string(depth_));
    }
  }
  ~Prefetch() override { window_.reset(); }  // its strand advances upstream_

  using Node<T>::reset;
  void reset(const PassContext& pass, conveyor::detail::ResetWalk& walk) override {
    // Upstream is the strand's: nothing may run on it while it is reset.
    if (window_) window_->cancel();
    // No id of its own: adding or removing a prefetch changes no seed.
    upstream_->reset(pass, walk);
    executor_.join(walk, 1);
    timed_ = pass.timed;
    ended_ = false;
    done_ = false;
    out_.clear();
    // Nothing runs after the cancel above: no job of the last pass is left.
    ready_.store(0, std::memory_order_relaxed);
    occupancy_.clear();
    strand_wait_ns_.clear();
    downstream_ns_.clear();
    handed_out_at_ = {};
  }
  std::optional<T> next() override {
    if (timed_ && handed_out_at_ != std::chrono::steady_clock::time_point{}) {
      downstream_ns_.add(
          std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - handed_out_at_)
              .count());
    }
    std::optional<T> out;
    while (!done_) {
      fill();
      if (take(window().take(), out)) {
        if (timed_) handed_out_at_ = std::chrono::steady_clock::now();
        return out;
      }
    }
    return std::nullopt;
  }
  Poll try_next(std::optional<T>& out) override {
    while (!done_) {
      fill();
      std::optional<typename Window::Taken> taken = window().try_take();
      if (!taken) return Poll::pending;
      if (take(std::move(*taken), out)) return Poll::ready;
    }
    return Poll::end;
  }
  std::string name() const override { return "prefetch(" + std::to_string(depth_) + ")"; }
  // Before the strand runs a job of the pass (reset cancelled the last):
  // upstream is this thread's until the first submit hands it over.
  uint64_t skip(uint64_t count, bool clean) override { return upstream_->skip(count, clean); }
  void save_extras(State& nodes, bool in_pass) const override { upstream_->save_extras(nodes, in_pass); }

  // Upstream runs on the strand: its counts may be a few items behind what
  // the strand has done by now.
  void collect_metrics(std::vector<NodeMetrics>& metrics) const override {
    upstream_->collect_metrics(metrics);
    NodeMetrics mine;
    mine.name = name();
    mine.items_in = mine.items_out = out_.get();
    mine.upstream_wait_seconds = static_cast<double>(strand_wait_ns_.get()) * 1e-9;
    mine.downstream_wait_seconds = static_cast<double>(downstream_ns_.get()) * 1e-9;
    mine.window = static_cast<size_t>(depth_);
    mine.mean_in_flight = occupancy_.mean();
    metrics.push_back(std::move(mine));
  }

 private:
  using Window = conveyor::detail::SequencedWindow<detail::Result<T>>;

  Window& window() {
    if (!window_) {
      window_.emplace(detail::engine_config(1, depth_, /*in_order=*/true, /*strand=*/true),
                      static_cast<typename Window::Work&>(*this), executor_.get());
      window_->begin_pass();
    }
    return *window_;
  }
  void fill() {
    while (window().has_room()) window().submit(0);
  }
  // True with an item in `out`; false at the end (done_).
  bool take(typename Window::Taken&& taken, std::optional<T>& out) {
    detail::Result<T>& result = taken.payload;
    // The items ready when the consumer took one, counting it (the window
    // is always full of jobs submitted, so those would say nothing): 1 when
    // the consumer waited on upstream, n when the prefetch kept up. Relaxed:
    // the strand's fetch_add in run() happens before the engine publishes
    // the job as ready, which this take acquired, so the count includes
    // this item; later items' increments may or may not be seen, which only
    // moves a figure for metrics.
    if (!result.end) occupancy_.add(ready_.fetch_sub(1, std::memory_order_relaxed));
    strand_wait_ns_.add(result.busy_ns);
    if (result.error) std::rethrow_exception(result.error);  // upstream's, already named
    if (result.end) {
      done_ = true;
      return false;
    }
    out = std::move(result.value);
    out_.add(1);
    return true;
  }

  // ---- on the strand ----
  void run(conveyor::detail::Job&, conveyor::detail::NoInput&, detail::Result<T>& out, int,
           const std::exception_ptr&) noexcept override {
    if (ended_) {
      out.end = true;
      return;
    }
    auto advance = [&] {
      try {
        out.value = upstream_->next();
        if (!out.value) ended_ = out.end = true;
      } catch (...) {
        out.error = std::current_exception();
      }
    };
    if (timed_) {
      out.busy_ns = detail::timed_ns(advance);
    } else {
      advance();
    }
    // Relaxed: see take(); the engine's release of this job orders it. The
    // end is no item: it is not counted.
    if (!out.end) ready_.fetch_add(1, std::memory_order_relaxed);
  }

  NodePtr<T> upstream_;  // advanced on the strand only (reset after a cancel)
  int depth_;
  bool ended_ = false;  // the strand's: upstream said it has no more
  bool done_ = false;   // the consumer's: the end was handed out
  bool timed_ = false;  // set by reset, before the strand runs a job of the pass
  detail::Counter<uint64_t> out_;
  std::atomic<uint64_t> ready_{0};  // items made and not yet taken (not the end)
  detail::Occupancy occupancy_;
  detail::Counter<int64_t> strand_wait_ns_;  // timed passes: the strand's time in upstream
  detail::Counter<int64_t> downstream_ns_;   // timed passes: between an item out and the next call
  std::chrono::steady_clock::time_point handed_out_at_{};  // the consumer's
  detail::ExecutorShare executor_;
  std::optional<Window> window_;  // last: stopped first
};

inline auto prefetch(int depth) {
  return [depth]<class T>(Pipeline<T>&& upstream) {
    return Pipeline<T>(std::make_unique<Prefetch<T>>(std::move(upstream).release(), depth));
  };
}

// map(f) runs f in the caller's thread; map(f, {.workers = n}) on n threads.
template <class F>
auto map(F f, MapOptions options) {
  return [f = std::move(f), options]<class T>(Pipeline<T>&& upstream) mutable {
    if (options.workers == 0) {
      using Node = Map<T, F>;
      return Pipeline<typename Node::Out>(
          std::make_unique<Node>(std::move(upstream).release(), std::move(f), options.on_error));
    }
    using Node = ParallelMap<T, F>;
    return Pipeline<typename Node::Out>(std::make_unique<Node>(std::move(upstream).release(), std::move(f), options));
  };
}

}  // namespace conveyor::nodes
