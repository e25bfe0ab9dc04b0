// conveyor/nodes/async.h: a node that keeps many requests outstanding on few
// threads (issue 16). Header-only; conveyor::core is enough.
//
//   from_range(0, n)
//       | async_map<Sample>([&](size_t i, Completion<Sample> done) {
//           store.fetch(i, std::move(done));  // returns at once; done(sample) later, any thread
//         }, {.max_in_flight = 256})
//       | batch(32) | collate()
//
// fn(item, completion) STARTS the work and returns; the work's owner calls
// completion(value) or completion.fail(exception_ptr) later, from any thread,
// once. The node keeps up to max_in_flight items started and not handed out
// (the window); no thread is parked per item.
//
// Why a completion callback and not C++20 coroutines: every asynchronous
// API a data loader talks to (libcurl's multi handle, io_uring's completion
// queue, a timer heap, gRPC, cloud SDKs) already ends in "call me back";
// a callback plugs into each without a coroutine frame allocated per item,
// without an executor type that fn must know, and a coroutine library can
// drive it by calling the completion where its task ends. The reverse (a
// coroutine interface over callback APIs) needs an awaiter per API.
//
// Contract (as every node, conveyor/node.h):
// - next() waits for the next item with a spin of at most 20 us, then a
//   futex wait that only the delivery it waits for ends (in order the
//   head's, out of order any): other deliveries make no system call.
//   try_next() never waits for a completion (Poll::pending), a resumed
//   pass's replay of its saved order included. fn and upstream run on the
//   thread advancing the node (try_next uses upstream's try_next, except in
//   that replay, which pulls upstream waiting, as every replay does).
// - Order: in input order (in_order = true), or as they complete.
// - Errors: fn throwing, completion.fail(e) or a completion destroyed
//   without being called fail the item: next() throws a NodeError naming the
//   node and the item's position (the original nested) at the item's place;
//   the pass goes on. OnError::skip drops and counts them (skipped).
//   Upstream errors keep their place and are always thrown. If fn throws
//   after its completion delivered, the delivery stands.
// - Randomness: fn's synchronous part draws from the item's own generator
//   (default_generator(), seeded from the pass, the node and the position).
// - Memory: at most max_in_flight items, started or waiting for their turn.
// - reset() (a new pass) and the node's destruction abandon the window at
//   once, without waiting: completions still out hold the window they were
//   made for (shared ownership) and are cancelled: calling one then does
//   nothing and returns false (one already delivering finishes into the
//   abandoned window); the last one frees it. A completion outliving its
//   node is safe to call or drop. What fn's own work uses must outlive that
//   work (fn's captures are the node's).
//
// Thread-safety: one thread advances the node at a time (as every node);
// completions may be called from any threads, concurrently.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <concepts>
#include <cstdint>
#include <deque>
#include <exception>
#include <map>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include "conveyor/data_error.h"
#include "conveyor/detail/cpu_relax.h"
#include "conveyor/detail/worker_scope.h"
#include "conveyor/detail/decision_log.h"
#include "conveyor/nodes/reordering_stage.h"
#include "conveyor/nodes/stage.h"

namespace conveyor::nodes {

struct AsyncOptions {
  // Items started and not yet handed out: the window. [1, 1048576].
  int max_in_flight = 64;
  // Hand items out in input order (true) or as each completes.
  bool in_order = true;
  // raise: next() throws at the item's place; skip: dropped and counted.
  OnError on_error = OnError::raise;
};

namespace detail {

// One pass's window, shared by the node and every completion it handed out
// (so that a completion may outlive the pass and the node).
//
// A slot's word is ticket << 2 | phase. The node writes `ticket | running`
// when it admits an item (tickets are unique within a window, never 0); the
// first completer to move it running -> writing owns the value fields until
// it stores `ticket | done`; after that only the node touches them, until it
// admits the slot's next ticket. A stale completer (its ticket gone) fails
// its compare-exchange and touches nothing.
template <class Out>
class AsyncWindow {
 public:
  static constexpr uint64_t kRunning = 0, kWriting = 1, kDone = 2, kCancelled = 3;
  static constexpr uint32_t kNoSlot = 0xffffffffu;

  struct Slot {
    std::atomic<uint64_t> word{0};
    // Owned as the word says (see above).
    std::optional<Out> value;
    std::exception_ptr error;
    bool dropped = false;  // error is the "dropped" one: fn's own throw may replace it
    uint32_t next_ready = kNoSlot;  // out of order: the ready stack's link, written before the push
  };

