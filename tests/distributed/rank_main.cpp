// One rank of a test job: started N times by distributed_test.cpp (or by
// torchrun), it reads the launcher's environment and prints what the test
// checks, one "key=value" line each, prefixed with "rank R:".
//
//   conveyor_distributed_rank agree [--seed S] [--data N] [--batch B] [--timeout-ms T]
//   conveyor_distributed_rank leave --lost K [--kill] [--timeout-ms T]
//   conveyor_distributed_rank rendezvous [--timeout-ms T]
//   conveyor_distributed_rank cost [--repeat K]   what one epoch's agreement
//                                                 costs: agree_seed + agree_batch_count
//
// Exit status: 0 done, 3 a conveyor error (printed as "error=..."), 2 usage.
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include <conveyor/distributed.h>
#include <conveyor/sampler.h>

namespace {

namespace dist = conveyor::distributed;
using Clock = std::chrono::steady_clock;

struct Args {
  std::string mode;
  std::optional<uint64_t> seed;
  size_t data = 103;  // not a multiple of 2, 3 or 4: DistributedSampler pads
  size_t batch = 4;
  int lost = -1;
  bool kill = false;
  long timeout_ms = 20000;
  int repeat = 1000;
};

Args parse(int argc, char** argv) {
  Args args;
  if (argc < 2) {
    std::fprintf(stderr, "usage: %s agree|leave|rendezvous [options]\n", argv[0]);
    std::exit(2);
  }
  args.mode = argv[1];
  for (int i = 2; i < argc; ++i) {
    std::string flag = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "%s needs a value\n", flag.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (flag == "--seed") args.seed = std::stoull(value());
    else if (flag == "--data") args.data = std::stoul(value());
    else if (flag == "--batch") args.batch = std::stoul(value());
    else if (flag == "--lost") args.lost = std::stoi(value());
    else if (flag == "--kill") args.kill = true;
    else if (flag == "--timeout-ms") args.timeout_ms = std::stol(value());
    else if (flag == "--repeat") args.repeat = std::stoi(value());
    else {
      std::fprintf(stderr, "unknown flag %s\n", flag.c_str());
      std::exit(2);
    }
  }
  return args;
}

int rank_for_output = -1;

void say(const std::string& line) {
  // One write per line: ranks of torchrun share its stdout.
  std::printf("rank %d: %s\n", rank_for_output, line.c_str());
  std::fflush(stdout);
}

std::string join(const std::vector<size_t>& values) {
  std::string out;
  for (size_t v : values) out += (out.empty() ? "" : ",") + std::to_string(v);
  return out;
}

// Deliberately uneven: rank r holds data/world + 7 r samples, so the batch
// counts differ and a loop of "my own count" would hang in the last allreduce.
size_t uneven_samples(const Args& args, int rank, int world) {
  return args.data / static_cast<size_t>(world) + 7 * static_cast<size_t>(rank);
}

int agree(const Args& args, dist::Group& group) {
  const int rank = group.rank();
  const int world = group.world_size();
  const uint64_t seed = group.agree_seed(args.seed);
  say("seed=" + std::to_string(seed));

  for (bool drop_last : {false, true}) {
    conveyor::DistributedSampler sampler(args.data, world, rank, /*shuffle=*/true, seed, drop_last);
    sampler.set_epoch(1);
    say(std::string(drop_last ? "shard_drop_last=" : "shard=") +
        join(conveyor::collect(sampler)));
  }

  const size_t samples = uneven_samples(args, rank, world);
  const size_t local = (samples + args.batch - 1) / args.batch;
  const dist::BatchCounts cut = group.agree_batch_count(local, dist::UnevenBatches::cut);
  const dist::BatchCounts pad = group.agree_batch_count(local);
  say("batches local=" + std::to_string(local) + " fewest=" + std::to_string(cut.fewest) +
      " most=" + std::to_string(cut.most) + " cut=" + std::to_string(cut.agreed) +
      " pad=" + std::to_string(pad.agreed));

  // A training loop's one allreduce per step, for the agreed count: returns on
  // every rank only if every rank runs the same number of steps.
  size_t steps = 0;
  for (; steps < pad.agreed; ++steps) {
    group.agree_batch_count(steps < local ? 1 : 0);
  }
  group.barrier();
  say("steps=" + std::to_string(steps));
  return 0;
}

int leave(const Args& args, dist::Group& group) {
  // Every rank has its peers' liveness ports once the barrier returns.
  group.barrier();
  if (group.rank() == args.lost) {
    say(args.kill ? "killing myself" : "leaving");
    if (args.kill) std::raise(SIGKILL);
    return 0;  // the Group closes its ports on the way out
  }
  const Clock::time_point start = Clock::now();
  try {
    group.agree_batch_count(1);
  } catch (const dist::DistributedError& error) {
    const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - start);
    std::string lost;
    for (int r : error.lost()) lost += (lost.empty() ? "" : ",") + std::to_string(r);
    say("elapsed_ms=" + std::to_string(ms.count()));
    say("lost=" + lost);
    say(std::string("timed_out=") + (error.timed_out() ? "1" : "0"));
    throw;
  }
  say("no error");
  return 4;
}

// The per-epoch collectives a loader needs (the seed, the batch count),
// timed over many epochs after one warm-up round.
int cost(const Args& args, dist::Group& group) {
  group.agree_seed(uint64_t{1});
  group.agree_batch_count(1);
  group.barrier();
  const Clock::time_point start = Clock::now();
  for (int epoch = 0; epoch < args.repeat; ++epoch) {
    group.agree_seed(uint64_t{1});
    group.agree_batch_count(static_cast<size_t>(100 + group.rank()));
  }
  const double us = std::chrono::duration<double, std::micro>(Clock::now() - start).count();
  say("epochs=" + std::to_string(args.repeat) + " us_per_epoch=" + std::to_string(us / args.repeat));
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const Args args = parse(argc, argv);
  const Clock::time_point start = Clock::now();
  try {
    dist::GroupOptions options;
    options.timeout = std::chrono::milliseconds(args.timeout_ms);
    options.environment = dist::read_environment();
    rank_for_output = options.environment->rank;
    say("launcher=" + options.environment->launcher + " world=" +
        std::to_string(options.environment->world_size) + " master=" +
        options.environment->master_addr + ":" + std::to_string(options.environment->master_port));
    // The node's share: torchrun's LOCAL_RANK or Open MPI's OMPI_COMM_WORLD_LOCAL_RANK.
    say("local_rank=" + std::to_string(options.environment->local_rank));
    say("local_world_size=" + std::to_string(options.environment->local_world_size));
    dist::Group group = dist::Group::init(options);
    if (args.mode == "agree") return agree(args, group);
    if (args.mode == "leave") return leave(args, group);
    if (args.mode == "cost") return cost(args, group);
    if (args.mode == "rendezvous") {
      say("joined");
      return 0;
    }
    std::fprintf(stderr, "unknown mode %s\n", args.mode.c_str());
    return 2;
  } catch (const conveyor::Error& error) {
    const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - start);
    say("error_after_ms=" + std::to_string(ms.count()));
    say(std::string("error=") + error.what());
    return 3;
  }
}
