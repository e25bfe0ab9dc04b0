// The runtime's engine: a oneTBB task_arena of num_workers threads, moodycamel
// queues for every hand-off, and a reorder window of `window` slots. It runs
// jobs; what a job computes (a loader's batch, a node's item) and how it is
// seeded belong to the TaskRunner.
//
// Threads and what they own:
//   consumer  the loader's thread. The only submitter and collector: owns
//             ConsumerSide (sequence counters, slot bookkeeping, free list).
//   workers   TBB threads in the arena. Run jobs; publish results into slots.
//             A logical worker's init state is owned by whichever task
//             currently drains that worker's lane; drains of one lane never
//             overlap (its `drains` count), so a lane is a strand.
//
// Window protocol (invariant 3 of DESIGN.md): the consumer submits only while
// fewer than `window` jobs are in flight, so the slot a job gets is free. A
// worker publishes with a store of the slot's turn = seq + 1; the consumer
// waits for that turn. Sequence numbers are compared only for equality, so
// they may wrap; a slot's previous turn (seq - k*window + 1) can never equal
// the awaited one while window < 2^64.
//
// Parking: the consumer spins briefly (up to 50 µs when every engine's
// workers and a consumer fit the cores, else 256 pauses), then parks on a
// LightweightSemaphore.
// It says which slot it waits for (`awaited_slot`, or any) and raises
// `consumer_parked` before its last check; a worker signals after publishing
// only if that flag is up and its slot is the awaited one. Two seq_cst fences
// make the pair (store slot and flag; check result) / (publish result; load
// flag and slot) a Dekker handshake: at least one side sees the other, so no
// wake-up is lost. In order, a worker finishing a batch behind the awaited
// one lets the consumer sleep on: each wake-up is a futex call and, with
// more busy threads than cores, a reschedule of a worker. For the same
// reason a consumer with wake_after > 0 first parks for a later job (the
// run's last), for at most kRunWaitLimit: a job that cannot finish before
// the consumer takes the earlier ones (f waiting on the consumer) then
// costs that much, not a hang, and each such timeout halves the run.
#include "conveyor/detail/engine.h"

#include <oneapi/tbb/global_control.h>
#include <oneapi/tbb/info.h>
#include <oneapi/tbb/task_arena.h>
#include <oneapi/tbb/task_group.h>

#include <concurrentqueue.h>
#include <lightweightsemaphore.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "conveyor/detail/check.h"
#include "conveyor/detail/cpu_relax.h"
#include "conveyor/errors.h"
#include "conveyor/warnings.h"

#if defined(__SANITIZE_THREAD__)
#define CONVEYOR_TSAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define CONVEYOR_TSAN 1
#endif
#endif

#if CONVEYOR_TSAN
extern "C" void __tsan_acquire(void* addr);
extern "C" void __tsan_release(void* addr);
#endif

namespace conveyor::detail {
namespace {

using Clock = std::chrono::steady_clock;

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now().time_since_epoch())
      .count();
}

// ---- ThreadSanitizer and TBB -------------------------------------------------
// libtbb is not built with TSan, so two things TBB synchronises are invisible
// to it: handing a task from the thread that enqueues it to the worker that
// runs it, and reusing a finished task's memory (TBB's small-object pool) for
// the next task placed there. Handoff announces both on the task's own
// address, so TSan learns only the orders TBB really gives: construction (in
// the task's memory) and the end of destruction release; the start of
// construction and of the run acquire. Tasks that never share memory stay
// unordered for TSan, and a race between them is still reported. The end of
// destruction also releases the task's group, which the engine acquires once
// it has waited for the group: all tasks are done before it tears down.
// Outside TSan builds all of this compiles to nothing.
#if CONVEYOR_TSAN
inline void tsan_release(const void* task) { __tsan_release(const_cast<void*>(task)); }
inline void tsan_acquire(const void* task) { __tsan_acquire(const_cast<void*>(task)); }
#else
inline void tsan_release(const void*) {}
inline void tsan_acquire(const void*) {}
#endif

// Runs first and last in a Handoff's life: base classes are built before and
// destroyed after the members. Its address is the Handoff's (the first base).
struct HandoffFence {
  // The acquire comes before the first write into the task's memory, and the
  // destructor reads everything before its release.
  explicit HandoffFence(const void* task_group) {
    tsan_acquire(this);
    group = task_group;
  }
  HandoffFence(const HandoffFence& other) {
    tsan_acquire(this);
    group = other.group;
  }
  ~HandoffFence() {
    const void* task_group = group;
    tsan_release(this);
    tsan_release(task_group);
  }
  const void* group;
};

template <class F>
class Handoff : private HandoffFence {
 public:
  Handoff(const void* task_group, F f) : HandoffFence(task_group), f_(std::move(f)) {
    tsan_release(this);
  }
  Handoff(Handoff&& other) noexcept : HandoffFence(other), f_(std::move(other.f_)) { tsan_release(this); }
  Handoff(const Handoff& other) : HandoffFence(other), f_(other.f_) { tsan_release(this); }
  Handoff& operator=(const Handoff&) = delete;
  void operator()() const {
    tsan_acquire(this);
    f_();
  }

