// The main job on 2 real ranks: train_fashion_mnist --distributed, started
// with torchrun's variables on 127.0.0.1 (a free port each time) and a
// deadline that kills what is left. Both ranks must exit 0, rank 0 alone must
// report, and the rerun must print the same loss-curve fingerprint; on tar
// shards of uneven sizes every rank must run the same number of steps.
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <regex>
#include <set>
#include <stdexcept>
#include <sstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <unistd.h>

#include <conveyor/idx.h>
#include <conveyor/image.h>
#include <conveyor/tar_shards.h>

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

// "rank R: epoch E: key=value ..." lines, the trainer's per-rank account
// of an epoch under --distributed: by (rank, epoch), key -> value.
using EpochLines = std::map<std::pair<int, int>, std::map<std::string, std::string>>;

EpochLines epoch_lines(const std::string& output) {
  static const std::regex line(R"(rank (\d+): epoch (\d+): (.*))");
  EpochLines out;
  std::istringstream lines(output);
  for (std::string text; std::getline(lines, text);) {
    std::smatch match;
    if (!std::regex_search(text, match, line)) continue;
    auto& fields = out[{std::stoi(match[1]), std::stoi(match[2])}];
    std::istringstream items(match[3].str());
    for (std::string item; items >> item;) {
      const size_t eq = item.find('=');
      if (eq != std::string::npos) fields[item.substr(0, eq)] = item.substr(eq + 1);
    }
  }
  return out;
}

std::set<std::string> split(const std::string& csv) {
  std::set<std::string> out;
  std::istringstream in(csv);
  for (std::string item; std::getline(in, item, ',');) out.insert(item);
  return out;
}

// Three shards of 200, 200 and 100 samples of the training set, in a new
// directory under /tmp (removed by the caller).
std::string write_uneven_shards(size_t& samples) {
  const size_t kSamples = 500, kPerShard = 200;
  samples = kSamples;
  char dir_template[] = "/tmp/conveyor-uneven-shards-XXXXXX";
  if (::mkdtemp(dir_template) == nullptr) throw std::runtime_error("mkdtemp failed");
  const std::string dir = dir_template;
  conveyor::IdxImageDataset train = conveyor::IdxImageDataset::from_directory(kData, true);
  conveyor::TarShardWriter writer(dir + "/train-", kPerShard);
  for (size_t i = 0; i < kSamples; ++i) {
    conveyor::LabeledImage sample = train.get(i);
    const std::string key = std::to_string(i), label = std::to_string(sample.label);
    writer.write(key, {{"jpg", conveyor::encode_jpeg(sample.image, 95)},
                       {"cls", std::vector<uint8_t>(label.begin(), label.end())}});
  }
  if (writer.close().size() != 3) throw std::runtime_error("expected 3 shards");
  std::ofstream(dir + "/COMPLETE");  // the trainer's mark of a finished shard set
  return dir;
}

