// Random pipelines for the property tests: the parallel and serial forms of
// one graph, and a pass's outcomes (items and errors) as text.
#pragma once

#include <conveyor/nodes.h>
#include <conveyor/nodes/async.h>

#include <cstdint>
#include <cstdio>
#include <condition_variable>
#include <cstdlib>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "support/sync.h"

namespace conveyor::testing {

namespace nodes = conveyor::nodes;

inline uint64_t property_seed() {
  if (const char* text = std::getenv("CONVEYOR_NODES_SEED")) return std::strtoull(text, nullptr, 10);
  return std::random_device{}();
}

// A property test's generator, its seed printed (before a crash, too) with
// how to replay it.
inline std::mt19937_64 property_rng(const char* test) {
  const uint64_t seed = property_seed();
  std::printf("%s seed: %llu (replay with CONVEYOR_NODES_SEED=%llu)\n", test, static_cast<unsigned long long>(seed),
              static_cast<unsigned long long>(seed));
  std::fflush(stdout);
  return std::mt19937_64(seed);
}

// How many random graphs a property test draws: fewer under a sanitizer.
constexpr int property_graphs(int plain, int sanitized) {
#if defined(__SANITIZE_THREAD__) || defined(__SANITIZE_ADDRESS__)
  (void)plain;
  return sanitized;
#else
  (void)sanitized;
  return plain;
#endif
}

// A stand-in for an async node: try_next() answers "not yet" about one call
// in four (drawn from its seed) before asking upstream's try_next();
// next() passes straight through. It takes no id: a graph with stutters
// draws what the same graph without them draws.
template <class T>
class Stutter final : public nodes::MeteredNode<T> {
 public:
  Stutter(NodePtr<T> upstream, uint64_t seed) : upstream_(std::move(upstream)), rng_(seed) {}
  using Node<T>::reset;
  void reset(const PassContext& pass, conveyor::detail::ResetWalk& walk) override {
    upstream_->reset(pass, walk);
    this->start_metering(pass, 0);
  }
  Poll try_next(std::optional<T>& out) override {
    if (rng_() % 4 == 0) return Poll::pending;
    return this->counted(upstream_->try_next(out));
  }
  std::string name() const override { return "stutter"; }
  uint64_t skip(uint64_t count, bool clean) override { return upstream_->skip(count, clean); }
  void save_extras(State& nodes, bool in_pass) const override { upstream_->save_extras(nodes, in_pass); }

 private:
  std::optional<T> produce() override { return this->meter_.wait([this] { return upstream_->next(); }); }
  void collect_upstream_metrics(std::vector<NodeMetrics>& out) const override { upstream_->collect_metrics(out); }

  NodePtr<T> upstream_;
  std::mt19937_64 rng_;
};

template <class T>
Pipeline<T> stutter(Pipeline<T>&& upstream, uint64_t seed) {
  return Pipeline<T>(std::make_unique<Stutter<T>>(std::move(upstream).release(), seed));
}

// A stand-in for an I/O engine's completion thread: work handed to later()
// runs on one background thread, in the order given, after whatever is
// queued before it.
class LateCompleter {
 public:
  static LateCompleter& instance() {
    static LateCompleter completer;
    return completer;
  }
  void later(std::function<void()> work) {
    {
      std::lock_guard lock(mutex_);
      queue_.push_back(std::move(work));
    }
    wake_.notify_one();
  }
  ~LateCompleter() {
    {
      std::lock_guard lock(mutex_);
      stopping_ = true;
    }
    wake_.notify_one();
    thread_.join();
  }

