// DataLoader::state_dict / load_state_dict: a loader stopped anywhere,
// saved, destroyed and built anew (another num_workers where that is
// allowed) hands out exactly the batches the uninterrupted run did after that
// point, then the same epochs after it.
//
// The property test draws random configurations: samplers, schedules,
// orders, workers, persistent workers, prefetch_to_device, errors, iterable
// datasets. Its seed is printed; CONVEYOR_RESUME_SEED=N replays one.
#include <gtest/gtest.h>

#include <conveyor/conveyor.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <memory>
#include <random>
#include <set>
#include <string>
#include <tuple>
#include <vector>

namespace {

using conveyor::DataLoader;
using conveyor::LoaderOptions;
using conveyor::Scheduling;
using conveyor::State;
using conveyor::StateError;

using Sample = std::tuple<int64_t, int64_t>;  // (index, what the dataset drew)

// Draws 1 to 3 numbers per sample from default_generator() (the batch's,
// the worker's or the process's generator, by schedule); the indices in
// `bad` throw after drawing.
struct DrawingDataset final : conveyor::Dataset<Sample> {
  DrawingDataset(size_t n, std::set<size_t> bad) : n(n), bad(std::move(bad)) {}
  size_t size() const override { return n; }
  Sample get(size_t i) override {
    int64_t draw = 0;
    for (size_t k = 0; k <= i % 3; ++k) draw = draw * 31 + conveyor::default_generator().random() % 1000;
    if (bad.count(i)) throw std::runtime_error("bad sample " + std::to_string(i));
    return {static_cast<int64_t>(i), draw};
  }
  size_t n;
  std::set<size_t> bad;
};

// Worker w of W reads w, w + W, ... below uneven ends (worker w stops before
// n - 3w) through a shuffle buffer of 3 (as TarShardDataset's, drawing from
// its worker's generator: a replay must draw as the first pass did), each
// sample with a draw; values in `bad` throw.
// With `seeded_at_iter`, the buffer draws from a generator of its own,
// seeded by one draw as the replica starts (as TarShardDataset's shuffle).
struct DrawingStream final : conveyor::IterableDataset<Sample> {
  DrawingStream(int64_t n, std::set<int64_t> bad, bool seeded_at_iter = false)
      : n(n), bad(std::move(bad)), seeded_at_iter(seeded_at_iter) {}
  std::unique_ptr<conveyor::SampleIterator<Sample>> iter(const conveyor::WorkerInfo* worker) override {
    const int64_t start = worker ? worker->id : 0;
    const int64_t step = worker ? worker->num_workers : 1;
    const int64_t end = n - start * 3;
    std::optional<conveyor::Generator> own;
    if (seeded_at_iter) own.emplace(conveyor::default_generator().random64());
    return conveyor::make_sample_iterator<Sample>(
        [next = start, step, end, buffer = std::vector<int64_t>{}, own, this]() mutable -> std::optional<Sample> {
          while (buffer.size() < 3 && next < end) {
            buffer.push_back(next);
            next += step;
          }
          if (buffer.empty()) return std::nullopt;
          conveyor::Generator& picks = own ? *own : conveyor::default_generator();
          const size_t pick = picks.random() % buffer.size();
          const int64_t value = buffer[pick];
          buffer.erase(buffer.begin() + static_cast<std::ptrdiff_t>(pick));
          const int64_t draw = conveyor::default_generator().random() % 1000;
          if (bad.count(value)) throw std::runtime_error("bad sample " + std::to_string(value));
          return Sample{value, draw};
        });
  }
  void set_epoch(uint64_t e) override { epoch = e; }
  int64_t n;
  std::set<int64_t> bad;
  bool seeded_at_iter;
  uint64_t epoch = 0;
};

template <class Batch>
std::string describe(const Batch& batch) {
  const auto& [indices, draws] = batch;
  std::string out;
  for (size_t i = 0; i < static_cast<size_t>(indices.numel()); ++i) {
    out += std::to_string(indices.data()[i]) + ":" + std::to_string(draws.data()[i]) + " ";
  }
  return out;
}

// The outputs of one epoch: batches described, failed batches by position.
using Outputs = std::vector<std::string>;

template <class Loader>
bool take_one(typename Loader::Epoch& epoch, Outputs& out) {
  try {
    auto batch = epoch.next();
    if (!batch) return false;
    out.push_back(describe(*batch));
  } catch (const conveyor::WorkerError& error) {
    // What failed, not where: an iterable's job numbers depend on timing.
    try {
      std::rethrow_exception(error.original());
    } catch (const std::exception& original) {
      out.push_back(std::string("error: ") + original.what());
    }
  }
  return true;
}

struct Config {
  bool iterable = false;
  size_t n = 0;
  int64_t batch_size = 1;
  bool drop_last = false;
  int sampler = 0;  // 0 sequential, 1 shuffle, 2 random with replacement, 3 subset, 4 weighted, 5 distributed
  int workers = 0;
  int workers_after = 0;  // the resumed loader's
  Scheduling scheduling = Scheduling::work_stealing;
  bool in_order = true;
  bool persistent = false;
  int prefetch_factor = 2;
  bool device = false;
  std::optional<uint64_t> seed;
  uint64_t sampler_seed = 0;
  std::set<size_t> bad;
  int epochs = 2;
  size_t limit = 0;  // > 0: each epoch is left after that many outputs (its workers ahead of it)
  bool between_epochs = false;  // the state is taken once an epoch has ended, not in it

