// conveyor/sampler.h: PyTorch's samplers, drawing the same indices in the
// same order for the same seed (see ../shared/PARITY.md and tests/parity).
//
// A Sampler<Index> is a reusable recipe; iter() starts one pass over it (one
// epoch) and draws its randomness lazily, at the points Python's generator
// functions draw it. Samplers are used by one thread at a time. The built-in
// samplers' passes may outlive them (they share the sampler's generator), and
// a pass whose next() threw is over: next() then returns false, as a Python
// generator that raised is finished.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "conveyor/generator.h"
#include "conveyor/state.h"

namespace conveyor {

template <class Index>
class SamplerIterator {
 public:
  virtual ~SamplerIterator() = default;
  // Writes the next index into `out`; false at the end of the pass.
  virtual bool next(Index& out) = 0;
};

template <class Index = size_t>
class Sampler {
 public:
  using index_type = Index;
  virtual ~Sampler() = default;

  virtual size_t size() const = 0;  // Python's __len__
  virtual std::unique_ptr<SamplerIterator<Index>> iter() = 0;
  // Called by DataLoader::set_epoch; DistributedSampler reshuffles by it.
  virtual void set_epoch(uint64_t /*epoch*/) {}
  // The class name, for error messages.
  virtual std::string name() const = 0;

  // Checkpointing (DataLoader::state_dict). state() is what iter() will
  // depend on beyond the constructor's arguments (a generator of the
  // sampler's own, its epoch), taken between passes; load_state() puts it
  // back. A sampler with hidden state of its own overrides both.
  virtual State state() const { return {}; }
  virtual void load_state(const State& /*state*/) {}
  // What must match between the sampler that saved a state and the one that
  // loads it: its name, size and parameters.
  virtual State fingerprint() const {
    State out = State::object();
    out.set("name", name());
    out.set("size", static_cast<uint64_t>(size()));
    return out;
  }
  // True when iter() draws from default_generator(): a loader's state then
  // holds that generator's too.
  virtual bool draws_from_default_generator() const { return false; }
};

using BatchIndices = std::vector<size_t>;

// list(sampler): one whole pass.
template <class Index>
std::vector<Index> collect(Sampler<Index>& sampler) {
  std::vector<Index> out;
  auto it = sampler.iter();
  Index index{};
  while (it->next(index)) out.push_back(index);
  return out;
}

// How many items a sampler covers: read again at every pass and every
// size(), as Python's samplers read len(data_source), so a dataset that grows
// or shrinks between epochs is sampled whole.
using DataSize = std::function<size_t()>;

// 0, 1, ..., size-1.
class SequentialSampler final : public Sampler<size_t> {
 public:
  explicit SequentialSampler(size_t data_size) : size_([data_size] { return data_size; }) {}
  explicit SequentialSampler(DataSize data_size) : size_(std::move(data_size)) {}
  size_t size() const override { return size_(); }
  std::unique_ptr<SamplerIterator<size_t>> iter() override;
  std::string name() const override { return "SequentialSampler"; }

 private:
  DataSize size_;
};

// A shuffled pass. Without replacement: one randperm per whole pass of
// num_samples, then one more cut to the remainder. With replacement: randint
// in chunks of 32. Without a generator each pass first draws a private seed
// from default_generator(), as PyTorch does.
class RandomSampler final : public Sampler<size_t> {
 public:
  // Throws ValueError unless num_samples (default: data_size) is positive.
  explicit RandomSampler(size_t data_size, bool replacement = false,
                         std::optional<int64_t> num_samples = std::nullopt,
                         std::optional<Generator> generator = std::nullopt);
  // The data size read at every pass; so is num_samples when not given.
  explicit RandomSampler(DataSize data_size, bool replacement = false,
                         std::optional<int64_t> num_samples = std::nullopt,
                         std::optional<Generator> generator = std::nullopt);
  size_t size() const override { return num_samples(); }
  std::unique_ptr<SamplerIterator<size_t>> iter() override;
  std::string name() const override { return "RandomSampler"; }
  State state() const override;
  void load_state(const State& state) override;
  State fingerprint() const override;
  bool draws_from_default_generator() const override { return !generator_; }

