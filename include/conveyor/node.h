// conveyor/node.h: the pipeline graph's building block (PyTorch RFC #49440's
// DataPipe, torchdata's BaseNode): a pull iterator over items of type T.
//
//   auto pipeline = conveyor::nodes::from_vector(paths)
//                 | conveyor::nodes::map(load)
//                 | conveyor::nodes::shuffle(1000)
//                 | conveyor::nodes::batch(64);
//   for (auto& batch : pipeline.pass(epoch)) train_step(batch);
//
// The contract every node keeps:
// - reset(pass) starts a pass (an epoch) over the node and everything
//   upstream of it. Nothing is opened, listed or read before the first reset
//   (lazy initialisation): a graph is cheap to build and to copy around.
// - next() blocks for the next item; std::nullopt ends the pass. try_next()
//   never waits on another thread or on I/O: an item, "not yet"
//   (Poll::pending) or the end. A node that computes in the caller's thread
//   asks its upstream with try_next() too, and is "not yet" when upstream
//   is; what it gathered stays for the next call. A source computes its
//   items (a user's dataset or stream is called, and may block).
// - An exception from user code inside a node leaves next() as a NodeError
//   naming the node and the item's position, the original nested; the next
//   call goes on with the following item (as the DataLoader goes on past a
//   failed batch).
// - Randomness is reproducible: a node draws from generators seeded from
//   (the pass's seed, epoch, the node's id, the item's position), so a
//   pipeline yields the same items however it is run (0 or N workers).
// - Sharding happens once per path, in the framework: the pass names the
//   shard (rank x worker of world_size x num_workers) and the most upstream
//   node that is shardable takes only its part; every other node sees its
//   share. Each input of zip, mux, weighted_mux and join takes it on its
//   own. A pass with more than one shard where no node can take it (a file
//   lister with no shard() after it) is a ValueError, not every rank
//   reading everything.
//
// - Checkpoints (Pipeline::state / load_state): a pass resumes by replay.
//   The state is the pass (epoch, seed, shard), how many outputs the
//   consumer received, and what timing decided (join's sources, the order
//   of a map with in_order = false). Resuming resets the pass and skips
//   that many outputs: each node skips as cheaply as its semantics allow (a
//   source jumps, a map passes the skip upstream without running f, batch
//   multiplies, shuffle replays its draws on positions), and pulls and
//   drops where it cannot. Nothing is stored that replay recomputes.
//
// Thread-safety: a node is advanced by one thread at a time (a parallel node
// runs user code on many, and keeps its own upstream on one).
#pragma once

#include <algorithm>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <iterator>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "conveyor/buffer.h"
#include "conveyor/errors.h"
#include "conveyor/state.h"

namespace conveyor {

// What a non-blocking next found.
enum class Poll {
  ready,    // an item is in `out`
  pending,  // none is ready yet; asking again later may give one
  end,      // the pass is over
};

// The shard a pass runs as: rank `rank` of `world_size` processes, worker
// `worker` of its `num_workers`. Shard index rank * num_workers + worker of
// world_size * num_workers, as a DistributedSampler strides ranks and an
// IterableDataset strides workers.
struct ShardSpec {
  int64_t rank = 0;
  int64_t world_size = 1;
  int64_t worker = 0;
  int64_t num_workers = 1;

