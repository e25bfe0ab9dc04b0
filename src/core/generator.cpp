// The draw primitives of torch's CPU generator (PyTorch 1.13), rebuilt on
// std::mt19937. Each function names the torch kernel it mirrors; the parity
// fixtures in tests/parity check them against the real thing.
#include "conveyor/generator.h"

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <limits>
#include <mutex>
#include <random>
#include <sstream>
#include <string>
#include <utility>

#include "conveyor/errors.h"
#include "conveyor/detail/seeds.h"
#include "conveyor/detail/worker_scope.h"

namespace conveyor {

namespace {

// torch's at::mt19937 and std::mt19937 produce the same stream.
class Mt19937Engine final : public RandomEngine {
 public:
  explicit Mt19937Engine(uint64_t seed) { Mt19937Engine::seed(seed); }
  std::mutex& mutex() override { return mutex_; }
  uint32_t next32() override {
    ++draws_;
    return static_cast<uint32_t>(engine_());
  }
  void seed(uint64_t seed) override {
    seed_ = seed;
    origin_.reset();
    draws_ = 0;
    engine_.seed(static_cast<uint32_t>(seed & 0xffffffffULL));  // only the low 32 bits count
  }
  std::optional<GeneratorPosition> position() const override { return GeneratorPosition{seed_, origin_, draws_}; }
  void seek(const GeneratorPosition& position) override {
    if (position.origin) {
      set_state(*position.origin);
    } else {
      seed(position.seed);
    }
    engine_.discard(position.draws);
    draws_ = position.draws;
  }
  uint64_t initial_seed() const override { return seed_; }
  std::vector<uint8_t> get_state() const override {
    std::ostringstream out;
    out << seed_ << ' ' << engine_;
    const std::string text = out.str();
    return {text.begin(), text.end()};
  }
  void set_state(std::span<const uint8_t> state) override {
    std::istringstream in(std::string(state.begin(), state.end()));
    uint64_t seed = 0;
    std::mt19937 engine;
    if (!(in >> seed >> engine)) {
      throw ValueError("Generator::set_state: the state is not one Generator::get_state produced");
    }
    seed_ = seed;
    engine_ = engine;
    origin_ = std::make_shared<const std::vector<uint8_t>>(state.begin(), state.end());
    draws_ = 0;
  }

 private:
  std::mutex mutex_;
  std::mt19937 engine_;
  uint64_t seed_ = 0;
  std::shared_ptr<const std::vector<uint8_t>> origin_;  // set by set_state: the stream starts there
  uint64_t draws_ = 0;                                  // outputs since the seed or origin_
};

// xoshiro256** (Blackman and Vigna), its four words filled by splitmix64
// from the seed: seeding costs four multiplications where MT19937 fills and
// then regenerates 624 words, which dominated a per-item generator.
class Xoshiro256Engine final : public RandomEngine {
 public:
  explicit Xoshiro256Engine(uint64_t seed) { Xoshiro256Engine::seed(seed); }
  std::mutex& mutex() override { return mutex_; }
  uint32_t next32() override { return static_cast<uint32_t>(next64() >> 32); }  // the high bits are the best
  void seed(uint64_t seed) override {
    seed_ = seed;
    uint64_t x = seed;
    for (uint64_t& word : state_) {
      x += 0x9e3779b97f4a7c15ULL;
      uint64_t z = x;
      z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
      z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
      word = z ^ (z >> 31);
    }
  }
  uint64_t initial_seed() const override { return seed_; }
  std::vector<uint8_t> get_state() const override {
    std::ostringstream out;
    out << "xoshiro256 " << seed_;
    for (uint64_t word : state_) out << ' ' << word;
    const std::string text = out.str();
    return {text.begin(), text.end()};
  }
  void set_state(std::span<const uint8_t> state) override {
    std::istringstream in(std::string(state.begin(), state.end()));
    std::string kind;
    uint64_t seed = 0;
    std::array<uint64_t, 4> words{};
    if (!(in >> kind >> seed >> words[0] >> words[1] >> words[2] >> words[3]) || kind != "xoshiro256") {
      throw ValueError("Generator::set_state: the state is not one Generator::get_state produced");
    }
    seed_ = seed;
    state_ = words;
  }

