// State: JSON text round trips, hostile text, the envelope's checks, files.
#include "conveyor/state.h"

#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <clocale>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <limits>
#include <string>
#include <thread>
#include <vector>

namespace conveyor {
namespace {

TEST(State, RoundTripsEveryKindOfValueAndKeepsSixtyFourBits) {
  State state = State::object();
  state.set("max", std::numeric_limits<uint64_t>::max());
  state.set("min", std::numeric_limits<int64_t>::min());
  state.set("half", 0.5);
  state.set("text", "a \"quoted\"\\ line\nwith \x01 control");
  state.set("flag", true);
  state.set("nothing", State());
  state.set("list", State::list({1, 2, 3}));
  State nested = State::object();
  nested.set("deeper", State::array());
  state.set("nested", nested);

  const std::string text = state.to_json();
  const State back = State::from_json(text);
  EXPECT_EQ(back, state);
  EXPECT_EQ(back.uint_at("max"), std::numeric_limits<uint64_t>::max());
  EXPECT_EQ(back.int_at("min"), std::numeric_limits<int64_t>::min());
  EXPECT_EQ(back.at("half").as_double(), 0.5);
  EXPECT_EQ(back.string_at("text"), "a \"quoted\"\\ line\nwith \x01 control");
  EXPECT_EQ(back.at("list").as_uint_list(), (std::vector<uint64_t>{1, 2, 3}));
  EXPECT_EQ(back.to_json(), text);  // members keep their order
}

TEST(State, ReadsEscapesAndWhitespace) {
  const State state = State::from_json(" { \"a\" : [ 1 , -2 , 3.5e1 ] ,\n \"u\" : \"\\u00e9\\ud83d\\ude00\\/\" } ");
  EXPECT_EQ(state.at("a").items()[1].as_int(), -2);
  EXPECT_EQ(state.at("a").items()[2].as_double(), 35.0);
  EXPECT_EQ(state.string_at("u"), "\xc3\xa9\xf0\x9f\x98\x80/");
}

TEST(State, RefusesMalformedAndHostileText) {
  for (const char* bad : {"", "{", "[1,]", "{\"a\":1,}", "{\"a\" 1}", "tru", "\"open", "01x", "1 2",
                          "{\"a\":1,\"a\":2}", "\"\\ud800\"", "\"\\q\"", "18446744073709551616",
                          "-9223372036854775809", "\"tab\there\"", "01", "-01", "1.", "1.e5", "-", "1e", "1e+",
                          ".5", "1e999"}) {
    EXPECT_THROW(State::from_json(bad), StateError) << bad;
  }
  // Deep nesting is refused, not a stack overflow.
  const std::string deep = std::string(100000, '[') + std::string(100000, ']');
  try {
    State::from_json(deep);
    FAIL() << "a 100000-deep array was accepted";
  } catch (const StateError& error) {
    EXPECT_NE(std::string(error.what()).find("deeper than 64"), std::string::npos) << error.what();
  }
}

// Doubles are written and read the same whatever the C locale says (a
// comma-decimal LC_NUMERIC must not turn 0.5 into "0,5").
TEST(State, DoublesRoundTripUnderAnyLocale) {
  const char* before = std::setlocale(LC_NUMERIC, nullptr);
  const std::string saved = before ? before : "C";
  const bool comma = std::setlocale(LC_NUMERIC, "de_DE.UTF-8") != nullptr ||
                     std::setlocale(LC_NUMERIC, "fr_FR.UTF-8") != nullptr;
  for (const double value : {0.5, -0.1, 1e300, 6.02214076e23, 5.0, -0.0}) {
    const std::string text = State(value).to_json();
    EXPECT_EQ(text.find(','), std::string::npos) << text;
    EXPECT_EQ(State::from_json(text).as_double(), value) << text;
  }
  EXPECT_EQ(State::from_json("[0.5,2]").size(), 2u);
  std::setlocale(LC_NUMERIC, saved.c_str());
  if (!comma) std::printf("no comma-decimal locale installed: checked under the C locale only\n");
}

// Many members: the duplicate check must not be quadratic (this would take
// minutes with a linear search per member).
TEST(State, AnObjectWithManyMembersParsesInLinearTime) {
  std::string text = "{";
  for (int i = 0; i < 200000; ++i) text += (i ? ",\"k" : "\"k") + std::to_string(i) + "\":" + std::to_string(i);
  text += "}";
  const State state = State::from_json(text);
  EXPECT_EQ(state.size(), 200000u);
  EXPECT_EQ(state.members().back().second.as_uint(), 199999u);
  EXPECT_THROW(State::from_json(text.substr(0, text.size() - 1) + ",\"k7\":1}"), StateError);
}

TEST(State, TypedReadsNameTheFieldAndWhatItHolds) {
  const State state = State::from_json(R"({"count": -1, "name": 7})");
  try {
    state.uint_at("count");
    FAIL();
  } catch (const StateError& error) {
    EXPECT_NE(std::string(error.what()).find("count should be a non-negative integer"), std::string::npos)
        << error.what();
  }
  EXPECT_THROW(state.string_at("name"), StateError);
  try {
    state.at("missing");
    FAIL();
  } catch (const StateError& error) {
    EXPECT_NE(std::string(error.what()).find("'missing' is missing"), std::string::npos) << error.what();
  }
}

TEST(State, TheEnvelopeNamesTheFieldThatDiffers) {
  State fingerprint = State::object();
  fingerprint.set("batch_size", 64);
  State sampler = State::object();
  sampler.set("name", "RandomSampler");
  fingerprint.set("sampler", sampler);
  const State saved = State::from_json(state_envelope("conveyor.DataLoader", fingerprint).to_json());
  EXPECT_NO_THROW(check_state_envelope(saved, "conveyor.DataLoader", fingerprint, "load_state_dict"));

  State other = fingerprint;
  other.set("batch_size", 32);
  try {
    check_state_envelope(saved, "conveyor.DataLoader", other, "load_state_dict");
    FAIL();
  } catch (const StateError& error) {
    EXPECT_STREQ(error.what(),
                 "load_state_dict: 'batch_size' does not match: the state was saved with 64, this one has 32");
  }
  State renamed = fingerprint;
  State sequential = State::object();
  sequential.set("name", "SequentialSampler");
  renamed.set("sampler", sequential);
  try {
    check_state_envelope(saved, "conveyor.DataLoader", renamed, "load_state_dict");
    FAIL();
  } catch (const StateError& error) {
    EXPECT_NE(std::string(error.what()).find("'sampler.name' does not match"), std::string::npos) << error.what();
  }
  EXPECT_THROW(check_state_envelope(saved, "conveyor.Pipeline", fingerprint, "load_state"), StateError);
  State future = saved;
  future.set("version", 2);
  EXPECT_THROW(check_state_envelope(future, "conveyor.DataLoader", fingerprint, "x"), StateError);
}

TEST(State, FilesAreReplacedWholeAndSpecialFilesRefused) {
  const std::filesystem::path dir =
      std::filesystem::temp_directory_path() / ("conveyor_state_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  const std::string path = (dir / "state.json").string();
  State first = State::object();
  first.set("n", 1);
  save_state_file(path, first);
  State second = State::object();
  second.set("n", 2);
  save_state_file(path, second);
  EXPECT_EQ(load_state_file(path), second);
  // No temporary file is left beside it.
  size_t files = 0;
  for ([[maybe_unused]] const auto& entry : std::filesystem::directory_iterator(dir)) ++files;
  EXPECT_EQ(files, 1u);

  const std::string fifo = (dir / "fifo").string();
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  EXPECT_THROW(load_state_file(fifo), StateError);
  const std::string link = (dir / "link").string();
  std::filesystem::create_symlink(path, link);
  EXPECT_THROW(load_state_file(link), StateError);
  std::ofstream(dir / "garbage") << "{\"n\": ";
  EXPECT_THROW(load_state_file((dir / "garbage").string()), StateError);
  EXPECT_THROW(load_state_file((dir / "absent").string()), RuntimeError);
  std::filesystem::remove_all(dir);
}

// Threads saving the same path at once each write a temporary file of
// their own: the file is always one of them, whole.
TEST(State, ConcurrentSavesOfOnePathLeaveOneWholeState) {
  const std::filesystem::path dir =
      std::filesystem::temp_directory_path() / ("conveyor_state_race_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  const std::string path = (dir / "state.json").string();
  std::vector<std::thread> savers;
  for (int t = 0; t < 4; ++t) {
    savers.emplace_back([&path, t] {
      for (int i = 0; i < 50; ++i) {
        State state = State::object();
        state.set("writer", t);
        state.set("payload", std::string(static_cast<size_t>(1000 * (t + 1)), static_cast<char>('a' + t)));
        save_state_file(path, state);
      }
    });
  }
  for (std::thread& saver : savers) saver.join();
  const State loaded = load_state_file(path);
  const auto writer = static_cast<size_t>(loaded.int_at("writer"));
  EXPECT_EQ(loaded.string_at("payload"), std::string(1000 * (writer + 1), static_cast<char>('a' + writer)));
  size_t files = 0;
  for ([[maybe_unused]] const auto& entry : std::filesystem::directory_iterator(dir)) ++files;
  EXPECT_EQ(files, 1u);
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace conveyor
