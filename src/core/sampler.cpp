// Samplers: each iterator draws where the matching Python generator function
// draws, so a shared generator advances exactly as PyTorch's does.
#include "conveyor/sampler.h"

#include <algorithm>
#include <array>
#include <cstdint>
#include <limits>
#include <string>
#include <utility>

#include "conveyor/errors.h"

namespace conveyor {
namespace {

// Hands out a materialised vector of indices.
class VectorIterator final : public SamplerIterator<size_t> {
 public:
  explicit VectorIterator(std::vector<size_t> indices) : indices_(std::move(indices)) {}
  bool next(size_t& out) override {
    if (position_ == indices_.size()) return false;
    out = indices_[position_++];
    return true;
  }

 private:
  std::vector<size_t> indices_;
  size_t position_ = 0;
};

// Draws its vector on the first next(), as a Python generator body starts.
template <class Draw>
class LazyIterator final : public SamplerIterator<size_t> {
 public:
  explicit LazyIterator(Draw draw) : draw_(std::move(draw)) {}
  bool next(size_t& out) override {
    if (!drawn_) {
      drawn_ = true;  // before the draw: a generator that raised is finished
      indices_ = draw_();
    }
    if (position_ == indices_.size()) return false;
    out = indices_[position_++];
    return true;
  }

 private:
  Draw draw_;
  bool drawn_ = false;
  std::vector<size_t> indices_;
  size_t position_ = 0;
};

template <class Draw>
std::unique_ptr<SamplerIterator<size_t>> lazy(Draw draw) {
  return std::make_unique<LazyIterator<Draw>>(std::move(draw));
}

class SequentialIterator final : public SamplerIterator<size_t> {
 public:
  explicit SequentialIterator(size_t size) : size_(size) {}
  bool next(size_t& out) override {
    if (next_ == size_) return false;
    out = next_++;
    return true;
  }

 private:
  size_t size_;
  size_t next_ = 0;
};

// RandomSampler.__iter__, step by step: draws happen when the consumer asks
// for the first index of each randperm / randint chunk, and the trailing
// remainder draw happens even when the remainder is empty. It holds copies of
// what it reads (the generator a handle on the sampler's own engine), so it
// may outlive its sampler, as Python's generator keeps its sampler alive.
class RandomIterator final : public SamplerIterator<size_t> {
 public:
  RandomIterator(DataSize data_size, bool replacement, std::optional<size_t> num_samples,
                 std::optional<Generator> generator)
      : data_size_fn_(std::move(data_size)),
        replacement_(replacement),
        num_samples_given_(num_samples),
        shared_generator_(std::move(generator)) {}

  bool next(size_t& out) override {
    while (position_ == block_.size()) {
      if (finished_) return false;
      step();
    }
    out = block_[position_++];
    return true;
  }

 private:
  static constexpr size_t kChunk = 32;

  // The next block, starting the pass first. A throw finishes the pass, as a
  // Python generator that raised is finished: next() then returns false.
  void step() {
    try {
      if (!started_) start();
      draw_block();
    } catch (...) {
      finished_ = true;
      block_.clear();
      position_ = 0;
      throw;
    }
  }

  // Where Python's generator body starts: it reads len(data_source) and
  // num_samples here.
  void start() {
    started_ = true;
    data_size_ = data_size_fn_();
    num_samples_ = num_samples_given_ ? *num_samples_given_ : data_size_;
    if (!shared_generator_) {
      generator_ = Generator(static_cast<uint64_t>(draw_seed(default_generator())));
    } else {
      generator_ = *shared_generator_;
    }
    if (!replacement_ && data_size_ == 0) {
      // Python fails here with ZeroDivisionError.
      throw ValueError("RandomSampler: cannot draw num_samples=" + std::to_string(num_samples_) +
                       " without replacement from an empty dataset");
    }
    full_blocks_left_ = replacement_ ? num_samples_ / kChunk : num_samples_ / data_size_;
  }