  std::string text() const {
    return std::string(iterable ? "iterable" : "map") + " n=" + std::to_string(n) +
           " batch_size=" + std::to_string(batch_size) + " drop_last=" + std::to_string(drop_last) +
           " sampler=" + std::to_string(sampler) + " workers=" + std::to_string(workers) + "->" +
           std::to_string(workers_after) +
           (scheduling == Scheduling::round_robin ? " round_robin" : " work_stealing") +
           " in_order=" + std::to_string(in_order) + " persistent=" + std::to_string(persistent) +
           " device=" + std::to_string(device) + " seed=" + (seed ? std::to_string(*seed) : "none") +
           " bad=" + std::to_string(bad.size()) + " limit=" + std::to_string(limit) +
           (between_epochs ? " between_epochs" : "");
  }
};

LoaderOptions options_for(const Config& config, int workers) {
  LoaderOptions options;
  options.batch_size = config.batch_size;
  options.drop_last = config.drop_last;
  options.num_workers = workers;
  options.prefetch_factor = workers > 0 ? config.prefetch_factor : 2;
  options.persistent_workers = workers > 0 && config.persistent;
  options.scheduling = config.scheduling;
  options.in_order = config.in_order;
  options.seed = config.seed;
  if (config.device) {
    options.pin_memory = true;
    options.transfer_device = conveyor::make_host_standin_device();
    options.prefetch_to_device = 2;
  }
  if (!config.iterable) {
    const size_t n = config.n;
    const conveyor::Generator own(config.sampler_seed);
    switch (config.sampler) {
      case 1: options.shuffle = true; break;
      case 2: options.sampler = std::make_shared<conveyor::RandomSampler>(n, true, static_cast<int64_t>(n + 37)); break;
      case 3: {
        std::vector<size_t> subset;
        for (size_t i = 0; i < n; i += 2) subset.push_back(i);
        options.sampler = std::make_shared<conveyor::SubsetRandomSampler>(subset, own);
        break;
      }
      case 4: {
        std::vector<double> weights(n);
        for (size_t i = 0; i < n; ++i) weights[i] = 1.0 + static_cast<double>(i % 5);
        options.sampler = std::make_shared<conveyor::WeightedRandomSampler>(weights, static_cast<int64_t>(n), true);
        break;
      }
      case 5: options.sampler = std::make_shared<conveyor::DistributedSampler>(n, 2, 1, true, config.sampler_seed); break;
      default: break;
    }
  }
  return options;
}

template <class Loader>
void start_epoch(Loader& loader, uint64_t epoch) {
  loader.set_epoch(epoch);
}

// Runs the configuration: reference epochs whole; then a loader stopped at
// (stop_epoch, stop_after), saved through JSON text, a new loader (another
// process generator) resumed from it, stopped again `second_stop` outputs
// later, saved and resumed once more. Compares every output after the stop.
template <class D>
void check_resume(const Config& config, std::shared_ptr<D> dataset, std::mt19937_64& rng) {
  using Loader = DataLoader<D>;
  // The next output of an epoch the consumer leaves after `limit` of them.
  auto next_of = [&config](typename Loader::Epoch& epoch, Outputs& out, size_t taken_before = 0) {
    if (config.limit > 0 && out.size() - taken_before >= config.limit) return false;
    return take_one<Loader>(epoch, out);
  };
  conveyor::manual_seed(1234);
  std::vector<Outputs> reference;
  {
    Loader loader(dataset, options_for(config, config.workers));
    for (int e = 0; e < config.epochs; ++e) {
      start_epoch(loader, static_cast<uint64_t>(e));
      auto epoch = loader.iter();
      Outputs outputs;
      while (next_of(epoch, outputs)) {
      }
      reference.push_back(outputs);
    }
  }
  // The epochs after the stop one, run by `loader`, as the reference's.
  auto expect_epochs_after = [&](Loader& loader, int stop_epoch) {
    for (int e = stop_epoch + 1; e < config.epochs; ++e) {
      start_epoch(loader, static_cast<uint64_t>(e));
      auto epoch = loader.iter();
      Outputs outputs;
      while (next_of(epoch, outputs)) {
      }
      Outputs want = reference[static_cast<size_t>(e)];
      if (!config.in_order) {
        std::sort(outputs.begin(), outputs.end());
        std::sort(want.begin(), want.end());
      }
      EXPECT_EQ(outputs, want) << "epoch " << e;
    }
  };
  if (config.between_epochs) {
    // Saved once the stop epoch has ended (its epoch still open, or gone),
    // loaded by a new process: the epochs after it are the reference's.
    const auto stop_epoch = static_cast<int>(rng() % static_cast<uint64_t>(config.epochs - 1));
    const bool epoch_open = rng() % 2 == 0;
    SCOPED_TRACE("saved after epoch " + std::to_string(stop_epoch) + (epoch_open ? ", its epoch open" : ""));
    std::string saved;
    conveyor::manual_seed(1234);
    {
      Loader loader(dataset, options_for(config, config.workers));
      for (int e = 0; e <= stop_epoch; ++e) {
        start_epoch(loader, static_cast<uint64_t>(e));
        auto epoch = loader.iter();
        Outputs ignored;
        while (next_of(epoch, ignored)) {
        }
        if (epoch_open && e == stop_epoch) saved = loader.state_dict().to_json();
      }
      if (!epoch_open) saved = loader.state_dict().to_json();
    }
    conveyor::manual_seed(rng());
    Loader loader(dataset, options_for(config, config.workers_after));
    loader.load_state_dict(State::from_json(saved));
    expect_epochs_after(loader, stop_epoch);
    return;
  }
  const auto stop_epoch = static_cast<int>(rng() % static_cast<uint64_t>(config.epochs));
  const size_t epoch_length = reference[static_cast<size_t>(stop_epoch)].size();
  const size_t stop_after = rng() % (epoch_length + 1);
  const size_t second_stop = rng() % (epoch_length - stop_after + 1);
  SCOPED_TRACE("stop at epoch " + std::to_string(stop_epoch) + " after " + std::to_string(stop_after) +
               " of " + std::to_string(epoch_length) + ", again " + std::to_string(second_stop) + " later");

  // What the stopped loaders handed out in the stop epoch, in order.
  Outputs before;
  std::string saved;
  conveyor::manual_seed(1234);
  {
    Loader loader(dataset, options_for(config, config.workers));
    for (int e = 0; e < stop_epoch; ++e) {
      start_epoch(loader, static_cast<uint64_t>(e));
      auto epoch = loader.iter();
      Outputs ignored;
      while (next_of(epoch, ignored)) {
      }
    }
    start_epoch(loader, static_cast<uint64_t>(stop_epoch));
    auto epoch = loader.iter();
    while (before.size() < stop_after) ASSERT_TRUE(take_one<Loader>(epoch, before));
    saved = loader.state_dict().to_json();
  }
  // A new process: its default generator elsewhere.
  conveyor::manual_seed(rng());
  {
    Loader loader(dataset, options_for(config, config.workers_after));
    loader.load_state_dict(State::from_json(saved));
    start_epoch(loader, static_cast<uint64_t>(stop_epoch));
    auto epoch = loader.iter();
    while (before.size() < stop_after + second_stop) ASSERT_TRUE(take_one<Loader>(epoch, before));
    saved = loader.state_dict().to_json();
  }
  conveyor::manual_seed(rng());
  Loader loader(dataset, options_for(config, config.workers_after));
  loader.load_state_dict(State::from_json(saved));
  Outputs after = before;
  start_epoch(loader, static_cast<uint64_t>(stop_epoch));
  {
    auto epoch = loader.iter();
    while (next_of(epoch, after)) {
    }
  }
  const Outputs& expected = reference[static_cast<size_t>(stop_epoch)];
  if (config.in_order) {
    EXPECT_EQ(after, expected) << "epoch " << stop_epoch;
  } else {
    Outputs a = after, b = expected;
    std::sort(a.begin(), a.end());
    std::sort(b.begin(), b.end());
    EXPECT_EQ(a, b) << "epoch " << stop_epoch << " (as a multiset: in_order = false)";
  }
  expect_epochs_after(loader, stop_epoch);
}

Config random_config(std::mt19937_64& rng) {
  Config config;
  config.iterable = rng() % 4 == 0;
  config.n = 1 + rng() % 60;
  config.batch_size = 1 + static_cast<int64_t>(rng() % 6);
  config.drop_last = rng() % 3 == 0;
  config.sampler = static_cast<int>(rng() % 6);
  config.persistent = rng() % 2 == 0;
  // Persistent workers need workers (and draw one base seed for all epochs).
  const int least = config.persistent ? 1 : 0;
  config.workers = least + static_cast<int>(rng() % 4);
  config.scheduling = config.iterable || rng() % 2 ? Scheduling::round_robin : Scheduling::work_stealing;
  // Another worker count only where the output does not depend on it.
  config.workers_after =
      config.scheduling == Scheduling::work_stealing ? least + static_cast<int>(rng() % 4) : config.workers;
  config.in_order = rng() % 3 != 0;
  config.prefetch_factor = 1 + static_cast<int>(rng() % 3);
  config.device = rng() % 4 == 0;
  if (rng() % 2) config.seed = rng();
  config.sampler_seed = rng();
  if (rng() % 3 == 0) {
    for (size_t k = 0; k < 3; ++k) config.bad.insert(rng() % config.n);
  }
  config.epochs = 1 + static_cast<int>(rng() % 3);
  // Epochs left early, where the uninterrupted run is the same however far
  // the workers ran ahead: in order (out of order, which batches an epoch
  // gave depends on timing), from a sampler that draws nothing (a random
  // one's draws for batches prepared and never received stay drawn, in
  // PyTorch too), and not ahead of the consumer in its own thread
  // (to_device there draws the dataset's batches from the process's
  // generator ahead). Workers' generators do not keep such draws.
  const bool drawless_sampler = config.iterable || config.sampler == 0 || config.sampler == 5;
  if (config.in_order && drawless_sampler && !(config.device && config.workers == 0) && rng() % 2 == 0) {
    config.limit = 1 + rng() % 8;
  }
  config.between_epochs = config.epochs > 1 && config.limit == 0 && rng() % 4 == 0;
  return config;
}

TEST(LoaderResume, RandomConfigurationsResumeExactlyAnywhere) {
  const char* replay = std::getenv("CONVEYOR_RESUME_SEED");
  const uint64_t seed = replay ? std::strtoull(replay, nullptr, 10) : std::random_device{}();
  std::printf("loader resume seed: %llu (each failing run prints its own to replay)\n",
              static_cast<unsigned long long>(seed));
  std::mt19937_64 rng(seed);
  const int runs = replay ? 1 : 150;
  for (int run = 0; run < runs; ++run) {
    const uint64_t run_seed = replay ? seed : rng();
    std::mt19937_64 run_rng(run_seed);
    const Config config = random_config(run_rng);
    SCOPED_TRACE("run seed " + std::to_string(run_seed) + ": " + config.text());
    if (config.iterable) {
      std::set<int64_t> bad(config.bad.begin(), config.bad.end());
      const bool seeded_at_iter = run_rng() % 2 == 0;
      SCOPED_TRACE(seeded_at_iter ? "buffer seeded as the replica starts" : "buffer drawing from the worker's");
      check_resume(config, std::make_shared<DrawingStream>(static_cast<int64_t>(config.n), bad, seeded_at_iter),
                   run_rng);
    } else {
      check_resume(config, std::make_shared<DrawingDataset>(config.n, config.bad), run_rng);
    }
    if (::testing::Test::HasFailure()) {
      std::printf("failing run: replay it with CONVEYOR_RESUME_SEED=%llu\n", static_cast<unsigned long long>(run_seed));
      return;
    }
  }
}

// Named cases the random draw may miss.
TEST(LoaderResume, RoundRobinPersistentWorkersAcrossEpochBoundaries) {
  std::mt19937_64 rng(7);
  for (size_t stop_trials = 0; stop_trials < 20; ++stop_trials) {
    Config config;
    config.n = 23;
    config.batch_size = 2;
    config.sampler = 1;
    config.workers = config.workers_after = 3;
    config.scheduling = Scheduling::round_robin;
    config.persistent = true;
    config.epochs = 3;
    check_resume(config, std::make_shared<DrawingDataset>(config.n, std::set<size_t>{4}), rng);
  }
}

// States taken once an epoch has ended. Before, a persistent iterable
// loader's crashed the next iter() (SIGSEGV: its position holds no lanes).
// Once that was mended its replicas drew other data: their generators were
// set after iter(), going back over its draws (a shuffle's seed); and the
// resumed epoch took the state's empty position for its own, so its
// replicas' ends went unrecorded and the epoch after it drew other data.
// With no workers under round_robin and a seed of the loader's own, the
// next epochs drew other data: the process's generator was not saved.
TEST(LoaderResume, StatesTakenBetweenEpochsResumeTheEpochsAfter) {
  std::mt19937_64 rng(19);
  for (const bool iterable : {false, true}) {
    for (const int workers : {0, 2}) {
      for (const bool persistent : {false, true}) {
        for (const Scheduling scheduling : {Scheduling::round_robin, Scheduling::work_stealing}) {
          if ((persistent && workers == 0) || (iterable && scheduling == Scheduling::work_stealing)) continue;
          for (const bool seeded : {false, true}) {
            Config config;
            config.iterable = iterable;
            config.n = 17;
            config.batch_size = 2;
            config.drop_last = true;  // a replica's last, partial batch drawn and dropped
            config.sampler = 1;
            config.workers = config.workers_after = workers;
            config.persistent = persistent;
            config.scheduling = scheduling;
            config.epochs = 3;
            config.between_epochs = true;
            if (seeded) config.seed = 5;
            SCOPED_TRACE(config.text());
            if (iterable) {
              check_resume(config,
                           std::make_shared<DrawingStream>(17, std::set<int64_t>{5}, /*seeded_at_iter=*/true), rng);
            } else {
              check_resume(config, std::make_shared<DrawingDataset>(17, std::set<size_t>{5}), rng);
            }
          }
        }
      }
    }
  }
}

TEST(LoaderResume, WorkStealingResumesWithAnotherWorkerCount) {
  std::mt19937_64 rng(11);
  for (int before : {0, 1, 4}) {
    for (int after : {0, 2, 3}) {
      Config config;
      config.n = 40;
      config.batch_size = 3;
      config.sampler = 1;
      config.workers = before;
      config.workers_after = after;
      config.in_order = true;
      config.seed = 99;
      config.epochs = 2;
      SCOPED_TRACE(config.text());
      check_resume(config, std::make_shared<DrawingDataset>(config.n, std::set<size_t>{}), rng);
    }
  }
}

using Loader = DataLoader<DrawingDataset>;

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const std::exception& error) {
    return error.what();
  }
  return "(no error)";
}