  AsyncWindow(uint32_t capacity, bool in_order)
      : capacity_(capacity),
        in_order_(in_order),
        slots_(std::make_unique<Slot[]>(capacity)),
        dropped_error_(std::make_exception_ptr(std::logic_error(
            "the item's Completion was destroyed without being called (fn or its work dropped it)"))) {}

  uint32_t capacity() const noexcept { return capacity_; }
  Slot& slot(uint32_t index) noexcept { return slots_[index]; }

  // A completer's delivery: true if it was the item's (the ticket still
  // running in the slot). Exactly one of value / error is set.
  bool deliver(uint32_t index, uint64_t ticket, std::optional<Out>* value, std::exception_ptr error,
               bool dropped) noexcept {
    Slot& s = slots_[index];
    uint64_t expected = ticket << 2 | kRunning;
    // acquire: pairs with the node's release store admitting `ticket`
    // (admit()), after which the slot's previous value was already moved out
    // and cleared: our writes below cannot overlap that clearing. relaxed on
    // failure: a stale completer reads nothing else of the slot.
    if (!s.word.compare_exchange_strong(expected, ticket << 2 | kWriting, std::memory_order_acquire,
                                        std::memory_order_relaxed)) {
      return false;
    }
    if (value) {
      s.value.emplace(std::move(**value));  // Out's move: noexcept in practice; see Completion
    } else {
      s.error = std::move(error);
      s.dropped = dropped;
    }
    // release: publishes value/error to the node's acquire load of the word
    // (ready_in_order(), settle_thrown()). In order, this store is our last
    // access to the slot.
    s.word.store(ticket << 2 | kDone, std::memory_order_release);
    if (!in_order_) {
      // The ready stack (Treiber, push only; the node takes it all at once
      // with exchange, so there is no pop and no ABA). next_ready is written
      // before the push and read by the node after its acquire exchange.
      uint32_t head = ready_head_.load(std::memory_order_relaxed);  // only a guess for the CAS
      do {
        s.next_ready = head == 0 ? kNoSlot : head - 1;
        // release: publishes next_ready (and, through the release sequence,
        // the value above) to the node's acquire exchange in take_ready();
        // the push is our last access to the slot out of order. relaxed on
        // failure: we retry with the fresh head.
      } while (!ready_head_.compare_exchange_weak(head, index + 1, std::memory_order_release,
                                                  std::memory_order_relaxed));
    }
    // The wake-up handshake (park()): (D) pairs with the node's fence (P).
    // Either the node's check after (P) sees this delivery, or our load
    // below sees the node parked. Only the delivery the node waits for
    // wakes it, so a burst of deliveries costs one system call, not one each.
    std::atomic_thread_fence(std::memory_order_seq_cst);  // (D)
    // The load: relaxed, ordered by (D). The compare-exchange decides which
    // completer wakes the node; seq_cst on success so that its store is not
    // reordered after libstdc++'s read of the waiter count in notify_one()
    // (on aarch64 a relaxed store may pass that load-acquire: the node would
    // then sleep on with its word cleared and no wake sent). relaxed on
    // failure: another completer wakes it.
    uint32_t parked = parked_.load(std::memory_order_relaxed);
    if (parked != kNotParked && (parked == kAwaitAny || parked == index + 1) &&
        parked_.compare_exchange_strong(parked, kNotParked, std::memory_order_seq_cst, std::memory_order_relaxed)) {
      parked_.notify_one();
    }
    return true;
  }

  // The node's, when it abandons the window: a completer of `ticket` that
  // has not begun delivering now fails (its operator() returns false); one
  // that has begun finishes into the abandoned window, harmlessly.
  void cancel(uint32_t index, uint64_t ticket) noexcept {
    uint64_t expected = ticket << 2 | kRunning;
    // relaxed: nothing is published either way; the node never reads this
    // window's slots again, and a completer that fails reads nothing.
    slots_[index].word.compare_exchange_strong(expected, ticket << 2 | kCancelled, std::memory_order_relaxed);
  }

  // A completer's hint (Completion::cancelled()).
  bool cancelled(uint32_t index, uint64_t ticket) const noexcept {
    // relaxed: a hint read for itself; deliver() decides with its own
    // compare-exchange whatever this returned.
    return slots_[index].word.load(std::memory_order_relaxed) == (ticket << 2 | kCancelled);
  }