  void draw_block() {
    position_ = 0;
    if (replacement_) {
      const size_t count = full_blocks_left_ > 0 ? kChunk : num_samples_ % kChunk;
      std::vector<int64_t> drawn(count);
      randint(0, static_cast<int64_t>(data_size_), drawn, generator_);
      block_.assign(drawn.begin(), drawn.end());
    } else {
      if (full_blocks_left_ > 0) {
        block_ = randperm(data_size_, generator_);
      } else {  // the remainder: often empty, but its randperm is drawn all the same
        block_ = randperm_prefix(data_size_, num_samples_ % data_size_, generator_);
      }
    }
    if (full_blocks_left_ > 0) {
      --full_blocks_left_;
    } else {
      finished_ = true;  // that was the remainder
    }
  }

  DataSize data_size_fn_;
  bool replacement_;
  std::optional<size_t> num_samples_given_;  // nullopt: the data size
  size_t data_size_ = 0;
  size_t num_samples_ = 0;
  std::optional<Generator> shared_generator_;
  Generator generator_;
  bool started_ = false;
  bool finished_ = false;
  size_t full_blocks_left_ = 0;
  std::vector<size_t> block_;
  size_t position_ = 0;
};

// Holds its sampler: the inner iterator of a sampler of the user's may refer
// to it, and Python's generator keeps it alive too.
class BatchIterator final : public SamplerIterator<BatchIndices> {
 public:
  BatchIterator(std::shared_ptr<Sampler<size_t>> sampler, size_t batch_size, bool drop_last)
      : indices_(sampler->iter()),
        sampler_(std::move(sampler)),
        batch_size_(batch_size),
        drop_last_(drop_last) {}

  bool next(BatchIndices& out) override {
    out.clear();
    if (done_) return false;
    out.reserve(std::min<size_t>(batch_size_, 1024));  // batch_size may be far above the data
    size_t index = 0;
    try {
      while (out.size() < batch_size_) {
        if (!indices_->next(index)) {
          done_ = true;
          break;
        }
        out.push_back(index);
      }
    } catch (...) {
      done_ = true;  // a generator that raised is finished, whatever the inner iterator does
      out.clear();
      throw;
    }
    if (out.empty() || (drop_last_ && out.size() < batch_size_)) {
      out.clear();
      return false;
    }
    return true;
  }

