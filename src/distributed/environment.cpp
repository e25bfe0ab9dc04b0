// The launcher's variables, read and checked once, with errors that name the
// variable and its value.
#include <charconv>
#include <cstdlib>
#include <string>
#include <string_view>

#include <conveyor/distributed.h>

namespace conveyor::distributed {
namespace {

[[noreturn]] void bad(const std::string& message) {
  throw ValueError("conveyor::distributed: " + message);
}

std::string quoted(const char* name, const char* value) {
  return std::string(name) + "='" + value + "'";
}

// The whole value must be a decimal integer in [low, high].
long long parse_integer(const char* name, const char* value, long long low, long long high) {
  std::string_view text(value);
  long long result = 0;
  auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), result);
  if (text.empty() || error != std::errc{} || end != text.data() + text.size()) {
    bad(quoted(name, value) + " is not an integer");
  }
  if (result < low || result > high) {
    bad(quoted(name, value) + " is outside " + std::to_string(low) + ".." + std::to_string(high));
  }
  return result;
}

class Reader {
 public:
  Reader(const std::function<const char*(const char*)>& lookup, std::string launcher)
      : lookup_(lookup), launcher_(std::move(launcher)) {}

  const char* optional(const char* name) const {
    const char* value = lookup_(name);
    return value != nullptr && *value != '\0' ? value : nullptr;
  }

  const char* required(const char* name, const char* hint = "") const {
    const char* value = optional(name);
    if (value == nullptr) {
      bad("environment variable " + std::string(name) + " expected (" + launcher_ +
          " launch), but not set" + hint);
    }
    return value;
  }

  int integer(const char* name, long long low, long long high) const {
    return static_cast<int>(parse_integer(name, required(name), low, high));
  }

 private:
  const std::function<const char*(const char*)>& lookup_;
  std::string launcher_;
};

constexpr long long kMaxRanks = 1 << 24;

}  // namespace

Environment read_environment() {
  return read_environment([](const char* name) -> const char* { return std::getenv(name); });
}

Environment read_environment(const std::function<const char*(const char*)>& lookup) {
  Environment env;
  // torchrun's variables win: an mpirun that starts torchrun-style programs
  // with -x RANK=... means them.
  const auto set = [&](const char* name) { return lookup(name) != nullptr && *lookup(name) != '\0'; };
  const bool torchrun = set("RANK");
  const bool open_mpi = !torchrun && lookup("OMPI_COMM_WORLD_RANK") != nullptr;
  // MPICH's and Intel MPI's launcher (Hydra's mpiexec) sets PMI_RANK and
  // PMI_SIZE, and the node's share as MPI_LOCALRANKID / MPI_LOCALNRANKS.
  const bool hydra = !torchrun && !open_mpi && set("PMI_RANK");
  if (!torchrun && !open_mpi && !hydra) {
    bad("no launcher environment: RANK (torchrun), OMPI_COMM_WORLD_RANK (Open MPI's mpirun) or "
        "PMI_RANK (MPICH's or Intel MPI's mpiexec) expected, but none is set");
  }
  env.launcher = torchrun ? "torchrun" : open_mpi ? "Open MPI" : "MPICH";
  Reader read(lookup, env.launcher);

  const char* rank_name = torchrun ? "RANK" : open_mpi ? "OMPI_COMM_WORLD_RANK" : "PMI_RANK";
  const char* size_name = torchrun ? "WORLD_SIZE" : open_mpi ? "OMPI_COMM_WORLD_SIZE" : "PMI_SIZE";
  const char* local_rank_name =
      torchrun ? "LOCAL_RANK" : open_mpi ? "OMPI_COMM_WORLD_LOCAL_RANK" : "MPI_LOCALRANKID";
  const char* local_size_name =
      torchrun ? "LOCAL_WORLD_SIZE" : open_mpi ? "OMPI_COMM_WORLD_LOCAL_SIZE" : "MPI_LOCALNRANKS";

  env.world_size = read.integer(size_name, 1, kMaxRanks);
  env.rank = read.integer(rank_name, 0, kMaxRanks);
  if (env.rank >= env.world_size) {
    bad(quoted(rank_name, read.required(rank_name)) + " is not below " +
        quoted(size_name, read.required(size_name)));
  }
  // A hand launch may leave the node out: then the node is the whole job.
  if (read.optional(local_size_name) != nullptr) {
    env.local_world_size = read.integer(local_size_name, 1, env.world_size);
  } else {
    env.local_world_size = env.world_size;
  }
  if (read.optional(local_rank_name) != nullptr) {
    env.local_rank = read.integer(local_rank_name, 0, kMaxRanks);
    if (env.local_rank >= env.local_world_size) {
      bad(quoted(local_rank_name, read.required(local_rank_name)) + " is not below " +
          (read.optional(local_size_name) != nullptr
               ? quoted(local_size_name, read.required(local_size_name))
               : quoted(size_name, read.required(size_name))));
    }
  } else if (env.local_world_size == env.world_size) {
    env.local_rank = env.rank;
  } else {
    read.required(local_rank_name);  // throws: a node's share without our place in it
  }

  const char* mpi_hint = open_mpi ? ": mpirun sets no rendezvous address; pass "
                                    "-x MASTER_ADDR=<rank 0's host> -x MASTER_PORT=<a free port>"
                         : hydra ? ": mpiexec sets no rendezvous address; pass "
                                   "-genv MASTER_ADDR <rank 0's host> -genv MASTER_PORT <a free port>"
                                 : "";
  env.master_addr = read.required("MASTER_ADDR", mpi_hint);
  env.master_port = static_cast<uint16_t>(
      parse_integer("MASTER_PORT", read.required("MASTER_PORT", mpi_hint), 1, 65535));

  if (const char* agent = read.optional("TORCHELASTIC_USE_AGENT_STORE")) {
    env.agent_store = std::string_view(agent) == "True";
  }
  if (const char* restarts = read.optional("TORCHELASTIC_RESTART_COUNT")) {
    env.restart_count =
        static_cast<int>(parse_integer("TORCHELASTIC_RESTART_COUNT", restarts, 0, 1 << 30));
  }
  return env;
}

}  // namespace conveyor::distributed