  // The node's: is `ticket` done in slot `index`? (In order.)
  bool done(uint32_t index, uint64_t ticket) const noexcept {
    // acquire: pairs with deliver()'s release store of `ticket | done`: the
    // value or error written before it is visible to the node.
    return slots_[index].word.load(std::memory_order_acquire) == (ticket << 2 | kDone);
  }

  // The node's: appends the slots delivered since the last call, oldest
  // first (out of order).
  void take_ready(std::deque<uint32_t>& out) {
    // acquire: pairs with every completer's release push (one release
    // sequence on ready_head_): their slots' values and links are visible.
    uint32_t head = ready_head_.exchange(0, std::memory_order_acquire);
    const size_t first = out.size();
    for (uint32_t index = head == 0 ? kNoSlot : head - 1; index != kNoSlot; index = slots_[index].next_ready) {
      out.push_back(index);
    }
    std::reverse(out.begin() + static_cast<std::ptrdiff_t>(first), out.end());  // the stack is newest first
  }

  // The node's: sleeps until ready() holds. `slot` is the slot whose
  // delivery makes it hold (in order), or kAnySlot (out of order: any).
  // ready() reads only what deliveries publish.
  static constexpr uint32_t kAnySlot = kNoSlot;
  static constexpr std::chrono::microseconds kSpin{20};
  template <class Ready>
  void park(uint32_t slot, Ready ready) noexcept {
    const uint32_t awaited = slot == kAnySlot ? kAwaitAny : slot + 1;
    // A short spin first: with hundreds in flight the next delivery is
    // often microseconds away, and a park costs the waking completer a
    // system call and this thread a reschedule (tens of us on a VM).
    // Bounded in time, not in pauses, whose length differs 10x across CPUs.
    const auto spin_end = std::chrono::steady_clock::now() + kSpin;
    for (uint32_t spin = 1;; ++spin) {
      if (ready()) return;
      conveyor::detail::cpu_relax();
      if (spin % 64 == 0 && std::chrono::steady_clock::now() >= spin_end) break;
    }
    while (true) {
      // relaxed: ordered against the check below by (P).
      parked_.store(awaited, std::memory_order_relaxed);
      std::atomic_thread_fence(std::memory_order_seq_cst);  // (P) pairs with deliver()'s (D)
      if (ready()) break;
      // Returns once the awaited delivery cleared parked_ (at once if it
      // already has); a spurious return checks again.
      parked_.wait(awaited, std::memory_order_relaxed);
      if (ready()) break;
    }
    // relaxed: a completer that still clears it later only wakes a later
    // park() spuriously, which checks again.
    parked_.store(kNotParked, std::memory_order_relaxed);
  }
  // Out of order: whether a delivery waits for take_ready().
  bool has_ready() const noexcept {
    // relaxed: a hint for park(); take_ready()'s exchange acquires the slots.
    return ready_head_.load(std::memory_order_relaxed) != 0;
  }

  const std::exception_ptr& dropped_error() const noexcept { return dropped_error_; }

 private:
  const uint32_t capacity_;
  const bool in_order_;
  std::unique_ptr<Slot[]> slots_;
  std::atomic<uint32_t> ready_head_{0};  // out of order: slot + 1 of the newest delivery, 0 empty
  // The node's futex word: kNotParked, the awaited slot + 1, or kAwaitAny.
  static constexpr uint32_t kNotParked = 0, kAwaitAny = 0xffffffffu;
  std::atomic<uint32_t> parked_{kNotParked};
  std::exception_ptr dropped_error_;     // made once: a destructor must not allocate
};

}  // namespace detail

// The one-shot handle that delivers an item's result. Move-only; callable
// from any thread; outliving the node or its pass is safe (see above).
template <class Out>
class Completion {
 public:
  Completion() = default;  // empty: calling it is a std::logic_error
  Completion(Completion&& other) noexcept
      : window_(std::move(other.window_)), slot_(other.slot_), ticket_(other.ticket_) {}
  Completion& operator=(Completion&& other) noexcept {
    if (this != &other) {
      drop();
      window_ = std::move(other.window_);
      slot_ = other.slot_;
      ticket_ = other.ticket_;
    }
    return *this;
  }
  Completion(const Completion&) = delete;
  Completion& operator=(const Completion&) = delete;
  // Not called: the item fails ("destroyed without being called").
  ~Completion() { drop(); }

