// Samplers: each iterator draws where the matching Python generator function
// draws, so a shared generator advances exactly as PyTorch's does.
#include "conveyor/sampler.h"

#include <algorithm>
#include <array>
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
      indices_ = draw_();
      drawn_ = true;
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
// remainder draw happens even when the remainder is empty.
class RandomIterator final : public SamplerIterator<size_t> {
 public:
  RandomIterator(const RandomSampler& sampler, std::optional<Generator> generator)
      : sampler_(sampler), replacement_(sampler.replacement()), shared_generator_(std::move(generator)) {}

  bool next(size_t& out) override {
    if (!started_) start();
    while (position_ == block_.size()) {
      if (finished_) return false;
      draw_block();
    }
    out = block_[position_++];
    return true;
  }

 private:
  static constexpr size_t kChunk = 32;

  // Where Python's generator body starts: it reads len(data_source) and
  // num_samples here.
  void start() {
    started_ = true;
    data_size_ = sampler_.data_size();
    num_samples_ = sampler_.num_samples();
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

  const RandomSampler& sampler_;  // outlives its passes (Sampler's contract)
  bool replacement_;
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

class BatchIterator final : public SamplerIterator<BatchIndices> {
 public:
  BatchIterator(std::unique_ptr<SamplerIterator<size_t>> indices, size_t batch_size,
                bool drop_last)
      : indices_(std::move(indices)), batch_size_(batch_size), drop_last_(drop_last) {}

  bool next(BatchIndices& out) override {
    out.clear();
    if (done_) return false;
    out.reserve(std::min<size_t>(batch_size_, 1024));  // batch_size may be far above the data
    size_t index = 0;
    while (out.size() < batch_size_) {
      if (!indices_->next(index)) {
        done_ = true;
        break;
      }
      out.push_back(index);
    }
    if (out.empty() || (drop_last_ && out.size() < batch_size_)) {
      out.clear();
      return false;
    }
    return true;
  }

 private:
  std::unique_ptr<SamplerIterator<size_t>> indices_;
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
  // Python checks the num_samples property once, at construction.
  const int64_t resolved = num_samples.value_or(static_cast<int64_t>(data_size_()));
  if (resolved <= 0) {
    throw ValueError("num_samples should be a positive integer value, but got num_samples=" +
                     std::to_string(resolved));
  }
  if (num_samples) num_samples_ = static_cast<size_t>(*num_samples);
}

std::unique_ptr<SamplerIterator<size_t>> RandomSampler::iter() {
  return std::make_unique<RandomIterator>(*this, generator_);
}

SubsetRandomSampler::SubsetRandomSampler(std::vector<size_t> indices,
                                         std::optional<Generator> generator)
    : indices_(std::move(indices)), generator_(std::move(generator)) {}

std::unique_ptr<SamplerIterator<size_t>> SubsetRandomSampler::iter() {
  return lazy([this] {
    Generator& g = generator_ ? *generator_ : default_generator();
    std::vector<size_t> order = randperm(indices_.size(), g);
    for (size_t& i : order) i = indices_[i];
    return order;
  });
}

WeightedRandomSampler::WeightedRandomSampler(std::vector<double> weights, int64_t num_samples,
                                             bool replacement, std::optional<Generator> generator)
    : weights_(std::move(weights)), replacement_(replacement), generator_(std::move(generator)) {
  if (num_samples <= 0) {
    throw ValueError("num_samples should be a positive integer value, but got num_samples=" +
                     std::to_string(num_samples));
  }
  num_samples_ = static_cast<size_t>(num_samples);
}

std::unique_ptr<SamplerIterator<size_t>> WeightedRandomSampler::iter() {
  return lazy([this] {
    Generator& g = generator_ ? *generator_ : default_generator();
    const std::vector<int64_t> drawn =
        multinomial(weights_, static_cast<int64_t>(num_samples_), replacement_, g);
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
  return std::make_unique<BatchIterator>(sampler_->iter(), batch_size_, drop_last_);
}

DistributedSampler::DistributedSampler(size_t data_size, int64_t num_replicas, int64_t rank,
                                       bool shuffle, uint64_t seed, bool drop_last)
    : data_size_(data_size), shuffle_(shuffle), seed_(seed), drop_last_(drop_last) {
  if (num_replicas < 1) {
    throw ValueError("num_replicas should be a positive integer, but got num_replicas=" +
                     std::to_string(num_replicas));
  }
  if (rank >= num_replicas || rank < 0) {
    throw ValueError("Invalid rank " + std::to_string(rank) +
                     ", rank should be in the interval [0, " + std::to_string(num_replicas - 1) +
                     "]");
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
  std::vector<size_t> indices;
  if (shuffle_) {
    Generator g(seed_ + epoch_);
    indices = randperm(data_size_, g);
  } else {
    indices.resize(data_size_);
    for (size_t i = 0; i < data_size_; ++i) indices[i] = i;
  }
  const size_t total = total_size();
  if (!drop_last_) {
    // Pad by repeating the head, the whole list as often as needed.
    const size_t original = indices.size();
    for (size_t i = 0; indices.size() < total && original > 0; ++i) {
      indices.push_back(indices[i % original]);
    }
  } else {
    indices.resize(total);
  }
  std::vector<size_t> mine;
  mine.reserve(num_samples_);
  for (size_t i = rank_; i < total; i += num_replicas_) mine.push_back(indices[i]);
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
  generator->set_state(std::span(reinterpret_cast<const uint8_t*>(text.data()), text.size()));
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
  out.set("categories", static_cast<uint64_t>(weights_.size()));
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
