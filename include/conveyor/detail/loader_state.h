// conveyor/detail/loader_state.h: a DataLoader's position, as the consumer
// has received it, and what a resumed epoch skips.
//
// A state never describes what is prefetched. fetch+collate (and the
// to_device stage after it) run ahead of the consumer; each result they take
// from the workers leaves a TakeRecord, and only when the consumer receives
// that batch is the record committed into the epoch's progress. Resuming is
// replay, not storage: the epoch starts again from the generators and sampler
// as they were when it began, the batches already received are drawn from
// the sampler again and dropped without being fetched (an iterable replica
// passes over them), and round_robin's generators are set to where they
// stood after each batch the consumer had received before the one to make.
//
// With in_order = false the consumer may receive a worker's later batch
// before an earlier one, so what was received is a set: a prefix and, above
// it, the batches received out of turn (at most a window), each with its
// worker's generator after it.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <vector>

#include "conveyor/generator.h"
#include "conveyor/state.h"

namespace conveyor::detail {

using OptionalPosition = std::optional<GeneratorPosition>;

// Batch numbers received: all below `prefix`, and those in `beyond`.
struct ReceivedSet {
  uint64_t prefix = 0;
  std::vector<uint64_t> beyond;              // sorted, all above prefix
  std::vector<OptionalPosition> beyond_generators;  // by beyond's entry: its generator after it

  bool contains(uint64_t number) const;
  // The generator after `number`, when it is in `beyond` (else nullptr).
  const OptionalPosition* generator_after(uint64_t number) const;
  // Adds `number`; `joined(n, generator)` sees each number that joins the
  // prefix, in order, with the generator after it.
  template <class Joined>
  void add(uint64_t number, OptionalPosition generator, Joined&& joined);
};

// One result fetch+collate took from its lanes. Plain data: one is noted
// per batch (the generator that made it travels beside it, when there is one).
struct TakeRecord {
  uint64_t batch_index = 0;
  // Iterable: the batch's number within its replica; with end_of_replica
  // and no output, how many the replica made.
  uint64_t ordinal = 0;
  int lane = 0;                 // the worker (iterable: the replica); 0 in the consumer's thread
  bool output = false;          // a batch or a failed batch: the consumer will receive it
  bool failed = false;          // a failed batch
  bool end_of_replica = false;  // iterable: that replica has no more
  // The sampler's error, thrown to the consumer in its place: nothing to
  // apply, but the consumer's receipt of it commits no batch after it.
  bool sampler_error = false;
};

// Where an epoch stands, as received: what a state holds and a resume reads.
struct EpochPosition {
  uint64_t received = 0;  // batches and failed batches the consumer got
  // Map-style: the sampler's errors the consumer got, each as the batch the
  // sampler was drawing. A resumed pass passes over its sampler's failures
  // there (the consumer has them) and hands out any other.
  std::vector<uint64_t> sampler_errors_at;
  // Map-style: the sampler's batches received.
  ReceivedSet batches;
  // Iterable, by replica: its batches received, how many of them failed,
  // how many it made in all once its end was received (-1 before); the
  // replica after the last taken.
  std::vector<ReceivedSet> lanes;
  std::vector<uint64_t> lane_failures;
  std::vector<int64_t> lane_end;
  uint64_t next_lane = 0;

  // Iterable: replica `lane` has handed over every batch it had.
  // False for a lane the position does not hold (a state between epochs
  // holds none).
  bool lane_done(size_t lane) const {
    return lane < lane_end.size() && lane < lanes.size() && lane_end[lane] >= 0 &&
           lanes[lane].prefix >= static_cast<uint64_t>(lane_end[lane]);
  }
  // round_robin, by worker (in the consumer's thread: the process's, slot
  // 0): the generator after its last batch below the prefix (its replica's
  // prefix), or as the pass began it.
  std::vector<OptionalPosition> generators;
  // round_robin, by worker: the generator as the pass began it (null: seeded
  // afresh). An iterable replica's pass over what was received draws from
  // it again (a shuffle buffer in the dataset, say), so it starts there.
  std::vector<OptionalPosition> start_generators;
};

// What an epoch has handed to its consumer. Consumer thread only.
struct EpochProgress {
  uint64_t epoch = 0;
  int64_t base_seed = 0;
  // The loader's generators and sampler as the epoch began (see
  // DataLoader::iter): the state a replay starts from.
  State start;
  bool live = true;   // its Epoch exists
  bool ended = false; // next() returned the end
  EpochPosition position;
  // In the consumer's thread: a resumed pass has not yet set the process
  // generator back (its sampler has not replayed): generators[0] is where it
  // will be, not where it is.
  bool seek_pending = false;