 private:
  F f_;
};

// ---- TBB's thread limit ------------------------------------------------------
// TBB runs at most max_allowed_parallelism - 1 worker threads in the whole
// process (default: one per core). An I/O-bound loader wants more threads
// than cores, so every live engine reserves its workers and the limit is
// raised to cover all reservations (never lowered below the default).
class ThreadReservations {
 public:
  // Never destroyed: an engine finishing in the background (see
  // finish_in_background) may still release its workers while the process
  // runs its static destructors.
  static ThreadReservations& instance() {
    static auto* reservations = new ThreadReservations;
    return *reservations;
  }

  void acquire(size_t workers) {
    std::lock_guard lock(mutex_);  // construction path only, not per batch
    reserved_ += workers;
    apply();
  }
  void release(size_t workers) noexcept {
    std::lock_guard lock(mutex_);
    reserved_ -= workers;
    try {
      apply();
    } catch (...) {
      // Keeping a higher limit than needed is harmless.
    }
  }

  // Whether every live engine's workers and one consumer fit the cores this
  // process may run on. Relaxed: a hint for how long a consumer spins; no
  // data depends on it, and a stale value costs only a spin or a park.
  bool spare_core() const noexcept { return spare_core_.load(std::memory_order_relaxed); }

 private:
  void apply() {
    const auto cores = static_cast<size_t>(tbb::info::default_concurrency());
    spare_core_.store(reserved_ + 1 <= cores, std::memory_order_relaxed);  // see spare_core()
    const size_t wanted = std::max<size_t>(cores, reserved_ + 1);  // + 1: TBB counts the caller too
    if (wanted == applied_) return;
    // global_control values combine by minimum: install the new one before
    // dropping the old, so the limit never dips in between.
    auto next = std::make_unique<tbb::global_control>(
        tbb::global_control::max_allowed_parallelism, wanted);
    control_ = std::move(next);
    applied_ = wanted;
    // oneTBB fixes its worker-thread limit when its first arena starts (our
    // first engine, if nothing in the process used TBB before).
    if (limit_at_start_ == 0) limit_at_start_ = wanted;
    const size_t active =
        tbb::global_control::active_value(tbb::global_control::max_allowed_parallelism);
    const size_t limit = tbb_worker_limit(limit_at_start_);
    // Once per cause, not once per engine.
    bool& warned = active < std::min(reserved_, limit) + 1 ? warned_held_by_other_ : warned_beyond_tbb_;
    const std::string warning = thread_limit_warning(reserved_, active, limit);
    if (!warning.empty() && !warned) {
      warned = true;
      warn(warning);
    }
  }

  std::mutex mutex_;
  size_t reserved_ = 0;
  size_t applied_ = 0;
  size_t limit_at_start_ = 0;
  bool warned_held_by_other_ = false;
  bool warned_beyond_tbb_ = false;
  std::unique_ptr<tbb::global_control> control_;
  std::atomic<bool> spare_core_{true};
};

}  // namespace

// oneTBB's market (src/tbb/market.cpp) starts at most
// max(factor * default_concurrency, 256, the parallelism limit in force when
// the market started) worker threads in a process, factor 4 up to 128 cores
// and 2 beyond, whatever a global_control allows later.
size_t tbb_worker_limit(size_t parallelism_at_start) {
  const auto cores = static_cast<size_t>(tbb::info::default_concurrency());
  const size_t factor = cores <= 128 ? 4 : 2;
  return std::max({factor * cores, size_t{256}, parallelism_at_start});
}

std::string thread_limit_warning(size_t workers_wanted, size_t parallelism_in_force,
                                 size_t tbb_worker_limit) {
  const std::string wanted = std::to_string(workers_wanted);
  // Every live engine reserves its threads: loaders' pools and pipelines' nodes.
  const std::string who = " conveyor worker threads (DataLoader workers and pipeline nodes together)";
  // Once oneTBB has started it reports at most its own worker limit + 1:
  // there, the limit is its own, not another control's.
  if (parallelism_in_force < std::min(workers_wanted, tbb_worker_limit) + 1) {
    return "TBB's max_allowed_parallelism is held at " + std::to_string(parallelism_in_force) +
           " by another tbb::global_control in this process, below the " + wanted +
           who + " that want to run at once; workers beyond " +
           std::to_string(parallelism_in_force == 0 ? 0 : parallelism_in_force - 1) +
           " will wait for a thread";
  }
  if (workers_wanted > tbb_worker_limit) {
    return wanted + who + " want to run at once, but oneTBB starts at most " +
           std::to_string(tbb_worker_limit) +
           " worker threads in a process (its own limit: the larger of 256 and 4 per core, or "
           "the limit in force when TBB started); workers beyond that wait for a thread";
  }
  return {};
}