 private:
  uint64_t next64() noexcept {
    const uint64_t result = std::rotl(state_[1] * 5, 7) * 9;
    const uint64_t t = state_[1] << 17;
    state_[2] ^= state_[0];
    state_[3] ^= state_[1];
    state_[1] ^= state_[2];
    state_[0] ^= state_[3];
    state_[2] ^= t;
    state_[3] = std::rotl(state_[3], 45);
    return result;
  }

  std::mutex mutex_;
  std::array<uint64_t, 4> state_{};
  uint64_t seed_ = 0;
};

}  // namespace

void RandomEngine::seek(const GeneratorPosition& position) {
  if (position.origin) {
    set_state(*position.origin);
  } else {
    seed(position.seed);
  }
  for (uint64_t i = 0; i < position.draws; ++i) next32();
}

Generator Generator::for_item(uint64_t seed) { return Generator(std::make_shared<Xoshiro256Engine>(seed)); }

// Holds the engine's lock for a run of draws: one lock per torch op, as in
// torch's kernels.
class GeneratorLock {
 public:
  explicit GeneratorLock(Generator& g) : engine_(*g.engine()), lock_(engine_.mutex()) {}
  uint32_t random() { return engine_.next32(); }
  uint64_t random64() {
    const uint64_t hi = random();
    const uint64_t lo = random();
    return (hi << 32) | lo;
  }
  // at::uniform_real_distribution<double>(0, 1): 53 random bits of random64().
  double uniform53() {
    constexpr uint64_t kMask = (uint64_t{1} << 53) - 1;
    return static_cast<double>(random64() & kMask) * std::ldexp(1.0, -53);
  }