TEST(DistributedTrainer, UnevenShardsGiveEveryRankTheSameStepCount) {
  if (!std::filesystem::exists(kData + "/train-images-idx3-ubyte") &&
      !std::filesystem::exists(kData + "/train-images-idx3-ubyte.gz")) {
    GTEST_SKIP() << "Fashion-MNIST is not at " << kData;
  }
  // Three shards of 200, 200 and 100 samples: rank 0 reads two of them,
  // rank 1 one, whatever each epoch's shard order. With 2 workers per rank
  // each worker batches its own shard (PyTorch's rule for iterable data
  // sets): rank 0 has 4 + 4 or 4 + 2 batches of 64 (more than 400 / 64 or
  // 300 / 64), rank 1 4 or 2. Without agreement rank 0 would wait in an
  // allreduce rank 1 never joins; counting samples / batch it would stop
  // before the end of its share.
  size_t kSamples = 0;
  const std::string dir = write_uneven_shards(kSamples);
  const std::set<std::string> all_shards = {"train-000000.tar", "train-000001.tar",
                                            "train-000002.tar"};
  for (const std::string& shard : all_shards) ASSERT_TRUE(std::filesystem::exists(dir + "/" + shard));

  const int kEpochs = 2;
  const uint16_t port = conveyor::test::free_port();
  std::printf("MASTER_PORT=%u, seed 0\n", port);
  const LaunchResult result =
      launch(kTrainer,
             {"--distributed", "--source", "shards", "--shards", dir, "--epochs", std::to_string(kEpochs),
              "--batch-size", "64", "--workers", "2", "--threads", "1", "--seed", "0", "--data", kData},
             2, port, std::chrono::seconds(150));
  std::filesystem::remove_all(dir);
  for (const auto& rank : result.ranks) {
    ASSERT_FALSE(rank.killed_at_deadline) << result.describe();
    ASSERT_EQ(rank.exit_code, 0) << result.describe();
  }
  const EpochLines lines = epoch_lines(result.ranks[0].output + result.ranks[1].output);
  for (int epoch = 1; epoch <= kEpochs; ++epoch) {
    ASSERT_TRUE(lines.count({0, epoch}) && lines.count({1, epoch})) << result.describe();
    const auto& zero = lines.at({0, epoch});
    const auto& one = lines.at({1, epoch});
    // Each rank's shards: disjoint, together every shard; their samples, all.
    const std::set<std::string> shards0 = split(zero.at("shards")), shards1 = split(one.at("shards"));
    std::set<std::string> both = shards0;
    both.insert(shards1.begin(), shards1.end());
    EXPECT_EQ(shards0.size() + shards1.size(), both.size()) << "a shard read twice\n" << result.describe();
    EXPECT_EQ(both, all_shards) << result.describe();
    EXPECT_EQ(std::stoul(zero.at("samples")) + std::stoul(one.at("samples")), kSamples) << result.describe();
    // Each rank trained on the whole of its share before padding.
    EXPECT_EQ(zero.at("read"), zero.at("samples")) << result.describe();
    EXPECT_EQ(one.at("read"), one.at("samples")) << result.describe();
    const size_t batches0 = std::stoul(zero.at("batches")), batches1 = std::stoul(one.at("batches"));
    ASSERT_GT(batches0, batches1) << "the shards must be uneven for this test to mean anything\n"
                                  << result.describe();
    // The same number of steps on both ranks: the most; the short rank pads.
    EXPECT_EQ(zero.at("steps"), std::to_string(batches0)) << result.describe();
    EXPECT_EQ(one.at("steps"), std::to_string(batches0)) << result.describe();
    EXPECT_EQ(zero.at("padded"), "0") << result.describe();
    EXPECT_EQ(one.at("padded"), std::to_string(batches0 - batches1)) << result.describe();
    std::printf("epoch %d: rank 0 %s (%zu batches), rank 1 %s (%zu batches), %s steps each\n", epoch,
                zero.at("shards").c_str(), batches0, one.at("shards").c_str(), batches1,
                one.at("steps").c_str());
  }
  EXPECT_NE(result.ranks[0].output.find("final: 2 epochs"), std::string::npos) << result.describe();
  std::printf("%.1f s\n", static_cast<double>(result.elapsed.count()) / 1000);
}

std::string find_on_path(const std::string& name) {
  const char* path = std::getenv("PATH");
  std::istringstream dirs(path != nullptr ? path : "");
  for (std::string dir; std::getline(dirs, dir, ':');) {
    std::string candidate = dir + "/" + name;
    if (::access(candidate.c_str(), X_OK) == 0) return candidate;
  }
  return "";
}

// torchrun --standalone with 2 ranks of the trainer; what it printed.
LaunchResult torchrun_trainer(const std::string& torchrun, int max_restarts, const std::vector<std::string>& args,
                              const std::map<std::string, std::string>& env) {
  char log_dir[] = "/tmp/conveyor-torchrun-XXXXXX";
  if (::mkdtemp(log_dir) == nullptr) throw std::runtime_error("mkdtemp failed");
  // --redirects 1 --tee 1: Debian's torchrun 1.13 on Python 3.11 fails on its
  // default --redirects 0. --monitor_interval: a dead rank noticed in 0.5 s.
  std::vector<std::string> argv = {torchrun, "--standalone", "--nproc_per_node", "2", "--max_restarts",
                                   std::to_string(max_restarts), "--monitor_interval", "0.5", "--redirects", "1",
                                   "--tee", "1", "--log_dir", log_dir, "--no_python", kTrainer};
  argv.insert(argv.end(), args.begin(), args.end());
  LaunchResult result = conveyor::test::run_all({{argv, env}}, std::chrono::seconds(300));
  std::filesystem::remove_all(log_dir);
  return result;
}