  int64_t index() const noexcept { return rank * num_workers + worker; }
  int64_t count() const noexcept { return world_size * num_workers; }
  // Throws ValueError naming the field that is out of range.
  void validate() const;
};

// What one pass gives every node in the graph.
struct PassContext {
  uint64_t epoch = 0;
  uint64_t seed = 0;  // the pipeline's base seed
  ShardSpec shard;
  bool timed = false;  // nodes time themselves for metrics (two or three clock reads per item each)
  // Where collate nodes allocate their batches: the pinned pool of a
  // pin_memory downstream of them; nullptr for the heap.
  BufferAllocator* batch_memory = nullptr;
};

// What a node did in its current (or last) pass: Pipeline::metrics().
// The work this process did: a resumed pass counts what its replay runs
// again (items pulled and made, failures met and skipped again, f's time),
// and nothing for what it passes over by arithmetic (a clean skip), so
// runs' metrics do not add up to one uninterrupted pass's.
struct NodeMetrics {
  std::string name;
  uint64_t id = 0;
  uint64_t items_in = 0;   // taken from upstream
  uint64_t items_out = 0;  // handed downstream
  uint64_t skipped = 0;    // dropped under OnError::skip
  // With timed passes: time in the node itself (a parallel node's workers
  // summed), time it waited for its upstream, and time it waited for its
  // downstream: from handing an item out to being asked for the next (the
  // consumer's own time; a parallel node works on through it until its
  // window is full, a serial one is idle).
  double busy_seconds = 0;
  double upstream_wait_seconds = 0;
  double downstream_wait_seconds = 0;
  // Parallel nodes: the window, and how full it was when the consumer asked
  // (prefetch: how many items were ready then, counting the one taken).
  size_t window = 0;
  double mean_in_flight = 0;
};

// The metrics as an aligned text table, one node per line, sources first.
std::string metrics_table(const std::vector<NodeMetrics>& nodes);

namespace detail {
class Executor;  // detail/engine.h

// Filled in while a reset walks the graph from the sink up: ids are handed
// out in that walk's order (the same for the same graph shape), and the
// first shardable node to see `sharded == false` applies the shard.
struct ResetWalk {
  uint64_t next_id = 0;
  bool sharded = false;
  // The first node upstream whose output order timing decides (a map out
  // of order, join), by name; empty if none. A shard taken after it would
  // split a different stream on each rank.
  std::string ordered_by_timing;
  // The threads the graph's parallel nodes share (one arena per graph):
  // made when the first of them asks (walk_executor), held by each.
  std::shared_ptr<Executor> executor;
  // A pass resuming from a state: its "nodes" member, what nodes saved
  // (save_extras) by id; null otherwise. Shared: a node that resets its
  // upstream again later in the pass (shuffle) keeps a copy of the walk.
  std::shared_ptr<const State> restoring;
  // This reset starts the current pass over from its first item (a resumed
  // shuffle that found its upstream ending sooner than it assumed). A fork
  // cannot start over one branch while another shares its pass.
  bool restart = false;
};

// What `walk` restores for node `id`, or nullptr.
inline const State* restored_extras(const ResetWalk& walk, uint64_t id) {
  return walk.restoring ? walk.restoring->find(std::to_string(id)) : nullptr;
}

// Saved extras that only spare a resumed pass what it would learn anyway by
// running (where a shuffle's upstream ended) hold this member, true: a pass
// resumed without them (a round of repeat() more than one behind the saved
// one) is still exact.
inline constexpr std::string_view kHintOnly = "hint_only";

// The walk's executor, made on first use.
std::shared_ptr<Executor> walk_executor(ResetWalk& walk);
}  // namespace detail

// The seed of item `position` of node `node_id` in a pass: independent of
// how many threads produce the items. `past_shard`: the node is downstream
// of the one that applied pass.shard, so its positions count its shard's
// items alone; the shard's index is folded in, or item k of every shard
// would draw alike (the same crop on every rank). Upstream of that point
// every shard sees the same stream and must draw the same.
uint64_t item_seed(const PassContext& pass, uint64_t node_id, uint64_t position, bool past_shard = false) noexcept;

// An exception from user code inside a node (a map function, a filter
// predicate, a collate function, a source), with where it happened. The
// original is nested: `std::rethrow_if_nested(e)` or `e.original()`.
class NodeError : public Error, public std::nested_exception {
 public:
  // Must be constructed in the catch block of the original exception.
  NodeError(const std::string& what, std::string node, uint64_t position)
      : Error(what), node_(std::move(node)), position_(position) {}
  const std::string& node() const noexcept { return node_; }
  // The failed item's position in the node's input (0 for the first).
  uint64_t position() const noexcept { return position_; }
  std::exception_ptr original() const noexcept { return nested_ptr(); }