// The largest "draws" anywhere in a state: the generator positions.
uint64_t most_draws(const State& state) {
  uint64_t most = 0;
  if (state.is_object()) {
    for (const auto& [key, value] : state.members()) {
      most = std::max(most, key == "draws" ? value.as_uint("draws") : most_draws(value));
    }
  } else if (state.is_array()) {
    for (const State& item : state.items()) most = std::max(most, most_draws(item));
  }
  return most;
}

// Persistent round_robin workers carry their generators from epoch to epoch
// as positions: an origin and the draws since. Each epoch's first job puts
// the generator where the last epoch left it, and makes that its origin once
// the draws to replay pass kRebaseAfterDraws, so a position never counts
// much more than that. (It used to seek back to the first epoch's origin
// every epoch: the draws to replay, and the time MT19937's discard() took,
// grew by an epoch's draws each epoch, without end.)
TEST(LoaderResume, PersistentWorkersPositionsStayBoundedOverManyEpochs) {
  auto dataset = std::make_shared<DrawingDataset>(40, std::set<size_t>{});
  Loader loader(dataset, {.batch_size = 4, .num_workers = 2, .persistent_workers = true, .seed = 5,
                          .scheduling = Scheduling::round_robin});
  // random() takes two 32-bit draws; a sample makes 1 to 3 of them. Over
  // 200 epochs a worker draws far more than the bound below.
  constexpr uint64_t kEpochDraws = 40 * 3 * 2;
  constexpr uint64_t kBound = conveyor::detail::kRebaseAfterDraws + kEpochDraws;
  uint64_t largest = 0;
  Outputs first_epoch;
  for (int epoch = 0; epoch < 200; ++epoch) {
    auto pass = loader.iter();
    Outputs outputs;
    while (take_one<Loader>(pass, outputs)) {
    }
    ASSERT_EQ(outputs.size(), 10u);
    if (epoch == 0) {
      first_epoch = outputs;
    } else {
      EXPECT_NE(outputs, first_epoch) << "epoch " << epoch << " drew what epoch 0 drew";
    }
    const uint64_t most = most_draws(loader.state_dict());
    ASSERT_LE(most, kBound) << "after epoch " << epoch;
    largest = std::max(largest, most);
  }
  EXPECT_GT(largest, kEpochDraws) << "no position ever counted more than an epoch: the test proves nothing";
}

