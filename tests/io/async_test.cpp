// async_map (conveyor/nodes/async.h): order, windows, errors, metrics, the
// non-blocking contract, and a randomized stress test of completions from
// many threads racing resets and the node's destruction (label "async": run
// under TSan and ASan in CI).
//
// The stress test prints its seed; CONVEYOR_ASYNC_SEED=<seed> replays it.
#include <conveyor/nodes.h>
#include <conveyor/nodes/async.h>
#include <gtest/gtest.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <future>
#include <mutex>
#include <queue>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace {

namespace nodes = conveyor::nodes;
using conveyor::NodeError;
using conveyor::OnError;
using conveyor::Poll;
using nodes::Completion;

// Runs jobs on `threads` threads, each at its deadline (the stand-in for an
// I/O system completing requests). Jobs left at destruction run then, so
// completions may outlive the node that made them.
class Completer {
 public:
  explicit Completer(int threads) {
    for (int i = 0; i < threads; ++i) threads_.emplace_back([this] { loop(); });
  }
  ~Completer() {
    {
      std::lock_guard lock(mutex_);
      stopping_ = true;
    }
    wake_.notify_all();
    for (auto& thread : threads_) thread.join();
  }
  void at(std::chrono::steady_clock::time_point when, std::packaged_task<void()> job) {
    {
      std::lock_guard lock(mutex_);
      jobs_.push(Job{when, sequence_++, std::make_shared<std::packaged_task<void()>>(std::move(job))});
    }
    wake_.notify_one();
  }
  template <class F>
  void after(std::chrono::microseconds delay, F f) {
    at(std::chrono::steady_clock::now() + delay, std::packaged_task<void()>(std::move(f)));
  }

 private:
  struct Job {
    std::chrono::steady_clock::time_point when;
    uint64_t sequence;
    std::shared_ptr<std::packaged_task<void()>> task;
    bool operator>(const Job& other) const {
      return when != other.when ? when > other.when : sequence > other.sequence;
    }
  };
  void loop() {
    std::unique_lock lock(mutex_);
    while (true) {
      if (jobs_.empty()) {
        if (stopping_) return;
        wake_.wait(lock);
        continue;
      }
      if (!stopping_ && jobs_.top().when > std::chrono::steady_clock::now()) {
        const auto when = jobs_.top().when;  // a copy: a push while we wait may move the heap
        wake_.wait_until(lock, when);        // the job's latency: the workload, not a race fix
        continue;
      }
      Job job = jobs_.top();
      jobs_.pop();
      lock.unlock();
      (*job.task)();
      job.task.reset();  // an uncalled completion inside is dropped here, on this thread
      lock.lock();
    }
  }
  std::mutex mutex_;
  std::condition_variable wake_;
  std::priority_queue<Job, std::vector<Job>, std::greater<>> jobs_;
  uint64_t sequence_ = 0;
  bool stopping_ = false;
  std::vector<std::thread> threads_;
};

// An error for Completion::fail, made in a statement of its own: the
// temporary exception is gone before the completion publishes the copy
// (std::runtime_error's message is a reference-counted string shared by the
// two; destroying the temporary after fail() would race, in ThreadSanitizer's
// eyes, with the consumer reading what(): libstdc++'s count is invisible to it).
std::exception_ptr error_ptr(const std::string& what) { return std::make_exception_ptr(std::runtime_error(what)); }

// Keeps the completions fn is handed, for the test to call in any order.
struct Held {
  std::vector<Completion<int64_t>> completions;
  std::vector<int64_t> inputs;
};

auto hold(Held& held) {
  return [&held](int64_t i, Completion<int64_t> done) {
    held.inputs.push_back(i);
    held.completions.push_back(std::move(done));
  };
}

std::vector<int64_t> drain(conveyor::Pipeline<int64_t>& pipeline) {
  std::vector<int64_t> out;
  for (int64_t v : pipeline.pass()) out.push_back(v);
  return out;
}

TEST(AsyncMap, HandsOutInInputOrderWhateverTheCompletionOrder) {
  Completer completer(4);
  std::mt19937 rng(7);
  auto pipeline = nodes::from_range(0, 500) | nodes::async_map<int64_t>(
                                                  [&](int64_t i, Completion<int64_t> done) {
                                                    const auto delay = std::chrono::microseconds(rng() % 2000);
                                                    completer.after(delay, [i, done = std::move(done)]() mutable {
                                                      done(i * 10);
                                                    });
                                                  },
                                                  {.max_in_flight = 64});
  std::vector<int64_t> expected;
  for (int64_t i = 0; i < 500; ++i) expected.push_back(i * 10);
  EXPECT_EQ(drain(pipeline), expected);
  EXPECT_EQ(drain(pipeline), expected);  // a second pass
}