namespace {

class ThreadReservation {
 public:
  explicit ThreadReservation(size_t workers) : workers_(workers) {
    ThreadReservations::instance().acquire(workers_);
  }
  ~ThreadReservation() { ThreadReservations::instance().release(workers_); }
  ThreadReservation(const ThreadReservation&) = delete;
  ThreadReservation& operator=(const ThreadReservation&) = delete;

 private:
  size_t workers_;
};

}  // namespace

void finish_in_background(std::function<void()> work) noexcept {
  // Shared, so that `work` survives a thread that fails to start.
  auto shared_work = std::make_shared<std::function<void()>>(std::move(work));
  const auto run = [](const std::function<void()>& w) noexcept {
    try {
      w();
    } catch (...) {
      // Stopping never throws; nothing here to report it to.
    }
  };
  try {
    std::thread([shared_work, run] { run(*shared_work); }).detach();
  } catch (...) {
    run(*shared_work);  // no thread to be had: finish here, waiting
  }
}

namespace {

// One place in the reorder window. Written by the worker running its job,
// read by the consumer. A line of its own: the consumer polls it.
struct alignas(64) Slot {
  // seq + 1 once the job of seq is done (run or skipped). (P1) release store
  // by the worker, paired with the consumer's (C1) acquire load.
  std::atomic<uint64_t> turn{0};
};

// For the timeout message only: when a slot's job started, on which worker.
// Kept apart from Slot so that writing it does not disturb the consumer's
// polling; written only when a timeout is configured. Relaxed: read after a
// timeout, never used for control.
struct alignas(64) SlotClock {
  std::atomic<int64_t> started_ns{0};
  std::atomic<int> running_worker{-1};
};

constexpr int kInitPending = 0;
constexpr int kInitRunning = 1;
constexpr int kInitDone = 2;

// A logical worker's once-only init. Owned by the task draining its Lane, or
// (shared lane) by the thread occupying that arena slot.
struct WorkerState {
  int id = 0;
  bool initialized = false;
  std::exception_ptr init_failure;
  // Shared lane: kInitPending, kInitRunning, kInitDone for this worker's
  // init. Atomic: successive holders of one worker may be different threads.
  std::atomic<int> init_state{kInitPending};
  // Shared lane: a drain task runs as this worker (see claim_worker()).
  std::atomic<bool> claimed{false};
};

// A queue of jobs and the drain tasks that empty it: at most one for a
// logical worker's lane (its jobs run one at a time, in order: a strand), up
// to num_workers for the shared lane.
//
// Activation (a Dekker handshake, like the consumer's parking): the consumer
// enqueues, fences, and starts a drain task if fewer than max_drains run. A
// drain task that finds the queue dry lingers briefly, then leaves: it drops
// `drains`, fences, and re-checks the queue, taking itself back if a job
// slipped in. Either side sees the other, so no job waits without a drain.
struct Lane {
  explicit Lane(uint32_t max) : max_drains(max) {}
  moodycamel::ConcurrentQueue<Job> queue;
  // Drain tasks running. acq_rel on every change: a leaving drain's release
  // hands its WorkerState to the next one's acquire.
  alignas(64) std::atomic<uint32_t> drains{0};
  const uint32_t max_drains;
  WorkerState worker;  // per-worker lanes only
};

// Everything a task may touch. Tasks hold a shared_ptr to it, so a task
// finishing its epilogue never touches freed memory after the Engine is gone.
struct Shared {
  explicit Shared(const EngineConfig& c, TaskRunner& r) : config(c), runner(&r) {}

  EngineConfig config;
  TaskRunner* runner;  // outlives every job (the Engine waits for them)
  std::unique_ptr<Slot[]> slots;
  std::unique_ptr<SlotClock[]> clocks;
  std::vector<std::unique_ptr<Lane>> lanes;  // one per worker, or one shared
  std::vector<std::unique_ptr<WorkerState>> slot_workers;  // shared lane: claimed by drain tasks
  moodycamel::ConcurrentQueue<uint32_t> completed;         // !in_order: published slots

  // Bumped by cancel(); jobs of older generations are skipped. The consumer's
  // (release) bump is acquired by workers before deciding to run a job.
  std::atomic<uint64_t> generation{0};

  static constexpr int64_t kAnySlot = -1;

  // Parks the consumer. No spinning of its own (its default is 10,000
  // spins): wait_until() has spun already, and a second, hidden spin kept a
  // consumer waiting microseconds per item from ever parking, so with more
  // threads than cores it took CPU from the workers (W5's per-sample node
  // graph at W=2 on 2 vCPUs: 118-128k -> 141-145k samples/s).
  moodycamel::LightweightSemaphore wake{0, 0};
  alignas(64) std::atomic<bool> consumer_parked{false};
  // The slot the parked consumer waits for, or kAnySlot. Written with
  // consumer_parked, before (C2); read with it, after (P2).
  std::atomic<int64_t> awaited_slot{kAnySlot};