 private:
  std::string node_;
  uint64_t position_;
};

namespace detail {
// Rethrows the exception in flight as a NodeError naming `node` and
// `position`, nesting it (a NodeError too: one from an inner pipeline that
// user code runs). Call inside a catch block whose try holds only the
// node's own work: an upstream NodeError must not pass through it.
[[noreturn]] void throw_node_error(const std::string& node, uint64_t position);
}  // namespace detail

template <class T>
class Node {
 public:
  using item_type = T;
  virtual ~Node() = default;

  // Starts a pass. Resets everything upstream first.
  void reset(const PassContext& pass) {
    detail::ResetWalk walk;
    reset(pass, walk);
  }
  // The graph walk behind reset(): resets upstream, then takes this node's
  // id (walk.next_id++) and, if shardable and nothing upstream sharded yet,
  // applies pass.shard and sets walk.sharded. A node with several inputs
  // clears walk.sharded before each (each path takes the shard on its own).
  virtual void reset(const PassContext& pass, detail::ResetWalk& walk) = 0;

  virtual std::optional<T> next() = 0;
  virtual Poll try_next(std::optional<T>& out) {
    out = next();
    return out ? Poll::ready : Poll::end;
  }

  // For errors and metrics: "map", "batch(64)", "untar".
  virtual std::string name() const = 0;

  // Appends this node's metrics after its upstream's (sources first).
  virtual void collect_metrics(std::vector<NodeMetrics>& out) const { out.push_back({name()}); }

  // Checkpoints. skip(): passes over the next `count` outputs of this pass
  // without handing them out, errors counting as outputs as items do, and
  // returns how many there were (fewer at the pass's end). `clean`: none of
  // them is an error, so a node may skip by arithmetic where errors would
  // shift its count (batch). The default pulls and drops; nodes override it
  // to skip cheaply. Called right after a reset, before any next().
  virtual uint64_t skip(uint64_t count, bool clean);
  // Writes what this node and everything upstream of it decided by timing
  // into `nodes` (by id), for a resumed pass to replay (ResetWalk::restoring).
  // Called from the consumer's thread while the pass runs (`in_pass`) or
  // between passes (the state is then the next pass's: what the last pass
  // decided does not belong in it, only what the next one starts from).
  virtual void save_extras(State& /*nodes*/, bool /*in_pass*/) const {}
};

template <class T>
uint64_t Node<T>::skip(uint64_t count, bool /*clean*/) {
  uint64_t skipped = 0;
  while (skipped < count) {
    try {
      if (!next()) break;
    } catch (...) {
      // A failed item is an output like any other: it was handed out (thrown).
    }
    ++skipped;
  }
  return skipped;
}

template <class T>
using NodePtr = std::unique_ptr<Node<T>>;

// A node graph ending in items of type T: what a source makes and every
// `| adaptor` step returns. Owns the graph; moves, does not copy.
template <class T>
class Pipeline {
 public:
  using item_type = T;

  explicit Pipeline(NodePtr<T> node) : node_(std::move(node)) {}

  Node<T>& node() noexcept { return *node_; }
  NodePtr<T> release() && noexcept { return std::move(node_); }

  // Settings a pass uses: the base seed and the shard. set_epoch() names
  // the epoch of the next pass (else passes count 0, 1, 2...).
  Pipeline& seed(uint64_t seed) noexcept {
    seed_ = seed;
    return *this;
  }
  Pipeline& shard(ShardSpec spec) {
    spec.validate();
    shard_ = spec;
    return *this;
  }
  void set_epoch(uint64_t epoch) noexcept { epoch_ = epoch; }
  // Passes time every node (busy and waiting); off by default.
  Pipeline& timed(bool on = true) noexcept {
    timed_ = on;
    return *this;
  }

  // Every node's metrics for the current (or last) pass, sources first.
  std::vector<NodeMetrics> metrics() const {
    check_not_moved_from("metrics");
    std::vector<NodeMetrics> out;
    node_->collect_metrics(out);
    return out;
  }