TEST(AsyncMap, OutOfOrderHandsOutAsCompleted) {
  Held held;
  auto pipeline = nodes::from_range(0, 4) | nodes::async_map<int64_t>(hold(held), {.max_in_flight = 4, .in_order = false});
  auto pass = pipeline.pass();
  std::optional<int64_t> out;
  ASSERT_EQ(pass.try_next(out), Poll::pending);  // all four started, none done
  ASSERT_EQ(held.completions.size(), 4u);
  EXPECT_TRUE(held.completions[2](102));
  EXPECT_TRUE(held.completions[0](100));
  ASSERT_EQ(pass.try_next(out), Poll::ready);
  EXPECT_EQ(*out, 102);
  ASSERT_EQ(pass.try_next(out), Poll::ready);
  EXPECT_EQ(*out, 100);
  EXPECT_EQ(pass.try_next(out), Poll::pending);
  EXPECT_TRUE(held.completions[3](103));
  EXPECT_TRUE(held.completions[1](101));
  EXPECT_EQ(pass.next(), 103);
  EXPECT_EQ(pass.next(), 101);
  EXPECT_EQ(pass.next(), std::nullopt);
  EXPECT_EQ(pass.try_next(out), Poll::end);
}

TEST(AsyncMap, TryNextIsPendingUntilTheHeadCompletesInOrder) {
  Held held;
  auto pipeline = nodes::from_range(0, 3) | nodes::async_map<int64_t>(hold(held), {.max_in_flight = 8});
  auto pass = pipeline.pass();
  std::optional<int64_t> out;
  EXPECT_EQ(pass.try_next(out), Poll::pending);
  ASSERT_EQ(held.completions.size(), 3u);
  held.completions[1](11);
  held.completions[2](12);
  EXPECT_EQ(pass.try_next(out), Poll::pending);  // item 0 holds its place
  held.completions[0](10);
  for (int64_t want : {10, 11, 12}) {
    ASSERT_EQ(pass.try_next(out), Poll::ready);
    EXPECT_EQ(*out, want);
  }
  EXPECT_EQ(pass.try_next(out), Poll::end);
}

TEST(AsyncMap, KeepsExactlyTheWindowInFlight) {
  Held held;
  auto pipeline = nodes::from_range(0, 100) | nodes::async_map<int64_t>(hold(held), {.max_in_flight = 16});
  auto pass = pipeline.pass();
  std::optional<int64_t> out;
  EXPECT_EQ(pass.try_next(out), Poll::pending);
  EXPECT_EQ(held.completions.size(), 16u);  // the window, not one more
  for (size_t taken = 0; taken < 100; ++taken) {
    held.completions[taken](static_cast<int64_t>(taken));
    ASSERT_EQ(pass.try_next(out), Poll::ready);
    EXPECT_EQ(*out, static_cast<int64_t>(taken));
    // The window refills before each take: `taken` handed out before this
    // call, 16 in flight when it took one, never more.
    EXPECT_EQ(held.completions.size(), std::min<size_t>(100, taken + 16));
  }
  EXPECT_EQ(pass.try_next(out), Poll::end);
}

TEST(AsyncMap, NextSleepsInTheKernelWhileWaiting) {
  // A blocked next() must park (futex), not spin: its thread's state in
  // /proc reaches 'S' (a spinning or yielding thread stays 'R').
  Held held;
  std::atomic<bool> started{false};  // fn ran (on the consumer's thread): `held` is the main thread's now
  auto pipeline = nodes::from_range(0, 1) | nodes::async_map<int64_t>(
                                                [&](int64_t i, Completion<int64_t> done) {
                                                  hold(held)(i, std::move(done));
                                                  started = true;
                                                },
                                                {.max_in_flight = 4});
  auto pass = pipeline.pass();
  std::atomic<pid_t> tid{0};
  std::optional<int64_t> got;
  std::thread consumer([&] {
    tid = static_cast<pid_t>(::syscall(SYS_gettid));
    got = pass.next();
  });
  while (tid.load() == 0) std::this_thread::yield();
  const std::string path = "/proc/self/task/" + std::to_string(tid.load()) + "/stat";
  char state = '?';
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  while (std::chrono::steady_clock::now() < deadline) {
    std::ifstream stat(path);
    std::string text((std::istreambuf_iterator<char>(stat)), std::istreambuf_iterator<char>());
    const size_t paren = text.rfind(')');
    if (paren != std::string::npos && paren + 2 < text.size()) state = text[paren + 2];
    if (state == 'S' && started) break;
    std::this_thread::yield();
  }
  EXPECT_EQ(state, 'S') << "the consumer blocked in next() is not sleeping";
  ASSERT_TRUE(started);
  ASSERT_EQ(held.completions.size(), 1u);
  held.completions[0](42);
  consumer.join();
  EXPECT_EQ(got, 42);
}