  size_t num_samples() const { return num_samples_ ? *num_samples_ : data_size_(); }
  size_t data_size() const { return data_size_(); }
  bool replacement() const { return replacement_; }

 private:
  DataSize data_size_;
  bool replacement_;
  std::optional<size_t> num_samples_;  // nullopt: the data size
  std::optional<Generator> generator_;
};

// A random permutation of `indices`.
class SubsetRandomSampler final : public Sampler<size_t> {
 public:
  explicit SubsetRandomSampler(std::vector<size_t> indices,
                               std::optional<Generator> generator = std::nullopt);
  size_t size() const override { return indices_->size(); }
  std::unique_ptr<SamplerIterator<size_t>> iter() override;
  std::string name() const override { return "SubsetRandomSampler"; }
  State state() const override;
  void load_state(const State& state) override;
  bool draws_from_default_generator() const override { return !generator_; }

 private:
  std::shared_ptr<const std::vector<size_t>> indices_;  // shared with passes that outlive this
  std::optional<Generator> generator_;
};

// Indices drawn with probability proportional to `weights` (torch.multinomial
// over float64 weights).
class WeightedRandomSampler final : public Sampler<size_t> {
 public:
  // Throws ValueError unless num_samples is positive.
  WeightedRandomSampler(std::vector<double> weights, int64_t num_samples, bool replacement = true,
                        std::optional<Generator> generator = std::nullopt);
  size_t size() const override { return num_samples_; }
  std::unique_ptr<SamplerIterator<size_t>> iter() override;
  std::string name() const override { return "WeightedRandomSampler"; }
  State state() const override;
  void load_state(const State& state) override;
  State fingerprint() const override;
  bool draws_from_default_generator() const override { return !generator_; }

 private:
  std::shared_ptr<const std::vector<double>> weights_;  // shared with passes that outlive this
  size_t num_samples_;
  bool replacement_;
  std::optional<Generator> generator_;
};

// Groups another sampler's indices into batches of batch_size; the last
// batch is shorter, or dropped with drop_last.
class BatchSampler final : public Sampler<BatchIndices> {
 public:
  // Throws ValueError unless batch_size is positive.
  BatchSampler(std::shared_ptr<Sampler<size_t>> sampler, int64_t batch_size, bool drop_last);
  size_t size() const override;
  std::unique_ptr<SamplerIterator<BatchIndices>> iter() override;
  void set_epoch(uint64_t epoch) override { sampler_->set_epoch(epoch); }
  std::string name() const override { return "BatchSampler"; }
  State state() const override { return sampler_->state(); }
  void load_state(const State& state) override { sampler_->load_state(state); }
  State fingerprint() const override;
  bool draws_from_default_generator() const override { return sampler_->draws_from_default_generator(); }

  const std::shared_ptr<Sampler<size_t>>& sampler() const { return sampler_; }
  size_t batch_size() const { return batch_size_; }
  bool drop_last() const { return drop_last_; }

 private:
  std::shared_ptr<Sampler<size_t>> sampler_;
  size_t batch_size_;
  bool drop_last_;
};

// This rank's share of the dataset: a permutation seeded seed + epoch, padded
// by repeating its head (or cut, with drop_last) to a multiple of
// num_replicas, then every num_replicas-th index from `rank`.
class DistributedSampler final : public Sampler<size_t> {
 public:
  // Throws ValueError for a rank outside [0, num_replicas-1] (so for any rank
  // when num_replicas < 1), with PyTorch's message.
  DistributedSampler(size_t data_size, int64_t num_replicas, int64_t rank, bool shuffle = true,
                     uint64_t seed = 0, bool drop_last = false);
  size_t size() const override { return num_samples_; }
  std::unique_ptr<SamplerIterator<size_t>> iter() override;
  void set_epoch(uint64_t epoch) override { epoch_ = epoch; }
  std::string name() const override { return "DistributedSampler"; }
  State state() const override;
  void load_state(const State& state) override;
  State fingerprint() const override;

  size_t total_size() const { return num_samples_ * num_replicas_; }

 private:
  size_t data_size_;
  size_t num_replicas_;
  size_t rank_;
  bool shuffle_;
  uint64_t seed_;
  bool drop_last_;
  size_t num_samples_;
  uint64_t epoch_ = 0;
};

}  // namespace conveyor