TEST(LoaderResume, AMismatchNamesTheFieldAndRoundRobinSaysWhyNotAnotherWorkerCount) {
  auto dataset = std::make_shared<DrawingDataset>(30, std::set<size_t>{});
  Loader saver(dataset, {.batch_size = 4, .shuffle = true, .num_workers = 2, .seed = 5,
                         .scheduling = Scheduling::round_robin});
  const State state = saver.state_dict();

  Loader other_batch(dataset, {.batch_size = 5, .shuffle = true, .num_workers = 2, .seed = 5,
                               .scheduling = Scheduling::round_robin});
  EXPECT_EQ(error_of([&] { other_batch.load_state_dict(state); }),
            "load_state_dict: 'sampler.batch_size' does not match: the state was saved with 4, this one has 5");

  Loader other_workers(dataset, {.batch_size = 4, .shuffle = true, .num_workers = 3, .seed = 5,
                                 .scheduling = Scheduling::round_robin});
  const std::string message = error_of([&] { other_workers.load_state_dict(state); });
  EXPECT_NE(message.find("num_workers=2 and this loader has num_workers=3"), std::string::npos) << message;
  EXPECT_NE(message.find("work_stealing"), std::string::npos) << message;

  Loader other_schedule(dataset, {.batch_size = 4, .shuffle = true, .num_workers = 2, .seed = 5});
  EXPECT_NE(error_of([&] { other_schedule.load_state_dict(state); }).find("'scheduling' does not match"),
            std::string::npos);

  auto smaller = std::make_shared<DrawingDataset>(29, std::set<size_t>{});
  Loader other_size(smaller, {.batch_size = 4, .shuffle = true, .num_workers = 2, .seed = 5,
                              .scheduling = Scheduling::round_robin});
  EXPECT_NE(error_of([&] { other_size.load_state_dict(state); }).find("'dataset_size' does not match"),
            std::string::npos);

  State future = state;
  future.set("version", 7);
  EXPECT_NE(error_of([&] { saver.load_state_dict(future); }).find("version 7"), std::string::npos);
  EXPECT_THROW(saver.load_state_dict(State::from_json(R"({"format": "conveyor.Pipeline"})")), StateError);
}