TEST(AsyncMap, ErrorsKeepTheirPlaceAndNameNodeAndPosition) {
  Completer completer(2);
  auto pipeline =
      nodes::from_range(0, 6) |
      nodes::async_map<int64_t>(
          [&](int64_t i, Completion<int64_t> done) {
            if (i == 1) throw std::runtime_error("thrown by fn");
            if (i == 2) return;  // dropped: destroyed without a value
            completer.after(std::chrono::microseconds(100 * (6 - i)), [i, done = std::move(done)]() mutable {
              if (i == 4) {
                done.fail(error_ptr("failed later"));
              } else {
                done(i);
              }
            });
          },
          {.max_in_flight = 8});
  auto pass = pipeline.pass();
  EXPECT_EQ(pass.next(), 0);
  auto expect_error = [&](uint64_t position, const std::string& text) {
    try {
      pass.next();
      ADD_FAILURE() << "no error at item " << position;
    } catch (const NodeError& e) {
      EXPECT_EQ(e.position(), position);
      EXPECT_EQ(e.node(), "async_map(max_in_flight=8)");
      EXPECT_NE(std::string(e.what()).find(text), std::string::npos) << e.what();
      EXPECT_TRUE(e.original());
    }
  };
  expect_error(1, "thrown by fn");
  expect_error(2, "destroyed without being called");
  EXPECT_EQ(pass.next(), 3);
  expect_error(4, "failed later");
  EXPECT_EQ(pass.next(), 5);
  EXPECT_EQ(pass.next(), std::nullopt);
}

TEST(AsyncMap, FnThrowingAfterDeliveringKeepsTheDelivery) {
  auto pipeline = nodes::from_range(0, 2) | nodes::async_map<int64_t>([](int64_t i, Completion<int64_t> done) {
                    done(i + 100);
                    throw std::runtime_error("late");
                  });
  EXPECT_EQ(drain(pipeline), (std::vector<int64_t>{100, 101}));
}

TEST(AsyncMap, SkipDropsAndCountsOwnErrorsInBothOrders) {
  for (bool in_order : {true, false}) {
    Completer completer(3);
    auto pipeline = nodes::from_range(0, 200) |
                    nodes::async_map<int64_t>(
                        [&](int64_t i, Completion<int64_t> done) {
                          if (i % 10 == 3) throw std::runtime_error("bad");
                          completer.after(std::chrono::microseconds(i % 7 * 50), [i, done = std::move(done)]() mutable {
                            if (i % 10 == 7) {
                              done.fail(error_ptr("bad later"));
                            } else {
                              done(i);
                            }
                          });
                        },
                        {.max_in_flight = 32, .in_order = in_order, .on_error = OnError::skip});
    std::vector<int64_t> got = drain(pipeline);
    std::vector<int64_t> expected;
    for (int64_t i = 0; i < 200; ++i) {
      if (i % 10 != 3 && i % 10 != 7) expected.push_back(i);
    }
    if (!in_order) std::sort(got.begin(), got.end());
    EXPECT_EQ(got, expected) << "in_order=" << in_order;
    const auto metrics = pipeline.metrics();
    EXPECT_EQ(metrics.back().skipped, 40u);
    EXPECT_EQ(metrics.back().items_in, 200u);
    EXPECT_EQ(metrics.back().items_out, 160u);
    EXPECT_EQ(metrics.back().window, 32u);
    EXPECT_GT(metrics.back().mean_in_flight, 0.0);
  }
}

