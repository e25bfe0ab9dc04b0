// conveyor/generator.h: a random generator that draws what torch.Generator
// draws, without LibTorch.
//
// Generator is MT19937 with torch.Generator's seeding (only the low 32 bits
// of the seed reach the engine) and torch's CPU draw primitives on top, so
// for the same seed the samplers in conveyor/sampler.h produce the same
// indices in the same order as PyTorch 1.13. conveyor/torch.h converts to and
// from torch::Generator.
//
// Generator is a handle: copies share one engine, as Python references to one
// torch.Generator do. Every draw locks the engine (like torch's
// generator->mutex_), so sharing across threads is safe; bulk operations
// (randperm, randint, multinomial) lock once.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <vector>

namespace conveyor {

// Where a generator's stream stands: its origin (a seed, or a state given to
// set_state) and the 32-bit outputs drawn since. Two integers and a shared
// handle: cheap enough to note after every batch, where get_state() writes
// out the whole engine (MT19937: 624 words as text). A checkpoint keeps it,
// and seek() brings a generator back to it.
struct GeneratorPosition {
  uint64_t seed = 0;
  std::shared_ptr<const std::vector<uint8_t>> origin;  // set_state's state, else null (the seed)
  uint64_t draws = 0;

  // The same place in the same stream: origins compare by their bytes.
  friend bool operator==(const GeneratorPosition& a, const GeneratorPosition& b) {
    if (a.seed != b.seed || a.draws != b.draws || !a.origin != !b.origin) return false;
    return !a.origin || a.origin == b.origin || *a.origin == *b.origin;
  }
};

// Where a Generator's bits come from: the built-in MT19937, or (see
// conveyor/torch.h) a torch::Generator's own engine, so that conveyor's
// samplers advance a torch generator exactly as PyTorch's would.
class RandomEngine {
 public:
  virtual ~RandomEngine() = default;
  // Held around every run of draws, and around the calls below.
  virtual std::mutex& mutex() = 0;
  virtual uint32_t next32() = 0;
  virtual void seed(uint64_t seed) = 0;
  virtual uint64_t initial_seed() const = 0;
  virtual std::vector<uint8_t> get_state() const = 0;
  virtual void set_state(std::span<const uint8_t> state) = 0;
  // The stream's position, for engines that count their draws (conveyor's
  // own do; a torch::Generator's engine does not: std::nullopt).
  virtual std::optional<GeneratorPosition> position() const { return std::nullopt; }
  // Back to `position`: from its origin, discarding `draws` outputs.
  virtual void seek(const GeneratorPosition& position);
};

class Generator {
 public:
  // torch.Generator()'s seed when never seeded.
  static constexpr uint64_t kDefaultSeed = 67280421310721ULL;

  Generator();  // seeded with kDefaultSeed
  explicit Generator(uint64_t seed);
  // Draws from `engine` (shared, not copied).
  explicit Generator(std::shared_ptr<RandomEngine> engine);
  // A generator that is cheap to seed (xoshiro256**), for one item's draws in
  // a pipeline node. The same draw primitives; not torch's bit stream.
  static Generator for_item(uint64_t seed);

  // Generator::manual_seed(): reseeds this engine (and every copy sharing it).
  Generator& manual_seed(uint64_t seed);
  uint64_t initial_seed() const;

  uint32_t random();    // one engine output (torch: generator->random())
  uint64_t random64();  // two outputs, (first << 32) | second

  // The engine's full state, for checkpointing a run mid-way. The format is
  // the engine's own.
  std::vector<uint8_t> get_state() const;
  void set_state(std::span<const uint8_t> state);
  // See GeneratorPosition: std::nullopt from an engine that does not count
  // its draws (a torch::Generator's).
  std::optional<GeneratorPosition> position() const;
  void seek(const GeneratorPosition& position);

  // Two handles are equal when they share one engine.
  friend bool operator==(const Generator& a, const Generator& b) noexcept {
    return a.engine_ == b.engine_;
  }

  const std::shared_ptr<RandomEngine>& engine() const noexcept { return engine_; }

 private:
  std::shared_ptr<RandomEngine> engine_;
};

// The process-wide default generator (torch's default CPU generator), seeded
// non-deterministically at start-up. On a loader's worker this returns that
// worker's generator instead, seeded as PyTorch seeds a worker process; see
// conveyor/worker_info.h.
Generator& default_generator();

// torch.manual_seed(): reseeds default_generator(): the process-wide one, or,
// called on a loader's worker (in worker_init_fn, say), that worker's.
void manual_seed(uint64_t seed);

// ---- draws, each the CPU kernel of the named torch op ----------------------

// torch.empty((), dtype=torch.int64).random_(generator=g).item(): a value in
// [0, 2^63). How PyTorch draws seeds (the DataLoader's base seed, a
// RandomSampler's private seed).
int64_t draw_seed(Generator& g);

// torch.randperm(n, generator=g), written into `out` (n = out.size()).
void randperm(std::span<size_t> out, Generator& g);
std::vector<size_t> randperm(size_t n, Generator& g);

// The first `prefix` entries of randperm(n, g), drawing exactly what the full
// randperm draws (n - 1 values), without shuffling what is thrown away.
std::vector<size_t> randperm_prefix(size_t n, size_t prefix, Generator& g);

// torch.randint(low, high, (out.size(),), generator=g). Throws RuntimeError
// unless low < high.
void randint(int64_t low, int64_t high, std::span<int64_t> out, Generator& g);

// torch.multinomial(weights (float64), num_samples, replacement, generator=g).
// Throws RuntimeError with torch's messages for invalid distributions.
std::vector<int64_t> multinomial(std::span<const double> weights, int64_t num_samples,
                                 bool replacement, Generator& g);

// torch.rand((), dtype=float64 / float32, generator=g): uniform in [0, 1).
double uniform(Generator& g);
float uniform_float(Generator& g);

}  // namespace conveyor
