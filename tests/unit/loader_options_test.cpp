// Every mistake PyTorch rejects, made through conveyor's API, must fail with
// PyTorch's message (tests/parity/fixtures/errors.txt, written by real PyTorch).
#include <gtest/gtest.h>

#include <conveyor/conveyor.h>

#include <functional>
#include <limits>
#include <map>
#include <regex>
#include <set>
#include <string>

#include "support/datasets.h"
#include "support/fixtures.h"

namespace {

using conveyor::LoaderOptions;
using conveyor::testing::RangeDataset;
using conveyor::testing::StridedStream;

// Python object reprs and class names cannot match across languages; the
// 'prefix' cases compare the text around them.
std::string normalise(const std::string& message) {
  return std::regex_replace(std::regex_replace(message, std::regex("<[^>]*>"), "<>"),
                            std::regex("'[^']*' has no len"), "'' has no len");
}

// Python's exception type, and how it is spelled in C++. AssertionError
// (PyTorch's bare asserts) becomes ValueError in conveyor.
std::string python_type_of(const std::exception& e) {
  if (dynamic_cast<const conveyor::ValueError*>(&e)) return "ValueError|AssertionError";
  if (dynamic_cast<const conveyor::TypeError*>(&e)) return "TypeError";
  if (dynamic_cast<const conveyor::KeyError*>(&e)) return "KeyError";
  if (dynamic_cast<const conveyor::RuntimeError*>(&e)) return "RuntimeError";
  return "unknown";
}

const std::map<std::string, std::function<void()>>& mistakes() {
  static RangeDataset ds(10);
  static StridedStream stream(4);
  static auto sequential = std::make_shared<conveyor::SequentialSampler>(10);
  static auto batches = std::make_shared<conveyor::BatchSampler>(sequential, 2, false);
  static const std::vector<double> dw;
  auto loader = [](LoaderOptions o) { conveyor::DataLoader l(ds, std::move(o)); };
  auto stream_loader = [](LoaderOptions o) { conveyor::DataLoader l(stream, std::move(o)); };
  auto multinomial = [](std::vector<double> w, int64_t k, bool replacement) {
    conveyor::Generator g(0);
    conveyor::multinomial(w, k, replacement, g);
  };
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const double inf = std::numeric_limits<double>::infinity();
  static const std::map<std::string, std::function<void()>> all = {
      {"num_workers_negative", [=] { loader({.num_workers = -1}); }},
      {"timeout_negative", [=] { loader({.timeout = -1}); }},
      {"prefetch_without_workers", [=] { loader({.prefetch_factor = 3}); }},
      {"persistent_without_workers", [=] { loader({.persistent_workers = true}); }},
      {"iterable_shuffle", [=] { stream_loader({.shuffle = true}); }},
      {"iterable_sampler", [=] { stream_loader({.sampler = sequential}); }},
      {"iterable_batch_sampler", [=] { stream_loader({.batch_sampler = batches}); }},
      {"sampler_and_shuffle", [=] { loader({.shuffle = true, .sampler = sequential}); }},
      {"batch_sampler_and_batch_size", [=] { loader({.batch_size = 2, .batch_sampler = batches}); }},
      {"batch_sampler_and_shuffle", [=] { loader({.shuffle = true, .batch_sampler = batches}); }},
      {"batch_sampler_and_sampler", [=] { loader({.sampler = sequential, .batch_sampler = batches}); }},
      {"batch_sampler_and_drop_last", [=] { loader({.batch_sampler = batches, .drop_last = true}); }},
      {"no_batching_drop_last",
       [] { conveyor::DataLoader<RangeDataset, conveyor::DefaultConvert> l(ds, {.batch_size = std::nullopt, .drop_last = true}); }},
      {"batch_size_zero", [=] { loader({.batch_size = 0}); }},
      {"batch_size_negative", [=] { loader({.batch_size = -3}); }},
      {"random_sampler_num_samples_zero", [] { conveyor::RandomSampler s(10, false, 0); }},
      {"random_sampler_empty_dataset", [] { conveyor::RandomSampler s(0); }},
      {"weighted_num_samples_zero", [] { conveyor::WeightedRandomSampler s({1.0, 2.0}, 0); }},
      {"distributed_rank_too_big", [] { conveyor::DistributedSampler s(10, 2, 2); }},
      {"distributed_rank_negative", [] { conveyor::DistributedSampler s(10, 3, -1); }},
      {"random_split_bad_sum",
       [] { conveyor::random_split<int64_t>(std::make_shared<RangeDataset>(10), {3.0, 3.0}); }},
      {"random_split_fractions_over_one",
       [] { conveyor::random_split<int64_t>(std::make_shared<RangeDataset>(10), {0.5, 0.6}); }},
      {"random_split_bad_fraction",
       [] { conveyor::random_split<int64_t>(std::make_shared<RangeDataset>(10), {1.5, -0.5}); }},
      {"concat_empty", [] { conveyor::ConcatDataset<int64_t> c({}); }},
      {"multinomial_negative", [=] { multinomial({-1, 0, 1}, 2, true); }},
      {"multinomial_nan", [=] { multinomial({nan, 0, 1}, 1, true); }},
      {"multinomial_inf", [=] { multinomial({inf, 0, 1}, 2, true); }},
      {"multinomial_zero_sum", [=] { multinomial({0, 0}, 2, true); }},
      {"multinomial_too_many", [=] { multinomial({1, 0, 1}, 4, false); }},
      {"multinomial_negative_no_replacement", [=] { multinomial({-1, 2, 1}, 2, false); }},
      {"multinomial_nan_no_replacement", [=] { multinomial({nan, 2, 1}, 2, false); }},
      {"multinomial_zero_sum_no_replacement", [=] { multinomial({0, 0, 0}, 2, false); }},
      {"randint_empty_range",
       [] {
         conveyor::Generator g;
         std::vector<int64_t> out(3);
         conveyor::randint(0, 0, out, g);
       }},
      {"stack_unequal",
       [] {
         conveyor::default_collate(
             std::vector<conveyor::Array<float>>{conveyor::Array<float>({3}), conveyor::Array<float>({4})});
       }},
      {"collate_unequal_lists", [] { conveyor::default_collate(std::vector<std::vector<int>>{{1, 2}, {1}}); }},
      {"collate_missing_key",
       [] { conveyor::default_collate(std::vector<std::map<std::string, int>>{{{"a", 1}}, {{"b", 2}}}); }},
      {"len_unsized_iterable", [] { conveyor::DataLoader l(stream); (void)l.size(); }},
  };
  return all;
}

// Cases that need LibTorch are replayed in tests/torch.
const std::set<std::string> kTorchOnly = {"tensor_dataset_mismatch"};

TEST(LoaderOptions, EveryPyTorchMistakeFailsWithPyTorchsMessage) {
  const auto cases = conveyor::testing::load_fixtures("errors.txt");
  ASSERT_GE(cases.size(), 30u);
  size_t checked = 0;
  for (const auto& c : cases) {
    if (kTorchOnly.count(c.name)) continue;
    SCOPED_TRACE(c.describe());
    const auto mistake = mistakes().find(c.name);
    ASSERT_NE(mistake, mistakes().end()) << "no C++ version of the mistake " << c.name;
    const std::string expected = c.results.at(0);
    const std::string expected_type = expected.substr(0, expected.find(':'));
    const std::string expected_message = expected.substr(expected.find(": ") + 2);
    try {
      mistake->second();
      ADD_FAILURE() << "no exception";
    } catch (const conveyor::Error& e) {
      EXPECT_NE(python_type_of(e).find(expected_type), std::string::npos)
          << "PyTorch raises " << expected_type << ", conveyor threw " << python_type_of(e);
      if (c.param("mode") == "exact") {
        EXPECT_EQ(std::string(e.what()), expected_message);
      } else {
        EXPECT_EQ(normalise(e.what()), normalise(expected_message));
      }
    }
    ++checked;
  }
  EXPECT_EQ(checked, mistakes().size());
}

TEST(LoaderOptions, ConveyorOwnMistakesNameTheBadValue) {
  RangeDataset ds(10);
  EXPECT_THROW(conveyor::DataLoader(ds, {.num_workers = 1, .prefetch_factor = 0}), conveyor::ValueError);
  try {
    conveyor::DataLoader l(ds, {.generator = conveyor::Generator(1), .seed = 2});
    FAIL();
  } catch (const conveyor::ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("mutually exclusive"), std::string::npos);
  }
  // A collate function of one sample cannot serve a batching loader, and
  // vice versa: TypeError at construction, not at the first batch.
  EXPECT_THROW((conveyor::DataLoader<RangeDataset, conveyor::DefaultConvert>(ds, {.batch_size = 4})),
               conveyor::TypeError);
  EXPECT_THROW((conveyor::DataLoader<RangeDataset>(ds, {.batch_size = std::nullopt})), conveyor::TypeError);
  // Without workers there is no one to wait for (PyTorch asserts timeout ==
  // 0 there): refused, not ignored.
  try {
    conveyor::DataLoader l(ds, {.num_workers = 0, .timeout = 1.5});
    FAIL() << "a timeout without workers was accepted";
  } catch (const conveyor::ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("timeout option (1.5"), std::string::npos) << e.what();
  }
  EXPECT_NO_THROW(conveyor::DataLoader(ds, {.num_workers = 1, .timeout = 1.5}));
  // A dataset size past int64 showed as num_samples=-1.
  try {
    conveyor::RandomSampler sampler(std::numeric_limits<size_t>::max());
    FAIL() << "a RandomSampler over 2^64 - 1 samples was made";
  } catch (const conveyor::ValueError& e) {
    EXPECT_STREQ(e.what(),
                 "RandomSampler: the dataset's size, 18446744073709551615, is more than an index holds "
                 "(9223372036854775807)");
  }
}