TEST(AsyncMap, UpstreamErrorsKeepTheirPlaceAndAreNotSkipped) {
  auto pipeline = nodes::from_range(0, 5) | nodes::map([](int64_t i) -> int64_t {
                    if (i == 2) throw std::runtime_error("upstream");
                    return i;
                  }) |
                  nodes::async_map<int64_t>([](int64_t i, Completion<int64_t> done) { done(i); },
                                            {.on_error = OnError::skip});
  auto pass = pipeline.pass();
  EXPECT_EQ(pass.next(), 0);
  EXPECT_EQ(pass.next(), 1);
  try {
    pass.next();
    ADD_FAILURE() << "the upstream error was lost";
  } catch (const NodeError& e) {
    EXPECT_EQ(e.node(), "map");  // named where it happened
    EXPECT_EQ(e.position(), 2u);
  }
  EXPECT_EQ(pass.next(), 3);
  EXPECT_EQ(pass.next(), 4);
  EXPECT_EQ(pass.next(), std::nullopt);
}

TEST(AsyncMap, OptionsOutOfRangeNameTheValue) {
  auto fn = [](int64_t, Completion<int64_t>) {};
  try {
    nodes::async_map<int64_t>(fn, {.max_in_flight = 0});
    ADD_FAILURE();
  } catch (const conveyor::ValueError& e) {
    EXPECT_STREQ(e.what(), "async_map: max_in_flight should be in [1, 1048576], but got 0");
  }
  EXPECT_THROW(nodes::async_map<int64_t>(fn, {.max_in_flight = (1 << 20) + 1}), conveyor::ValueError);
}

TEST(AsyncMap, ACompletionDeliversOnce) {
  Held held;
  auto pipeline = nodes::from_range(0, 1) | nodes::async_map<int64_t>(hold(held));
  auto pass = pipeline.pass();
  std::optional<int64_t> out;
  EXPECT_EQ(pass.try_next(out), Poll::pending);
  Completion<int64_t>& done = held.completions.at(0);
  EXPECT_THROW(done.fail(nullptr), std::invalid_argument);
  EXPECT_TRUE(done);
  EXPECT_TRUE(done(1));
  EXPECT_FALSE(done);
  EXPECT_THROW(done(2), std::logic_error);
  EXPECT_EQ(pass.next(), 1);
}

TEST(AsyncMap, CompletionsAfterResetOrDestructionAreIgnoredSafely) {
  Held held;
  {
    auto pipeline = nodes::from_range(0, 10) | nodes::async_map<int64_t>(hold(held), {.max_in_flight = 4});
    {
      auto pass = pipeline.pass();
      std::optional<int64_t> out;
      EXPECT_EQ(pass.try_next(out), Poll::pending);
    }
    ASSERT_EQ(held.completions.size(), 4u);
    held.completions[0](0);
    // A new pass abandons the old window: its completions land there.
    auto pass = pipeline.pass();
    std::optional<int64_t> out;
    EXPECT_EQ(pass.try_next(out), Poll::pending);
    ASSERT_EQ(held.completions.size(), 8u);
    EXPECT_FALSE(held.completions[1](1));
    EXPECT_FALSE(held.completions[2].fail(std::make_exception_ptr(std::runtime_error("late"))));
    for (size_t i = 4; i < 8; ++i) EXPECT_TRUE(held.completions[i](static_cast<int64_t>(i - 4)));
    EXPECT_EQ(pass.next(), 0);
    EXPECT_EQ(pass.next(), 1);
    // The node goes with items 2 and 3 taken, 4.. in flight.
  }
  ASSERT_EQ(held.completions.size(), 9u);  // 4 + the window of 4 + the one admitted when item 0 left
  EXPECT_FALSE(held.completions[8](7));
  held.completions.clear();  // the uncalled completion of the old pass drops into its freed-by-us window
}

TEST(AsyncMap, FnDrawsFromTheItemsGenerator) {
  auto run = [](bool in_order) {
    auto pipeline = nodes::from_range(0, 50) | nodes::async_map<int64_t>(
                                                   [](int64_t i, Completion<int64_t> done) {
                                                     done(static_cast<int64_t>(conveyor::default_generator().random64() % 1000) * 100 + i);
                                                   },
                                                   {.max_in_flight = 7, .in_order = in_order});
    pipeline.seed(3);
    std::vector<int64_t> v = drain(pipeline);
    std::sort(v.begin(), v.end(), [](int64_t a, int64_t b) { return a % 100 < b % 100; });
    return v;
  };
  EXPECT_EQ(run(true), run(false));
}

// ---- the stress test ---------------------------------------------------------

