// conveyor/distributed.h: many ranks on LibTorch's c10d (Gloo), launched by
// torchrun or mpirun (conveyor::distributed).
//
// What a data loader needs from a data-parallel job, on the process group its
// users already run: which rank this is and how many there are, one seed for
// every rank, and one batch count per epoch for every rank (an uneven last
// batch count is the classic way a job hangs in its last allreduce).
//
//   auto group = conveyor::distributed::Group::init();      // torchrun's env
//   uint64_t seed = group.agree_seed(std::nullopt);          // rank 0 draws
//   conveyor::DistributedSampler sampler(n, group.world_size(), group.rank(),
//                                        /*shuffle=*/true, seed);
//   auto counts = group.agree_batch_count(local_batches);    // pad by default
//
// This header names c10d's types only by declaration, so it compiles without
// LibTorch; linking needs conveyor::distributed (LibTorch + libgloo-dev).
//
// Thread-safety: a Group is used from one thread at a time, and every rank
// calls the same collectives in the same order (c10d's rule).
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <optional>
#include <memory>
#include <string>
#include <vector>

#include <conveyor/errors.h>

namespace c10d {
class ProcessGroup;
}  // namespace c10d

namespace conveyor::distributed {

// What the launcher told this process. torchrun (and torch.distributed.launch)
// set RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and
// MASTER_PORT; Open MPI's mpirun sets OMPI_COMM_WORLD_RANK, _SIZE,
// _LOCAL_RANK and _LOCAL_SIZE and no rendezvous address, so MASTER_ADDR and
// MASTER_PORT come from `mpirun -x`; MPICH's and Intel MPI's mpiexec set
// PMI_RANK, PMI_SIZE, MPI_LOCALRANKID and MPI_LOCALNRANKS (the address from
// `-genv`).
struct Environment {
  int rank = 0;
  int world_size = 1;
  // The node's share; a launch that does not say is taken as one node.
  int local_rank = 0;
  int local_world_size = 1;
  std::string master_addr = "127.0.0.1";
  uint16_t master_port = 29500;
  std::string launcher;  // "torchrun", "Open MPI" or "MPICH": whose variables these are
  // TORCHELASTIC_USE_AGENT_STORE=True: torchrun's agent already hosts the
  // store at MASTER_PORT, so rank 0 connects to it instead of serving one.
  bool agent_store = false;
  int restart_count = 0;  // TORCHELASTIC_RESTART_COUNT: keys stay per attempt
};

// Reads the launcher's variables. Throws ValueError naming the variable and
// its value: a missing MASTER_ADDR, RANK="abc", RANK=4 with WORLD_SIZE=4, a
// port outside 1..65535, none of RANK, OMPI_COMM_WORLD_RANK, PMI_RANK set.
Environment read_environment();
// The same from a lookup of one's own (tests): nullptr means "not set".
Environment read_environment(const std::function<const char*(const char*)>& lookup);

// A collective or the rendezvous failed: a peer exited, a timeout passed, the
// store was not reachable. Says which rank saw it, what it was doing, the
// store's address, the timeout, and which ranks were found gone (`lost()`).
// c10d's own message, first line, is kept at the end.
class DistributedError : public RuntimeError {
 public:
  DistributedError(const std::string& what, std::vector<int> lost, bool timed_out)
      : RuntimeError(what), lost_(std::move(lost)), timed_out_(timed_out) {}
  // Ranks whose process was found gone (their liveness port refused), or that
  // never joined the rendezvous; empty when every rank was still there.
  const std::vector<int>& lost() const noexcept { return lost_; }
  // c10d reported a timeout (as opposed to a closed connection).
  bool timed_out() const noexcept { return timed_out_; }

 private:
  std::vector<int> lost_;
  bool timed_out_;
};

struct GroupOptions {
  // Bounds the rendezvous and every collective, as init_process_group's
  // `timeout`. PyTorch's default is 30 minutes; a hung peer costs that long.
  std::chrono::milliseconds timeout = std::chrono::minutes(30);
  // Default: read_environment().
  std::optional<Environment> environment;
};

// Ranks' answer to "how many batches this epoch". `agreed` is `fewest` under
// UnevenBatches::cut and `most` under ::pad.
struct BatchCounts {
  size_t local = 0;
  size_t fewest = 0;
  size_t most = 0;
  size_t agreed = 0;
};

// What ranks with more batches (cut) or fewer (pad) do: cut stops every rank
// at the fewest, as DistributedSampler(drop_last=True) drops the tail; pad
// runs every rank to the most, as DistributedSampler pads by repeating
// samples (its default, and this one's).
enum class UnevenBatches { pad, cut };

// One rank's view of the job: a c10d process group plus what conveyor adds
// (agreement on seed and batch count, errors that name the lost rank).
// Creating one is collective: every rank of the job must do it.
class Group {
 public:
  // Rendezvous through a c10d::TCPStore at MASTER_ADDR:MASTER_PORT (rank 0
  // serves it unless torchrun's agent does) and a ProcessGroupGloo on it.
  // Gloo binds to 127.0.0.1 when MASTER_ADDR is a loopback address, to
  // GLOO_SOCKET_IFNAME when set, else to this host's name (as PyTorch).
  // Throws ValueError for a bad environment or mismatched WORLD_SIZE,
  // DistributedError when the rendezvous fails within `timeout`.
  // Sets SIGPIPE to SIG_IGN when it is SIG_DFL, as Python does: Gloo's
  // writes to a dead peer would otherwise kill the process (adopt() too).
  static Group init(GroupOptions options = {});

  // Wraps a process group the program already has (a
  // c10::intrusive_ptr<c10d::ProcessGroup> or of a subclass) that takes CPU
  // tensors (Gloo, MPI). `options.timeout` is only quoted in errors: the
  // group's own timeout applies. `options.environment`, when given, must
  // agree with the group's rank and size.
  template <class ProcessGroupPtr>
  static Group adopt(const ProcessGroupPtr& group, GroupOptions options = {}) {
    return adopt_raw(group.get(), std::move(options));
  }

  Group(Group&&) noexcept;
  Group& operator=(Group&&) noexcept;
  ~Group();

  int rank() const noexcept;
  int world_size() const noexcept;
  const Environment& environment() const noexcept;
  std::chrono::milliseconds timeout() const noexcept;

  // One seed for every rank, in one collective. Ranks that pass a seed must
  // pass the same one, and it is used; when none does, rank 0 draws one from
  // std::random_device. Throws ValueError on every rank when ranks disagree.
  uint64_t agree_seed(std::optional<uint64_t> seed);

  // One batch count for every rank, in one allreduce (MIN of the count and
  // of its negation). `local`: this rank's count this epoch.
  BatchCounts agree_batch_count(size_t local, UnevenBatches policy = UnevenBatches::pad);

  // Returns when every rank has called it.
  void barrier();

  // A collective of the caller's own (a gradient allreduce) with conveyor's
  // error reporting: c10d's exceptions come out as DistributedError.
  void run(const std::string& operation, const std::function<void(c10d::ProcessGroup&)>& collective);

  // The c10d group itself, for what conveyor does not wrap.
  c10d::ProcessGroup& process_group() noexcept;

 private:
  struct Impl;
  explicit Group(std::unique_ptr<Impl> impl);
  static Group adopt_raw(c10d::ProcessGroup* group, GroupOptions options);
  std::unique_ptr<Impl> impl_;
};

}  // namespace conveyor::distributed