  // One pass, as a range: for (auto& item : pipeline.pass()) ...
  // A new pass resets the nodes: a Pass of this pipeline still alive then
  // throws ValueError on its next use instead of reading the new pass.
  class Pass;
  Pass pass() {
    check_not_moved_from("pass");
    if (resume_ && resume_->epoch != epoch_) {
      throw StateError("this pipeline resumes pass " + std::to_string(resume_->epoch) +
                       " (load_state), but set_epoch(" + std::to_string(epoch_) + ") asked for another");
    }
    // seed() and shard() may come after load_state (restore, then join the
    // job): the pass checks them against the state again.
    if (resume_) check_state_envelope(resume_->saved, "conveyor.Pipeline", fingerprint(), "pass after load_state");
    const PassContext context{epoch_, seed_, shard_, timed_};
    auto progress = std::make_shared<PassProgress>();
    progress->epoch = context.epoch;
    detail::ResetWalk walk;
    if (resume_) walk.restoring = std::make_shared<const State>(resume_->nodes);
    // A pass refused below (its state does not fit the data) leaves the
    // pipeline where it stood: the same epoch, the state still loaded.
    std::optional<Resume> resume = std::exchange(resume_, std::nullopt);
    struct Refused {
      Pipeline& pipeline;
      std::optional<Resume>& resume;
      bool accepted = false;
      ~Refused() {
        if (!accepted) pipeline.resume_ = std::move(resume);
      }
    } refused{*this, resume};
    if (progress_ && progress_->live) progress_->superseded = true;
    node_->reset(context, walk);
    if (!walk.sharded && context.shard.count() > 1) {
      throw ValueError("pipeline: the pass runs as rank " + std::to_string(context.shard.rank) + " of " +
                       std::to_string(context.shard.world_size) + ", worker " + std::to_string(context.shard.worker) +
                       " of " + std::to_string(context.shard.num_workers) +
                       ", but no node takes the shard, so every rank and worker would read all of it: start from "
                       "a shardable source (from_vector, from_range, from_sampler, from_map_dataset, from_iterable) or add "
                       "shard() after the source");
    }
    if (resume && resume->received > 0) {
      const uint64_t skipped = node_->skip(resume->received, resume->errors == 0);
      if (skipped < resume->received) {
        throw StateError("load_state: pass " + std::to_string(context.epoch) + " ended after " +
                         std::to_string(skipped) + " items, but the state's consumer had received " +
                         std::to_string(resume->received) + ": the data is not what it was");
      }
      progress->received = resume->received;
      progress->errors = resume->errors;
    }
    refused.accepted = true;
    ++epoch_;
    progress_ = progress;
    resumed_ = std::move(resume);
    return Pass(*node_, std::move(progress));
  }