  // Delivers the item's value. False when the item is no longer wanted (its
  // pass was reset or its node destroyed): the value is dropped here.
  bool operator()(Out value) {
    auto window = take("called");
    std::optional<Out> holder(std::move(value));
    return window->deliver(slot_, ticket_, &holder, nullptr, false);
  }
  // Fails the item with `error` (thrown at the item's place, or skipped).
  // Make the exception_ptr in a statement before this call, not inside it:
  // a temporary exception outliving the call would be destroyed while the
  // consumer reads the copy, and standard exceptions share their message
  // buffer between copies (reference-counted where ThreadSanitizer cannot
  // see the count).
  bool fail(std::exception_ptr error) {
    if (!error) throw std::invalid_argument("Completion::fail: the exception_ptr is empty");
    auto window = take("failed");
    return window->deliver(slot_, ticket_, nullptr, std::move(error), false);
  }
  // True until called, failed or moved from.
  explicit operator bool() const noexcept { return window_ != nullptr; }
  // True once the item is known unwanted (its pass reset, its node gone):
  // work not yet begun for it may be skipped. A hint: false may be stale.
  bool cancelled() const noexcept { return window_ && window_->cancelled(slot_, ticket_); }

 private:
  template <class, class, class>
  friend class AsyncMap;
  Completion(std::shared_ptr<detail::AsyncWindow<Out>> window, uint32_t slot, uint64_t ticket) noexcept
      : window_(std::move(window)), slot_(slot), ticket_(ticket) {}

  std::shared_ptr<detail::AsyncWindow<Out>> take(const char* what) {
    if (!window_) {
      throw std::logic_error(std::string("Completion ") + what +
                             " twice, or after a move: each item's completion delivers once");
    }
    return std::move(window_);
  }
  void drop() noexcept {
    if (!window_) return;
    std::shared_ptr<detail::AsyncWindow<Out>> window = std::move(window_);
    window->deliver(slot_, ticket_, nullptr, window->dropped_error(), true);
  }

  std::shared_ptr<detail::AsyncWindow<Out>> window_;
  uint32_t slot_ = 0;
  uint64_t ticket_ = 0;
};

namespace detail {
inline void validate_async(const AsyncOptions& options, const std::string& name) {
  if (options.max_in_flight < 1 || options.max_in_flight > (1 << 20)) {
    throw ValueError(name + ": max_in_flight should be in [1, 1048576], but got " +
                     std::to_string(options.max_in_flight));
  }
}

// How an own error leaves next(): wrapped in a NodeError naming the node and
// the position (async_map), or a DataError as it is (read_files_async: it
// names the file already, as read_files' do).
enum class AsyncErrors { node_error, data_error_as_is };
}  // namespace detail

template <class In, class Out, class F>
class AsyncMap : public detail::ReorderingStage<In, Out> {
  using Base = detail::ReorderingStage<In, Out>;
  using Base::inputs_;
  using Base::order_;
  using Base::replay_inputs_;

 public:
  using item_type = Out;

  AsyncMap(NodePtr<In> upstream, F fn, AsyncOptions options, std::string name = "async_map",
           detail::AsyncErrors errors = detail::AsyncErrors::node_error)
      : Base(std::move(upstream), options.in_order, options.on_error),
        fn_(std::move(fn)),
        options_(options),
        base_name_(std::move(name)),
        errors_(errors) {
    detail::validate_async(options_, base_name_);
    const auto capacity = static_cast<size_t>(options_.max_in_flight);
    tickets_.resize(capacity);
    positions_.resize(capacity);
    inputs_of_.resize(capacity);
    upstream_error_.resize(capacity);
    if (!options_.in_order) {
      free_.reserve(capacity);
      for (size_t i = capacity; i-- > 0;) free_.push_back(static_cast<uint32_t>(i));
    }
  }

  std::optional<Out> produce() override {
    std::optional<Out> out;
    while (order_.replaying() || replay_started_) {
      if (replay(out, /*wait=*/true) == Poll::ready) return out;
    }
    while (true) {
      fill(/*blocking=*/true);
      if (in_flight() == 0) return std::nullopt;
      const Poll poll = take(out);
      if (poll == Poll::ready) return out;
      if (poll == Poll::pending) park();  // else skipped: look again
    }
  }