// The state's generator texts belong to the generators it was saved from:
// a loader with its own generator does not load a state of one drawing from
// the process's (its sampler would draw from an unrestored one).
TEST(LoaderResume, AStateLoadsOnlyWhereItsGeneratorsAre) {
  auto dataset = std::make_shared<DrawingDataset>(30, std::set<size_t>{});
  Loader process_drawn(dataset, {.batch_size = 4, .shuffle = true});
  Loader own(dataset, {.batch_size = 4, .shuffle = true, .seed = 5});
  EXPECT_NE(error_of([&] { own.load_state_dict(process_drawn.state_dict()); }).find("'own_generator' does not match"),
            std::string::npos);
  EXPECT_NE(error_of([&] { process_drawn.load_state_dict(own.state_dict()); }).find("'own_generator' does not match"),
            std::string::npos);

  // A generator text that is not one is refused at load, before the loader
  // changes, naming the field.
  State bad = own.state_dict();
  State start = bad.at("start");
  start.set("generator", "not a generator");
  bad.set("start", std::move(start));
  const std::string message = error_of([&] { own.load_state_dict(bad); });
  EXPECT_NE(message.find("'start.generator' is not a generator's state"), std::string::npos) << message;

  // So is the sampler's own generator text: a StateError naming it (it was a
  // bare ValueError from Generator::set_state).
  State bad_sampler = own.state_dict();
  State sampler_start = bad_sampler.at("start");
  State sampler = sampler_start.at("sampler");
  ASSERT_NE(sampler.find("generator"), nullptr) << bad_sampler.to_json();
  sampler.set("generator", "not a generator");
  sampler_start.set("sampler", std::move(sampler));
  bad_sampler.set("start", std::move(sampler_start));
  try {
    own.load_state_dict(bad_sampler);
    ADD_FAILURE() << "a broken sampler generator was loaded";
  } catch (const StateError& e) {
    EXPECT_NE(std::string(e.what()).find("RandomSampler's 'generator' is not a generator's state"), std::string::npos)
        << e.what();
  }
}

TEST(LoaderResume, IterableDatasetsRefuseAnotherWorkerCount) {
  auto dataset = std::make_shared<DrawingStream>(40, std::set<int64_t>{});
  DataLoader<DrawingStream> saver(dataset, {.batch_size = 4, .num_workers = 2});
  DataLoader<DrawingStream> other(dataset, {.batch_size = 4, .num_workers = 3});
  const std::string message = error_of([&] { other.load_state_dict(saver.state_dict()); });
  EXPECT_NE(message.find("iterable dataset is split among its workers"), std::string::npos) << message;
}