  // ---- checkpoints ----------------------------------------------------
  //
  // state(): where the consumer of the current pass is (the outputs it
  // received, errors included, and what timing decided upstream), or, with
  // no pass going on or a loaded one not yet begun, the next pass. load_state() into a pipeline built the
  // same way makes its next pass() hand out exactly what the saved one had
  // not, then the passes after it. The fingerprint holds the graph's shape
  // (its nodes' names, sources first), the seed and the shard.
  State state() const {
    check_not_moved_from("state");
    // A loaded state whose pass has not begun is the next pass: saved
    // again, it must resume where it does (reporting the last pass, or a
    // fresh one, handed its items out twice), under the fingerprint it was
    // saved with: a seed() or shard() since then makes pass() refuse it, and
    // so must every other pipeline.
    if (resume_) return loaded_state(*resume_);
    const bool in_pass = progress_ && progress_->live && !progress_->ended;
    // So is a resumed pass that has handed nothing out since: its nodes may
    // not have replayed their part yet (a shuffle fills its buffer at its
    // first item), and would describe the pass's start (a repeat's round 0
    // under 311 items received, refused on loading).
    if (in_pass && resumed_ && progress_->epoch == resumed_->epoch && progress_->received == resumed_->received) {
      return loaded_state(*resumed_);
    }
    State out = state_envelope("conveyor.Pipeline", fingerprint());
    out.set("epoch", in_pass ? progress_->epoch : epoch_);
    out.set("received", in_pass ? progress_->received : uint64_t{0});
    out.set("errors", in_pass ? progress_->errors : uint64_t{0});
    State nodes = State::object();
    node_->save_extras(nodes, in_pass);
    out.set("nodes", std::move(nodes));
    return out;
  }
  // Throws StateError for a state of another kind or version, or whose
  // fingerprint differs (naming the field).
  void load_state(const State& state) {
    check_not_moved_from("load_state");
    check_state_envelope(state, "conveyor.Pipeline", fingerprint(), "load_state");
    Resume resume;
    resume.saved = state_envelope("conveyor.Pipeline", state.at("fingerprint"));
    resume.epoch = state.uint_at("epoch");
    resume.received = state.uint_at("received");
    resume.errors = state.uint_at("errors");
    if (resume.errors > resume.received) {
      throw StateError("load_state: the state's consumer had " + std::to_string(resume.errors) +
                       " errors among " + std::to_string(resume.received) +
                       " outputs received: errors are outputs, so at most as many");
    }
    resume.nodes = state.at("nodes");
    if (!resume.nodes.is_object()) throw StateError("load_state: 'nodes' should be an object");
    epoch_ = resume.epoch;
    resume_ = std::move(resume);
  }

 private:
  // The consumer's count in a pass; shared with its Pass (which may outlive
  // a moved pipeline).
  struct PassProgress {
    uint64_t epoch = 0;
    uint64_t received = 0;  // outputs handed to the consumer, errors included
    uint64_t errors = 0;
    bool ended = false;
    bool live = true;  // its Pass exists
    bool superseded = false;  // a later pass() reset the nodes under it
  };
  void check_not_moved_from(const char* function) const {
    if (!node_) {
      throw ValueError(std::string("pipeline: ") + function +
                       "() on a pipeline that was moved from (into `| adaptor`, or by release()): use the pipeline "
                       "it was moved into");
    }
  }
  struct Resume {
    State saved;  // the state's envelope and fingerprint, for pass()
    uint64_t epoch = 0;
    uint64_t received = 0;
    uint64_t errors = 0;
    State nodes;
  };
  // A loaded state as state() gives it back, under the fingerprint it was
  // saved with.
  static State loaded_state(const Resume& resume) {
    State out = resume.saved;
    out.set("epoch", resume.epoch);
    out.set("received", resume.received);
    out.set("errors", resume.errors);
    out.set("nodes", resume.nodes);
    return out;
  }

  // The graph's shape: its nodes' names, without how they run (a map's
  // workers, requests in flight, a prefetch's or a transfer's depth): a
  // pass's items do not depend on that, so a state loads whatever those are.
  State fingerprint() const {
    State names = State::array();
    for (const NodeMetrics& node : metrics()) {
      if (node.name.starts_with("prefetch(")) continue;
      names.push_back(without_run_settings(node.name));
    }
    State shard = State::object();
    shard.set("rank", shard_.rank);
    shard.set("world_size", shard_.world_size);
    shard.set("worker", shard_.worker);
    shard.set("num_workers", shard_.num_workers);
    State out = State::object();
    out.set("nodes", std::move(names));
    out.set("seed", seed_);
    out.set("shard", std::move(shard));
    return out;
  }

  // A node's name without how it runs: "map(workers=4, in_order=false)" ->
  // "map(in_order=false)", "async_map(max_in_flight=64)" -> "async_map",
  // "to_device(2)" -> "to_device". A serial map and a parallel one, or 64
  // requests in flight and 1024, hand out the same items; an order or an
  // error policy (in_order, on_error) changes them and stays.
  static std::string without_run_settings(const std::string& name) {
    if (name.starts_with("to_device(")) return "to_device";
    const size_t open = name.find('(');
    if (open == std::string::npos || !name.ends_with(')')) return name;
    const size_t close = name.size() - 1;
    std::string kept;
    for (size_t at = open + 1; at < close;) {
      const size_t end = std::min(name.find(", ", at), close);
      const std::string setting = name.substr(at, end - at);
      if (!setting.starts_with("workers=") && !setting.starts_with("max_in_flight=")) {
        kept += (kept.empty() ? "" : ", ") + setting;
      }
      at = end + 2;
    }
    return kept.empty() ? name.substr(0, open) : name.substr(0, open + 1) + kept + ")";
  }