  Poll try_next(std::optional<Out>& out) override {
    while (order_.replaying() || replay_started_) {
      const Poll poll = replay(out, /*wait=*/false);
      if (poll == Poll::ready) return this->counted(Poll::ready);
      if (poll == Poll::pending) return Poll::pending;  // its completion may come from this very thread
    }
    while (true) {
      fill(/*blocking=*/false);
      if (in_flight() == 0) return upstream_done_ ? this->counted(Poll::end) : Poll::pending;
      const Poll poll = take(out);
      if (poll != Poll::end) return this->counted(poll);  // ready or pending; end here means skipped
    }
  }

  std::string name() const override {
    return base_name_ + "(max_in_flight=" + std::to_string(options_.max_in_flight) +
           (options_.in_order ? "" : ", in_order=false") + (options_.on_error == OnError::skip ? ", on_error=skip" : "") +
           ")";
  }

  F& fn() noexcept { return fn_; }

  ~AsyncMap() override { abandon(); }  // completions out now return false

  // reset, skip and save_extras as a parallel map's (ReorderingStage): in
  // order, one output per input without fn starting; out of order, the
  // saved log's inputs. And as a parallel map, with in_order = false it
  // hands the saved order out again when a node after it replays by
  // pulling (replay()).

 protected:
  // Abandons the window: completions out deliver into it and are ignored.
  void stop_pass() override { abandon(); }
  void start_pass() override {
    upstream_done_ = false;
    replay_started_ = false;
    inputs_ = 0;
    replay_inputs_.ahead.clear();
    occupancy_takes_.clear();
    occupancy_sum_.clear();
    busy_ns_.clear();
  }
  void add_own_metrics(NodeMetrics& metrics) const override {
    metrics.window = static_cast<size_t>(options_.max_in_flight);
    const uint64_t takes = occupancy_takes_.get();
    metrics.mean_in_flight =
        takes ? static_cast<double>(occupancy_sum_.get()) / static_cast<double>(takes) : 0;
    // busy: time in fn starting items (the waits are nobody's CPU).
    if (this->meter_.timed) metrics.busy_seconds = static_cast<double>(busy_ns_.get()) * 1e-9;
  }

 private:
  using Window = detail::AsyncWindow<Out>;

  Window& window() {
    if (!window_) window_ = std::make_shared<Window>(static_cast<uint32_t>(options_.max_in_flight), options_.in_order);
    return *window_;
  }
  uint64_t in_flight() const noexcept { return tail_ - head_; }
  bool has_room() const noexcept { return in_flight() < static_cast<uint64_t>(options_.max_in_flight); }

  // Admits upstream items while the window has room and upstream has some
  // (now, when not blocking). An upstream error takes a slot of its own, so
  // that it is thrown at its place.
  void fill(bool blocking) {
    // What a replay pulled ahead of its turn goes first, in input order.
    auto& ahead = replay_inputs_.ahead;
    while (!ahead.empty() && has_room()) {
      auto first = ahead.begin();
      if (first->second.error) {
        const uint32_t index = claim();
        upstream_error_[index] = first->second.error;
        inputs_of_[index] = first->first;
        if (!options_.in_order) ready_.push_back(index);
      } else {
        start(std::move(*first->second.item), first->first, first->second.position);
      }
      ahead.erase(first);
    }
    if (!ahead.empty()) return;
    while (!upstream_done_ && has_room()) {
      std::optional<In> item;
      const uint64_t input = inputs_;
      try {
        if (blocking) {
          item = this->pull();
        } else {
          const Poll poll = this->upstream_->try_next(item);
          if (poll == Poll::pending) return;
          if (poll == Poll::ready) {
            this->meter_.in.add(1);
            ++this->position_;
          }
        }
      } catch (...) {
        ++inputs_;
        if (order_.dropped(input)) continue;
        const uint32_t index = claim();
        upstream_error_[index] = std::current_exception();
        inputs_of_[index] = input;
        if (!options_.in_order) ready_.push_back(index);
        continue;
      }
      if (!item) {
        upstream_done_ = true;
        return;
      }
      ++inputs_;
      if (order_.dropped(input)) continue;
      start(std::move(*item), input, this->position());
    }
  }