// A rank SIGKILLed while padding the epoch (its shard is the short one),
// torchrun restarts the job (--max_restarts 1), every rank resumes from the
// checkpoint all of them saved (--auto-resume): the job ends with the loss
// curve of one never stopped.
TEST(DistributedTrainer, ARankKilledMidEpochResumesFromTheRanksCheckpointUnderTorchrun) {
  const std::string torchrun = find_on_path("torchrun");
  if (torchrun.empty()) GTEST_SKIP() << "torchrun is not on the PATH (Debian: python3-torch)";
  if (!std::filesystem::exists(kData + "/train-images-idx3-ubyte") &&
      !std::filesystem::exists(kData + "/train-images-idx3-ubyte.gz")) {
    GTEST_SKIP() << "Fashion-MNIST is not at " << kData;
  }
  size_t samples = 0;
  const std::string shards = write_uneven_shards(samples);
  const std::string checkpoints = shards + "-checkpoints";
  const std::vector<std::string> args = {"--distributed", "--source", "shards", "--shards", shards, "--epochs", "2",
                                         "--batch-size", "64", "--workers", "2", "--threads", "1", "--seed", "0",
                                         "--data", kData};
  const std::regex final_line(R"(final: .*test accuracy ([0-9.]+)%.*loss-curve fingerprint ([0-9a-f]{16}))");
  const LaunchResult whole = torchrun_trainer(torchrun, 0, args, {});
  ASSERT_EQ(whole.ranks[0].exit_code, 0) << whole.describe();
  std::smatch want;
  ASSERT_TRUE(std::regex_search(whole.ranks[0].output, want, final_line)) << whole.describe();

  // Rank 1 reads the 100-sample shard in one epoch of two at least (with
  // --seed 0, the second: 2 batches of its 8 steps). Killed at step 7 with a
  // checkpoint every 3 steps, it resumes from step 6, taken while it pads
  // the first epoch; killed at step 12 with one every 5, from step 10, taken
  // while it pads the second, whose shards are not epoch 0's. (The second
  // resumed over epoch 0's shards before the trainer set the dataset's
  // epoch for it: another loss curve.)
  for (const auto& [every, kill_at] : {std::pair{"3", "7"}, std::pair{"5", "12"}}) {
    SCOPED_TRACE(std::string("a checkpoint every ") + every + " steps, killed at step " + kill_at);
    std::filesystem::remove_all(checkpoints);
    std::vector<std::string> with_checkpoints = args;
    for (const char* arg : {"--checkpoint-every", every, "--auto-resume"}) with_checkpoints.push_back(arg);
    with_checkpoints.push_back("--checkpoint");
    with_checkpoints.push_back(checkpoints);
    const LaunchResult killed = torchrun_trainer(
        torchrun, 1, with_checkpoints, {{"CONVEYOR_TRAINER_KILL_AT_STEP", kill_at}, {"CONVEYOR_TRAINER_KILL_RANK", "1"}});
    ASSERT_FALSE(killed.ranks[0].killed_at_deadline) << killed.describe();
    ASSERT_EQ(killed.ranks[0].exit_code, 0) << killed.describe();
    const std::string& out = killed.ranks[0].output;
    EXPECT_NE(out.find("resumed from"), std::string::npos) << "the job was not restarted\n" << killed.describe();
    // The last final line is the restarted job's.
    std::string last;
    for (std::sregex_iterator it(out.begin(), out.end(), final_line), end; it != end; ++it) last = (*it)[0];
    std::smatch got;
    ASSERT_TRUE(std::regex_search(last, got, final_line)) << killed.describe();
    std::printf("uninterrupted: accuracy %s%%, fingerprint %s; killed at step %s and restarted: %s%%, %s\n",
                want[1].str().c_str(), want[2].str().c_str(), kill_at, got[1].str().c_str(), got[2].str().c_str());
    EXPECT_EQ(got[2].str(), want[2].str()) << killed.describe();
    EXPECT_EQ(got[1].str(), want[1].str()) << killed.describe();
  }
  std::filesystem::remove_all(shards);
  std::filesystem::remove_all(checkpoints);
}

}  // namespace
