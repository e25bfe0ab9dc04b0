#include <gtest/gtest.h>

#include <conveyor/sample_fields.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

using conveyor::SampleFields;
using Bytes = std::vector<uint8_t>;

Bytes bytes_of(const std::string& text) { return Bytes(text.begin(), text.end()); }

std::vector<std::string> names_of(const SampleFields& fields) {
  std::vector<std::string> names;
  for (const auto& [name, bytes] : fields) names.push_back(name);
  return names;
}

TEST(SampleFields, IterateInNameOrderWhateverTheInsertionOrder) {
  SampleFields fields;
  fields.try_emplace("txt", bytes_of("caption"));
  fields.try_emplace("cls", bytes_of("7"));
  fields.try_emplace("seg.png", bytes_of("mask"));
  fields.try_emplace("jpg", bytes_of("image"));
  EXPECT_EQ(names_of(fields), (std::vector<std::string>{"cls", "jpg", "seg.png", "txt"}));
  EXPECT_EQ(fields.at("jpg"), bytes_of("image"));
  EXPECT_EQ(fields.size(), 4u);
}

TEST(SampleFields, AFieldAddedTwiceKeepsItsFirstBytesAsAMapDoes) {
  SampleFields fields;
  const auto [first, added_first] = fields.try_emplace("cls", bytes_of("1"));
  EXPECT_TRUE(added_first);
  const auto [again, added_again] = fields.try_emplace("cls", bytes_of("2"));
  EXPECT_FALSE(added_again);
  EXPECT_EQ(again->second, bytes_of("1"));
  EXPECT_EQ(fields.size(), 1u);

  const SampleFields listed{{"b", bytes_of("first")}, {"a", bytes_of("x")}, {"b", bytes_of("second")}};
  const std::map<std::string, Bytes> mapped{{"b", bytes_of("first")}, {"a", bytes_of("x")}, {"b", bytes_of("second")}};
  ASSERT_EQ(listed.size(), mapped.size());
  EXPECT_EQ(listed.at("b"), mapped.at("b"));
}

TEST(SampleFields, AMissingFieldIsAnErrorNamingIt) {
  const SampleFields fields{{"jpg", bytes_of("image")}};
  EXPECT_FALSE(fields.contains("cls"));
  EXPECT_EQ(fields.count("cls"), 0u);
  EXPECT_EQ(fields.find("cls"), fields.end());
  try {
    (void)fields.at("cls");
    FAIL() << "at() found a field that is not there";
  } catch (const std::out_of_range& error) {
    EXPECT_EQ(std::string(error.what()), "sample has no field 'cls'");
  }
}

TEST(SampleFields, EqualWhenTheSameFieldsHoldTheSameBytes) {
  SampleFields one;
  one.try_emplace("jpg", bytes_of("image"));
  one.try_emplace("cls", bytes_of("3"));
  const SampleFields other{{"cls", bytes_of("3")}, {"jpg", bytes_of("image")}};
  EXPECT_EQ(one, other);
  one.at("cls") = bytes_of("4");
  EXPECT_NE(one, other);
  EXPECT_EQ(one.erase("cls"), 1u);
  EXPECT_EQ(one.erase("cls"), 0u);
  EXPECT_NE(one, other);
}

TEST(SampleFields, ReservedRoomTakesTheFieldsWithoutMovingThem) {
  SampleFields fields;
  fields.reserve(3);
  fields.try_emplace("a");
  const auto* storage = &*fields.begin();
  fields.try_emplace("c");
  fields.try_emplace("b");
  EXPECT_EQ(&*fields.begin(), storage);
  EXPECT_EQ(names_of(fields), (std::vector<std::string>{"a", "b", "c"}));
}