  // A resumed pass with in_order = false whose outputs a node downstream
  // takes again by pulling (a filter, say): they come in the saved order,
  // each started alone when its turn comes and waited for (nothing else is
  // in flight until the replay is over). Inputs pulled before their turn
  // wait in replay_inputs_; fill() starts them first afterwards. Ready with
  // an item in `out`; end for one dropped under OnError::skip; pending (not
  // `wait`ing) while the item started is not complete: the next call waits
  // for that one.
  Poll replay(std::optional<Out>& out, bool wait) {
    if (!replay_started_) {
      uint64_t wanted = 0;
      auto pending = replay_inputs_.take_next_saved(order_, wanted, inputs_, name(), [this] { return this->pull(); },
                                                    [this] { return this->position(); });
      start(std::move(*pending.item), wanted, pending.position);
      replay_started_ = true;
    }
    while (true) {
      Poll poll = Poll::pending;
      try {
        poll = take(out);  // logs the input it hands out
      } catch (...) {
        replay_started_ = false;  // a failed item is handed out too: the next call starts the next one
        throw;
      }
      if (poll != Poll::pending) {
        replay_started_ = false;
        return poll;
      }
      if (!wait) return Poll::pending;
      park();
    }
  }
  bool replay_started_ = false;  // replay()'s item is in flight

  // The next slot and ticket: in order, ticket t lives in slot (t - 1) %
  // capacity (head_ <= t - 1 < tail_ <= head_ + capacity: never two at once);
  // out of order, any free slot.
  uint32_t claim() {
    Window& w = window();
    uint32_t index;
    if (options_.in_order) {
      index = static_cast<uint32_t>(tail_ % w.capacity());
    } else {
      index = free_.back();
      free_.pop_back();
    }
    ++tail_;
    tickets_[index] = next_ticket_++;
    return index;
  }

  void start(In&& item, uint64_t input, uint64_t position) {
    Window& w = window();
    const uint32_t index = claim();
    const uint64_t ticket = tickets_[index];
    positions_[index] = position;
    inputs_of_[index] = input;
    // release: pairs with a completer's acquire compare-exchange in
    // deliver(): the slot was cleared (take()) before this store.
    w.slot(index).word.store(ticket << 2 | Window::kRunning, std::memory_order_release);
    Completion<Out> completion(window_, index, ticket);
    auto call = [&] {
      const conveyor::detail::WorkerScope scope(nullptr, this->seed_of(position));
      try {
        fn_(std::move(item), std::move(completion));
      } catch (...) {
        settle_thrown(index, ticket, std::current_exception());
      }
    };
    if (this->meter_.timed) {
      const auto begin = std::chrono::steady_clock::now();
      call();
      busy_ns_.add(std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - begin)
                       .count());
    } else {
      call();
    }
    // completion is empty here unless fn took it by reference and kept it
    // not: then it is dropped now, failing the item (as documented).
  }

  // fn threw: the item fails with what it threw, unless its completion had
  // delivered already (that delivery stands) or was dropped while fn unwound
  // (the throw says more: it replaces the "dropped" error).
  void settle_thrown(uint32_t index, uint64_t ticket, std::exception_ptr thrown) noexcept {
    Window& w = window();
    if (w.deliver(index, ticket, nullptr, thrown, false)) return;  // still running: ours now
    typename Window::Slot& s = w.slot(index);
    while (true) {
      // acquire: pairs with the completer's release store of `done`: after
      // it, the slot's fields are the node's until it admits a new ticket.
      const uint64_t word = s.word.load(std::memory_order_acquire);
      if (word == (ticket << 2 | Window::kDone)) break;
      // A completer on another thread is between its compare-exchange and
      // its `done` store (moving one value): yield until it is through.
      std::this_thread::yield();
    }
    if (s.dropped) {
      s.error = std::move(thrown);
      s.dropped = false;
    }
  }

  // Sleeps until take() has something: in order, the head slot's delivery;
  // out of order, any.
  void park() {
    Window& w = window();
    if (options_.in_order) {
      const auto index = static_cast<uint32_t>(head_ % w.capacity());
      const uint64_t ticket = tickets_[index];
      w.park(index, [&] { return w.done(index, ticket); });
    } else {
      w.park(Window::kAnySlot, [&] { return w.has_ready(); });
    }
  }