  void publish(const Job& job) {
    Slot& slot = slots[job.slot];
    slot.turn.store(job.seq + 1, std::memory_order_release);  // (P1) pairs with (C1)
    if (!config.in_order) completed.enqueue(job.slot);
    // (P2) with the consumer's (C2): whichever runs second sees the other.
    std::atomic_thread_fence(std::memory_order_seq_cst);
    // Both loads ordered by the fence above; a stale pair only adds a spare
    // signal, or skips one the consumer does not need (it saw the publish).
    if (!consumer_parked.load(std::memory_order_relaxed)) return;
    const int64_t awaited = awaited_slot.load(std::memory_order_relaxed);
    if (awaited == kAnySlot || awaited == static_cast<int64_t>(job.slot)) wake.signal();
  }

  // `slot_owned`: the worker state belongs to an arena slot (shared lane)
  // rather than to a lane.
  void run_job(Job& job, WorkerState& worker, bool slot_owned) {
    // Acquire: pairs with cancel()'s bump, so a cancelled job sees it.
    if (job.generation != generation.load(std::memory_order_acquire)) {
      publish(job);  // cancelled: published empty, so cancel() knows it is done
      return;
    }
    const bool timed = config.timeout.count() > 0;
    if (timed) {
      clocks[job.slot].running_worker.store(worker.id, std::memory_order_relaxed);
      clocks[job.slot].started_ns.store(now_ns(), std::memory_order_relaxed);
    }
    ensure_initialized(worker, slot_owned);
    runner->run(job, worker.id, worker.init_failure);
    if (timed) clocks[job.slot].started_ns.store(0, std::memory_order_relaxed);
    publish(job);  // the job's last touch of the runner is before this
  }

  void ensure_initialized(WorkerState& worker, bool slot_owned) {
    if (!slot_owned) {
      if (worker.initialized) return;
      run_init(worker);
      worker.initialized = true;
      return;
    }
    // Slot-owned state: the first thread to claim it runs the init; any other
    // waits until it is done. acq_rel/acquire: publishes init_failure.
    int state = worker.init_state.load(std::memory_order_acquire);
    if (state == kInitDone) return;
    if (state == kInitPending &&
        worker.init_state.compare_exchange_strong(state, kInitRunning, std::memory_order_acq_rel)) {
      run_init(worker);
      worker.init_state.store(kInitDone, std::memory_order_release);
      worker.init_state.notify_all();
      return;
    }
    while ((state = worker.init_state.load(std::memory_order_acquire)) != kInitDone) {
      worker.init_state.wait(state, std::memory_order_acquire);
    }
  }

  void run_init(WorkerState& worker) {
    try {
      runner->init_worker(worker.id);
    } catch (...) {
      worker.init_failure = std::current_exception();
    }
  }

  // The worker a drain task runs as, for as long as it runs. A lane of its
  // own: the lane's. The shared lane: one no other drain holds, claimed
  // here and given back by release_worker() before the drain drops
  // `drains`. Claims never outnumber drains (at most num_workers), so one
  // is always free. (The arena slot is no worker: an Executor shared by
  // several engines puts more threads than this engine's workers in the
  // arena, and two slots mapped onto one worker ran jobs at once.)
  WorkerState& claim_worker(Lane& lane) {
    if (config.per_worker_queues) return lane.worker;
    const int index = tbb::this_task_arena::current_thread_index();
    CONVEYOR_CHECK(index >= 0, "a task ran outside the engine's arena");
    const size_t count = slot_workers.size();
    for (size_t start = static_cast<size_t>(index) % count;;) {  // from the slot's own, for locality
      for (size_t k = 0; k < count; ++k) {
        WorkerState& worker = *slot_workers[(start + k) % count];
        bool free = false;
        // Acquire: pairs with release_worker()'s release, so this drain
        // sees what the worker's last holder wrote (its init, its failure).
        // The relaxed look first only spares a CAS on a held worker.
        if (!worker.claimed.load(std::memory_order_relaxed) &&
            worker.claimed.compare_exchange_strong(free, true, std::memory_order_acquire)) {
          return worker;
        }
      }
      cpu_relax();  // a drain giving one back is between its release and its exit
    }
  }
  void release_worker(WorkerState& worker) {
    if (config.per_worker_queues) return;
    worker.claimed.store(false, std::memory_order_release);  // pairs with claim_worker()'s acquire
  }
};

// Spins a drain task makes, when its queue runs dry, before giving the thread
// back: a job arriving meanwhile then costs no new task (an arena.enqueue
// costs more than a whole small batch).
// Polls are spaced out: each poll of the queue pulls its index line away from
// the consumer, who is about to write it.
constexpr int kLingerPolls = 16;
constexpr int kPausesPerPoll = 4;

void drain(Shared& shared, Lane& lane) {
  Job job;
  WorkerState* worker = &shared.claim_worker(lane);
  while (true) {
    bool found = lane.queue.try_dequeue(job);
    for (int poll = 0; !found && poll < kLingerPolls; ++poll) {
      for (int pause = 0; pause < kPausesPerPoll; ++pause) cpu_relax();
      found = lane.queue.try_dequeue(job);
    }
    if (found) {
      shared.run_job(job, *worker, !shared.config.per_worker_queues);
      continue;
    }
    // Leave, unless a job slipped in after the last look (see Lane).
    shared.release_worker(*worker);  // before `drains` drops: claims never outnumber drains
    // Release: hands the lane's WorkerState to the next drain's acquire.
    lane.drains.fetch_sub(1, std::memory_order_acq_rel);
    std::atomic_thread_fence(std::memory_order_seq_cst);  // (D1) pairs with (E1)
    if (lane.queue.size_approx() == 0) return;
    uint32_t running = lane.drains.load(std::memory_order_acquire);
    while (true) {
      if (running >= lane.max_drains) return;  // others will take it
      if (lane.drains.compare_exchange_weak(running, running + 1, std::memory_order_acq_rel)) break;
    }
    worker = &shared.claim_worker(lane);
  }
}

}  // namespace