 private:
  std::unique_ptr<SamplerIterator<size_t>> indices_;
  std::shared_ptr<Sampler<size_t>> sampler_;
  size_t batch_size_;
  bool drop_last_;
  bool done_ = false;
};

size_t ceil_div(size_t a, size_t b) { return (a + b - 1) / b; }

}  // namespace

std::unique_ptr<SamplerIterator<size_t>> SequentialSampler::iter() {
  return std::make_unique<SequentialIterator>(size_());
}

RandomSampler::RandomSampler(size_t data_size, bool replacement,
                             std::optional<int64_t> num_samples,
                             std::optional<Generator> generator)
    : RandomSampler(DataSize([data_size] { return data_size; }), replacement, num_samples,
                    std::move(generator)) {}

RandomSampler::RandomSampler(DataSize data_size, bool replacement,
                             std::optional<int64_t> num_samples,
                             std::optional<Generator> generator)
    : data_size_(std::move(data_size)), replacement_(replacement), generator_(std::move(generator)) {
  // Python checks the num_samples property once, at construction. A size
  // past int64 would show as a negative num_samples: Python's len() cannot
  // return it either.
  if (!num_samples) {
    const size_t size = data_size_();
    if (size > static_cast<size_t>(std::numeric_limits<int64_t>::max())) {
      throw ValueError("RandomSampler: the dataset's size, " + std::to_string(size) +
                       ", is more than an index holds (" + std::to_string(std::numeric_limits<int64_t>::max()) + ")");
    }
  }
  const int64_t resolved = num_samples.value_or(static_cast<int64_t>(data_size_()));
  if (resolved <= 0) {
    throw ValueError("num_samples should be a positive integer value, but got num_samples=" +
                     std::to_string(resolved));
  }
  if (num_samples) num_samples_ = static_cast<size_t>(*num_samples);
}

std::unique_ptr<SamplerIterator<size_t>> RandomSampler::iter() {
  return std::make_unique<RandomIterator>(data_size_, replacement_, num_samples_, generator_);
}

SubsetRandomSampler::SubsetRandomSampler(std::vector<size_t> indices,
                                         std::optional<Generator> generator)
    : indices_(std::make_shared<const std::vector<size_t>>(std::move(indices))),
      generator_(std::move(generator)) {}

// The draws hold what they read, not the sampler, which may go first.
std::unique_ptr<SamplerIterator<size_t>> SubsetRandomSampler::iter() {
  return lazy([indices = indices_, generator = generator_]() mutable {
    Generator& g = generator ? *generator : default_generator();
    std::vector<size_t> order = randperm(indices->size(), g);
    for (size_t& i : order) i = (*indices)[i];
    return order;
  });
}

WeightedRandomSampler::WeightedRandomSampler(std::vector<double> weights, int64_t num_samples,
                                             bool replacement, std::optional<Generator> generator)
    : weights_(std::make_shared<const std::vector<double>>(std::move(weights))),
      replacement_(replacement),
      generator_(std::move(generator)) {
  if (num_samples <= 0) {
    throw ValueError("num_samples should be a positive integer value, but got num_samples=" +
                     std::to_string(num_samples));
  }
  num_samples_ = static_cast<size_t>(num_samples);
}

std::unique_ptr<SamplerIterator<size_t>> WeightedRandomSampler::iter() {
  return lazy([weights = weights_, num_samples = num_samples_, replacement = replacement_,
               generator = generator_]() mutable {
    Generator& g = generator ? *generator : default_generator();
    const std::vector<int64_t> drawn =
        multinomial(*weights, static_cast<int64_t>(num_samples), replacement, g);
    return std::vector<size_t>(drawn.begin(), drawn.end());
  });
}

BatchSampler::BatchSampler(std::shared_ptr<Sampler<size_t>> sampler, int64_t batch_size,
                           bool drop_last)
    : sampler_(std::move(sampler)), drop_last_(drop_last) {
  if (batch_size <= 0) {
    throw ValueError("batch_size should be a positive integer value, but got batch_size=" +
                     std::to_string(batch_size));
  }
  if (!sampler_) throw ValueError("BatchSampler: sampler must not be null");
  batch_size_ = static_cast<size_t>(batch_size);
}

size_t BatchSampler::size() const {
  return drop_last_ ? sampler_->size() / batch_size_ : ceil_div(sampler_->size(), batch_size_);
}

std::unique_ptr<SamplerIterator<BatchIndices>> BatchSampler::iter() {
  return std::make_unique<BatchIterator>(sampler_, batch_size_, drop_last_);
}

DistributedSampler::DistributedSampler(size_t data_size, int64_t num_replicas, int64_t rank,
                                       bool shuffle, uint64_t seed, bool drop_last)
    : data_size_(data_size), shuffle_(shuffle), seed_(seed), drop_last_(drop_last) {
  // PyTorch 1.13 checks the rank only: num_replicas < 1 fails it, whatever the rank.
  if (rank >= num_replicas || rank < 0) {
    const std::string last = num_replicas == INT64_MIN ? "-9223372036854775809"  // no overflow
                                                       : std::to_string(num_replicas - 1);
    throw ValueError("Invalid rank " + std::to_string(rank) +
                     ", rank should be in the interval [0, " + last + "]");
  }
  num_replicas_ = static_cast<size_t>(num_replicas);
  rank_ = static_cast<size_t>(rank);
  if (drop_last_ && data_size_ % num_replicas_ != 0) {
    // ceil((n - R) / R); n < R leaves nothing.
    num_samples_ = data_size_ < num_replicas_ ? 0 : ceil_div(data_size_ - num_replicas_, num_replicas_);
  } else {
    num_samples_ = ceil_div(data_size_, num_replicas_);
  }
}

std::unique_ptr<SamplerIterator<size_t>> DistributedSampler::iter() {
  std::vector<size_t> order;
  if (shuffle_) {
    Generator g(seed_ + epoch_);
    order = randperm(data_size_, g);
  }
  // Entry i of the padded list is order[i % n] (padding repeats the whole
  // list from its head; drop_last cuts it, i < n), so this rank's share comes
  // straight from the order, not from a list of total_size(), which a huge
  // num_replicas makes huge. num_samples_ > 0 implies n > 0.
  std::vector<size_t> mine(num_samples_);
  size_t i = rank_;
  for (size_t& index : mine) {
    const size_t at = i % data_size_;
    index = shuffle_ ? order[at] : at;
    i += num_replicas_;
  }
  return std::make_unique<VectorIterator>(std::move(mine));
}

// ---- checkpointing ---------------------------------------------------------

namespace {
// A sampler's own generator, as text (Generator::get_state's format).
State generator_state(const std::optional<Generator>& generator) {
  State out = State::object();
  if (generator) {
    const std::vector<uint8_t> bytes = generator->get_state();
    out.set("generator", std::string(bytes.begin(), bytes.end()));
  }
  return out;
}
void load_generator_state(std::optional<Generator>& generator, const State& state, const std::string& sampler) {
  const State* saved = state.find("generator");
  if (!generator && !saved) return;
  if (!generator || !saved) {
    throw StateError("load_state_dict: the " + sampler + " was saved " + (saved ? "with" : "without") +
                     " a generator of its own, and this one has " + (generator ? "one" : "none"));
  }
  const std::string& text = saved->as_string("generator");
  try {
    generator->set_state(std::span(reinterpret_cast<const uint8_t*>(text.data()), text.size()));
  } catch (const ValueError& error) {  // set_state parses into a copy: the generator is as it was
    throw StateError("load_state_dict: the " + sampler + "'s 'generator' is not a generator's state: " +
                     error.what());
  }
}
}  // namespace

State RandomSampler::state() const { return generator_state(generator_); }
void RandomSampler::load_state(const State& state) { load_generator_state(generator_, state, name()); }
State RandomSampler::fingerprint() const {
  State out = Sampler::fingerprint();
  out.set("replacement", replacement_);
  out.set("data_size", static_cast<uint64_t>(data_size()));
  return out;
}

State SubsetRandomSampler::state() const { return generator_state(generator_); }
void SubsetRandomSampler::load_state(const State& state) { load_generator_state(generator_, state, name()); }

State WeightedRandomSampler::state() const { return generator_state(generator_); }
void WeightedRandomSampler::load_state(const State& state) { load_generator_state(generator_, state, name()); }
State WeightedRandomSampler::fingerprint() const {
  State out = Sampler::fingerprint();
  out.set("replacement", replacement_);
  out.set("categories", static_cast<uint64_t>(weights_->size()));
  return out;
}

State BatchSampler::fingerprint() const {
  State out = State::object();  // the parameters first: a mismatch names the cause, not the size it makes
  out.set("name", name());
  out.set("batch_size", static_cast<uint64_t>(batch_size_));
  out.set("drop_last", drop_last_);
  out.set("sampler", sampler_->fingerprint());
  out.set("size", static_cast<uint64_t>(size()));
  return out;
}

State DistributedSampler::state() const {
  State out = State::object();
  out.set("epoch", epoch_);
  return out;
}
void DistributedSampler::load_state(const State& state) { epoch_ = state.uint_at("epoch"); }
State DistributedSampler::fingerprint() const {
  State out = Sampler::fingerprint();
  out.set("data_size", static_cast<uint64_t>(data_size_));
  out.set("num_replicas", static_cast<uint64_t>(num_replicas_));
  out.set("rank", static_cast<uint64_t>(rank_));
  out.set("shuffle", shuffle_);
  out.set("seed", seed_);
  out.set("drop_last", drop_last_);
  return out;
}

}  // namespace conveyor