  // One attempt at the next item: ready, pending, or end (= it was skipped;
  // the caller looks again).
  Poll take(std::optional<Out>& out) {
    Window& w = window();
    uint32_t index;
    if (options_.in_order) {
      index = static_cast<uint32_t>(head_ % w.capacity());
      if (!upstream_error_[index] && !w.done(index, tickets_[index])) return Poll::pending;
    } else {
      if (ready_.empty()) w.take_ready(ready_);
      if (ready_.empty()) return Poll::pending;
      index = ready_.front();
      ready_.pop_front();
    }
    occupancy_takes_.add(1);
    occupancy_sum_.add(in_flight());
    ++head_;
    typename Window::Slot& s = w.slot(index);
    std::exception_ptr upstream_error = std::exchange(upstream_error_[index], nullptr);
    std::optional<Out> value = std::exchange(s.value, std::nullopt);
    std::exception_ptr error = std::exchange(s.error, nullptr);
    s.dropped = false;
    if (!options_.in_order) free_.push_back(index);
    // Out of order, what is handed out (a failure too) is logged for a
    // state; an item dropped under OnError::skip is not handed out.
    const bool handed_out = !error || upstream_error || options_.on_error != OnError::skip;
    if (!options_.in_order && handed_out) order_.handed_out(inputs_of_[index]);
    if (upstream_error) std::rethrow_exception(upstream_error);  // named upstream already
    if (error) {
      if (options_.on_error == OnError::skip) {
        this->meter_.skipped.add(1);
        return Poll::end;
      }
      try {
        std::rethrow_exception(error);
      } catch (const DataError&) {
        if (errors_ == detail::AsyncErrors::data_error_as_is) throw;
        conveyor::detail::throw_node_error(name(), positions_[index]);
      } catch (...) {
        conveyor::detail::throw_node_error(name(), positions_[index]);
      }
    }
    out = std::move(value);
    return Poll::ready;
  }

  // Leaves the window to its completions (cancelled: they return false)
  // and starts a fresh one lazily.
  void abandon() noexcept {
    if (window_) {
      for (uint32_t index = 0; index < window_->capacity(); ++index) {
        if (tickets_[index] != 0) window_->cancel(index, tickets_[index]);
      }
    }
    window_.reset();
    std::fill(tickets_.begin(), tickets_.end(), 0);
    head_ = tail_ = 0;
    ready_.clear();
    std::fill(upstream_error_.begin(), upstream_error_.end(), nullptr);
    if (!options_.in_order) {
      free_.clear();
      for (size_t i = static_cast<size_t>(options_.max_in_flight); i-- > 0;) free_.push_back(static_cast<uint32_t>(i));
    }
  }

  F fn_;
  AsyncOptions options_;
  std::string base_name_;
  detail::AsyncErrors errors_;
  std::shared_ptr<Window> window_;  // this pass's; completions share it
  // The node thread's own bookkeeping (never touched by completers).
  uint64_t head_ = 0, tail_ = 0;   // items handed out / admitted this pass
  uint64_t next_ticket_ = 1;       // unique within a window (and beyond: never reset)
  std::vector<uint64_t> tickets_;  // by slot: the ticket of the item in it
  std::vector<uint64_t> positions_;                 // by slot: the item's input position
  std::vector<uint64_t> inputs_of_;                 // by slot: its number among upstream's outputs
  std::vector<std::exception_ptr> upstream_error_;  // by slot: an upstream error holding the place
  std::vector<uint32_t> free_;                      // out of order: free slots
  std::deque<uint32_t> ready_;                      // out of order: delivered, not yet taken
  bool upstream_done_ = false;
  conveyor::nodes::detail::Counter<uint64_t> occupancy_takes_, occupancy_sum_;
  conveyor::nodes::detail::Counter<int64_t> busy_ns_;
};

// Pipeline<In> -> Pipeline<Out>: fn(In, Completion<Out>) starts each item.
// Throws ValueError for options out of range.
template <class Out, class F>
auto async_map(F fn, AsyncOptions options = {}) {
  detail::validate_async(options, "async_map");
  return [fn = std::move(fn), options]<class In>(Pipeline<In>&& upstream) mutable {
    static_assert(std::invocable<F&, In&&, Completion<Out>&&>,
                  "async_map<Out>(fn): fn must be callable as fn(In&&, Completion<Out>&&)");
    return Pipeline<Out>(std::make_unique<AsyncMap<In, Out, F>>(std::move(upstream).release(), std::move(fn), options));
  };
}

}  // namespace conveyor::nodes
