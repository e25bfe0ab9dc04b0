// DecisionLog (conveyor/detail/decision_log.h; with the nodes, so under
// TSan in CI): one writer appending and clearing (a node starting a round
// mid-pass), one reader copying (state() on the consumer's thread). A copy is always one generation's; a full log
// refuses a state and loses nothing else.
#include "conveyor/detail/decision_log.h"

#include <gtest/gtest.h>

#include <atomic>
#include <cstdint>
#include <string>
#include <thread>
#include <vector>

namespace {

using conveyor::detail::DecisionLog;

// Generation g writes only the value g: a copy mixing two is torn. Under
// ThreadSanitizer this is also the race check.
TEST(DecisionLog, ACopyIsOneGenerationsWhileTheWriterClearsAndAppends) {
  DecisionLog log;
  std::atomic<bool> stop{false};
  std::thread writer([&] {
    for (uint32_t generation = 1; generation <= 20000; ++generation) {
      log.clear();
      // Across a chunk boundary now and then (chunks are 65,536 entries).
      const uint32_t length = generation % 50 == 0 ? 70000 : generation % 97;
      for (uint32_t k = 0; k < length; ++k) log.append(generation);
    }
    stop.store(true);
  });
  uint64_t copies = 0, nonempty = 0;
  while (!stop.load()) {
    const std::vector<uint32_t> copy = log.read_all();
    ++copies;
    if (copy.empty()) continue;
    ++nonempty;
    for (const uint32_t value : copy) ASSERT_EQ(value, copy.front()) << "a torn copy of " << copy.size();
  }
  writer.join();
  std::printf("%llu copies, %llu not empty\n", static_cast<unsigned long long>(copies),
              static_cast<unsigned long long>(nonempty));
}

TEST(DecisionLog, AFullLogRefusesAStateUntilItIsCleared) {
  DecisionLog log(5);
  for (uint32_t k = 0; k < 5; ++k) log.append(k);
  EXPECT_EQ(log.read_all(), (std::vector<uint32_t>{0, 1, 2, 3, 4}));
  log.append(5);  // one too many: dropped, the log is full
  log.append(6);
  try {
    (void)log.read_all();
    FAIL() << "a full log was read";
  } catch (const conveyor::StateError& error) {
    EXPECT_NE(std::string(error.what()).find("more than 5 items"), std::string::npos) << error.what();
  }
  log.clear();
  log.append(7);
  EXPECT_EQ(log.read_all(), (std::vector<uint32_t>{7}));
}

}  // namespace