uint64_t stress_seed() {
  if (const char* text = std::getenv("CONVEYOR_ASYNC_SEED")) return std::strtoull(text, nullptr, 10);
  return std::random_device{}() * uint64_t{0x100000001} ^ static_cast<uint64_t>(
                                                              std::chrono::steady_clock::now().time_since_epoch().count());
}

// What happens to item i in round `round` of the stress test: a pure
// function of (seed, round, i), so the expected output is computed apart
// from the run.
enum class Fate { value, fail_later, throw_now, drop, value_now };
struct Plan {
  Fate fate;
  int delay_us;
  int thread_hint;
};
Plan plan_for(uint64_t seed, uint64_t round, int64_t i) {
  std::mt19937_64 rng(seed ^ (round * 0x9E3779B97F4A7C15ULL) ^ (static_cast<uint64_t>(i) * 0xC2B2AE3D27D4EB4FULL));
  const uint64_t roll = rng() % 100;
  Fate fate = roll < 80 ? Fate::value : roll < 86 ? Fate::fail_later : roll < 90 ? Fate::throw_now
                                                  : roll < 94 ? Fate::drop : Fate::value_now;
  return {fate, static_cast<int>(rng() % 300), static_cast<int>(rng() % 4)};
}

TEST(AsyncMapStress, RandomCompletionsResetsAndDestructionAgainstTheModel) {
  const uint64_t seed = stress_seed();
  std::printf("async_map stress seed %llu (replay: CONVEYOR_ASYNC_SEED=%llu)\n", static_cast<unsigned long long>(seed),
              static_cast<unsigned long long>(seed));
  std::fflush(stdout);
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  const int rounds = 40;
  for (int round = 0; round < rounds; ++round) {
    SCOPED_TRACE("round " + std::to_string(round));
    const int64_t n = static_cast<int64_t>(rng() % 400);
    const int window = 1 + static_cast<int>(rng() % 64);
    const bool in_order = rng() % 3 != 0;
    const bool skip = rng() % 4 == 0;
    const int threads = 1 + static_cast<int>(rng() % 4);
    const int64_t cut = rng() % 3 == 0 ? static_cast<int64_t>(rng() % (n + 1)) : -1;  // reset after this many
    const bool destroy_early = rng() % 4 == 0;
    const bool poll = rng() % 2 == 0;  // try_next instead of next
    auto completer = std::make_unique<Completer>(threads);
    std::atomic<int64_t> late_rejections{0};
    auto fn = [&, round](int64_t i, Completion<int64_t> done) {
      const Plan plan = plan_for(seed, static_cast<uint64_t>(round), i);
      switch (plan.fate) {
        case Fate::throw_now:
          throw std::runtime_error("throw " + std::to_string(i));
        case Fate::drop:
          completer->after(std::chrono::microseconds(plan.delay_us), [done = std::move(done)]() mutable {});
          return;
        case Fate::value_now:
          done(i * 3);
          return;
        case Fate::fail_later:
          completer->after(std::chrono::microseconds(plan.delay_us), [i, done = std::move(done), &late_rejections]() mutable {
            if (!done.fail(error_ptr("fail " + std::to_string(i)))) ++late_rejections;
          });
          return;
        case Fate::value:
          completer->after(std::chrono::microseconds(plan.delay_us), [i, done = std::move(done), &late_rejections]() mutable {
            if (!done(i * 3)) ++late_rejections;
          });
          return;
      }
    };
    auto pipeline = std::make_unique<conveyor::Pipeline<int64_t>>(
        nodes::from_range(0, n) |
        nodes::async_map<int64_t>(fn, {.max_in_flight = window, .in_order = in_order,
                                       .on_error = skip ? OnError::skip : OnError::raise}));
    // The model: what each item gives, in input order.
    struct Want {
      int64_t position;
      bool error;
      int64_t value;
    };
    std::vector<Want> model;
    for (int64_t i = 0; i < n; ++i) {
      const Fate fate = plan_for(seed, static_cast<uint64_t>(round), i).fate;
      const bool error = fate == Fate::fail_later || fate == Fate::throw_now || fate == Fate::drop;
      if (error && skip) continue;
      model.push_back({i, error, i * 3});
    }
    auto run_pass = [&](int64_t limit, std::vector<Want>& got) {
      auto pass = pipeline->pass();
      while (limit < 0 || static_cast<int64_t>(got.size()) < limit) {
        try {
          std::optional<int64_t> item;
          if (poll) {
            Poll p;
            while ((p = pass.try_next(item)) == Poll::pending) {
              std::this_thread::yield();  // the test's own event loop: nothing else to do
            }
            if (p == Poll::end) break;
          } else {
            item = pass.next();
            if (!item) break;
          }
          got.push_back({*item / 3, false, *item});
        } catch (const NodeError& e) {
          EXPECT_EQ(e.node().rfind("async_map(", 0), 0u) << e.node();
          got.push_back({static_cast<int64_t>(e.position()), true, 0});
        }
      }
    };
    auto check = [&](std::vector<Want> got, size_t expect_count) {
      ASSERT_EQ(got.size(), expect_count);
      std::vector<Want> want(model.begin(), model.begin() + static_cast<std::ptrdiff_t>(expect_count));
      if (!in_order) {
        auto by_position = [](const Want& a, const Want& b) { return a.position < b.position; };
        std::sort(got.begin(), got.end(), by_position);
        if (expect_count < model.size()) return;  // out of order, a cut pass's items are any subset
      }
      for (size_t k = 0; k < expect_count; ++k) {
        ASSERT_EQ(got[k].position, want[k].position) << "item " << k;
        ASSERT_EQ(got[k].error, want[k].error) << "item " << k;
        if (!want[k].error) {
          ASSERT_EQ(got[k].value, want[k].value) << "item " << k;
        }
      }
    };
    if (cut >= 0) {
      std::vector<Want> got;
      run_pass(std::min<int64_t>(cut, static_cast<int64_t>(model.size())), got);
      check(got, std::min<size_t>(static_cast<size_t>(cut), model.size()));
    }
    if (destroy_early) {
      // Start a pass, take a few, and destroy the node with the rest in flight.
      std::vector<Want> got;
      run_pass(std::min<int64_t>(3, static_cast<int64_t>(model.size())), got);
      pipeline.reset();
      completer.reset();  // runs every pending completion now, after the node is gone
      continue;
    }
    std::vector<Want> got;
    run_pass(-1, got);
    check(got, model.size());
    completer.reset();
    pipeline.reset();
    if (cut < 0) {
      EXPECT_EQ(late_rejections.load(), 0);  // nothing abandoned: every delivery was wanted
    }
  }
}