TEST(LoaderResume, AResumedEpochMustBeTheOneAskedFor) {
  auto dataset = std::make_shared<DrawingDataset>(30, std::set<size_t>{});
  Loader saver(dataset, {.batch_size = 4, .shuffle = true, .seed = 5});
  saver.set_epoch(3);
  auto epoch = saver.iter();
  (void)epoch.next();
  const State state = saver.state_dict();
  EXPECT_THROW(saver.load_state_dict(state), conveyor::RuntimeError);  // its epoch is live

  Loader resumed(dataset, {.batch_size = 4, .shuffle = true, .seed = 5});
  resumed.load_state_dict(state);
  resumed.set_epoch(4);
  const std::string message = error_of([&] { (void)resumed.iter(); });
  EXPECT_NE(message.find("resumes epoch 3"), std::string::npos) << message;
  resumed.set_epoch(3);
  auto again = resumed.iter();
  auto batch = again.next();
  ASSERT_TRUE(batch);
}

TEST(LoaderResume, AStateIsSmallWhateverTheDatasetsSize) {
  // Counts and generator states, never the order: a million samples in a
  // shuffled epoch, stopped in the middle.
  auto dataset = std::make_shared<DrawingDataset>(1000000, std::set<size_t>{});
  Loader loader(dataset, {.batch_size = 1000, .shuffle = true, .num_workers = 2, .seed = 1,
                          .scheduling = Scheduling::round_robin});
  auto epoch = loader.iter();
  for (int i = 0; i < 10; ++i) (void)epoch.next();
  const std::string text = loader.state_dict().to_json();
  EXPECT_LT(text.size(), 32u * 1024) << text.substr(0, 400);
}


// `state` with the value at `path` replaced: each step a member's name, or an
// array's index.
State edited(const State& state, const std::vector<std::string>& path, State value, size_t step = 0) {
  if (step == path.size()) return value;
  if (state.is_array()) {
    const size_t at = std::stoul(path[step]);
    State out = State::array();
    for (size_t i = 0; i < state.items().size(); ++i) {
      out.push_back(i == at ? edited(state.items()[i], path, value, step + 1) : state.items()[i]);
    }
    return out;
  }
  State out = state;
  out.set(path[step], edited(state.at(path[step]), path, std::move(value), step + 1));
  return out;
}

State one_null() {
  State out = State::array();
  out.push_back(State());
  return out;
}

std::string last(const Outputs& outputs) { return outputs.empty() ? "(none)" : outputs.back(); }

// What an epoch hands out up to its end, or up to a StateError (as "error: "
// and its message) from iter() or next().
template <class L>
Outputs epoch_or_error(L& loader) {
  Outputs out;
  try {
    auto epoch = loader.iter();
    while (take_one<L>(epoch, out)) {
    }
  } catch (const StateError& error) {
    out.push_back(std::string("error: ") + error.what());
  }
  return out;
}

// A state saved right after load_state_dict(), before the resumed epoch
// has begun or handed anything out, is the loaded one: resumed, it hands
// out what the first state had not. Before the fix state_dict() ignored
// the pending resume and said "the start of the epoch": resumed, it handed
// out again the 3 batches the consumer already had.
TEST(LoaderResume, AStateSavedBeforeTheResumedEpochRunsIsTheLoadedOne) {
  auto dataset = std::make_shared<DrawingDataset>(30, std::set<size_t>{});  // 8 batches
  for (const int workers : {0, 2}) {
    for (const Scheduling scheduling : {Scheduling::work_stealing, Scheduling::round_robin}) {
      SCOPED_TRACE(std::to_string(workers) + " workers, " +
                   (scheduling == Scheduling::round_robin ? "round_robin" : "work_stealing"));
      const LoaderOptions options{.batch_size = 4, .shuffle = true, .num_workers = workers, .seed = 5,
                                  .scheduling = scheduling};
      // With 0 workers under round_robin the dataset draws from the
      // process's generator: the same for the reference and the saver.
      conveyor::manual_seed(1234);
      Loader reference(dataset, options);
      const Outputs all = epoch_or_error(reference);
      ASSERT_EQ(all.size(), 8u);
      const Outputs rest(all.begin() + 3, all.end());

      conveyor::manual_seed(1234);
      Loader saver(dataset, options);
      State state;
      {
        auto epoch = saver.iter();
        Outputs taken;
        for (int k = 0; k < 3; ++k) ASSERT_TRUE(take_one<Loader>(epoch, taken));
        state = saver.state_dict();
      }
      // Saved again at once, through JSON, twice over.
      Loader loaded(dataset, options);
      loaded.load_state_dict(state);
      const State again = State::from_json(loaded.state_dict().to_json());
      Loader twice(dataset, options);
      twice.load_state_dict(again);
      const State twice_again = twice.state_dict();
      Loader resumed(dataset, options);
      resumed.load_state_dict(twice_again);
      EXPECT_EQ(epoch_or_error(resumed), rest);

      // Saved after the resumed epoch began, before its first batch.
      Loader started(dataset, options);
      started.load_state_dict(state);
      State at_start;
      {
        auto epoch = started.iter();
        at_start = started.state_dict();
      }
      Loader resumed_at_start(dataset, options);
      resumed_at_start.load_state_dict(at_start);
      EXPECT_EQ(epoch_or_error(resumed_at_start), rest);
    }
  }
}