  // `lanes`: replicas of an iterable dataset (0: map-style); `workers`:
  // round_robin's worker count (a map-style batch's worker is its index
  // modulo it). `deferred`: a stage between fetch+collate and the consumer
  // runs ahead (to_device), so a result counts once the consumer has it;
  // otherwise it counts when taken (the consumer has it then).
  void begin(size_t lanes, size_t workers, bool deferred);
  // fetch+collate took a result; under round_robin, `generator` is the one
  // that made it (the worker's, or the process's in the consumer's thread),
  // after it.
  void note_taken(const TakeRecord& record, OptionalPosition&& generator) {
    if (!deferred_) {
      apply(record, generator);
    } else {
      defer(record, std::move(generator));
    }
  }
  // The sampler failed, and its error goes to the consumer after every
  // batch taken so far (and before any taken after).
  void note_sampler_error(uint64_t batch_index) {
    if (deferred_) {
      defer(TakeRecord{.batch_index = batch_index, .sampler_error = true}, std::nullopt);
    } else {
      position.sampler_errors_at.push_back(batch_index);
    }
  }
  // The consumer received the next batch (or failed batch, or sampler
  // error): commits the records up to it.
  void commit_received() {
    if (deferred_) commit_deferred();
  }
  // The consumer received the end: every record is committed (a replica's
  // end found after the last batch among them).
  void commit_end() {
    ended = true;
    while (deferred_ && pending_size_ > 0) commit_deferred();
  }

 private:
  // Once per batch: the common case (a map-style batch in turn, no
  // generator to note) inline, the rest in apply_any.
  void apply(const TakeRecord& record, const OptionalPosition& generator) {
    EpochPosition& at = position;
    if (record.output && !generator && at.lanes.empty() && record.batch_index == at.batches.prefix &&
        at.batches.beyond.empty()) {
      ++at.batches.prefix;
      ++at.received;
      return;
    }
    apply_any(record, generator);
  }
  void apply_any(const TakeRecord& record, const OptionalPosition& generator);
  void defer(const TakeRecord& record, OptionalPosition&& generator);
  void commit_deferred();
  bool deferred_ = false;
  size_t workers_ = 1;
  size_t mask_ = 0;  // pending_.size() - 1: the ring's size is a power of two
  // Iterable, by replica: the generator after its end was found (the last
  // draws it made), taken once every batch before it is received.
  std::vector<OptionalPosition> end_generators_;
  std::vector<TakeRecord> pending_;  // a ring: pending_head_ .. + pending_size_
  std::vector<OptionalPosition> pending_generators_;  // beside it (round_robin)
  size_t pending_head_ = 0;
  size_t pending_size_ = 0;
};

// What load_state_dict leaves for the next iter(): the epoch it resumes and
// what that epoch skips.
struct LoaderResume {
  uint64_t epoch = 0;
  std::optional<int64_t> base_seed;  // mid-epoch: the one the epoch drew
  EpochPosition position;
  // Taken once an epoch had ended: `position` holds only where persistent
  // workers' generators go on from; the epoch itself starts afresh.
  bool between_epochs = false;
};

// An epoch's position as the "epoch" member of a state, and back.
State position_to_state(const EpochPosition& position);
EpochPosition epoch_position_from_state(const State& state);

// The most draws a generator position in a state may count: a resume seeks
// there by replaying them (MT19937's discard(), about 5 ns a draw on a busy
// CI core: some 90 s at most), and a larger count (2^62 in a damaged state)
// never returned. A position counts one pass's draws (each pass rebases it),
// so only a worker, or the consumer's thread under round_robin, that draws
// more than this in one epoch (16 billion 32-bit draws: a million samples of
// 16,000 each) saves a state that load_state_dict refuses. A jump-ahead seek
// (polynomial arithmetic on MT19937's state) would lift the bound.
inline constexpr uint64_t kMostReplayedDraws = uint64_t{1} << 34;

// A generator position as a State ({"seed", "draws"[, "origin"]}), and back.
// Throws StateError for a position past kMostReplayedDraws.
State generator_to_state(const GeneratorPosition& position);
GeneratorPosition generator_from_state(const State& state);

template <class Joined>
void ReceivedSet::add(uint64_t number, OptionalPosition generator, Joined&& joined) {
  if (number != prefix) {
    const auto at = static_cast<std::ptrdiff_t>(std::lower_bound(beyond.begin(), beyond.end(), number) - beyond.begin());
    beyond.insert(beyond.begin() + at, number);
    beyond_generators.insert(beyond_generators.begin() + at, std::move(generator));
    return;
  }
  joined(prefix, generator);
  ++prefix;
  size_t merged = 0;
  while (merged < beyond.size() && beyond[merged] == prefix) {
    joined(prefix, beyond_generators[merged]);
    ++prefix;
    ++merged;
  }
  beyond.erase(beyond.begin(), beyond.begin() + static_cast<std::ptrdiff_t>(merged));
  beyond_generators.erase(beyond_generators.begin(), beyond_generators.begin() + static_cast<std::ptrdiff_t>(merged));
}

}  // namespace conveyor::detail