// The wake-up handshake (AsyncWindow::park / deliver): one thread
// delivers the window's items in a shuffled order, each after a random busy
// wait of 0-60 us (around the node's 20 us spin, so deliveries land before,
// during and after it parks). In order, only the head's delivery may wake
// the node; out of order, any. A lost wake-up hangs next(): the watchdog
// fails the test, naming the seed.
TEST(AsyncMapStress, AParkedNodeIsWokenByTheDeliveryItWaitsFor) {
  const uint64_t seed = stress_seed();
  std::printf("async_map park seed %llu (replay: CONVEYOR_ASYNC_SEED=%llu)\n", static_cast<unsigned long long>(seed),
              static_cast<unsigned long long>(seed));
  std::fflush(stdout);
  for (const bool in_order : {true, false}) {
    SCOPED_TRACE(std::string("in_order ") + (in_order ? "true" : "false") + ", seed " + std::to_string(seed));
    std::mutex mutex;
    std::condition_variable started_more;
    std::vector<std::pair<int64_t, Completion<int64_t>>> started;
    bool stopping = false;
    std::thread deliverer([&, rng = std::mt19937_64(seed ^ in_order)]() mutable {
      std::vector<std::pair<int64_t, Completion<int64_t>>> mine;
      std::unique_lock lock(mutex);
      while (true) {
        started_more.wait(lock, [&] { return stopping || !started.empty(); });
        if (started.empty()) return;
        mine.swap(started);
        lock.unlock();
        std::shuffle(mine.begin(), mine.end(), rng);
        for (auto& [i, done] : mine) {
          const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(rng() % 61);
          while (std::chrono::steady_clock::now() < until) {
          }  // busy: a delivery at a chosen point of the node's spin or park
          done(i * 7);
        }
        mine.clear();
        lock.lock();
      }
    });
    const int64_t n = 3000;
    const int window = 1 + static_cast<int>(seed % 8);
    auto pipeline = nodes::from_range(0, n) |
                    nodes::async_map<int64_t>(
                        [&](int64_t i, Completion<int64_t> done) {
                          {
                            std::lock_guard lock(mutex);
                            started.emplace_back(i, std::move(done));
                          }
                          started_more.notify_one();
                        },
                        {.max_in_flight = window, .in_order = in_order});
    auto consume = std::async(std::launch::async, [&] {
      std::vector<int64_t> got;
      for (int64_t v : pipeline.pass()) got.push_back(v);
      return got;
    });
    if (consume.wait_for(std::chrono::seconds(120)) != std::future_status::ready) {
      std::fprintf(stderr, "async_map park: next() still waiting after 120 s: a lost wake-up (seed %llu)\n",
                   static_cast<unsigned long long>(seed));
      std::abort();  // the consumer cannot be joined
    }
    std::vector<int64_t> got = consume.get();
    {
      std::lock_guard lock(mutex);
      stopping = true;
    }
    started_more.notify_one();
    deliverer.join();
    if (!in_order) std::sort(got.begin(), got.end());
    ASSERT_EQ(got.size(), static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) ASSERT_EQ(got[static_cast<size_t>(i)], i * 7) << "item " << i;
  }
}

}  // namespace