// A refused load changes nothing: every field is read and checked before the
// first is applied (persistent_base_seed was read after the sampler and the
// generators had been put back).
TEST(LoaderResume, ARefusedStateLeavesTheLoaderUntouched) {
  auto dataset = std::make_shared<DrawingDataset>(30, std::set<size_t>{});
  const LoaderOptions options{.batch_size = 4, .shuffle = true, .seed = 5};
  Loader saver(dataset, options);
  for (int e = 0; e < 2; ++e) (void)epoch_or_error(saver);
  const State bad = edited(saver.state_dict(), {"start", "persistent_base_seed"}, "x");

  Loader fresh(dataset, options);
  const Outputs want = epoch_or_error(fresh);
  Loader refused(dataset, options);
  const std::string message = error_of([&] { refused.load_state_dict(bad); });
  EXPECT_NE(message.find("persistent_base_seed"), std::string::npos) << message;
  EXPECT_EQ(epoch_or_error(refused), want) << "the refused state was partly loaded";
}

// A position past the epoch's end is refused, not resumed as an empty or a
// short epoch: at load where the state contradicts itself, else once the
// replay finds the sampler's epoch shorter.
TEST(LoaderResume, AMapStylePositionPastTheEpochIsRefused) {
  auto dataset = std::make_shared<DrawingDataset>(30, std::set<size_t>{});  // 8 batches
  const LoaderOptions options{.batch_size = 4, .shuffle = true, .seed = 5};
  Loader saver(dataset, options);
  Outputs whole;
  {
    Loader reference(dataset, options);
    whole = epoch_or_error(reference);
  }
  ASSERT_EQ(whole.size(), 8u);
  auto epoch = saver.iter();
  (void)epoch.next();
  (void)epoch.next();
  const State state = saver.state_dict();
  ASSERT_EQ(state.at("epoch").at("batches").uint_at("prefix"), 2u);

  const State past =
      edited(edited(state, {"epoch", "received"}, uint64_t{1000}), {"epoch", "batches", "prefix"}, uint64_t{1000});
  Loader prefix_past(dataset, options);
  prefix_past.load_state_dict(past);
  Outputs got = epoch_or_error(prefix_past);
  EXPECT_EQ(got.size(), 1u);
  EXPECT_NE(last(got).find("'batches.prefix' (1000) is past the end of the epoch: its sampler gave 8 batches"),
            std::string::npos)
      << last(got);

  // Received out of turn past the end: the epoch's other batches, then the error.
  State beyond = edited(state, {"epoch", "received"}, uint64_t{3});
  beyond = edited(beyond, {"epoch", "batches", "beyond"}, State::list({uint64_t{1} << 63}));
  beyond = edited(beyond, {"epoch", "batches", "beyond_generators"}, one_null());
  Loader beyond_past(dataset, options);
  beyond_past.load_state_dict(beyond);
  got = epoch_or_error(beyond_past);
  EXPECT_EQ(Outputs(got.begin(), got.begin() + std::min<std::ptrdiff_t>(6, std::ssize(got))),
            Outputs(whole.begin() + 2, whole.end()));
  EXPECT_EQ(got.size(), 7u);
  EXPECT_NE(last(got).find("'batches.beyond' lists batch 9223372036854775808, past the end of the epoch"),
            std::string::npos)
      << last(got);

  // Near 2^64, a worker's next batch after one received out of turn
  // (beyond + num_workers) wrapped onto batch 1 and re-seeded its draws:
  // refused at load.
  const LoaderOptions with_workers{.batch_size = 4, .shuffle = true, .num_workers = 2, .seed = 5};
  Loader worker_saver(dataset, with_workers);
  auto worker_epoch = worker_saver.iter();
  (void)worker_epoch.next();
  State near_end = edited(worker_saver.state_dict(), {"epoch", "received"}, uint64_t{2});
  near_end = edited(near_end, {"epoch", "batches", "beyond"}, State::list({std::numeric_limits<uint64_t>::max()}));
  State generator = State::object();
  generator.set("seed", uint64_t{123});
  generator.set("draws", uint64_t{7});
  State generators = State::array();
  generators.push_back(generator);
  near_end = edited(near_end, {"epoch", "batches", "beyond_generators"}, generators);
  Loader wrapped(dataset, with_workers);
  const std::string wrap = error_of([&] { wrapped.load_state_dict(near_end); });
  EXPECT_NE(wrap.find("'beyond' lists batch 18446744073709551615, past any epoch"), std::string::npos) << wrap;

  // 'received' counts the batches in 'prefix' and 'beyond'.
  Loader miscounted(dataset, options);
  const std::string message =
      error_of([&] { miscounted.load_state_dict(edited(state, {"epoch", "received"}, uint64_t{7})); });
  EXPECT_NE(message.find("'received' (7) should be"), std::string::npos) << message;
}