 private:
  RandomEngine& engine_;
  std::lock_guard<std::mutex> lock_;
};

Generator::Generator() : Generator(kDefaultSeed) {}
Generator::Generator(uint64_t seed) : engine_(std::make_shared<Mt19937Engine>(seed)) {}
Generator::Generator(std::shared_ptr<RandomEngine> engine) : engine_(std::move(engine)) {
  if (!engine_) throw ValueError("Generator: engine must not be null");
}

Generator& Generator::manual_seed(uint64_t seed) {
  std::lock_guard lock(engine_->mutex());
  engine_->seed(seed);
  return *this;
}

uint64_t Generator::initial_seed() const {
  std::lock_guard lock(engine_->mutex());
  return engine_->initial_seed();
}

uint32_t Generator::random() { return GeneratorLock(*this).random(); }
uint64_t Generator::random64() { return GeneratorLock(*this).random64(); }

std::vector<uint8_t> Generator::get_state() const {
  std::lock_guard lock(engine_->mutex());
  return engine_->get_state();
}

void Generator::set_state(std::span<const uint8_t> state) {
  std::lock_guard lock(engine_->mutex());
  engine_->set_state(state);
}

std::optional<GeneratorPosition> Generator::position() const {
  std::lock_guard lock(engine_->mutex());
  return engine_->position();
}

void Generator::seek(const GeneratorPosition& position) {
  std::lock_guard lock(engine_->mutex());
  engine_->seek(position);
}

namespace {
Generator& process_generator() {
  // Seeded non-deterministically, as torch seeds its default CPU generator.
  static Generator generator([] {
    std::random_device device;
    return (uint64_t{device()} << 32) | device();
  }());
  return generator;
}
}  // namespace

Generator& default_generator() {
  if (Generator* worker = detail::current_worker_generator()) return *worker;
  return process_generator();
}

// On a loader's worker this is the worker's generator, as torch.manual_seed
// in a worker process seeds that process's default generator.
void manual_seed(uint64_t seed) { default_generator().manual_seed(seed); }

// random_() on an int64 tensor: random64() % (INT64_MAX + 1).
int64_t draw_seed(Generator& g) {
  return static_cast<int64_t>(GeneratorLock(g).random64() &
                              static_cast<uint64_t>(std::numeric_limits<int64_t>::max()));
}

// randperm_cpu: Fisher-Yates from the front, one random() per position.
void randperm(std::span<size_t> out, Generator& g) {
  const size_t n = out.size();
  for (size_t i = 0; i < n; ++i) out[i] = i;
  if (n < 2) return;
  GeneratorLock draws(g);
  for (size_t i = 0; i + 1 < n; ++i) {
    const size_t z = draws.random() % (n - i);
    std::swap(out[i], out[i + z]);
  }
}

std::vector<size_t> randperm(size_t n, Generator& g) {
  std::vector<size_t> out;
  try {
    out.resize(n);
  } catch (const std::exception&) {  // bad_alloc, or length_error past what a vector holds
    const std::string bytes = n > std::numeric_limits<size_t>::max() / sizeof(size_t)
                                  ? "more than " + std::to_string(std::numeric_limits<size_t>::max()) + " bytes"
                                  : std::to_string(n * sizeof(size_t)) + " bytes";
    throw RuntimeError("randperm: can't allocate memory for a permutation of " + std::to_string(n) + " indices (" +
                       bytes + ")");
  }
  randperm(std::span<size_t>(out), g);
  return out;
}

std::vector<size_t> randperm_prefix(size_t n, size_t prefix, Generator& g) {
  if (prefix >= n) return randperm(n, g);
  std::vector<size_t> out;
  if (prefix > 0) {
    out = randperm(n, g);  // positions < prefix are final after prefix steps; the rest
    out.resize(prefix);    // of the shuffle never touches them, but draws must happen
    return out;
  }
  if (n < 2) return out;
  GeneratorLock draws(g);
  for (size_t i = 0; i + 1 < n; ++i) draws.random();  // the draws of an unused randperm
  return out;
}

// random_from_to: 32-bit draws while the range fits in 32 bits, else 64-bit.
void randint(int64_t low, int64_t high, std::span<int64_t> out, Generator& g) {
  if (low >= high) {
    throw RuntimeError("random_ expects 'from' to be less than 'to', but got from=" +
                     std::to_string(low) + " >= to=" + std::to_string(high));
  }
  const uint64_t range = static_cast<uint64_t>(high) - static_cast<uint64_t>(low);
  GeneratorLock draws(g);
  const bool wide = range >= (uint64_t{1} << 32);
  for (int64_t& value : out) {
    const uint64_t r = wide ? draws.random64() : draws.random();
    value = static_cast<int64_t>(static_cast<uint64_t>(low) + r % range);
  }
}

namespace {

// multinomial_with_replacement kernel: inverse CDF by binary search.
std::vector<int64_t> multinomial_with_replacement(std::span<const double> weights,
                                                  int64_t num_samples, Generator& g) {
  const size_t n = weights.size();
  std::vector<double> cumulative(n);
  double sum = 0;
  for (size_t j = 0; j < n; ++j) {
    const double w = weights[j];
    if (!(w >= 0)) {
      throw RuntimeError("invalid multinomial distribution (encountering probability entry < 0)");
    }
    if (!std::isfinite(w)) {
      throw RuntimeError(
          "invalid multinomial distribution (encountering probability entry = infinity or NaN)");
    }
    sum += w;
    cumulative[j] = sum;
  }
  if (!(sum > 0)) throw RuntimeError("invalid multinomial distribution (sum of probabilities <= 0)");
  for (double& c : cumulative) c /= sum;
  cumulative[n - 1] = 1;  // the last bucket closes the distribution

  std::vector<int64_t> result(static_cast<size_t>(num_samples));
  GeneratorLock draws(g);
  for (int64_t& out : result) {
    const double u = draws.uniform53();
    size_t left = 0, right = n;
    while (right > left) {
      const size_t mid = left + (right - left) / 2;
      if (cumulative[mid] < u) {
        left = mid + 1;
      } else {
        right = mid;
      }
    }
    out = static_cast<int64_t>(left);
  }
  return result;
}

// Without replacement torch draws one Exp(1) key per category and keeps the
// top k of weight/key (Gumbel top-k), with topk's exact tie-breaking.
std::vector<int64_t> multinomial_without_replacement(std::span<const double> weights,
                                                     int64_t num_samples, Generator& g) {
  const size_t n = weights.size();
  double max = -std::numeric_limits<double>::infinity();
  double min = std::numeric_limits<double>::infinity();
  double sum = 0;
  bool has_nan = false;
  for (double w : weights) {
    has_nan |= std::isnan(w);
    max = std::max(max, w);
    min = std::min(min, w);
    sum += w;
  }
  if (has_nan || !(max < std::numeric_limits<double>::infinity()) || !(min >= 0)) {
    throw RuntimeError("probability tensor contains either `inf`, `nan` or element < 0");
  }
  if (sum == 0) throw RuntimeError("invalid multinomial distribution (sum of probabilities <= 0)");

  using Keyed = std::pair<double, int64_t>;
  std::vector<Keyed> queue(n);
  {
    GeneratorLock draws(g);
    for (size_t j = 0; j < n; ++j) {
      // exponential_(1): -1/lambda * log(1 - u), then weights / q.
      const double q = -1.0 / 1.0 * std::log(1.0 - draws.uniform53());
      queue[j] = {weights[j] / q, static_cast<int64_t>(j)};
    }
  }
  if (num_samples == 1) {  // argmax: the first maximum
    size_t best = 0;
    for (size_t j = 1; j < n; ++j) {
      if (queue[j].first > queue[best].first) best = j;
    }
    return {queue[best].second};
  }
  // topk_kernel (largest, sorted) with its NaN-first comparator.
  const auto larger = [](const Keyed& x, const Keyed& y) {
    return (std::isnan(x.first) && !std::isnan(y.first)) || (x.first > y.first);
  };
  const auto k = static_cast<std::ptrdiff_t>(num_samples);
  if (static_cast<size_t>(num_samples) * 64 <= n) {
    std::partial_sort(queue.begin(), queue.begin() + k, queue.end(), larger);
  } else {
    std::nth_element(queue.begin(), queue.begin() + k - 1, queue.end(), larger);
    std::sort(queue.begin(), queue.begin() + k - 1, larger);
  }
  std::vector<int64_t> result(static_cast<size_t>(num_samples));
  for (size_t i = 0; i < result.size(); ++i) result[i] = queue[i].second;
  return result;
}

}  // namespace

std::vector<int64_t> multinomial(std::span<const double> weights, int64_t num_samples,
                                 bool replacement, Generator& g) {
  if (num_samples <= 0) throw RuntimeError("cannot sample n_sample <= 0 samples");
  const auto categories = static_cast<int64_t>(weights.size());
  if (!replacement && num_samples > categories) {
    throw RuntimeError("cannot sample n_sample > prob_dist.size(-1) samples without replacement");
  }
  if (categories > (int64_t{1} << 24)) throw RuntimeError("number of categories cannot exceed 2^24");
  return replacement ? multinomial_with_replacement(weights, num_samples, g)
                     : multinomial_without_replacement(weights, num_samples, g);
}

double uniform(Generator& g) { return GeneratorLock(g).uniform53(); }

// uniform_real_distribution<float>: 24 random bits of one random().
float uniform_float(Generator& g) {
  constexpr uint32_t kMask = (uint32_t{1} << 24) - 1;
  return static_cast<float>(GeneratorLock(g).random() & kMask) * std::ldexp(1.0f, -24);
}

}  // namespace conveyor

namespace conveyor::detail {
namespace {

// splitmix64's finaliser: spreads (base_seed, epoch, batch) into a seed.
uint64_t mix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

}  // namespace

uint64_t work_stealing_seed(int64_t base_seed, uint64_t epoch, uint64_t batch_index) {
  return mix(mix(mix(static_cast<uint64_t>(base_seed)) ^ epoch) ^ batch_index);
}

}  // namespace conveyor::detail