// ---- Executor ------------------------------------------------------------
struct Executor::Impl {
  // The arena, started once with every thread reserved until then; the
  // first engine to start it fixes its size. Construction path only.
  tbb::task_arena& start() {
    std::call_once(started_once, [&] {
      std::lock_guard lock(mutex);
      started = true;
      reservation.emplace(reserved);
      arena.initialize(static_cast<int>(reserved), /*reserved_for_masters=*/0);
    });
    return arena;
  }

  mutable std::mutex mutex;  // reserve() and start(): never on the hot path
  size_t reserved = 0;
  bool started = false;
  std::once_flag started_once;
  std::optional<ThreadReservation> reservation;
  tbb::task_arena arena;
};

Executor::Executor() : impl_(std::make_unique<Impl>()) {}
Executor::~Executor() = default;

bool Executor::reserve(size_t threads) {
  std::lock_guard lock(impl_->mutex);
  if (impl_->started) return false;
  impl_->reserved += threads;
  return true;
}

size_t Executor::reserved() const {
  std::lock_guard lock(impl_->mutex);
  return impl_->reserved;
}

namespace {

std::shared_ptr<Executor> own_executor(size_t workers) {
  auto executor = std::make_shared<Executor>();
  executor->reserve(workers);
  return executor;
}

}  // namespace

struct Engine::Impl {
  Impl(const EngineConfig& config, TaskRunner& runner, std::shared_ptr<Executor> given)
      : executor(given ? std::move(given) : own_executor(config.num_workers)),
        shared(std::make_shared<Shared>(config, runner)),
        arena(executor->impl_->start()) {
    const size_t workers = config.num_workers;
    const size_t window = config.window;
    CONVEYOR_CHECK(workers > 0 && window > 0, "an engine needs workers and a window");
    run_ahead = config.wake_after;
    shared->slots = std::make_unique<Slot[]>(window);
    shared->clocks = std::make_unique<SlotClock[]>(window);
    for (size_t i = 0; i < window; ++i) {
      // A turn no job of this engine can be waiting for: seqs start at first_seq.
      // Relaxed: no worker runs yet; submit()'s queue hand-off publishes it.
      shared->slots[i].turn.store(config.first_seq, std::memory_order_relaxed);
    }
    if (config.per_worker_queues) {
      for (size_t w = 0; w < workers; ++w) {
        auto lane = std::make_unique<Lane>(1);
        lane->worker.id = static_cast<int>(w);
        shared->lanes.push_back(std::move(lane));
      }
    } else {
      shared->lanes.push_back(std::make_unique<Lane>(static_cast<uint32_t>(workers)));
      for (size_t w = 0; w < workers; ++w) {
        shared->slot_workers.push_back(std::make_unique<WorkerState>());
        shared->slot_workers.back()->id = static_cast<int>(w);
      }
    }
    for (auto& lane : shared->lanes) producer_tokens.emplace_back(lane->queue);
    meta.resize(window);
    for (size_t i = window; i-- > 0;) free_slots.push_back(static_cast<uint32_t>(i));
    next_seq = config.first_seq;
  }

  ~Impl() {
    cancel();
    // A drain task may still be lingering, or be queued and not yet started
    // (another drain took its job). Wait for every one to be destroyed: a
    // task left queued in a dropped arena may never run, and would keep
    // `shared` alive for good.
    // Waited on from outside the arena: arena.execute() could hand the wait
    // to a worker. The acquire pairs with each Handoff's destructor.
    drain_tasks.wait();
    tsan_acquire(&drain_tasks);
  }

  const EngineConfig& config() const { return shared->config; }

  void begin_pass() {
    CONVEYOR_CHECK(in_flight == 0, "begin_pass with jobs in flight");
    job_index = 0;
  }

