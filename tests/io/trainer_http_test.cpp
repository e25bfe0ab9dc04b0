// The trainer on tar shards streamed over HTTP (`--shards URL-pattern`)
// against the same shards read from disk, from their directory and through
// a local pattern: the same loss curve (its fingerprint) and the same test
// accuracy. A real nginx on a free loopback
// port (nginx_server.h) serves the shards the disk run wrote; its access log
// proves the second run read them over HTTP.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <regex>
#include <string>
#include <vector>

#include "nginx_server.h"

namespace {

namespace fs = std::filesystem;
using conveyor::test::NginxServer;

struct Finished {
  int status = -1;
  std::string output;  // stdout and stderr
};

Finished run(const std::string& command) {
  Finished finished;
  std::FILE* pipe = popen((command + " 2>&1").c_str(), "r");
  if (pipe == nullptr) return finished;
  char chunk[4096];
  size_t n = 0;
  while ((n = std::fread(chunk, 1, sizeof chunk, pipe)) > 0) finished.output.append(chunk, n);
  const int status = pclose(pipe);
  finished.status = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return finished;
}

// The first group of `pattern` in `output`, or "" (the test then fails
// showing the output).
std::string first_match(const std::string& output, const char* pattern) {
  std::smatch found;
  return std::regex_search(output, found, std::regex(pattern)) ? found[1].str() : "";
}

TEST(TrainerOverHttp, SameLossCurveAndAccuracyAsFromDisk) {
  CONVEYOR_NGINX_SKIP_WITHOUT(!NginxServer::binary().empty());
  NginxServer server;
  const std::string directory = server.www() + "/shards";
  // Two workers, each streaming shards of its own; one LibTorch thread so
  // the loss curve depends on the data alone.
  const std::string trainer = std::string(CONVEYOR_TRAINER) +
                              " --source shards --epochs 1 --limit 1280 --batch-size 64 --threads 1"
                              " --workers 2 --seed 5 --shards ";

  const Finished disk = run(trainer + directory);  // writes the shards, then reads them
  ASSERT_EQ(disk.status, 0) << disk.output;
  std::vector<std::string> names;
  for (const auto& entry : fs::directory_iterator(directory)) {
    if (entry.path().extension() == ".tar") names.push_back(entry.path().filename().string());
  }
  std::sort(names.begin(), names.end());
  ASSERT_FALSE(names.empty()) << disk.output;
  char last[16];
  std::snprintf(last, sizeof last, "%06zu", names.size() - 1);
  ASSERT_EQ(names.back(), "train-" + std::string(last) + ".tar");

  server.start();
  const std::string pattern = server.url("/shards/train-{000000.." + std::string(last) + "}.tar");
  const Finished http = run(trainer + "'" + pattern + "'");
  ASSERT_EQ(http.status, 0) << http.output;

  const char* kFingerprint = "loss-curve fingerprint ([0-9a-f]+)";
  const char* kAccuracy = "test accuracy ([0-9.]+)%";
  ASSERT_NE(first_match(disk.output, kFingerprint), "") << disk.output;
  EXPECT_EQ(first_match(http.output, kFingerprint), first_match(disk.output, kFingerprint))
      << "from disk:\n" << disk.output << "\nover HTTP:\n" << http.output;
  ASSERT_NE(first_match(disk.output, kAccuracy), "") << disk.output;
  EXPECT_EQ(first_match(http.output, kAccuracy), first_match(disk.output, kAccuracy));

  // The same shards named by a local pattern: read where they are, not
  // written again into a directory named by the pattern.
  const std::string local_pattern = directory + "/train-{000000.." + std::string(last) + "}.tar";
  const Finished local = run(trainer + "'" + local_pattern + "'");
  ASSERT_EQ(local.status, 0) << local.output;
  EXPECT_FALSE(fs::exists(local_pattern)) << "the pattern was taken for a directory:\n" << local.output;
  EXPECT_EQ(local.output.find("writing JPEG tar shards"), std::string::npos) << local.output;
  EXPECT_EQ(first_match(local.output, kFingerprint), first_match(disk.output, kFingerprint)) << local.output;

  int requests = 0;
  for (const std::string& name : names) requests += server.requests_logged("/shards/" + name);
  EXPECT_GT(requests, 0) << "nginx logged no request for a shard: the run did not read over HTTP";
  std::printf("fingerprint %s, test accuracy %s%%, from disk and over HTTP (%d GETs of %zu shards)\n",
              first_match(http.output, kFingerprint).c_str(), first_match(http.output, kAccuracy).c_str(), requests,
              names.size());
}

}  // namespace