TEST(LoaderResume, AnIterablePositionPastItsReplicaIsRefused) {
  using Streams = DataLoader<DrawingStream>;
  auto dataset = std::make_shared<DrawingStream>(40, std::set<int64_t>{});  // 10 batches
  for (const int workers : {0, 2}) {
    SCOPED_TRACE("num_workers=" + std::to_string(workers));
    const LoaderOptions options{.batch_size = 4, .num_workers = workers, .seed = 5};
    Outputs whole;
    {
      Streams reference(dataset, options);
      whole = epoch_or_error(reference);
    }
    Streams saver(dataset, options);
    auto epoch = saver.iter();
    ASSERT_TRUE(epoch.next());
    const State state = saver.state_dict();
    ASSERT_EQ(state.at("epoch").at("lanes").items()[0].uint_at("prefix"), 1u);

    // Lane 0 received 100 batches: its replica has fewer. The other lane's
    // batches come, then the error (not an empty epoch).
    State past = edited(state, {"epoch", "received"}, uint64_t{100});
    past = edited(past, {"epoch", "lanes", "0", "prefix"}, uint64_t{100});
    Streams prefix_past(dataset, options);
    prefix_past.load_state_dict(past);
    Outputs got = epoch_or_error(prefix_past);
    EXPECT_NE(last(got).find("'lanes[0].prefix' (100) is past the end of that replica's epoch"), std::string::npos)
        << last(got);
    if (workers == 2) {
      const auto odd = [](const std::string& batch) { return std::stoll(batch) % 2 == 1; };  // lane 1's
      EXPECT_EQ(got.size(), 1u + static_cast<size_t>(std::count_if(whole.begin(), whole.end(), odd)));
    }

    State beyond = edited(state, {"epoch", "received"}, uint64_t{2});
    beyond = edited(beyond, {"epoch", "lanes", "0", "beyond"}, State::list({50}));
    beyond = edited(beyond, {"epoch", "lanes", "0", "beyond_generators"}, one_null());
    Streams beyond_past(dataset, options);
    beyond_past.load_state_dict(beyond);
    got = epoch_or_error(beyond_past);
    EXPECT_NE(last(got).find("'lanes[0].beyond' lists batch 50, past the end of that replica's epoch"),
              std::string::npos)
        << last(got);

    // A replica's end before a batch received from it contradicts the state.
    Streams ended(dataset, options);
    std::string message =
        error_of([&] { ended.load_state_dict(edited(state, {"epoch", "lanes", "0", "end"}, int64_t{0})); });
    EXPECT_NE(message.find("'lanes[0].end' (0)"), std::string::npos) << message;
    Streams miscounted(dataset, options);
    message = error_of([&] { miscounted.load_state_dict(edited(state, {"epoch", "received"}, uint64_t{7})); });
    EXPECT_NE(message.find("'received' (7) should be"), std::string::npos) << message;
  }
}

// prefix x batch_size samples to skip wrapped (2^63 x 4 = 0): the resume
// handed out the whole epoch again.
TEST(LoaderResume, AnIterablePrefixWhoseSamplesOverflowIsRefused) {
  using Streams = DataLoader<DrawingStream>;
  auto dataset = std::make_shared<DrawingStream>(40, std::set<int64_t>{});
  const LoaderOptions options{.batch_size = 4, .seed = 5};
  Streams saver(dataset, options);
  auto epoch = saver.iter();
  ASSERT_TRUE(epoch.next());
  State state = edited(saver.state_dict(), {"epoch", "received"}, uint64_t{1} << 62);
  state = edited(state, {"epoch", "lanes", "0", "prefix"}, uint64_t{1} << 62);
  Streams loader(dataset, options);
  const std::string message = error_of([&] { loader.load_state_dict(state); });
  EXPECT_NE(message.find("'lanes[0].prefix' (4611686018427387904)"), std::string::npos) << message;
}

// A generator position is sought by replaying its draws one by one: 2^62 of
// them never returned.
TEST(LoaderResume, AGeneratorPositionPastWhatAResumeReplaysIsRefused) {
  using Streams = DataLoader<DrawingStream>;
  auto dataset = std::make_shared<DrawingStream>(40, std::set<int64_t>{});
  const LoaderOptions options{.batch_size = 4, .seed = 5};
  Streams saver(dataset, options);
  auto epoch = saver.iter();
  ASSERT_TRUE(epoch.next());
  const State state = saver.state_dict();
  const std::string most = std::to_string(conveyor::detail::kMostReplayedDraws);
  for (const uint64_t draws : {uint64_t{1} << 62, conveyor::detail::kMostReplayedDraws + 1}) {
    for (const char* where : {"generators", "start_generators"}) {
      SCOPED_TRACE(std::string(where) + " draws " + std::to_string(draws));
      Streams loader(dataset, options);
      const std::string message =
          error_of([&] { loader.load_state_dict(edited(state, {"epoch", where, "0", "draws"}, draws)); });
      EXPECT_NE(message.find("'draws' (" + std::to_string(draws) + ") is more than a resume replays (at most " +
                             most + ")"),
                std::string::npos)
          << message;
    }
  }

  // Persistent workers' generators between epochs.
  Loader persistent(std::make_shared<DrawingDataset>(30, std::set<size_t>{}),
                    {.batch_size = 4, .num_workers = 2, .persistent_workers = true, .seed = 5,
                     .scheduling = Scheduling::round_robin});
  (void)epoch_or_error(persistent);
  const State between = persistent.state_dict();
  ASSERT_NE(between.find("workers"), nullptr);
  Loader other(std::make_shared<DrawingDataset>(30, std::set<size_t>{}),
               {.batch_size = 4, .num_workers = 2, .persistent_workers = true, .seed = 5,
                .scheduling = Scheduling::round_robin});
  const std::string message =
      error_of([&] { other.load_state_dict(edited(between, {"workers", "1", "draws"}, uint64_t{1} << 62)); });
  EXPECT_NE(message.find("is more than a resume replays"), std::string::npos) << message;
}

}  // namespace
