// The main job on 2 real ranks: train_fashion_mnist --distributed, started
// twice with torchrun's variables on 127.0.0.1 (a free port each time) and a
// deadline that kills what is left. Both ranks must exit 0, rank 0 alone must
// report, and the rerun must print the same loss-curve fingerprint.
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <regex>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "distributed/launcher.h"

namespace {

using conveyor::test::launch;
using conveyor::test::LaunchResult;

const std::string kTrainer = CONVEYOR_TRAINER_BINARY;
const std::string kData = "/usr/share/datasets/fashion-mnist";

// A bounded run: 2048 samples of the job (1024 per rank, 16 steps of 64 per
// rank), one thread and one worker per rank on a 2-core machine.
LaunchResult train_on_two_ranks() {
  const uint16_t port = conveyor::test::free_port();
  std::printf("MASTER_PORT=%u\n", port);
  return launch(kTrainer,
                {"--distributed", "--epochs", "1", "--limit", "2048", "--workers", "1", "--threads", "1",
                 "--data", kData},
                2, port, std::chrono::seconds(100));
}

std::string first_match(const std::string& text, const std::regex& pattern) {
  std::smatch match;
  return std::regex_search(text, match, pattern) ? match[1].str() : "";
}

TEST(DistributedTrainer, TwoRanksAgreeAndRerunIdentically) {
  if (!std::filesystem::exists(kData + "/train-images-idx3-ubyte") &&
      !std::filesystem::exists(kData + "/train-images-idx3-ubyte.gz")) {
    GTEST_SKIP() << "Fashion-MNIST is not at " << kData;
  }
  const std::regex fingerprint(R"(final: .*loss-curve fingerprint ([0-9a-f]{16}))");
  const std::regex accuracy(R"(final: 1 epochs, test accuracy ([0-9.]+)%)");
  std::vector<std::string> fingerprints;
  for (int run = 0; run < 2; ++run) {
    const LaunchResult result = train_on_two_ranks();
    ASSERT_EQ(result.ranks.size(), 2u);
    for (const auto& rank : result.ranks) ASSERT_EQ(rank.exit_code, 0) << result.describe();
    const std::string& lead = result.ranks[0].output;
    const std::string& other = result.ranks[1].output;
    EXPECT_NE(lead.find("distributed: rank 0 of 2"), std::string::npos) << result.describe();
    // Progress, evaluation and the summary come from rank 0 alone.
    EXPECT_EQ(other.find("epoch 1/1"), std::string::npos) << result.describe();
    EXPECT_EQ(other.find("final:"), std::string::npos) << result.describe();
    const std::string percent = first_match(lead, accuracy);
    ASSERT_FALSE(percent.empty()) << result.describe();
    // 32 averaged steps of a fresh CNN: well above chance (10%) when the
    // gradients are averaged, not when they are garbage.
    EXPECT_GT(std::stod(percent), 30.0) << result.describe();
    fingerprints.push_back(first_match(lead, fingerprint));
    ASSERT_FALSE(fingerprints.back().empty()) << result.describe();
    std::printf("run %d: %.1f s, test accuracy %s%%, fingerprint %s\n", run + 1,
                static_cast<double>(result.elapsed.count()) / 1000, percent.c_str(),
                fingerprints.back().c_str());
  }
  EXPECT_EQ(fingerprints[0], fingerprints[1]);
}

}  // namespace