// conveyor's own checks come after PyTorch's: options PyTorch 1.13 refuses
// get its message (they all got the timeout's, checked first).
TEST(LoaderOptions, PyTorchsMessagesComeBeforeConveyorsOwnChecks) {
  RangeDataset ds(10);
  conveyor::testing::StridedStream stream(4);
  const auto message_of = [](auto make) -> std::string {
    try {
      make();
    } catch (const conveyor::ValueError& e) {
      return e.what();
    }
    return "no error";
  };
  EXPECT_EQ(message_of([&] { conveyor::DataLoader l(ds, {.prefetch_factor = 3, .timeout = 5}); }),
            "prefetch_factor option could only be specified in multiprocessing.let num_workers > 0 to enable "
            "multiprocessing.");
  EXPECT_EQ(message_of([&] { conveyor::DataLoader l(ds, {.persistent_workers = true, .timeout = 5}); }),
            "persistent_workers option needs num_workers > 0");
  EXPECT_EQ(message_of([&] { conveyor::DataLoader l(stream, {.shuffle = true, .timeout = 5}); }),
            "DataLoader with IterableDataset: expected unspecified shuffle option, but got shuffle=True");
  EXPECT_EQ(message_of([&] { conveyor::DataLoader l(ds, {.batch_size = 0, .timeout = 5}); }),
            "batch_size should be a positive integer value, but got batch_size=0");
  EXPECT_EQ(message_of([&] { conveyor::DataLoader l(ds, {.batch_size = 0, .generator = conveyor::Generator(1), .seed = 1}); }),
            "batch_size should be a positive integer value, but got batch_size=0");
}

}  // namespace