  bool has_room() const { return in_flight < config().window; }

  uint32_t next_slot() const { return config().in_order ? issue_slot : free_slots.back(); }

  void submit(int lane_wanted) {
    CONVEYOR_CHECK(has_room(), "submit into a full window");
    uint32_t slot = 0;
    if (config().in_order) {
      slot = issue_slot;
      issue_slot = static_cast<uint32_t>((issue_slot + 1) % config().window);
    } else {
      slot = free_slots.back();
      free_slots.pop_back();
    }
    Job job;
    job.seq = next_seq++;
    job.index = job_index++;
    job.slot = slot;
    job.lane = lane_wanted;
    job.generation = generation;
    meta[slot] = {job.seq, job.index, slot, lane_wanted};
    ++in_flight;
    ++submitted;

    size_t lane_index = 0;
    if (config().per_worker_queues) {
      CONVEYOR_CHECK(lane_wanted >= 0 && static_cast<size_t>(lane_wanted) < shared->lanes.size(),
                     "job for a lane that does not exist");
      lane_index = static_cast<size_t>(lane_wanted);
    }
    Lane& lane = *shared->lanes[lane_index];
    lane.queue.enqueue(producer_tokens[lane_index], std::move(job));
    // Start a drain task if the lane has room for one (see Lane).
    std::atomic_thread_fence(std::memory_order_seq_cst);  // (E1) pairs with (D1)
    uint32_t running = lane.drains.load(std::memory_order_acquire);
    while (running < lane.max_drains) {
      if (lane.drains.compare_exchange_weak(running, running + 1, std::memory_order_acq_rel)) {
        arena.enqueue(
            drain_tasks.defer(Handoff(&drain_tasks, [keep = shared, &lane] { drain(*keep, lane); })));
        break;
      }
    }
  }

  // Spins, then parks until `ready()` holds or the timeout passes. Only the
  // publication of `awaited_slot` (kAnySlot: any) can make `ready()` true.
  template <class Ready>
  bool wait_until(Ready ready, Clock::time_point deadline, bool has_deadline,
                  int64_t awaited_slot = Shared::kAnySlot, bool spin = true) {
    // With a core to spare, the consumer spins up to kSpareCoreSpin: a
    // per-item wait of a few µs (W5's per-sample node graph at W=1) then
    // ends without parking, which would put a futex wake on the worker's
    // path for every item. With more threads than cores it spins kSpins
    // pauses only: a longer spin takes the CPU the workers need (the same
    // graph at W=2 on 2 vCPUs: 0.77x with 2,048 pauses).
    // A wait for a run of jobs (wait_for_run) expects to wait long: no spin.
    const bool spare_core = ThreadReservations::instance().spare_core();
    const Clock::time_point spin_until = spare_core ? Clock::now() + kSpareCoreSpin : Clock::time_point{};
    do {
      for (int turn = 0; spin && turn < kSpins; ++turn) {
        if (ready()) return true;
        cpu_relax();
      }
    } while (spin && spare_core && Clock::now() < spin_until);
    // Relaxed: the fence below orders it against the check that follows.
    shared->awaited_slot.store(awaited_slot, std::memory_order_relaxed);
    while (true) {
      // Relaxed: the fence below orders it against the check that follows.
      shared->consumer_parked.store(true, std::memory_order_relaxed);
      std::atomic_thread_fence(std::memory_order_seq_cst);  // (C2) pairs with (P2)
      if (ready()) {
        shared->consumer_parked.store(false, std::memory_order_relaxed);  // a spare signal is harmless
        return true;
      }
      int64_t timeout_us = -1;
      if (has_deadline) {
        const auto left = std::chrono::duration_cast<std::chrono::microseconds>(deadline - Clock::now());
        timeout_us = std::max<int64_t>(left.count(), 1);
      }
      shared->wake.wait(timeout_us);
      shared->consumer_parked.store(false, std::memory_order_relaxed);  // a spare signal is harmless
      if (ready()) return true;
      if (has_deadline && Clock::now() >= deadline) return false;
    }
  }

  Clock::time_point deadline_from_now() const {
    const auto timeout = config().timeout;
    return timeout.count() > 0 ? Clock::now() + timeout : Clock::time_point::max();
  }

  ReadyJob wait_ready(Clock::time_point deadline) {
    CONVEYOR_CHECK(in_flight > taken, "wait_ready with nothing in flight");
    const bool has_deadline = deadline != Clock::time_point::max();
    ReadyJob ready;
    const int64_t awaited = config().in_order ? static_cast<int64_t>(expect_slot) : Shared::kAnySlot;
    if (config().in_order && !has_deadline) wait_for_run();
    if (!wait_until([&] { return try_ready(ready); }, deadline, has_deadline, awaited)) {
      throw_timeout(config().in_order ? expect_slot : oldest_in_flight());
    }
    return ready;
  }