 private:
  LateCompleter() : thread_([this] { run(); }) {}
  void run() {
    std::unique_lock lock(mutex_);
    while (true) {
      wake_.wait(lock, [this] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) return;
      std::function<void()> work = std::move(queue_.front());
      queue_.pop_front();
      lock.unlock();
      work();
      lock.lock();
    }
  }
  std::mutex mutex_;
  std::condition_variable wake_;
  std::deque<std::function<void()>> queue_;
  bool stopping_ = false;
  std::thread thread_;  // last: starts once the rest is built
};

// A pipeline drawn from `rng`: a range, then a few stages; each stage's
// parallel form (workers from `parallel`, 0 for none) yields what its serial
// form yields. Some stages fail on some items (skipped, or raised in their
// place); some spin a random while; some draw from the item's generator.
// A map handing items out as they finish (in_order = false) is followed
// only by stages that treat items one by one; `ordered` is then false and
// the runs are compared as multisets.
// Some stages merge in a second random pipeline (mux, weighted_mux, zip,
// and join, whose order is timing's: `ordered` false), drawn in order and at
// most two levels deep; a fork's two consumers are zipped back together; a
// repeat runs what is upstream twice; an async_map completes some items at
// once and the rest later on another thread (LateCompleter). A cache sits only where its
// pass is always read to the end (not in a merged pipeline, nothing after
// it that stops early): a parallel node after it may read ahead to the end
// of a pass the consumer left, completing the cache in one run and not the
// other (conveyor/nodes/repeat.h). With `stutter` (a seed, 0 for none), a
// Stutter follows the source and every stage: the drawn graph is the same.
inline Pipeline<int64_t> random_pipeline(std::mt19937_64 rng, bool parallel, bool& ordered, int depth = 0,
                                  bool allow_unordered = true, uint64_t stutter = 0) {
  std::uniform_int_distribution<int> pick(0, 18);
  ordered = true;
  bool cached = false;  // a cache upstream: nothing may cut its pass short
  const int64_t n = std::uniform_int_distribution<int64_t>(0, 300)(rng);
  Pipeline<int64_t> p = nodes::from_range(0, n);
  uint64_t stutters = 0;
  auto maybe_stutter = [&] {
    if (stutter != 0) p = conveyor::testing::stutter(std::move(p), stutter * 1000 + ++stutters);
  };
  maybe_stutter();
  const int stages = std::uniform_int_distribution<int>(1, 5)(rng);
  for (int s = 0; s < stages; ++s, maybe_stutter()) {
    int kind = pick(rng);
    // After items leave out of order, a stage's positions differ from the
    // serial run's: no stage whose output depends on them (shuffle, batch,
    // the item's generator, an error's position).
    if (!ordered && (kind == 2 || kind == 4 || kind == 6 || kind == 7 || kind >= 10)) kind = 1;
    if ((kind == 8 || kind == 15) && !allow_unordered) kind = 5;
    if (((kind >= 11 && kind <= 13) || kind == 15 || kind == 16) && depth >= 2) kind = 9;
    if (kind == 14 && depth > 0) kind = 9;
    if (cached && (kind == 10 || kind == 13)) kind = 5;
    const int64_t k = std::uniform_int_distribution<int64_t>(2, 9)(rng);
    const int drawn_workers = std::uniform_int_distribution<int>(1, 4)(rng);  // drawn either way: same graph
    const int workers = parallel ? drawn_workers : 0;
    const uint64_t delay_seed = rng();
    auto work = [k, delay_seed](int64_t x) {
      // Random spin, seeded by the item: shakes out completion orders.
      const uint64_t h = (static_cast<uint64_t>(x) * 0x9e3779b97f4a7c15ULL) ^ delay_seed;
      conveyor::testing::spin_delay(h % 7 == 0 ? h % 20000 : 0);
      if (x % 37 == static_cast<int64_t>(k)) throw std::runtime_error("fails on " + std::to_string(x));
      return x * k % 1000003;
    };
    switch (kind) {
      case 0:
        p = std::move(p) | nodes::map(work, {.workers = workers, .on_error = conveyor::OnError::skip});
        break;
      case 1:
        p = std::move(p) | nodes::filter([k](int64_t x) { return x % k != 0; });
        break;
      case 2:
        p = std::move(p) | nodes::shuffle(static_cast<size_t>(k));
        break;
      case 3:
        if (parallel) p = std::move(p) | nodes::prefetch(static_cast<int>(k));
        break;
      case 4:
        p = std::move(p) | nodes::batch(static_cast<size_t>(k)) | nodes::map([](std::vector<int64_t>&& b) {
              int64_t sum = 0;
              for (int64_t x : b) sum += x;
              return sum;
            }, {.workers = workers});
        break;
      case 6:  // failures raised in their place: a NodeError, then the pass goes on
        p = std::move(p) | nodes::map(work, {.workers = workers});
        break;
      case 7:  // the item's own generator: the same draw on any thread
        p = std::move(p) | nodes::map([](int64_t x) {
              return x + static_cast<int64_t>(conveyor::uniform(conveyor::default_generator()) * 1000);
            }, {.workers = workers});
        break;
      case 8:  // as each finishes
        p = std::move(p) | nodes::map(work, {.workers = workers, .in_order = false,
                                             .on_error = conveyor::OnError::skip});
        ordered = false;  // in both runs: they draw the same stages
        break;
      case 9:
        p = std::move(p) | nodes::flat_map([k](int64_t x) { return std::vector<int64_t>(static_cast<size_t>(x % 3), x + k); });
        break;
      case 10:
        p = std::move(p) | nodes::take(static_cast<uint64_t>(k * 11));
        break;
      case 11:
      case 12:
      case 13: {
        bool other_ordered = true;
        Pipeline<int64_t> other =
            random_pipeline(std::mt19937_64(rng()), parallel, other_ordered, depth + 1, /*allow_unordered=*/false,
                            stutter == 0 ? 0 : stutter * 7 + static_cast<uint64_t>(s) + 1);
        if (kind == 11) {
          std::vector<Pipeline<int64_t>> sources;
          sources.push_back(std::move(p));
          sources.push_back(std::move(other));
          p = nodes::mux(std::move(sources));
        } else if (kind == 12) {
          std::vector<Pipeline<int64_t>> sources;
          sources.push_back(std::move(p));
          sources.push_back(std::move(other));
          p = nodes::weighted_mux(std::move(sources), {1.0, static_cast<double>(k)});
        } else {
          p = nodes::zip(std::move(p), std::move(other)) |
              nodes::map([](std::pair<int64_t, int64_t>&& pair) { return pair.first * 7 + pair.second; },
                         {.workers = workers});
        }
        break;
      }
      case 14:
        p = std::move(p) | nodes::cache();
        cached = true;
        break;
      case 15: {  // whichever is ready first: the order is timing's
        bool other_ordered = true;
        Pipeline<int64_t> other =
            random_pipeline(std::mt19937_64(rng()), parallel, other_ordered, depth + 1, /*allow_unordered=*/false,
                            stutter == 0 ? 0 : stutter * 7 + static_cast<uint64_t>(s) + 1);
        std::vector<Pipeline<int64_t>> sources;
        sources.push_back(std::move(p));
        sources.push_back(std::move(other));
        p = nodes::join(std::move(sources));
        ordered = false;
        break;
      }
      case 16: {  // two consumers of one upstream, zipped back together
        std::vector<Pipeline<int64_t>> consumers = nodes::fork(std::move(p), 2, 4096);
        if (parallel && k % 2 == 0) {  // each on a thread of its own
          consumers[0] = std::move(consumers[0]) | nodes::prefetch(static_cast<int>(k));
          consumers[1] = std::move(consumers[1]) | nodes::prefetch(static_cast<int>(k) + 1);
        }
        Pipeline<int64_t> shifted =
            std::move(consumers[1]) | nodes::map([k](int64_t x) { return x + k; }, {.workers = workers});
        p = nodes::zip(std::move(consumers[0]), std::move(shifted)) |
            nodes::map([](std::pair<int64_t, int64_t>&& pair) { return pair.first * 3 + pair.second; });
        break;
      }
      case 17:
        p = std::move(p) | nodes::repeat(2);
        break;
      case 18: {  // completed at once or later on another thread; failures through fail()
        const auto on_error = k % 2 == 0 ? conveyor::OnError::skip : conveyor::OnError::raise;
        p = std::move(p) | nodes::async_map<int64_t>(
                               [work, delay_seed](int64_t x, nodes::Completion<int64_t> done) {
                                 auto complete = [work, x](nodes::Completion<int64_t>& completion) {
                                   int64_t value = 0;
                                   try {
                                     value = work(x);
                                   } catch (...) {
                                     const std::exception_ptr error = std::current_exception();
                                     completion.fail(error);
                                     return;
                                   }
                                   completion(value);
                                 };
                                 if ((static_cast<uint64_t>(x) ^ delay_seed) % 3 == 0) {
                                   complete(done);
                                   return;
                                 }
                                 auto held = std::make_shared<nodes::Completion<int64_t>>(std::move(done));
                                 LateCompleter::instance().later([complete, held] { complete(*held); });
                               },
                               {.max_in_flight = static_cast<int>(k * 4), .on_error = on_error});
        break;
      }
      default:
        p = std::move(p) | nodes::map([k](int64_t x) { return x + k; }, {.workers = workers});
        break;
    }
  }
  return p;
}

// One pass's items and errors, in order. An error is its node's kind and
// the failed item's position: the serial map is "map", the parallel one
// "map(workers=N)".
// A failed item as an outcome: its node and position, and whether the
// message names the node. The message is read whole, as a consumer would,
// so a sanitizer sees every byte of the error the consumer was thrown.
inline std::string error_outcome(const conveyor::NodeError& e) {
  const std::string message = e.what();
  const bool named = message.find("'" + e.node() + "'") != std::string::npos;
  return "error in " + e.node().substr(0, e.node().find('(')) + " at " + std::to_string(e.position()) +
         (named ? "" : " (its message does not name the node: " + message + ")");
}

inline std::vector<std::string> outcomes(Pipeline<int64_t>& pipeline) {
  std::vector<std::string> out;
  auto pass = pipeline.pass();
  while (true) {
    try {
      std::optional<int64_t> item = pass.next();
      if (!item) break;
      out.push_back(std::to_string(*item));
    } catch (const conveyor::NodeError& e) {
      out.push_back(error_outcome(e));
    }
  }
  return out;
}

// The same, taken with try_next(): after a "not yet" the thread yields
// (to the workers of a parallel node, on a machine of few cores) and asks
// again. `pending` counts them.
inline std::vector<std::string> polled_outcomes(Pipeline<int64_t>& pipeline, uint64_t& pending) {
  std::vector<std::string> out;
  auto pass = pipeline.pass();
  while (true) {
    try {
      std::optional<int64_t> item;
      const Poll poll = pass.try_next(item);
      if (poll == Poll::pending) {
        ++pending;
        std::this_thread::yield();
        continue;
      }
      if (poll == Poll::end) break;
      out.push_back(std::to_string(*item));
    } catch (const conveyor::NodeError& e) {
      out.push_back(error_outcome(e));
    }
  }
  return out;
}

}  // namespace conveyor::testing