namespace {

// How many requests are in flight does not change what an async_map hands
// out: a state loads whatever max_in_flight is. Its order and its error
// policy do: a state of one is refused by the other, before a resumed pass
// skips what the saved pass handed out by another rule.
TEST(AsyncMapResume, RequestsInFlightAreNotInTheFingerprintOrderAndErrorPolicyAre) {
  const auto make = [](nodes::AsyncOptions options) {
    return nodes::from_range(0, 10) |
           nodes::async_map<int64_t>([](int64_t i, Completion<int64_t> done) { done(i); }, options);
  };
  auto saved = make({.max_in_flight = 4});
  const conveyor::State state = saved.state();
  auto wider = make({.max_in_flight = 1024});
  EXPECT_NO_THROW(wider.load_state(state));
  auto out_of_order = make({.max_in_flight = 4, .in_order = false});
  EXPECT_THROW(out_of_order.load_state(state), conveyor::StateError);
  auto skipping = make({.max_in_flight = 4, .on_error = conveyor::OnError::skip});
  EXPECT_THROW(skipping.load_state(state), conveyor::StateError);
  EXPECT_EQ(skipping.metrics().back().name, "async_map(max_in_flight=4, on_error=skip)");
}

// A pass of an async_map that hands items out as they complete, stopped,
// saved and resumed in a new pipeline: what the two passes hand out together
// is each item once, alone and behind a filter (which replays by pulling:
// the resumed map hands the saved order out again).
TEST(AsyncMapResume, OutOfOrderResumesEachItemOnceAloneAndBehindAFilter) {
  Completer completer(3);
  for (const bool filtered : {false, true}) {
    auto make = [&completer, filtered] {
      auto p = nodes::from_range(0, 300) |
               nodes::async_map<int64_t>(
                   [&completer](int64_t i, Completion<int64_t> done) {
                     const auto delay = std::chrono::microseconds((static_cast<uint64_t>(i) * 2654435761u) % 1500);
                     completer.after(delay, [i, done = std::move(done)]() mutable { done(i * 3); });
                   },
                   {.max_in_flight = 32, .in_order = false});
      if (filtered) p = std::move(p) | nodes::filter([](int64_t v) { return v % 2 == 0; });
      return p;
    };
    std::vector<int64_t> expected;
    for (int64_t i = 0; i < 300; ++i) {
      if (!filtered || (i * 3) % 2 == 0) expected.push_back(i * 3);
    }
    for (int trial = 0; trial < 8; ++trial) {
      std::vector<int64_t> got;
      std::string saved;
      {
        auto pipeline = make();
        auto pass = pipeline.pass();
        for (int k = 0; k < 5 + trial * 15; ++k) got.push_back(*pass.next());
        saved = pipeline.state().to_json();
      }
      auto pipeline = make();
      pipeline.load_state(conveyor::State::from_json(saved));
      auto pass = pipeline.pass();
      while (std::optional<int64_t> v = pass.next()) got.push_back(*v);
      std::sort(got.begin(), got.end());
      ASSERT_EQ(got, expected) << "trial " << trial << (filtered ? ", behind a filter" : "");
    }
  }
}

// A resumed out-of-order pass behind a filter replays the saved order,
// failures included. Before, a replayed item that failed left the replay
// marked as started: the next call waited for an item never started, and
// the resumed pass() (the filter's skip pulls) hung for ever. Resumed after
// every output, next() and try_next() hand out the rest of the saved pass.
TEST(AsyncMapResume, AFailedItemInAnOutOfOrderReplayBehindAFilterIsHandedOutAndTheReplayGoesOn) {
  auto make = [] {
    return nodes::from_range(0, 6) |
           nodes::async_map<int64_t>(
               [](int64_t i, Completion<int64_t> done) {
                 if (i == 1) throw std::runtime_error("item 1 fails");
                 done(i);
               },
               {.max_in_flight = 2, .in_order = false}) |
           nodes::filter([](int64_t) { return true; });
  };
  const auto outcome = [](auto& pass, bool polling, std::vector<std::string>& out) {
    try {
      std::optional<int64_t> item;
      if (polling) {
        Poll poll;
        while ((poll = pass.try_next(item)) == Poll::pending) {
        }
        if (poll == Poll::end) return false;
      } else {
        item = pass.next();
        if (!item) return false;
      }
      out.push_back(std::to_string(*item));
    } catch (const NodeError& e) {
      out.push_back("error at " + std::to_string(e.position()));
    }
    return true;
  };
  std::vector<std::string> reference;
  {
    auto pipeline = make();
    auto pass = pipeline.pass();
    while (outcome(pass, false, reference)) {
    }
  }
  ASSERT_EQ(reference, (std::vector<std::string>{"0", "error at 1", "2", "3", "4", "5"}));
  for (const bool polling : {false, true}) {
    for (size_t stop = 0; stop <= reference.size(); ++stop) {
      std::vector<std::string> got;
      std::string saved;
      {
        auto pipeline = make();
        auto pass = pipeline.pass();
        for (size_t k = 0; k < stop; ++k) ASSERT_TRUE(outcome(pass, polling, got));
        saved = pipeline.state().to_json();
      }
      auto pipeline = make();
      pipeline.load_state(conveyor::State::from_json(saved));
      auto pass = pipeline.pass();
      while (outcome(pass, polling, got)) {
      }
      EXPECT_EQ(got, reference) << "stopped after " << stop << (polling ? ", try_next()" : ", next()");
    }
  }
}

// A dataset whose get is asynchronous, read in a sampler's order: the
// sampler's pass as a node (from_sampler), then async_map. In input order it
// gives what from_map_dataset gives with a synchronous get through the same
// sampler; stopped, saved and resumed in a new pipeline with the process
// generator reseeded (a new process), it hands out the rest of the same
// permutation.
TEST(AsyncMapResume, AShuffledAsyncDatasetReadsAndResumesInTheSamplersOrder) {
  constexpr size_t kSize = 200;
  struct Store {  // get_async(i, done): the value later, on another thread
    Completer* completer;
    void get_async(size_t i, Completion<int64_t> done) const {
      const auto delay = std::chrono::microseconds((i * 2654435761u) % 700);
      completer->after(delay, [i, done = std::move(done)]() mutable { done(static_cast<int64_t>(i) * 7); });
    }
  };
  struct SyncStore {
    int64_t get(size_t i) const { return static_cast<int64_t>(i) * 7; }
    size_t size() const { return kSize; }
  };
  Completer completer(3);
  const Store store{&completer};
  auto sampler = std::make_shared<conveyor::RandomSampler>(kSize);  // draws from the process generator
  auto make = [&] {
    return nodes::from_sampler(sampler) |
           nodes::async_map<int64_t>([&store](size_t i, Completion<int64_t> done) { store.get_async(i, std::move(done)); },
                                     {.max_in_flight = 48});
  };
  conveyor::manual_seed(17);
  auto synchronous = nodes::from_map_dataset(std::make_shared<SyncStore>(), sampler);
  const std::vector<int64_t> expected = drain(synchronous);
  ASSERT_EQ(expected.size(), kSize);
  conveyor::manual_seed(17);
  auto whole = make();
  ASSERT_EQ(drain(whole), expected);

  for (const size_t stop : {size_t{1}, size_t{37}, size_t{150}}) {
    std::vector<int64_t> got;
    std::string saved;
    conveyor::manual_seed(17);
    {
      auto pipeline = make();
      auto pass = pipeline.pass();
      for (size_t k = 0; k < stop; ++k) got.push_back(*pass.next());
      saved = pipeline.state().to_json();
    }
    conveyor::manual_seed(4242);  // a new process's generator
    auto pipeline = make();
    pipeline.load_state(conveyor::State::from_json(saved));
    for (int64_t v : pipeline.pass()) got.push_back(v);
    EXPECT_EQ(got, expected) << "stopped after " << stop;
  }
}

}  // namespace
