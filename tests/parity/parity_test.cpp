// Replays the fixtures PyTorch 1.13 wrote (tests/parity/make_fixtures.py)
// through conveyor's public API: same seed, same draws, same order.
#include <gtest/gtest.h>

#include <conveyor/conveyor.h>

#include <cmath>
#include <map>
#include <string>
#include <vector>

#include "support/fixtures.h"

namespace {

using conveyor::testing::FixtureCase;
using conveyor::testing::load_fixtures;
using conveyor::testing::number_lists;
using conveyor::testing::numbers;
using conveyor::testing::split;

const std::map<std::string, std::vector<double>>& weight_sets() {
  static const std::map<std::string, std::vector<double>> sets = [] {
    std::map<std::string, std::vector<double>> s;
    s["w5"] = {0.1, 0.9, 0.4, 0.7, 3.0};
    s["w6"] = {0.9, 0.4, 0.05, 0.2, 0.3, 0.1};
    s["ties"] = {0.0, 0.0, 0.0, 1.0, 0.0, 0.0};
    s["flat64"] = std::vector<double>(64, 1.0);
    std::vector<double> ramp;
    for (int i = 0; i < 200; ++i) ramp.push_back(i + 1);
    s["ramp200"] = ramp;
    s["one"] = {2.5};
    return s;
  }();
  return sets;
}

std::vector<int64_t> as_int64(const std::vector<size_t>& v) { return {v.begin(), v.end()}; }

// Runs `check` on every case of `name` and counts them, so that an empty or
// misnamed fixture fails instead of passing vacuously.
template <class Check>
void for_each_case(const std::string& file, const std::string& name, Check check) {
  const std::vector<FixtureCase> cases = load_fixtures(file, name);
  ASSERT_FALSE(cases.empty()) << "no '" << name << "' cases in " << file;
  for (const FixtureCase& c : cases) {
    SCOPED_TRACE(c.describe());
    check(c);
  }
}

std::vector<std::vector<int64_t>> epochs_of(const FixtureCase& c) {
  std::vector<std::vector<int64_t>> out;
  for (const std::string& epoch : split(c.results.at(0), '/')) out.push_back(numbers<int64_t>(epoch));
  return out;
}

TEST(GeneratorParity, DrawSeedMatchesRandomUnderscore) {
  for_each_case("generator.txt", "draw_seed", [](const FixtureCase& c) {
    conveyor::Generator g(c.unsigned_integer("seed"));
    std::vector<int64_t> drawn;
    for (int i = 0; i < 8; ++i) drawn.push_back(conveyor::draw_seed(g));
    EXPECT_EQ(drawn, numbers<int64_t>(c.results[0]));
  });
}

TEST(GeneratorParity, Randperm) {
  for_each_case("generator.txt", "randperm", [](const FixtureCase& c) {
    conveyor::Generator g(c.unsigned_integer("seed"));
    EXPECT_EQ(as_int64(conveyor::randperm(static_cast<size_t>(c.integer("n")), g)),
              numbers<int64_t>(c.results[0]));
  });
}

TEST(GeneratorParity, UnseededGeneratorStartsAtTorchDefaultSeed) {
  for_each_case("generator.txt", "randperm_unseeded", [](const FixtureCase& c) {
    conveyor::Generator g;
    EXPECT_EQ(g.initial_seed(), 67280421310721ULL);
    EXPECT_EQ(as_int64(conveyor::randperm(static_cast<size_t>(c.integer("n")), g)),
              numbers<int64_t>(c.results[0]));
  });
}

TEST(GeneratorParity, Randint) {
  for_each_case("generator.txt", "randint", [](const FixtureCase& c) {
    conveyor::Generator g(c.unsigned_integer("seed"));
    std::vector<int64_t> drawn(static_cast<size_t>(c.integer("count")));
    conveyor::randint(c.integer("low"), c.integer("high"), drawn, g);
    EXPECT_EQ(drawn, numbers<int64_t>(c.results[0]));
  });
}

TEST(GeneratorParity, Uniform) {
  for_each_case("generator.txt", "uniform_double", [](const FixtureCase& c) {
    conveyor::Generator g(c.unsigned_integer("seed"));
    for (double expected : numbers<double>(c.results[0])) EXPECT_EQ(conveyor::uniform(g), expected);
  });
  for_each_case("generator.txt", "uniform_float", [](const FixtureCase& c) {
    conveyor::Generator g(c.unsigned_integer("seed"));
    for (double expected : numbers<double>(c.results[0])) {
      EXPECT_EQ(static_cast<double>(conveyor::uniform_float(g)), expected);
    }
  });
}

TEST(GeneratorParity, MultinomialAndWhatItLeavesBehind) {
  for_each_case("generator.txt", "multinomial", [](const FixtureCase& c) {
    conveyor::Generator g(c.unsigned_integer("seed"));
    const auto& weights = weight_sets().at(c.param("weights"));
    const std::vector<int64_t> drawn =
        conveyor::multinomial(weights, c.integer("k"), c.integer("replacement") != 0, g);
    const auto expected = epochs_of(c);
    EXPECT_EQ(drawn, expected.at(0));
    // The generator's position afterwards: the next two seeds drawn.
    EXPECT_EQ(std::vector<int64_t>({conveyor::draw_seed(g), conveyor::draw_seed(g)}), expected.at(1));
  });
}

TEST(SamplerParity, RandomSamplerWithSharedGeneratorOverThreeEpochs) {
  for_each_case("samplers.txt", "random", [](const FixtureCase& c) {
    conveyor::Generator g(c.unsigned_integer("seed"));
    const int64_t num_samples = c.integer("num_samples");
    conveyor::RandomSampler sampler(static_cast<size_t>(c.integer("n")), c.integer("replacement") != 0,
                                    num_samples < 0 ? std::nullopt : std::optional<int64_t>(num_samples), g);
    for (const auto& epoch : epochs_of(c)) {
      EXPECT_EQ(as_int64(conveyor::collect(sampler)), epoch);
      EXPECT_EQ(sampler.size(), epoch.size());
    }
  });
}

TEST(SamplerParity, RandomSamplerWithoutGeneratorDrawsAPrivateSeed) {
  for_each_case("samplers.txt", "random_default", [](const FixtureCase& c) {
    conveyor::manual_seed(c.unsigned_integer("seed"));
    conveyor::RandomSampler sampler(static_cast<size_t>(c.integer("n")));
    for (const auto& epoch : epochs_of(c)) EXPECT_EQ(as_int64(conveyor::collect(sampler)), epoch);
  });
}

TEST(SamplerParity, SubsetRandomSampler) {
  for_each_case("samplers.txt", "subset_random", [](const FixtureCase& c) {
    const auto indices = numbers<size_t>(c.param("indices"));
    conveyor::SubsetRandomSampler sampler(indices, conveyor::Generator(c.unsigned_integer("seed")));
    for (const auto& epoch : epochs_of(c)) EXPECT_EQ(as_int64(conveyor::collect(sampler)), epoch);
  });
  for_each_case("samplers.txt", "subset_random_default", [](const FixtureCase& c) {
    conveyor::manual_seed(c.unsigned_integer("seed"));
    conveyor::SubsetRandomSampler sampler(numbers<size_t>(c.param("indices")));
    for (const auto& epoch : epochs_of(c)) EXPECT_EQ(as_int64(conveyor::collect(sampler)), epoch);
  });
}

TEST(SamplerParity, WeightedRandomSampler) {
  for_each_case("samplers.txt", "weighted", [](const FixtureCase& c) {
    conveyor::WeightedRandomSampler sampler(weight_sets().at(c.param("weights")), c.integer("k"),
                                            c.integer("replacement") != 0,
                                            conveyor::Generator(c.unsigned_integer("seed")));
    for (const auto& epoch : epochs_of(c)) EXPECT_EQ(as_int64(conveyor::collect(sampler)), epoch);
  });
}

TEST(SamplerParity, BatchSamplerOverRandomSampler) {
  for_each_case("samplers.txt", "batch", [](const FixtureCase& c) {
    auto inner = std::make_shared<conveyor::RandomSampler>(
        static_cast<size_t>(c.integer("n")), false, std::nullopt,
        conveyor::Generator(c.unsigned_integer("seed")));
    conveyor::BatchSampler sampler(inner, c.integer("batch_size"), c.integer("drop_last") != 0);
    for (const std::string& epoch : split(c.results[0], '/')) {
      const auto expected = number_lists<size_t>(epoch);
      EXPECT_EQ(conveyor::collect(sampler), expected);
      EXPECT_EQ(sampler.size(), expected.size());
    }
  });
}

TEST(SamplerParity, DistributedSamplerAcrossEpochsAndRanks) {
  for_each_case("samplers.txt", "distributed", [](const FixtureCase& c) {
    conveyor::DistributedSampler sampler(static_cast<size_t>(c.integer("n")), c.integer("replicas"),
                                         c.integer("rank"), c.integer("shuffle") != 0,
                                         c.unsigned_integer("seed"), c.integer("drop_last") != 0);
    const uint64_t epochs[] = {0, 1, 3};
    const auto expected = epochs_of(c);
    ASSERT_EQ(expected.size(), 3u);
    for (size_t e = 0; e < 3; ++e) {
      sampler.set_epoch(epochs[e]);
      EXPECT_EQ(as_int64(conveyor::collect(sampler)), expected[e]);
      EXPECT_EQ(sampler.size(), expected[e].size());
    }
  });
}

TEST(DatasetParity, RandomSplit) {
  for_each_case("samplers.txt", "random_split", [](const FixtureCase& c) {
    std::vector<int> values(static_cast<size_t>(c.integer("n")));
    for (size_t i = 0; i < values.size(); ++i) values[i] = static_cast<int>(i);
    auto dataset = std::make_shared<conveyor::VectorDataset<int>>(values);
    const std::vector<double> lengths = numbers<double>(c.param("lengths"));
    conveyor::Generator g(c.unsigned_integer("seed"));
    const auto previous = conveyor::set_warning_handler([](const std::string&) {});
    const auto parts = conveyor::random_split<int>(dataset, lengths, g);
    conveyor::set_warning_handler(previous);
    const auto expected = number_lists<size_t>(c.results[0]);
    ASSERT_EQ(parts.size(), lengths.size());
    for (size_t i = 0; i < parts.size(); ++i) {
      const std::vector<size_t> want = i < expected.size() ? expected[i] : std::vector<size_t>{};
      EXPECT_EQ(parts[i]->indices(), want) << "part " << i;
    }
  });
}

struct RangeDataset final : conveyor::Dataset<int64_t> {
  explicit RangeDataset(size_t n) : n(n) {}
  size_t size() const override { return n; }
  int64_t get(size_t i) override { return static_cast<int64_t>(i); }
  size_t n;
};

void expect_loader_epochs(conveyor::DataLoader<RangeDataset>& loader, const FixtureCase& c) {
  const std::vector<std::string> epochs = split(c.results.at(0), '/');
  const std::vector<int64_t> base_seeds = numbers<int64_t>(c.results.at(1));
  ASSERT_EQ(epochs.size(), base_seeds.size());
  for (size_t e = 0; e < epochs.size(); ++e) {
    auto epoch = loader.iter();
    EXPECT_EQ(epoch.base_seed(), base_seeds[e]) << "epoch " << e;
    std::vector<std::vector<int64_t>> got;
    while (auto batch = epoch.next()) {
      got.emplace_back(batch->values().begin(), batch->values().end());
    }
    EXPECT_EQ(got, number_lists<int64_t>(epochs[e])) << "epoch " << e;
  }
}

TEST(LoaderParity, ShuffledBatchOrderAndBaseSeedsOverEpochs) {
  for_each_case("loader.txt", "loader", [](const FixtureCase& c) {
    RangeDataset dataset(static_cast<size_t>(c.integer("n")));
    conveyor::DataLoader loader(dataset, {.batch_size = c.integer("batch_size"),
                                          .shuffle = c.integer("shuffle") != 0,
                                          .drop_last = c.integer("drop_last") != 0,
                                          .seed = c.unsigned_integer("seed")});
    expect_loader_epochs(loader, c);
  });
}

TEST(LoaderParity, WithoutGeneratorBaseSeedComesBeforeTheSamplersSeed) {
  for_each_case("loader.txt", "loader_default", [](const FixtureCase& c) {
    RangeDataset dataset(static_cast<size_t>(c.integer("n")));
    conveyor::DataLoader loader(dataset, {.batch_size = c.integer("batch_size"), .shuffle = true});
    conveyor::manual_seed(c.unsigned_integer("seed"));
    expect_loader_epochs(loader, c);
  });
}

}  // namespace