  // With wake_after > 0 and no core to spare: while the awaited job is not
  // done, parks until the job run_ahead places on is (see EngineConfig).
  // Its wait is bounded, so that job need not finish first.
  void wait_for_run() {
    if (config().wake_after == 0 || in_flight < 2) return;
    if (ThreadReservations::instance().spare_core()) return;
    if (run_ahead == 0) {
      // Switched off by timeouts; tried again now and then, as f may change.
      if (++waits_without_runs < kRunRetryAfter) return;
      waits_without_runs = 0;
      run_ahead = 1;
    }
    // (C1) pairs with (P1), as in try_ready().
    auto published = [&](uint32_t slot) {
      return shared->slots[slot].turn.load(std::memory_order_acquire) == meta[slot].seq + 1;
    };
    if (published(expect_slot)) return;
    // Jobs behind the run's last keep every worker busy meanwhile: the
    // window is not refilled while the consumer sleeps.
    const size_t behind = config().num_workers + 1;
    if (in_flight <= behind) return;
    const size_t ahead = std::min(run_ahead, in_flight - behind);
    const auto last = static_cast<uint32_t>((expect_slot + ahead) % config().window);
    // Either way the wait for the awaited job follows; a spare signal from
    // `last` after this gives up is harmless.
    if (wait_until([&] { return published(last); }, Clock::now() + kRunWaitLimit, true, last, false)) {
      run_ahead = std::min(config().wake_after, run_ahead * 2);
    } else if (published(expect_slot)) {
      run_ahead /= 2;  // the awaited job waited, done: f may wait on the consumer
    }
  }

  bool try_ready(ReadyJob& ready) {
    CONVEYOR_CHECK(in_flight > taken, "try_ready with nothing in flight");
    if (config().in_order) {
      const uint32_t slot = expect_slot;
      // (C1) pairs with (P1).
      if (shared->slots[slot].turn.load(std::memory_order_acquire) != meta[slot].seq + 1) return false;
      ready = meta[slot];
      return true;
    }
    uint32_t slot = 0;
    if (!shared->completed.try_dequeue(slot)) return false;
    // The queue delivered the slot after its turn was stored; check anyway.
    CONVEYOR_CHECK(shared->slots[slot].turn.load(std::memory_order_acquire) == meta[slot].seq + 1,
                   "a completed slot without its turn");
    ++taken;
    ready = meta[slot];
    return true;
  }

  // The oldest job not yet done: one done (handed out and not released, or
  // waiting in `completed`) is not what the consumer waits for.
  uint32_t oldest_in_flight() const {
    uint32_t oldest = 0;
    uint64_t best = UINT64_MAX;
    for (uint32_t s = 0; s < meta.size(); ++s) {
      if (!slot_in_flight(s)) continue;
      // Relaxed: it only names a job in a message; a turn published
      // meanwhile names a job that was just done, as a later look would.
      if (shared->slots[s].turn.load(std::memory_order_relaxed) == meta[s].seq + 1) continue;
      const uint64_t age = meta[s].index;
      if (age < best) {
        best = age;
        oldest = s;
      }
    }
    return oldest;
  }

  [[noreturn]] void throw_timeout(uint32_t slot) const {
    const SlotClock& s = shared->clocks[slot];
    const ReadyJob& m = meta[slot];
    const double timeout_s = std::chrono::duration<double>(config().timeout).count();
    char seconds[32];
    std::snprintf(seconds, sizeof seconds, "%g", timeout_s);
    std::string message = config().timeout_subject + " timed out after " + std::string(seconds) +
                          " seconds waiting for " + config().job_noun + " " +
                          std::to_string(config().job_number ? config().job_number(m.index) : m.index);
    const int64_t started = s.started_ns.load(std::memory_order_relaxed);
    const int running = s.running_worker.load(std::memory_order_relaxed);
    if (started != 0) {
      char held[32];
      std::snprintf(held, sizeof held, "%.3f", static_cast<double>(now_ns() - started) / 1e9);
      message += " (worker " + std::to_string(running) + " has been on it for " + held + " s)";
    } else if (m.lane >= 0) {
      message += " (queued for worker " + std::to_string(m.lane) + ", not started)";
    } else {
      message += " (queued, not started)";
    }
    message += "; " + std::to_string(in_flight) + " " + config().jobs_noun + " in flight";
    throw TimeoutError(message);
  }

  void release(const ReadyJob& ready) {
    CONVEYOR_CHECK(in_flight > 0, "release with nothing in flight");
    if (config().in_order) {
      CONVEYOR_CHECK(ready.slot == expect_slot, "in-order release out of order");
      expect_slot = static_cast<uint32_t>((expect_slot + 1) % config().window);
    } else {
      free_slots.push_back(ready.slot);
      --taken;
    }
    --in_flight;
    ++released;
  }

