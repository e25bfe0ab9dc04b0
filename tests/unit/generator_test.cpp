#include <gtest/gtest.h>

#include <conveyor/detail/worker_scope.h>
#include <conveyor/errors.h>
#include <conveyor/generator.h>

#include <algorithm>
#include <thread>
#include <vector>

namespace {

std::vector<uint32_t> draw(conveyor::Generator& g, int n) {
  std::vector<uint32_t> out;
  for (int i = 0; i < n; ++i) out.push_back(g.random());
  return out;
}

TEST(Generator, SameSeedSameStream) {
  conveyor::Generator a(123), b(123), c(124);
  EXPECT_EQ(draw(a, 50), draw(b, 50));
  EXPECT_NE(draw(a, 50), draw(c, 50));
}

TEST(Generator, OnlyTheLow32BitsOfTheSeedReachTheEngine) {
  conveyor::Generator a(5), b(5 + (uint64_t{1} << 32));
  EXPECT_EQ(draw(a, 20), draw(b, 20));
  EXPECT_EQ(b.initial_seed(), 5 + (uint64_t{1} << 32));  // but the seed itself is kept
}

TEST(Generator, CopiesShareOneEngine) {
  conveyor::Generator a(9);
  conveyor::Generator shared = a;
  conveyor::Generator fresh(9);
  const uint32_t first = a.random();
  EXPECT_EQ(first, fresh.random());
  EXPECT_EQ(shared.random(), fresh.random());  // shared advanced with a
  EXPECT_TRUE(shared == a);
  EXPECT_FALSE(fresh == a);
}

TEST(Generator, ManualSeedRestarts) {
  conveyor::Generator g(77);
  const auto first = draw(g, 10);
  g.manual_seed(77);
  EXPECT_EQ(draw(g, 10), first);
}

TEST(Generator, Random64IsTwoDrawsHighFirst) {
  conveyor::Generator a(3), b(3);
  const uint64_t hi = b.random(), lo = b.random();
  EXPECT_EQ(a.random64(), (hi << 32) | lo);
}

TEST(Generator, StateRoundTripsMidStream) {
  conveyor::Generator g(11);
  draw(g, 1000);
  const auto state = g.get_state();
  const auto expected = draw(g, 100);
  conveyor::Generator other(1);
  other.set_state(state);
  EXPECT_EQ(draw(other, 100), expected);
  EXPECT_EQ(other.initial_seed(), 11u);
  const std::vector<uint8_t> garbage{'x', 'y'};
  EXPECT_THROW(other.set_state(garbage), conveyor::ValueError);
}

TEST(Generator, ForItemIsSeededCheaplyReproducibleAndRoundTrips) {
  conveyor::Generator a = conveyor::Generator::for_item(42), b = conveyor::Generator::for_item(42);
  const auto first = draw(a, 1000);
  EXPECT_EQ(draw(b, 1000), first);
  // Neighbouring seeds (items next to each other) give unrelated streams.
  conveyor::Generator c = conveyor::Generator::for_item(43);
  const auto other = draw(c, 1000);
  size_t same = 0;
  for (size_t i = 0; i < first.size(); ++i) same += first[i] == other[i] ? 1 : 0;
  EXPECT_LT(same, 5u);
  // Every output bit varies: no bit stuck across 1000 draws.
  uint32_t ors = 0, ands = ~0u;
  for (uint32_t v : first) {
    ors |= v;
    ands &= v;
  }
  EXPECT_EQ(ors, ~0u);
  EXPECT_EQ(ands, 0u);
  // State: mid-stream into a fresh for_item generator, not into an MT19937 one.
  const auto state = a.get_state();
  const auto expected = draw(a, 100);
  conveyor::Generator restored = conveyor::Generator::for_item(0);
  restored.set_state(state);
  EXPECT_EQ(draw(restored, 100), expected);
  EXPECT_EQ(restored.initial_seed(), 42u);
  conveyor::Generator torch_like(1);
  EXPECT_THROW(torch_like.set_state(state), conveyor::ValueError);
  EXPECT_THROW(restored.set_state(torch_like.get_state()), conveyor::ValueError);
}

TEST(Generator, RandpermIsAPermutation) {
  conveyor::Generator g(5);
  for (size_t n : {0u, 1u, 2u, 17u, 1000u}) {
    auto perm = conveyor::randperm(n, g);
    std::vector<bool> seen(n, false);
    for (size_t v : perm) {
      ASSERT_LT(v, n);
      ASSERT_FALSE(seen[v]);
      seen[v] = true;
    }
  }
}

// A permutation larger than memory or than a vector holds is an error
// naming its size, not a bare std::bad_alloc or length_error.
TEST(Generator, ARandpermTooLargeToHoldIsAnErrorNamingItsSize) {
  conveyor::Generator g(5);
  const size_t n = size_t{1} << 61;  // past what a vector of size_t holds: no allocation is tried
  try {
    (void)conveyor::randperm(n, g);
    FAIL() << "a permutation of 2^61 indices was made";
  } catch (const conveyor::RuntimeError& e) {
    EXPECT_STREQ(e.what(),
                 "randperm: can't allocate memory for a permutation of 2305843009213693952 indices (more than "
                 "18446744073709551615 bytes)");
  }
}

TEST(Generator, MultinomialWithoutReplacementNeverRepeats) {
  conveyor::Generator g(8);
  std::vector<double> weights(50);
  for (size_t i = 0; i < weights.size(); ++i) weights[i] = 1.0 + static_cast<double>(i % 7);
  for (int trial = 0; trial < 20; ++trial) {
    auto drawn = conveyor::multinomial(weights, 50, false, g);
    std::sort(drawn.begin(), drawn.end());
    for (int64_t i = 0; i < 50; ++i) ASSERT_EQ(drawn[static_cast<size_t>(i)], i);
  }
}

TEST(Generator, MultinomialNeverPicksZeroWeightsWithReplacement) {
  conveyor::Generator g(8);
  const std::vector<double> weights{0.0, 1.0, 0.0, 3.0, 0.0};
  for (int64_t index : conveyor::multinomial(weights, 500, true, g)) {
    EXPECT_TRUE(index == 1 || index == 3) << index;
  }
}

TEST(Generator, DefaultGeneratorIsTheWorkersOnAWorkerThread) {
  conveyor::Generator worker_generator(1234);
  conveyor::Generator expected(1234);
  conveyor::WorkerInfo info;
  info.id = 3;
  std::thread([&] {
    EXPECT_EQ(conveyor::get_worker_info(), nullptr);
    conveyor::detail::WorkerScope scope(&info, &worker_generator);
    EXPECT_EQ(conveyor::get_worker_info()->id, 3);
    EXPECT_EQ(conveyor::default_generator().random(), expected.random());
  }).join();
  EXPECT_EQ(conveyor::get_worker_info(), nullptr);
  EXPECT_FALSE(conveyor::default_generator() == worker_generator);
}

TEST(Generator, ManualSeedMakesTheDefaultGeneratorReproducible) {
  conveyor::manual_seed(99);
  const uint32_t first = conveyor::default_generator().random();
  conveyor::manual_seed(99);
  EXPECT_EQ(conveyor::default_generator().random(), first);
}

// Positions are equal where the streams are: the same seed or the same
// origin's bytes (not the same pointer), and the same number of draws.
TEST(Generator, PositionsCompareByStreamAndDraws) {
  conveyor::Generator a(7);
  conveyor::Generator b(7);
  EXPECT_EQ(a.position(), b.position());
  (void)a.random();
  EXPECT_NE(a.position(), b.position());
  (void)b.random();
  EXPECT_EQ(a.position(), b.position());
  EXPECT_NE(a.position(), conveyor::Generator(8).position());
  EXPECT_NE(conveyor::Generator(7).position(), conveyor::Generator(8).position());  // the seed alone

  a.set_state(a.get_state());  // rebased: an origin of its own
  b.set_state(b.get_state());
  ASSERT_NE(a.position()->origin, nullptr);
  EXPECT_NE(a.position()->origin, b.position()->origin);  // two copies of the same bytes
  EXPECT_EQ(a.position(), b.position());
  (void)a.random();
  EXPECT_NE(a.position(), b.position());
  EXPECT_NE(conveyor::Generator(7).position(), b.position());  // a seed is not an origin
}

}  // namespace
