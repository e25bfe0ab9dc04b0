// conveyor::distributed with real processes: 2 and 4 ranks on 127.0.0.1,
// each a conveyor_distributed_rank started here (or by torchrun), every
// launch bounded by a deadline that kills what is left.
#include <fcntl.h>
#include <poll.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cerrno>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include <conveyor/distributed.h>

#include "distributed/launcher.h"

namespace {

namespace dist = conveyor::distributed;
using conveyor::test::launch;
using conveyor::test::LaunchResult;
using conveyor::test::value_of;
using std::chrono::milliseconds;

const std::string kRank = CONVEYOR_DISTRIBUTED_RANK_BINARY;

uint16_t port_for_test() {
  const uint16_t port = conveyor::test::free_port();
  std::printf("MASTER_PORT=%u\n", port);
  return port;
}

std::vector<size_t> numbers(const std::string& csv) {
  std::vector<size_t> out;
  std::istringstream in(csv);
  for (std::string item; std::getline(in, item, ',');) out.push_back(std::stoul(item));
  return out;
}

std::map<std::string, size_t> fields(const std::string& line) {
  std::map<std::string, size_t> out;
  std::istringstream in("local=" + line);
  for (std::string item; in >> item;) {
    auto eq = item.find('=');
    out[item.substr(0, eq)] = std::stoul(item.substr(eq + 1));
  }
  return out;
}

std::string all_output(const LaunchResult& result) {
  std::string out;
  for (const auto& r : result.ranks) out += r.output;
  return out;
}

// ---- the environment, in process ----------------------------------------------

using Vars = std::map<std::string, std::string>;

dist::Environment read(const Vars& vars) {
  return dist::read_environment([&](const char* name) -> const char* {
    auto it = vars.find(name);
    return it == vars.end() ? nullptr : it->second.c_str();
  });
}

std::string error_of(const Vars& vars) {
  try {
    read(vars);
  } catch (const conveyor::ValueError& error) {
    return error.what();
  }
  return "no error";
}

const Vars kTorchrun = {{"RANK", "1"},        {"WORLD_SIZE", "4"},     {"LOCAL_RANK", "1"},
                        {"LOCAL_WORLD_SIZE", "2"}, {"MASTER_ADDR", "10.0.0.1"},
                        {"MASTER_PORT", "29400"}};

Vars with(Vars vars, const std::string& key, const std::string& value) {
  if (value.empty()) vars.erase(key);
  else vars[key] = value;
  return vars;
}

TEST(DistributedEnvironment, ReadsTorchrunVariables) {
  dist::Environment env = read(kTorchrun);
  EXPECT_EQ(env.rank, 1);
  EXPECT_EQ(env.world_size, 4);
  EXPECT_EQ(env.local_rank, 1);
  EXPECT_EQ(env.local_world_size, 2);
  EXPECT_EQ(env.master_addr, "10.0.0.1");
  EXPECT_EQ(env.master_port, 29400);
  EXPECT_EQ(env.launcher, "torchrun");
  EXPECT_FALSE(env.agent_store);
  EXPECT_TRUE(read(with(kTorchrun, "TORCHELASTIC_USE_AGENT_STORE", "True")).agent_store);
}

// Whose variables `env` holds, and the rank's place in the job and the node.
void expect_place(const dist::Environment& env, const std::string& launcher, int rank, int world_size,
                  int local_rank, int local_world_size) {
  EXPECT_EQ(env.launcher, launcher);
  EXPECT_EQ(env.rank, rank);
  EXPECT_EQ(env.world_size, world_size);
  EXPECT_EQ(env.local_rank, local_rank);
  EXPECT_EQ(env.local_world_size, local_world_size);
}

TEST(DistributedEnvironment, ReadsOpenMpiVariables) {
  Vars mpi = {{"OMPI_COMM_WORLD_RANK", "2"},       {"OMPI_COMM_WORLD_SIZE", "3"},
              {"OMPI_COMM_WORLD_LOCAL_RANK", "0"}, {"OMPI_COMM_WORLD_LOCAL_SIZE", "1"},
              {"MASTER_ADDR", "node0"},            {"MASTER_PORT", "1234"}};
  expect_place(read(mpi), "Open MPI", 2, 3, 0, 1);
  EXPECT_NE(error_of(with(mpi, "MASTER_ADDR", "")).find("pass -x MASTER_ADDR="),
            std::string::npos);
}

// MPICH's and Intel MPI's mpiexec (Hydra) set PMI_RANK, PMI_SIZE and the
// node's share as MPI_LOCALRANKID / MPI_LOCALNRANKS. Before, such a launch
// was told that RANK or OMPI_COMM_WORLD_RANK was expected.
TEST(DistributedEnvironment, ReadsMpichVariables) {
  Vars hydra = {{"PMI_RANK", "3"},        {"PMI_SIZE", "4"},         {"MPI_LOCALRANKID", "1"},
                {"MPI_LOCALNRANKS", "2"}, {"MASTER_ADDR", "node0"}, {"MASTER_PORT", "1234"}};
  expect_place(read(hydra), "MPICH", 3, 4, 1, 2);
  EXPECT_EQ(error_of(with(hydra, "PMI_RANK", "4")), "conveyor::distributed: PMI_RANK='4' is not below PMI_SIZE='4'");
  EXPECT_NE(error_of(with(hydra, "MASTER_ADDR", "")).find("pass -genv MASTER_ADDR"), std::string::npos);
  EXPECT_EQ(read(with(with(hydra, "RANK", "0"), "WORLD_SIZE", "1")).launcher, "torchrun")
      << "torchrun's variables win";
}

TEST(DistributedEnvironment, NamesTheBadVariableAndValue) {
  EXPECT_EQ(error_of(with(kTorchrun, "RANK", "abc")),
            "conveyor::distributed: RANK='abc' is not an integer");
  EXPECT_EQ(error_of(with(kTorchrun, "RANK", "4")),
            "conveyor::distributed: RANK='4' is not below WORLD_SIZE='4'");
  EXPECT_EQ(error_of(with(kTorchrun, "WORLD_SIZE", "0")),
            "conveyor::distributed: WORLD_SIZE='0' is outside 1..16777216");
  EXPECT_EQ(error_of(with(kTorchrun, "MASTER_PORT", "70000")),
            "conveyor::distributed: MASTER_PORT='70000' is outside 1..65535");
  EXPECT_EQ(error_of(with(kTorchrun, "MASTER_PORT", "29500x")),
            "conveyor::distributed: MASTER_PORT='29500x' is not an integer");
  EXPECT_EQ(error_of(with(kTorchrun, "LOCAL_RANK", "2")),
            "conveyor::distributed: LOCAL_RANK='2' is not below LOCAL_WORLD_SIZE='2'");
  EXPECT_EQ(error_of(with(kTorchrun, "MASTER_ADDR", "")),
            "conveyor::distributed: environment variable MASTER_ADDR expected (torchrun "
            "launch), but not set");
  EXPECT_EQ(error_of({}),
            "conveyor::distributed: no launcher environment: RANK (torchrun), OMPI_COMM_WORLD_RANK (Open "
            "MPI's mpirun) or PMI_RANK (MPICH's or Intel MPI's mpiexec) expected, but none is set");
}

TEST(DistributedEnvironment, AHandLaunchIsOneNode) {
  dist::Environment env = read(with(with(kTorchrun, "LOCAL_RANK", ""), "LOCAL_WORLD_SIZE", ""));
  EXPECT_EQ(env.local_rank, 1);
  EXPECT_EQ(env.local_world_size, 4);
}

// The timeout is checked before anything is opened, naming the value: 0
// (c10d's "none") and anything past a year. milliseconds::max(), the C++
// way to ask for no timeout, overflowed c10d's nanosecond deadline: every
// rank failed at once, the error blaming the port.
// An Environment given in GroupOptions is checked as the launcher's
// variables are: world_size -1 reached c10d as "unspecified", and rank 1 of
// 1 waited out the whole timeout for a store that was not there.
TEST(DistributedEnvironment, AGivenEnvironmentOutOfRangeIsRefusedNamingTheField) {
  const auto refusal = [](auto change) {
    dist::Environment env;  // rank 0 of 1 on 127.0.0.1:29500
    change(env);
    try {
      (void)dist::Group::init({.timeout = milliseconds(60000), .environment = env});
      return std::string("accepted");
    } catch (const conveyor::ValueError& error) {
      return std::string(error.what());
    }
  };
  const std::string prefix = "conveyor::distributed: ";
  EXPECT_EQ(refusal([](dist::Environment& e) { e.world_size = 0; }),
            prefix + "Environment.world_size=0 should be in [1, 16777216]");
  EXPECT_EQ(refusal([](dist::Environment& e) { e.world_size = -1; }),
            prefix + "Environment.world_size=-1 should be in [1, 16777216]");
  EXPECT_EQ(refusal([](dist::Environment& e) { e.rank = 1; }),
            prefix + "Environment.rank=1 should be in [0, Environment.world_size=1)");
  EXPECT_EQ(refusal([](dist::Environment& e) { e.rank = -1; }),
            prefix + "Environment.rank=-1 should be in [0, Environment.world_size=1)");
  EXPECT_EQ(refusal([](dist::Environment& e) { e.local_world_size = 2; }),
            prefix + "Environment.local_world_size=2 should be in [1, Environment.world_size=1]");
  EXPECT_EQ(refusal([](dist::Environment& e) {
              e.world_size = 4;
              e.local_rank = 4;
            }),
            prefix + "Environment.local_rank=4 should be in [0, Environment.world_size=4)");
  EXPECT_EQ(refusal([](dist::Environment& e) { e.master_port = 0; }),
            prefix + "Environment.master_port=0 should be in [1, 65535]");
  EXPECT_EQ(refusal([](dist::Environment& e) { e.master_addr.clear(); }), prefix + "Environment.master_addr is empty");
}

TEST(DistributedEnvironment, AnOutOfRangeTimeoutIsRefusedNamingIt) {
  for (const milliseconds timeout : {milliseconds(0), milliseconds(-5), milliseconds::max(),
                                     milliseconds(31536000001)}) {
    try {
      Vars alone = with(with(kTorchrun, "RANK", "0"), "WORLD_SIZE", "1");
      alone = with(with(alone, "LOCAL_RANK", ""), "LOCAL_WORLD_SIZE", "");
      (void)dist::Group::init({.timeout = timeout, .environment = read(alone)});
      ADD_FAILURE() << "a timeout of " << timeout.count() << " ms was accepted";
    } catch (const conveyor::ValueError& error) {
      EXPECT_EQ(std::string(error.what()),
                "conveyor::distributed: timeout should be in [1, 31536000000] ms (a year at most), but got " +
                    std::to_string(timeout.count()) + " ms");
    }
  }
}

// ---- the launcher ----------------------------------------------------------------

// A later spawn that fails kills and reaps the processes already started:
// before, run_all threw with the first one still running (and its folder
// left in /tmp). Nothing else in this binary has a child meanwhile.
TEST(Launcher, ASpawnFailureLeavesNoEarlierProcessRunning) {
  EXPECT_THROW(conveyor::test::run_all({{{"/bin/sleep", "300"}, {}}, {{"/nonexistent/conveyor-rank"}, {}}},
                                       milliseconds(60000)),
               std::runtime_error);
  int status = 0;
  const pid_t left = ::waitpid(-1, &status, WNOHANG);
  EXPECT_EQ(left, -1) << "a child of this process is still running after run_all threw";
  EXPECT_EQ(errno, ECHILD);
}

// A test binary killed mid-run (by its timeout, or a user) leaves no rank
// behind: each is started with a parent-death signal. Here a child process
// runs run_all and is killed; the rank it started (a shell that writes its
// pid into a FIFO, then sleeps) must end with it. Before, it slept on,
// re-parented. Both events are waited for with poll(): the pid's arrival on
// the FIFO, and the rank's end on a pidfd (readable once it has exited).
TEST(Launcher, ARankEndsWithTheProcessThatLaunchedIt) {
  const std::string fifo = std::filesystem::temp_directory_path() /
                           ("conveyor-launcher-rank-" + std::to_string(::getpid()) + ".fifo");
  std::filesystem::remove(fifo);
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0) << fifo << ": " << std::strerror(errno);
  // Opened before the rank starts, so the rank's open for writing does not
  // wait, and no end of file is seen before a writer has come and gone.
  const int pid_reader = ::open(fifo.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  ASSERT_GE(pid_reader, 0) << fifo << ": " << std::strerror(errno);
  const pid_t runner = ::fork();
  ASSERT_GE(runner, 0);
  if (runner == 0) {
    try {
      conveyor::test::run_all({{{"/bin/sh", "-c", "echo $$ > " + fifo + " && exec sleep 300"}, {}}},
                              milliseconds(60000));
    } catch (...) {
    }
    ::_exit(0);
  }
  std::string said;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  while (said.find('\n') == std::string::npos && std::chrono::steady_clock::now() < deadline) {
    pollfd ready{.fd = pid_reader, .events = POLLIN, .revents = 0};
    const auto left = std::chrono::duration_cast<milliseconds>(deadline - std::chrono::steady_clock::now());
    if (::poll(&ready, 1, static_cast<int>(std::max<int64_t>(left.count(), 1))) <= 0) continue;
    char bytes[64];
    const ssize_t got = ::read(pid_reader, bytes, sizeof bytes);
    if (got > 0) said.append(bytes, static_cast<size_t>(got));
    if (got == 0) break;  // the writer came and went
  }
  ::close(pid_reader);
  std::filesystem::remove(fifo);
  const pid_t rank = said.find('\n') == std::string::npos ? 0 : static_cast<pid_t>(std::atol(said.c_str()));
  // Taken while the runner lives: the rank cannot have ended yet, so the
  // pid is still the rank's.
  const int rank_end = rank > 0 ? static_cast<int>(::syscall(SYS_pidfd_open, rank, 0)) : -1;
  ::kill(runner, SIGKILL);
  ::waitpid(runner, nullptr, 0);
  ASSERT_GT(rank, 0) << "the rank never wrote its pid into " << fifo << " (it said \"" << said << "\")";
  ASSERT_GE(rank_end, 0) << "pidfd_open(" << rank << "): " << std::strerror(errno);
  // The signal is sent as the runner ends; the rank's end is waited for
  // for at most 30 s.
  pollfd ended{.fd = rank_end, .events = POLLIN, .revents = 0};
  const int polled = ::poll(&ended, 1, 30000);
  EXPECT_EQ(polled, 1) << "rank " << rank << " outlived the process that launched it";
  if (polled != 1) ::kill(rank, SIGKILL);
  ::close(rank_end);
  ::waitpid(rank, nullptr, WNOHANG);  // ours to reap where this process is a subreaper
}

// ---- many ranks ---------------------------------------------------------------------

struct Agreement {
  int world;
  bool seeded;
};

class ManyRanks : public ::testing::TestWithParam<Agreement> {};

// Seeds, shards and batch counts, checked across every rank's output (`out`:
// every process's output together; `context` is quoted on failure).
void check_agreement(const std::string& out, const std::string& context, int world,
                     std::optional<uint64_t> seed, size_t data, size_t batch) {
  const std::string seed0 = value_of(out, 0, "seed");
  ASSERT_FALSE(seed0.empty()) << context;
  if (seed) {
    EXPECT_EQ(seed0, std::to_string(*seed));
  }
  std::printf("agreed seed %s\n", seed0.c_str());

  std::vector<size_t> padded_union;
  std::set<size_t> dropped_union;
  size_t dropped_total = 0;
  const size_t per_rank = (data + world - 1) / world;
  const size_t per_rank_dropped = data / world;
  std::vector<size_t> expected_local;
  for (int rank = 0; rank < world; ++rank) {
    EXPECT_EQ(value_of(out, rank, "seed"), seed0) << "rank " << rank << "\n" << context;
    std::vector<size_t> shard = numbers(value_of(out, rank, "shard"));
    std::vector<size_t> dropped = numbers(value_of(out, rank, "shard_drop_last"));
    EXPECT_EQ(shard.size(), per_rank) << "rank " << rank;
    EXPECT_EQ(dropped.size(), per_rank_dropped) << "rank " << rank;
    padded_union.insert(padded_union.end(), shard.begin(), shard.end());
    dropped_union.insert(dropped.begin(), dropped.end());
    dropped_total += dropped.size();
    const size_t samples = data / world + 7 * rank;
    expected_local.push_back((samples + batch - 1) / batch);
  }
  // Padding: every index at least once, only the padding twice.
  std::set<size_t> distinct(padded_union.begin(), padded_union.end());
  EXPECT_EQ(distinct.size(), data);
  EXPECT_EQ(*distinct.rbegin(), data - 1);
  EXPECT_EQ(padded_union.size() - distinct.size(), per_rank * world - data);
  // drop_last: disjoint shards.
  EXPECT_EQ(dropped_union.size(), dropped_total);

  const size_t fewest = *std::min_element(expected_local.begin(), expected_local.end());
  const size_t most = *std::max_element(expected_local.begin(), expected_local.end());
  ASSERT_LT(fewest, most) << "the shards must be uneven for this test to mean anything";
  for (int rank = 0; rank < world; ++rank) {
    auto counts = fields(value_of(out, rank, "batches local"));
    EXPECT_EQ(counts["local"], expected_local[rank]) << "rank " << rank;
    EXPECT_EQ(counts["fewest"], fewest) << "rank " << rank;
    EXPECT_EQ(counts["most"], most) << "rank " << rank;
    EXPECT_EQ(counts["cut"], fewest) << "rank " << rank;
    EXPECT_EQ(counts["pad"], most) << "rank " << rank;
    EXPECT_EQ(value_of(out, rank, "steps"), std::to_string(most)) << "rank " << rank;
  }
}

// One process per rank, launched here: each must exit 0 first.
void check_agreement(const LaunchResult& result, int world, std::optional<uint64_t> seed,
                     size_t data, size_t batch) {
  for (int rank = 0; rank < world; ++rank) {
    ASSERT_EQ(result.ranks[rank].exit_code, 0) << result.describe();
  }
  check_agreement(all_output(result), result.describe(), world, seed, data, batch);
}

// Two runs of `agree` with the same seed print the same on every rank.
void expect_same_results(const std::string& first, const std::string& second, int world) {
  for (int rank = 0; rank < world; ++rank) {
    for (const char* key : {"seed", "shard", "shard_drop_last", "batches local", "steps"}) {
      EXPECT_FALSE(value_of(first, rank, key).empty()) << key << " on rank " << rank;
      EXPECT_EQ(value_of(first, rank, key), value_of(second, rank, key))
          << key << " on rank " << rank;
    }
  }
}

TEST_P(ManyRanks, AgreeOnSeedShardsAndBatchCounts) {
  const Agreement p = GetParam();
  std::vector<std::string> args = {"agree", "--data", "103", "--batch", "4"};
  std::optional<uint64_t> seed;
  if (p.seeded) {
    seed = 20240917;
    args.insert(args.end(), {"--seed", std::to_string(*seed)});
  }
  LaunchResult result = launch(kRank, args, p.world, port_for_test(), milliseconds(90000));
  check_agreement(result, p.world, seed, 103, 4);
}

INSTANTIATE_TEST_SUITE_P(Distributed, ManyRanks,
                         ::testing::Values(Agreement{2, true}, Agreement{2, false},
                                           Agreement{4, true}, Agreement{4, false}),
                         [](const auto& info) {
                           return std::to_string(info.param.world) + "Ranks" +
                                  (info.param.seeded ? "Seeded" : "Unseeded");
                         });

TEST(Distributed, ARerunWithTheSameSeedPrintsTheSame) {
  const std::vector<std::string> args = {"agree", "--seed", "11", "--data", "50", "--batch", "3"};
  LaunchResult first = launch(kRank, args, 2, port_for_test(), milliseconds(60000));
  LaunchResult second = launch(kRank, args, 2, port_for_test(), milliseconds(60000));
  for (int rank = 0; rank < 2; ++rank) {
    ASSERT_EQ(first.ranks[rank].exit_code, 0) << first.describe();
    ASSERT_EQ(second.ranks[rank].exit_code, 0) << second.describe();
  }
  expect_same_results(all_output(first), all_output(second), 2);
}

TEST(Distributed, RanksThatExitRightAfterInitAllSucceed) {
  // "rendezvous" makes the group and exits: the first rank done must not
  // close its liveness port before the others have connected to it.
  LaunchResult result = launch(kRank, {"rendezvous"}, 4, port_for_test(), milliseconds(60000));
  for (int rank = 0; rank < 4; ++rank) {
    EXPECT_EQ(result.ranks[rank].exit_code, 0) << result.describe();
    EXPECT_NE(result.ranks[rank].output.find("rank " + std::to_string(rank) + ": joined"),
              std::string::npos)
        << result.describe();
  }
}

TEST(Distributed, RanksThatSetDifferentSeedsAllFail) {
  // Rank 1 gets another seed on its own command line.
  std::vector<conveyor::test::Command> commands;
  const uint16_t port = port_for_test();
  for (int rank = 0; rank < 2; ++rank) {
    commands.push_back({{kRank, "agree", "--seed", rank == 0 ? "5" : "6"},
                        {{"RANK", std::to_string(rank)},
                         {"WORLD_SIZE", "2"},
                         {"MASTER_ADDR", "127.0.0.1"},
                         {"MASTER_PORT", std::to_string(port)}}});
  }
  LaunchResult result = conveyor::test::run_all(commands, milliseconds(60000));
  for (int rank = 0; rank < 2; ++rank) {
    EXPECT_EQ(result.ranks[rank].exit_code, 3) << result.describe();
    EXPECT_EQ(value_of(result.ranks[rank].output, rank, "error"),
              "conveyor::distributed: ranks set different seeds (rank 0: 5, rank 1: 6): set "
              "the same seed on every rank, or none")
        << result.describe();
  }
}

// ---- faults ------------------------------------------------------------------------

struct Leaving {
  int world;
  int lost;
  bool kill;
};

class LostRank : public ::testing::TestWithParam<Leaving> {};

constexpr long kFaultTimeoutMs = 4000;
// What an error may take beyond the timeout: the wait for a liveness port to
// close (2 s at most, and only when none does) and the message.
constexpr long kDiagnosisSlackMs = 2500;

TEST_P(LostRank, TheOthersFailNamingItWithinTheTimeout) {
  const Leaving p = GetParam();
  std::vector<std::string> args = {"leave", "--lost", std::to_string(p.lost), "--timeout-ms",
                                   std::to_string(kFaultTimeoutMs)};
  if (p.kill) args.push_back("--kill");
  LaunchResult result = launch(kRank, args, p.world, port_for_test(), milliseconds(60000));
  const std::string lost = std::to_string(p.lost);
  for (int rank = 0; rank < p.world; ++rank) {
    const auto& r = result.ranks[rank];
    ASSERT_FALSE(r.killed_at_deadline) << result.describe();
    if (rank == p.lost) {
      if (p.kill) {
        EXPECT_EQ(r.signal, SIGKILL) << result.describe();
      } else {
        EXPECT_EQ(r.exit_code, 0) << result.describe();
      }
      continue;
    }
    EXPECT_EQ(r.exit_code, 3) << result.describe();
    const std::string error = value_of(r.output, rank, "error");
    EXPECT_NE(error.find("rank " + lost + " has exited"), std::string::npos)
        << "rank " << rank << ": " << error;
    EXPECT_NE(error.find("agree_batch_count"), std::string::npos) << error;
    EXPECT_NE(error.find("failed on rank " + std::to_string(rank) + " of " +
                         std::to_string(p.world)),
              std::string::npos)
        << error;
    EXPECT_NE(error.find("timeout 4000 ms"), std::string::npos) << error;
    std::vector<size_t> lost_ranks = numbers(value_of(r.output, rank, "lost"));
    EXPECT_NE(std::find(lost_ranks.begin(), lost_ranks.end(), size_t(p.lost)), lost_ranks.end())
        << error;
    const long elapsed = std::stol("0" + value_of(r.output, rank, "elapsed_ms"));
    EXPECT_LT(elapsed, kFaultTimeoutMs + kDiagnosisSlackMs) << error;
    std::printf("rank %d: %ld ms: %s\n", rank, elapsed, error.c_str());
  }
}

INSTANTIATE_TEST_SUITE_P(Distributed, LostRank,
                         ::testing::Values(Leaving{2, 1, false}, Leaving{4, 2, false},
                                           Leaving{4, 3, true}, Leaving{4, 0, true}),
                         [](const auto& info) {
                           return std::to_string(info.param.world) + "RanksLose" +
                                  std::to_string(info.param.lost) +
                                  (info.param.kill ? "Killed" : "Exited");
                         });

TEST(Distributed, AWrongMasterPortFailsWithinTheRendezvousTimeout) {
  const uint16_t port = port_for_test();
  const uint16_t wrong = port_for_test();
  const long timeout = 3000;
  LaunchResult result =
      launch(kRank, {"rendezvous", "--timeout-ms", std::to_string(timeout)}, 2, port,
             milliseconds(60000), {{1, {{"MASTER_PORT", std::to_string(wrong)}}}});
  for (int rank = 0; rank < 2; ++rank) {
    ASSERT_FALSE(result.ranks[rank].killed_at_deadline) << result.describe();
    EXPECT_EQ(result.ranks[rank].exit_code, 3) << result.describe();
    const long elapsed = std::stol("0" + value_of(result.ranks[rank].output, rank, "error_after_ms"));
    EXPECT_LT(elapsed, timeout + kDiagnosisSlackMs) << result.describe();
  }
  const std::string error0 = value_of(result.ranks[0].output, 0, "error");
  const std::string error1 = value_of(result.ranks[1].output, 1, "error");
  std::printf("rank 0: %s\nrank 1: %s\n", error0.c_str(), error1.c_str());
  EXPECT_NE(error0.find("rendezvous failed on rank 0 of 2"), std::string::npos) << error0;
  EXPECT_NE(error0.find("rank 1 did not join within 3000 ms"), std::string::npos) << error0;
  EXPECT_NE(error0.find("store 127.0.0.1:" + std::to_string(port)), std::string::npos) << error0;
  EXPECT_NE(error1.find("rendezvous failed on rank 1 of 2"), std::string::npos) << error1;
  EXPECT_NE(error1.find("could not reach the store"), std::string::npos) << error1;
  EXPECT_NE(error1.find("store 127.0.0.1:" + std::to_string(wrong)), std::string::npos) << error1;
}

TEST(Distributed, AMismatchedWorldSizeIsNamed) {
  const uint16_t port = port_for_test();
  LaunchResult result = launch(kRank, {"rendezvous", "--timeout-ms", "3000"}, 2, port,
                               milliseconds(60000), {{1, {{"WORLD_SIZE", "3"}}}});
  const std::string error1 = value_of(result.ranks[1].output, 1, "error");
  EXPECT_EQ(result.ranks[1].exit_code, 3) << result.describe();
  EXPECT_EQ(error1, "conveyor::distributed: WORLD_SIZE=3 on rank 1 of 3 but WORLD_SIZE=2 on rank 0")
      << result.describe();
  // Rank 0 reads rank 1's announced WORLD_SIZE and names it. Before, it
  // waited for rank 1 in Gloo's connect for its whole timeout, then said
  // only "Socket Timeout".
  EXPECT_FALSE(result.ranks[0].killed_at_deadline) << result.describe();
  EXPECT_EQ(result.ranks[0].exit_code, 3) << result.describe();
  EXPECT_EQ(value_of(result.ranks[0].output, 0, "error"),
            "conveyor::distributed: WORLD_SIZE=2 on rank 0 of 2 but WORLD_SIZE=3 on rank 1")
      << result.describe();
}

// ---- torchrun ------------------------------------------------------------------------

std::string find_on_path(const std::string& name) {
  const char* path = std::getenv("PATH");
  std::istringstream dirs(path != nullptr ? path : "");
  for (std::string dir; std::getline(dirs, dir, ':');) {
    std::string candidate = dir + "/" + name;
    if (::access(candidate.c_str(), X_OK) == 0) return candidate;
  }
  return "";
}

// torchrun 1.13's agent picks its workers' MASTER_PORT by binding port 0
// and closing it; rank 0 binds it later, and any process on the machine may
// take it in between (torch 2.5 closed that window by having the agent hold
// the store, pytorch/pytorch#135957). That race is the launcher's, not
// conveyor's: when rank 0 says the port was taken, and only then, launch
// again, at most three times in all.
LaunchResult launch_torchrun(const std::function<LaunchResult()>& launch_once) {
  for (int attempt = 1;; ++attempt) {
    LaunchResult result = launch_once();
    const std::string out = all_output(result);
    const bool port_taken = out.find("could not serve the store") != std::string::npos &&
                            out.find("Address already in use") != std::string::npos;
    if (!port_taken || attempt == 3) return result;
    std::printf("attempt %d: the port torchrun picked for its workers was taken before rank 0 "
                "bound it; launching again\n",
                attempt);
  }
}

TEST(Distributed, TorchrunLaunchesTwoRanks) {
  const std::string torchrun = find_on_path("torchrun");
  if (torchrun.empty()) GTEST_SKIP() << "torchrun is not on the PATH (Debian: python3-torch)";
  // --standalone picks its own free port for the rendezvous and another for
  // the workers' MASTER_PORT. Debian's torchrun 1.13 on Python 3.11 fails on
  // its default --redirects 0 (IntFlag no longer iterates Std.NONE), so the
  // workers' stdout goes to log files and is teed back (1 = stdout).
  char log_dir[] = "/tmp/conveyor-torchrun-XXXXXX";
  ASSERT_NE(::mkdtemp(log_dir), nullptr);
  LaunchResult result = launch_torchrun([&] {
    return conveyor::test::run_all(
        {{{torchrun, "--standalone", "--nproc_per_node", "2", "--redirects", "1", "--tee", "1",
           "--log_dir", log_dir, "--no_python", kRank, "agree", "--seed", "42", "--data", "103",
           "--batch", "4"},
          {}}},
        milliseconds(120000));
  });
  std::filesystem::remove_all(log_dir);
  ASSERT_FALSE(result.ranks[0].killed_at_deadline) << result.describe();
  ASSERT_EQ(result.ranks[0].exit_code, 0) << result.describe();
  const std::string& out = result.ranks[0].output;
  for (int rank = 0; rank < 2; ++rank) {
    // torchrun gives its workers this host's name as MASTER_ADDR.
    EXPECT_EQ(value_of(out, rank, "launcher").rfind("torchrun world=2 master=", 0), 0u) << out;
    EXPECT_EQ(value_of(out, rank, "seed"), "42") << out;
    EXPECT_EQ(value_of(out, rank, "steps"), value_of(out, 0, "steps")) << out;
  }
  EXPECT_FALSE(value_of(out, 1, "steps").empty()) << out;
}

// Two torchrun agents on this machine, as two nodes would run them: c10d's
// rendezvous on 127.0.0.1:<free port>, `per_node` ranks each. Node 0's agent
// hosts the rendezvous store (is_host): on one machine both agents match the
// endpoint's host, and saying which one keeps the test off torchrun's
// fallback of retrying as a client after a failed bind.
LaunchResult launch_two_torchrun_nodes(const std::string& torchrun, int per_node,
                                       const std::vector<std::string>& args,
                                       milliseconds deadline) {
  const std::string endpoint = "127.0.0.1:" + std::to_string(port_for_test());
  char log_dir[] = "/tmp/conveyor-torchrun-XXXXXX";
  if (::mkdtemp(log_dir) == nullptr) throw std::runtime_error("mkdtemp failed");
  std::vector<conveyor::test::Command> commands;
  for (int node = 0; node < 2; ++node) {
    // --monitor_interval: the agent notices its workers' exit within 0.5 s,
    // not its default 5 s. --max_restarts 0: a failure fails the test.
    std::vector<std::string> argv = {
        torchrun, "--nnodes", "2", "--node_rank", std::to_string(node), "--nproc_per_node",
        std::to_string(per_node), "--rdzv_backend", "c10d", "--rdzv_endpoint", endpoint,
        "--rdzv_id", "conveyor-test-" + endpoint, "--rdzv_conf",
        node == 0 ? "is_host=1" : "is_host=0", "--max_restarts", "0", "--monitor_interval",
        "0.5", "--redirects", "1", "--tee", "1", "--log_dir", log_dir, "--no_python", kRank};
    argv.insert(argv.end(), args.begin(), args.end());
    commands.push_back({argv, {}});
  }
  LaunchResult result = conveyor::test::run_all(commands, deadline);
  std::filesystem::remove_all(log_dir);
  return result;
}

TEST(Distributed, TwoTorchrunNodesOnOneMachine) {
  const std::string torchrun = find_on_path("torchrun");
  if (torchrun.empty()) GTEST_SKIP() << "torchrun is not on the PATH (Debian: python3-torch)";
  constexpr int kPerNode = 2;
  constexpr int kWorld = 2 * kPerNode;
  const uint64_t seed = 20240918;
  const std::vector<std::string> args = {"agree", "--seed", std::to_string(seed), "--data",
                                         "103", "--batch", "4"};
  std::vector<std::string> outputs;
  for (int run = 0; run < 2; ++run) {
    const LaunchResult result = launch_torchrun(
        [&] { return launch_two_torchrun_nodes(torchrun, kPerNode, args, milliseconds(120000)); });
    for (const auto& agent : result.ranks) {
      ASSERT_FALSE(agent.killed_at_deadline) << result.describe();
      ASSERT_EQ(agent.exit_code, 0) << result.describe();
    }
    const std::string out = all_output(result);
    check_agreement(out, result.describe(), kWorld, seed, 103, 4);
    // Each agent started one node: ranks g*2 and g*2+1 of its group rank g
    // (c10d's rendezvous numbers the agents in the order they join), with
    // local ranks 0 and 1.
    std::set<int> groups;
    for (const auto& agent : result.ranks) {
      std::vector<int> here;
      for (int rank = 0; rank < kWorld; ++rank) {
        if (!value_of(agent.output, rank, "seed").empty()) here.push_back(rank);
      }
      ASSERT_EQ(here.size(), size_t(kPerNode)) << result.describe();
      const int group = here[0] / kPerNode;
      groups.insert(group);
      for (int local = 0; local < kPerNode; ++local) {
        const int rank = here[local];
        EXPECT_EQ(rank, group * kPerNode + local) << result.describe();
        EXPECT_EQ(value_of(agent.output, rank, "local_rank"), std::to_string(local));
        EXPECT_EQ(value_of(agent.output, rank, "local_world_size"), std::to_string(kPerNode));
        EXPECT_EQ(value_of(agent.output, rank, "launcher").rfind("torchrun world=4 master=", 0), 0u)
            << result.describe();
      }
    }
    EXPECT_EQ(groups, (std::set<int>{0, 1})) << result.describe();
    std::printf("run %d: two torchrun nodes x %d ranks in %.1f s\n", run + 1, kPerNode,
                static_cast<double>(result.elapsed.count()) / 1000);
    outputs.push_back(out);
  }
  expect_same_results(outputs[0], outputs[1], kWorld);
}

// ---- Open MPI ------------------------------------------------------------------------

// Open MPI's mpirun, or why there is none to use.
std::string open_mpi_mpirun(std::string& why_not) {
  const std::string mpirun = find_on_path("mpirun");
  if (mpirun.empty()) {
    why_not = "mpirun is not on the PATH (Debian: openmpi-bin)";
    return "";
  }
  const LaunchResult version = conveyor::test::run_all({{{mpirun, "--version"}, {}}}, milliseconds(30000));
  const std::string& said = version.ranks[0].output;
  if (said.find("Open MPI") == std::string::npos) {
    why_not = mpirun + " is not Open MPI's (it said: " + said.substr(0, said.find('\n')) + ")";
    return "";
  }
  return mpirun;
}

// mpirun's flags for a job on this machine alone, wherever the test runs:
// as root in a container (Open MPI refuses root without the flag), on fewer
// cores than ranks, and with no ssh (Open MPI 4.1 fails at startup when its
// rsh launcher finds no ssh, even for local ranks: plm "isolated" launches
// on this node only). Its own sockets stay on the loopback.
std::vector<std::string> mpirun_on_this_machine(const std::string& mpirun, int ranks) {
  return {mpirun, "--allow-run-as-root", "--oversubscribe", "--mca", "plm", "isolated", "--mca",
          "oob_tcp_if_include", "lo", "-np", std::to_string(ranks)};
}

TEST(Distributed, MpirunLaunchesTwoRanks) {
  std::string why_not;
  const std::string mpirun = open_mpi_mpirun(why_not);
  if (mpirun.empty()) GTEST_SKIP() << why_not;
  constexpr int kWorld = 2;
  const uint64_t seed = 20240919;
  std::vector<std::string> outputs;
  for (int run = 0; run < 2; ++run) {
    // mpirun sets no rendezvous address: MASTER_ADDR and MASTER_PORT go by -x.
    const std::string port = std::to_string(port_for_test());
    std::vector<std::string> argv = mpirun_on_this_machine(mpirun, kWorld);
    for (const std::string& arg :
         {std::string("-x"), std::string("MASTER_ADDR=127.0.0.1"), std::string("-x"),
          "MASTER_PORT=" + port, kRank, std::string("agree"), std::string("--seed"),
          std::to_string(seed), std::string("--data"), std::string("103"), std::string("--batch"),
          std::string("4")}) {
      argv.push_back(arg);
    }
    const LaunchResult result = conveyor::test::run_all({{argv, {}}}, milliseconds(60000));
    ASSERT_FALSE(result.ranks[0].killed_at_deadline) << result.describe();
    ASSERT_EQ(result.ranks[0].exit_code, 0) << result.describe();
    const std::string& out = result.ranks[0].output;
    check_agreement(out, result.describe(), kWorld, seed, 103, 4);
    for (int rank = 0; rank < kWorld; ++rank) {
      // Read from OMPI_COMM_WORLD_*, not from torchrun's variables.
      EXPECT_EQ(value_of(out, rank, "launcher"), "Open MPI world=2 master=127.0.0.1:" + port) << out;
      EXPECT_EQ(value_of(out, rank, "local_rank"), std::to_string(rank)) << out;
      EXPECT_EQ(value_of(out, rank, "local_world_size"), "2") << out;
    }
    std::printf("run %d: mpirun, %d ranks in %.1f s\n", run + 1, kWorld,
                static_cast<double>(result.elapsed.count()) / 1000);
    outputs.push_back(out);
  }
  expect_same_results(outputs[0], outputs[1], kWorld);
}

// mpirun puts each rank in a process group of its own: killing mpirun's
// group at the deadline must not leave the ranks running.
TEST(Distributed, AnMpirunJobPastTheDeadlineLeavesNoRankBehind) {
  std::string why_not;
  const std::string mpirun = open_mpi_mpirun(why_not);
  if (mpirun.empty()) GTEST_SKIP() << why_not;
  std::vector<std::string> argv = mpirun_on_this_machine(mpirun, 2);
  // Each rank says its pid, then becomes a process that outlives the deadline.
  for (const char* arg : {"/bin/sh", "-c", "echo \"pid=$$\"; exec sleep 600"}) argv.push_back(arg);
  const LaunchResult result = conveyor::test::run_all({{argv, {}}}, milliseconds(8000));
  ASSERT_TRUE(result.ranks[0].killed_at_deadline) << result.describe();
  std::vector<pid_t> pids;
  std::istringstream lines(result.ranks[0].output);
  for (std::string line; std::getline(lines, line);) {
    if (line.rfind("pid=", 0) == 0) pids.push_back(std::stoi(line.substr(4)));
  }
  // Both ranks must have started, or the test proves nothing.
  ASSERT_EQ(pids.size(), 2u) << "the ranks did not start within the deadline\n" << result.describe();
  for (pid_t pid : pids) {
    const std::string cmdline = "/proc/" + std::to_string(pid) + "/cmdline";
    std::ifstream in(cmdline);
    std::string command;
    std::getline(in, command, '\0');
    EXPECT_NE(command, "sleep") << "rank pid " << pid << " is still running";
    std::printf("rank pid %d: %s\n", pid, command.empty() ? "gone" : command.c_str());
  }
}

}  // namespace
