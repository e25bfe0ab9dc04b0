// A loader's position as its consumer received it; see detail/loader_state.h.
#include "conveyor/detail/loader_state.h"

#include <algorithm>
#include <memory>
#include <string>
#include <utility>

namespace conveyor::detail {

bool ReceivedSet::contains(uint64_t number) const {
  return number < prefix || std::binary_search(beyond.begin(), beyond.end(), number);
}

const OptionalPosition* ReceivedSet::generator_after(uint64_t number) const {
  const auto it = std::lower_bound(beyond.begin(), beyond.end(), number);
  if (it == beyond.end() || *it != number) return nullptr;
  return &beyond_generators[static_cast<size_t>(it - beyond.begin())];
}

void EpochProgress::begin(size_t lanes, size_t workers, bool deferred) {
  deferred_ = deferred;
  position = EpochPosition{};
  position.lanes.assign(lanes, ReceivedSet{});
  position.lane_failures.assign(lanes, 0);
  position.lane_end.assign(lanes, -1);
  workers_ = std::max<size_t>(workers, 1);
  end_generators_.assign(lanes, std::nullopt);
  pending_size_ = 0;
  pending_head_ = 0;
}

void EpochProgress::defer(const TakeRecord& record, OptionalPosition&& generator) {
  if (pending_size_ == pending_.size()) {
    // Full: unroll the ring into one twice as large (only while the stages
    // after fetch+collate first fill up; never in a steady epoch).
    const size_t size = std::max<size_t>(4, 2 * pending_.size());
    std::vector<TakeRecord> larger(size);
    std::vector<OptionalPosition> larger_generators(size);
    for (size_t i = 0; i < pending_size_; ++i) {
      larger[i] = pending_[(pending_head_ + i) & mask_];
      larger_generators[i] = std::move(pending_generators_[(pending_head_ + i) & mask_]);
    }
    pending_ = std::move(larger);
    pending_generators_ = std::move(larger_generators);
    mask_ = size - 1;
    pending_head_ = 0;
  }
  const size_t slot = (pending_head_ + pending_size_) & mask_;
  pending_[slot] = record;
  if (generator || pending_generators_[slot]) pending_generators_[slot] = std::move(generator);
  ++pending_size_;
}

void EpochProgress::commit_deferred() {
  while (pending_size_ > 0) {
    const size_t slot = pending_head_;
    pending_head_ = (pending_head_ + 1) & mask_;
    --pending_size_;
    if (pending_[slot].sampler_error) {  // what the consumer just received
      position.sampler_errors_at.push_back(pending_[slot].batch_index);
      return;
    }
    apply(pending_[slot], pending_generators_[slot]);
    if (pending_[slot].output) return;
  }
}

void EpochProgress::apply_any(const TakeRecord& record, const OptionalPosition& generator) {
  EpochPosition& at = position;
  const auto lane = static_cast<size_t>(record.lane);
  auto set_generator = [&at](size_t worker, const OptionalPosition& generator) {
    if (!generator) return;
    if (at.generators.size() <= worker) at.generators.resize(worker + 1);
    at.generators[worker] = generator;
  };
  if (!at.lanes.empty()) {  // iterable
    if (record.output) {
      if (record.failed) ++at.lane_failures[lane];
      at.lanes[lane].add(record.ordinal, generator,
                         [&](uint64_t, const OptionalPosition& generator) { set_generator(lane, generator); });
    }
    if (record.end_of_replica) {
      at.lane_end[lane] = static_cast<int64_t>(record.ordinal + (record.output ? 1 : 0));
      end_generators_[lane] = generator;
    }
    if (at.lane_done(lane)) set_generator(lane, end_generators_[lane]);
    at.next_lane = (lane + 1) % at.lanes.size();
  } else if (record.output) {
    at.batches.add(record.batch_index, generator, [&](uint64_t batch, const OptionalPosition& after) {
      set_generator(static_cast<size_t>(batch % workers_), after);
    });
  }
  if (record.output) ++at.received;
}

State generator_to_state(const GeneratorPosition& position) {
  State out = State::object();
  out.set("seed", position.seed);
  out.set("draws", position.draws);
  if (position.origin) out.set("origin", std::string(position.origin->begin(), position.origin->end()));
  return out;
}

GeneratorPosition generator_from_state(const State& state) {
  GeneratorPosition position;
  position.seed = state.uint_at("seed");
  position.draws = state.uint_at("draws");
  if (position.draws > kMostReplayedDraws) {
    throw StateError("load_state_dict: a generator position's 'draws' (" + std::to_string(position.draws) +
                     ") is more than a resume replays (at most " + std::to_string(kMostReplayedDraws) + ")");
  }
  if (const State* origin = state.find("origin")) {
    const std::string& text = origin->as_string("origin");
    position.origin = std::make_shared<const std::vector<uint8_t>>(text.begin(), text.end());
    // Checked now, on a scratch engine: a bad one would otherwise fail only
    // when a worker seeks to it (or in a destructor that applies a seek).
    try {
      Generator scratch;
      scratch.set_state(*position.origin);
    } catch (const std::exception& error) {
      throw StateError(std::string("load_state_dict: a generator position's 'origin' is not a generator's state: ") +
                       error.what());
    }
  }
  return position;
}

namespace {

State generators_to_state(const std::vector<OptionalPosition>& generators) {
  State out = State::array();
  for (const OptionalPosition& position : generators) out.push_back(position ? generator_to_state(*position) : State());
  return out;
}

std::vector<OptionalPosition> generators_from_state(const State& state) {
  std::vector<OptionalPosition> out;
  for (const State& position : state.items()) {
    out.push_back(position.is_null() ? std::nullopt : OptionalPosition(generator_from_state(position)));
  }
  return out;
}

State set_to_state(const ReceivedSet& set) {
  State out = State::object();
  out.set("prefix", set.prefix);
  out.set("beyond", State::list(set.beyond));
  out.set("beyond_generators", generators_to_state(set.beyond_generators));
  return out;
}

ReceivedSet set_from_state(const State& state) {
  ReceivedSet set;
  set.prefix = state.uint_at("prefix");
  set.beyond = state.at("beyond").as_uint_list("beyond");
  set.beyond_generators = generators_from_state(state.at("beyond_generators"));
  if (!std::is_sorted(set.beyond.begin(), set.beyond.end()) ||
      std::adjacent_find(set.beyond.begin(), set.beyond.end()) != set.beyond.end() ||
      (!set.beyond.empty() && set.beyond.front() <= set.prefix)) {
    throw StateError("load_state_dict: 'beyond' should list batches after 'prefix' (" + std::to_string(set.prefix) +
                     "), each once, in increasing order, but it is " + state.at("beyond").to_json().substr(0, 200));
  }
  if (set.beyond_generators.size() != set.beyond.size()) {
    throw StateError("load_state_dict: 'beyond_generators' should hold one entry per batch in 'beyond' (" +
                     std::to_string(set.beyond.size()) + "), but it holds " +
                     std::to_string(set.beyond_generators.size()));
  }
  return set;
}

}  // namespace

State position_to_state(const EpochPosition& position) {
  State out = State::object();
  out.set("received", position.received);
  out.set("batches", set_to_state(position.batches));
  if (!position.sampler_errors_at.empty()) out.set("sampler_errors_at", State::list(position.sampler_errors_at));
  if (!position.lanes.empty()) {
    State lanes = State::array();
    for (size_t lane = 0; lane < position.lanes.size(); ++lane) {
      State entry = set_to_state(position.lanes[lane]);
      entry.set("failures", position.lane_failures[lane]);
      entry.set("end", position.lane_end[lane]);
      lanes.push_back(std::move(entry));
    }
    out.set("lanes", std::move(lanes));
    out.set("next_lane", position.next_lane);
  }
  out.set("generators", generators_to_state(position.generators));
  out.set("start_generators", generators_to_state(position.start_generators));
  return out;
}

EpochPosition epoch_position_from_state(const State& state) {
  EpochPosition position;
  position.received = state.uint_at("received");
  position.batches = set_from_state(state.at("batches"));
  if (const State* errors = state.find("sampler_errors_at")) {
    position.sampler_errors_at = errors->as_uint_list("sampler_errors_at");
    if (!std::is_sorted(position.sampler_errors_at.begin(), position.sampler_errors_at.end())) {
      throw StateError("load_state_dict: 'sampler_errors_at' should list batches in order, but it is " +
                       errors->to_json().substr(0, 200));
    }
  }
  // Every batch received is in one set, once: 'received' counts them again.
  uint64_t in_sets = 0;
  bool overflow = false;
  auto count = [&](const ReceivedSet& set) {
    overflow |= __builtin_add_overflow(in_sets, set.prefix, &in_sets);
    overflow |= __builtin_add_overflow(in_sets, set.beyond.size(), &in_sets);
    return set.prefix + set.beyond.size();  // the sets' checks keep beyond above prefix: no wrap
  };
  count(position.batches);
  if (const State* lanes = state.find("lanes")) {
    if (position.batches.prefix > 0 || !position.batches.beyond.empty()) {
      throw StateError("load_state_dict: an iterable dataset's epoch counts its batches in 'lanes', but 'batches' "
                       "holds some: " + state.at("batches").to_json().substr(0, 200));
    }
    for (const State& entry : lanes->items()) {
      const std::string lane = "'lanes[" + std::to_string(position.lanes.size()) + "].";
      const ReceivedSet& set = position.lanes.emplace_back(set_from_state(entry));
      const uint64_t received = count(set);
      position.lane_failures.push_back(entry.uint_at("failures"));
      position.lane_end.push_back(entry.int_at("end"));
      if (position.lane_failures.back() > received) {
        throw StateError("load_state_dict: " + lane + "failures' (" + std::to_string(position.lane_failures.back()) +
                         ") should be at most the batches received from that replica (" + std::to_string(received) +
                         ")");
      }
      // Its end is the count it made, known once received: every batch
      // received from it is below that.
      const int64_t end = position.lane_end.back();
      if (end < -1 || (end >= 0 && (set.prefix > static_cast<uint64_t>(end) ||
                                    (!set.beyond.empty() && set.beyond.back() >= static_cast<uint64_t>(end))))) {
        throw StateError("load_state_dict: " + lane + "end' (" + std::to_string(end) +
                         ") should be -1 (not reached) or the batches that replica made, above every one received "
                         "from it (" + entry.at("prefix").to_json() + " in turn, " +
                         entry.at("beyond").to_json().substr(0, 200) + " beyond)");
      }
    }
    position.next_lane = state.uint_at("next_lane");
    if (position.lanes.empty() || position.next_lane >= position.lanes.size()) {
      throw StateError("load_state_dict: 'next_lane' should name one of the " + std::to_string(position.lanes.size()) +
                       " replicas, but it is " + std::to_string(position.next_lane));
    }
  }
  if (overflow || in_sets != position.received) {
    throw StateError("load_state_dict: 'received' (" + std::to_string(position.received) +
                     ") should be the batches received in turn ('prefix') and out of turn ('beyond')" +
                     (position.lanes.empty() ? std::string() : " of every replica in 'lanes'") + ": " +
                     (overflow ? std::string("more than 2^64") : std::to_string(in_sets)));
  }
  position.generators = generators_from_state(state.at("generators"));
  position.start_generators = generators_from_state(state.at("start_generators"));
  return position;
}

}  // namespace conveyor::detail
