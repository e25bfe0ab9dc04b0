// State: JSON text round trips, hostile text, the envelope's checks, files.
#include "conveyor/state.h"

#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <clocale>
#include <cmath>
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

// JSON has no inf or NaN: they are written as Python's json module writes
// them and read back (they were written as null, and a diverged run's
// checkpoint could never be loaded). A bad byte is shown, not embedded:
// a NUL ended the message.
TEST(State, NonFiniteDoublesRoundTripAndBadBytesAreShownInMessages) {
  State state = State::object();
  state.set("up", std::numeric_limits<double>::infinity());
  state.set("down", -std::numeric_limits<double>::infinity());
  state.set("lost", std::numeric_limits<double>::quiet_NaN());
  const std::string text = state.to_json();
  EXPECT_EQ(text, R"({"up":Infinity,"down":-Infinity,"lost":NaN})");
  const State back = State::from_json(text);
  EXPECT_EQ(back.at("up").as_double(), std::numeric_limits<double>::infinity());
  EXPECT_EQ(back.at("down").as_double(), -std::numeric_limits<double>::infinity());
  EXPECT_TRUE(std::isnan(back.at("lost").as_double()));
  EXPECT_EQ(back.to_json(), text);
  for (const std::string& bad : {std::string("\0", 1), std::string("\xff"), std::string("\"\\\0\"", 4)}) {
    try {
      (void)State::from_json(bad);
      ADD_FAILURE() << "accepted";
    } catch (const StateError& e) {
      const std::string message = e.what();
      EXPECT_EQ(message.find('\0'), std::string::npos);
      EXPECT_NE(message.find(bad[0] == '"' ? "\\x00" : bad[0] == '\0' ? "\\x00" : "\\xFF"), std::string::npos)
          << message;
    }
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

// Arrays of non-negative integers are kept packed (list(), and what
// from_json reads): they must read, compare, print and grow as any array.
TEST(State, PackedIntegerListsBehaveAsArraysOfStates) {
  const State parsed = State::from_json("[ 0 , 7, 18446744073709551615 ]");
  const State built = State::list({0, 7, std::numeric_limits<uint64_t>::max()});
  State::Array spelled;
  for (const int64_t value : {int64_t{0}, int64_t{7}}) spelled.emplace_back(value);
  spelled.emplace_back(std::numeric_limits<uint64_t>::max());
  const State as_states(spelled);
  EXPECT_TRUE(parsed.is_array());
  EXPECT_EQ(parsed.size(), 3u);
  EXPECT_EQ(parsed, built);
  EXPECT_EQ(parsed, as_states);
  EXPECT_EQ(as_states, parsed);
  EXPECT_NE(parsed, State::list({0, 7}));
  EXPECT_NE(State::from_json("[0,7,1]"), as_states);
  EXPECT_EQ(parsed.to_json(), "[0,7,18446744073709551615]");
  EXPECT_EQ(parsed.items().at(1).as_uint(), 7u);
  EXPECT_EQ(parsed.items().at(2).as_uint(), std::numeric_limits<uint64_t>::max());
  EXPECT_EQ(parsed.as_uint_list(), (std::vector<uint64_t>{0, 7, std::numeric_limits<uint64_t>::max()}));

  // Integers then other values, in every order, read as they are written.
  for (const char* text : {"[1,-2,3]", "[1,2.5,3]", "[1,2e3]", "[4,\"x\",[5,6]]", "[-0,1]", "[[1,2],[3]]", "[1,null]"}) {
    const State value = State::from_json(text);
    EXPECT_EQ(value.to_json(), State::from_json(value.to_json()).to_json()) << text;
    EXPECT_EQ(State::from_json(value.to_json()), value) << text;
  }
  const State mixed = State::from_json("[1,-2,3.5,4]");
  ASSERT_EQ(mixed.size(), 4u);
  EXPECT_EQ(mixed.items()[0].as_uint(), 1u);
  EXPECT_EQ(mixed.items()[1].as_int(), -2);
  EXPECT_EQ(mixed.items()[2].as_double(), 3.5);
  EXPECT_EQ(mixed.items()[3].as_uint(), 4u);
  for (const char* bad : {"[01]", "[1,01]", "[18446744073709551616]", "[1,2,]", "[1 2]", "[1,", "[1.]"}) {
    EXPECT_THROW(State::from_json(bad), StateError) << bad;
  }

  // Growing one turns it into States; a copy keeps its own values.
  State grown = built;
  grown.push_back("end");
  EXPECT_EQ(grown.to_json(), "[0,7,18446744073709551615,\"end\"]");
  EXPECT_EQ(built.size(), 3u);
  State moved_from = State::list({1, 2});
  (void)moved_from.items();
  State moved = std::move(moved_from);
  EXPECT_EQ(moved.as_uint_list(), (std::vector<uint64_t>{1, 2}));
  EXPECT_EQ(moved.items().size(), 2u);
  State assigned = State::list({9});
  (void)assigned.items();
  assigned = moved;
  EXPECT_EQ(assigned.items().size(), 2u);
  EXPECT_EQ(assigned.items()[1].as_uint(), 2u);
  EXPECT_THROW(State::list({1}).at("x"), StateError);
  EXPECT_THROW(State::list({1}).as_uint(), StateError);
  EXPECT_EQ(State::list({}).to_json(), "[]");
  EXPECT_EQ(State::list({}), State::array());
}

// items() on a packed list makes its States once, whichever caller is first;
// the others read that one array.
TEST(State, ConcurrentItemsOfOnePackedListSeeOneArray) {
  std::vector<uint64_t> values(4096);
  for (size_t i = 0; i < values.size(); ++i) values[i] = i * 3;
  for (int round = 0; round < 50; ++round) {
    const State list = State::list(values);
    std::vector<const State::Array*> seen(4, nullptr);
    std::vector<std::thread> threads;
    for (size_t t = 0; t < seen.size(); ++t) {
      threads.emplace_back([&, t] { seen[t] = &list.items(); });
    }
    for (std::thread& thread : threads) thread.join();
    for (const State::Array* items : seen) {
      ASSERT_EQ(items, seen[0]);
      ASSERT_EQ(items->size(), values.size());
      EXPECT_EQ((*items)[4095].as_uint(), 4095u * 3);
    }
  }
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