  // Every job publishes its slot exactly once, run or skipped; so once each
  // in-flight job has published, no job of this pass touches the runner any
  // more (nothing but the publication itself follows a run).
  // In order, publication is the turn store: wait for each in-flight turn.
  // Out of order it ends with the slot's enqueue on `completed`, after the
  // turn: count those in instead (a turn alone could leave a stale slot to
  // reach the next pass's wait_ready).
  void cancel() noexcept {
    if (in_flight == 0) return;
    generation = shared->generation.fetch_add(1, std::memory_order_acq_rel) + 1;
    if (config().in_order) {
      for (uint32_t slot = 0; slot < meta.size(); ++slot) {
        if (!slot_in_flight(slot)) continue;
        std::atomic<uint64_t>& turn = shared->slots[slot].turn;
        const uint64_t want = meta[slot].seq + 1;
        wait_until([&] { return turn.load(std::memory_order_acquire) == want; },  // (C1)
                   Clock::time_point::max(), false, slot);
      }
    } else {
      // The in-flight slots not yet taken by wait_ready() are each enqueued
      // exactly once; the queue's dequeue acquires what the worker released.
      for (size_t outstanding = in_flight - taken; outstanding > 0; --outstanding) {
        uint32_t drained = 0;
        wait_until([&] { return shared->completed.try_dequeue(drained); }, Clock::time_point::max(),
                   false);
      }
    }
    for (uint32_t s = 0; s < config().window; ++s) shared->runner->clear(s);
    free_slots.clear();
    for (size_t i = config().window; i-- > 0;) free_slots.push_back(static_cast<uint32_t>(i));
    issue_slot = expect_slot = 0;
    released += in_flight;
    in_flight = 0;
    taken = 0;
  }

  // Whether `slot` holds a job submitted and not yet released.
  bool slot_in_flight(uint32_t slot) const {
    if (!config().in_order) {
      return std::find(free_slots.begin(), free_slots.end(), slot) == free_slots.end();
    }
    // In order, the in-flight slots are the in_flight ones from expect_slot on.
    const size_t window = config().window;
    const size_t offset = (slot + window - expect_slot) % window;
    return offset < in_flight;
  }

  static constexpr int kSpins = 256;
  static constexpr std::chrono::microseconds kSpareCoreSpin{50};
  // The longest wait_for_run() parks for a later job: a bound on the delay
  // of a done job, and ~100 W5 samples' decode on one worker.
  static constexpr std::chrono::milliseconds kRunWaitLimit{1};
  // Waits with runs switched off before one is tried again.
  static constexpr uint32_t kRunRetryAfter = 1024;

  std::shared_ptr<Executor> executor;  // first: outlives the tasks ~Impl waits for
  std::shared_ptr<Shared> shared;
  tbb::task_arena& arena;  // the executor's
  tbb::task_group drain_tasks;  // this engine's drain tasks, so ~Impl can wait for them

  // ---- consumer thread only ----
  std::vector<moodycamel::ProducerToken> producer_tokens;  // by lane
  std::vector<ReadyJob> meta;  // by slot: what was submitted there
  std::vector<uint32_t> free_slots;
  uint64_t next_seq = 0;
  uint64_t job_index = 0;
  uint64_t generation = 0;
  uint32_t issue_slot = 0;
  uint32_t expect_slot = 0;
  size_t in_flight = 0;
  // In order: how far ahead wait_for_run() parks (config().wake_after at
  // most; halved by each timeout with the awaited job done).
  size_t run_ahead = 0;
  uint32_t waits_without_runs = 0;
  // Out of order: slots wait_ready() took off `completed`, not yet released.
  size_t taken = 0;
  uint64_t submitted = 0;
  uint64_t released = 0;
};

Engine::Engine(const EngineConfig& config, TaskRunner& runner, std::shared_ptr<Executor> executor)
    : impl_(std::make_unique<Impl>(config, runner, std::move(executor))) {}
Engine::~Engine() = default;

void Engine::begin_pass() { impl_->begin_pass(); }
bool Engine::has_room() const noexcept { return impl_->has_room(); }
uint32_t Engine::next_slot() const noexcept { return impl_->next_slot(); }
void Engine::submit(int lane) { impl_->submit(lane); }
ReadyJob Engine::wait_ready(Clock::time_point deadline) { return impl_->wait_ready(deadline); }
bool Engine::try_ready(ReadyJob& ready) { return impl_->try_ready(ready); }
Clock::time_point Engine::deadline_from_now() const noexcept { return impl_->deadline_from_now(); }
void Engine::release(const ReadyJob& ready) noexcept { impl_->release(ready); }
void Engine::cancel() noexcept { impl_->cancel(); }
size_t Engine::num_workers() const noexcept { return impl_->config().num_workers; }
uint64_t Engine::cancellations() const noexcept {
  // Relaxed: a counter for observers; nothing is published through it.
  return impl_->shared->generation.load(std::memory_order_relaxed);
}

EngineStats Engine::stats() const noexcept {
  return {impl_->in_flight, impl_->config().window, impl_->submitted, impl_->released, impl_->run_ahead};
}

}  // namespace conveyor::detail