  NodePtr<T> node_;
  uint64_t seed_ = 0;
  uint64_t epoch_ = 0;
  ShardSpec shard_;
  bool timed_ = false;
  std::shared_ptr<PassProgress> progress_;  // the last pass's
  std::optional<Resume> resume_;            // load_state's, for the next pass
  std::optional<Resume> resumed_;           // the one the current pass began from
};

template <class T>
class Pipeline<T>::Pass {
 public:
  // Counts what the consumer receives (Pipeline::state).
  ~Pass() {
    if (progress_) progress_->live = false;
  }
  Pass(Pass&&) noexcept = default;

  class iterator {
   public:
    using value_type = T;
    using difference_type = std::ptrdiff_t;
    using iterator_concept = std::input_iterator_tag;
    iterator() = default;
    T& operator*() const { return **current_; }
    T* operator->() const { return &**current_; }
    iterator& operator++() {
      current_->reset();
      if (std::optional<T> item = counted_next(*node_, *progress_)) current_->emplace(std::move(*item));
      return *this;
    }
    void operator++(int) { ++*this; }
    friend bool operator==(const iterator& it, std::default_sentinel_t) noexcept {
      return !it.current_->has_value();
    }

   private:
    friend class Pass;
    iterator(Node<T>& node, PassProgress& progress)
        : node_(&node), progress_(&progress), current_(std::make_unique<std::optional<T>>()) {
      ++*this;
    }
    Node<T>* node_ = nullptr;
    PassProgress* progress_ = nullptr;
    std::unique_ptr<std::optional<T>> current_;  // on the heap: see DataLoader::iterator
  };

  // The blocking and non-blocking next of the pass's last node.
  std::optional<T> next() { return counted_next(node_, *progress_); }
  Poll try_next(std::optional<T>& out) {
    check_current(*progress_);
    Poll poll = Poll::pending;
    try {
      poll = node_.try_next(out);
    } catch (...) {
      ++progress_->received;
      ++progress_->errors;
      throw;
    }
    if (poll == Poll::ready) ++progress_->received;
    if (poll == Poll::end) progress_->ended = true;
    return poll;
  }

  iterator begin() { return iterator(node_, *progress_); }
  std::default_sentinel_t end() const noexcept { return {}; }

 private:
  friend class Pipeline;
  Pass(Node<T>& node, std::shared_ptr<PassProgress> progress) : node_(node), progress_(std::move(progress)) {}
  static void check_current(const PassProgress& progress) {
    if (progress.superseded) {
      throw ValueError("pipeline: this pass was replaced by a later pass() of its pipeline, which reset the nodes "
                       "under it; take items from the new pass");
    }
  }
  static std::optional<T> counted_next(Node<T>& node, PassProgress& progress) {
    check_current(progress);
    std::optional<T> item;
    try {
      item = node.next();
    } catch (...) {
      ++progress.received;
      ++progress.errors;
      throw;
    }
    if (item) {
      ++progress.received;
    } else {
      progress.ended = true;
    }
    return item;
  }
  Node<T>& node_;
  std::shared_ptr<PassProgress> progress_;
};

// `pipeline | adaptor`: an adaptor is anything callable with a Pipeline<T>&&
// that returns the longer pipeline (conveyor::nodes::map(f), batch(64), ...).
template <class T, class Adaptor>
  requires std::invocable<Adaptor, Pipeline<T>&&>
auto operator|(Pipeline<T>&& pipeline, Adaptor&& adaptor) {
  return std::forward<Adaptor>(adaptor)(std::move(pipeline));
}

}  // namespace conveyor