// Random inserts, assignments, erases and lookups, applied to SampleFields
// and to std::map alike: the two hold the same fields in the same order
// after every step. The seed is printed; CONVEYOR_FIELDS_SEED replays one.
// Another field's bytes as the value of a new field (WebDataset's
// s["input"] = s["jpg"], written with insert_or_assign or try_emplace):
// copied, though the insertion moves that field (with room reserved, in
// place: the new field read itself and came out empty; without, the array
// moved and the copy read freed memory).
TEST(SampleFields, AnotherFieldsBytesAreCopiedIntoANewField) {
  for (const bool reserved : {true, false}) {
    SCOPED_TRACE(reserved ? "room reserved" : "no room reserved");
    conveyor::SampleFields by_assign, by_emplace;
    for (conveyor::SampleFields* fields : {&by_assign, &by_emplace}) {
      if (reserved) fields->reserve(4);
      fields->try_emplace("jpg", std::vector<uint8_t>{1, 2, 3});
      fields->try_emplace("txt", std::vector<uint8_t>{9});
    }
    EXPECT_TRUE(by_assign.insert_or_assign("input", by_assign.at("jpg")).second);
    EXPECT_TRUE(by_emplace.try_emplace("input", by_emplace.at("jpg")).second);
    for (const conveyor::SampleFields* fields : {&by_assign, &by_emplace}) {
      EXPECT_EQ(fields->at("input"), (std::vector<uint8_t>{1, 2, 3}));
      EXPECT_EQ(fields->at("jpg"), (std::vector<uint8_t>{1, 2, 3}));
      EXPECT_EQ(fields->at("txt"), (std::vector<uint8_t>{9}));
    }
    // A field there already takes the other's bytes in place.
    by_assign.insert_or_assign("txt", by_assign.at("jpg"));
    EXPECT_EQ(by_assign.at("txt"), (std::vector<uint8_t>{1, 2, 3}));
  }
}

TEST(SampleFields, BehavesAsStdMapUnderRandomOperations) {
  const char* fixed = std::getenv("CONVEYOR_FIELDS_SEED");
  const uint64_t seed = fixed != nullptr ? std::stoull(fixed) : std::random_device{}();
  std::printf("SampleFields random operations: seed %llu (replay with CONVEYOR_FIELDS_SEED=%llu)\n",
              static_cast<unsigned long long>(seed), static_cast<unsigned long long>(seed));
  std::mt19937_64 random(seed);
  const std::vector<std::string> names = {"", "a", "b", "cls", "jpg", "json", "seg.png", "txt", "z.z.z"};
  SampleFields fields;
  std::map<std::string, Bytes> expected;
  for (int step = 0; step < 5000; ++step) {
    SCOPED_TRACE("seed " + std::to_string(seed) + ", step " + std::to_string(step));
    const std::string& name = names[random() % names.size()];
    const Bytes bytes(random() % 4, static_cast<uint8_t>(random()));
    switch (random() % 7) {
      case 0: {
        const bool added = fields.try_emplace(name, bytes).second;
        EXPECT_EQ(added, expected.try_emplace(name, bytes).second);
        break;
      }
      case 1:
        fields.insert_or_assign(name, bytes);
        expected.insert_or_assign(name, bytes);
        break;
      case 2:
        EXPECT_EQ(fields.erase(name), expected.erase(name));
        break;
      case 3:
        fields[name] = bytes;
        expected[name] = bytes;
        break;
      case 4: {
        const bool added = fields.emplace(name, bytes).second;
        EXPECT_EQ(added, expected.emplace(name, bytes).second);
        break;
      }
      case 5: {
        const bool added = fields.insert({name, bytes}).second;
        EXPECT_EQ(added, expected.insert({name, bytes}).second);
        break;
      }
      default:
        ASSERT_EQ(fields.contains(name), expected.contains(name));
        if (expected.contains(name)) {
          EXPECT_EQ(fields.at(name), expected.at(name));
        }
        break;
    }
    ASSERT_EQ(fields.size(), expected.size());
    auto field = fields.begin();
    for (const auto& [expected_name, expected_bytes] : expected) {
      ASSERT_EQ(field->first, expected_name);
      ASSERT_EQ(field->second, expected_bytes);
      ++field;
    }
    if (random() % 200 == 0) {
      fields.clear();
      expected.clear();
    }
  }
}

}  // namespace
