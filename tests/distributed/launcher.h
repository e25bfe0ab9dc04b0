// Starts N real rank processes on 127.0.0.1 and collects what they print,
// with a deadline after which every one still running is killed: a test of
// many ranks fails, it never hangs.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace conveyor::test {

struct RankResult {
  int exit_code = -1;  // -1: killed by a signal (see `signal`)
  int signal = 0;
  bool killed_at_deadline = false;
  std::string output;  // stdout and stderr together
};

struct LaunchResult {
  std::vector<RankResult> ranks;
  std::chrono::milliseconds elapsed{};
  std::string describe() const;  // every rank's status and output, for failures
};

// A loopback TCP port nothing holds right now, below the ephemeral range
// where one can (see launcher.cpp).
uint16_t free_port();

// Runs `argv` as one process, environment = ours minus the launchers'
// variables plus `env`, output to a file; kills it at the deadline, with its
// process group and any process it leaves behind (mpirun's ranks).
struct Command {
  std::vector<std::string> argv;
  std::map<std::string, std::string> env;
};
LaunchResult run_all(const std::vector<Command>& commands, std::chrono::milliseconds deadline);

// `world` ranks of `binary args...` with torchrun's variables, MASTER_PORT =
// `port`; `per_rank_env` overrides for single ranks.
LaunchResult launch(const std::string& binary, const std::vector<std::string>& args, int world,
                    uint16_t port, std::chrono::milliseconds deadline,
                    const std::map<int, std::map<std::string, std::string>>& per_rank_env = {});

// The value of "rank R: key=value" in a rank's output; empty when absent.
std::string value_of(const std::string& output, int rank, const std::string& key);

}  // namespace conveyor::test
