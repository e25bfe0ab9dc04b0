// conveyor::distributed::Group on c10d: a TCPStore rendezvous, a
// ProcessGroupGloo, and errors that say which rank went missing.
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#include <torch/csrc/distributed/c10d/exception.h>

#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <random>
#include <sstream>

#include <conveyor/distributed.h>

#include "liveness.h"

namespace conveyor::distributed {
namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

std::string first_line(const std::string& text) {
  // c10::Error appends a C++ backtrace: the first line is the message.
  return text.substr(0, text.find('\n'));
}

bool looks_like_timeout(const std::exception& error) {
  if (dynamic_cast<const c10d::TimeoutError*>(&error) != nullptr) return true;
  const std::string what = first_line(error.what());
  for (const char* word : {"Timed out", "timed out", "Timeout", "timeout"}) {
    if (what.find(word) != std::string::npos) return true;
  }
  return false;
}

std::string ranks_text(const std::vector<int>& ranks) {
  std::string out = ranks.size() == 1 ? "rank " : "ranks ";
  for (size_t i = 0; i < ranks.size(); ++i) {
    out += (i == 0 ? "" : ", ") + std::to_string(ranks[i]);
  }
  return out;
}

std::string seconds(Clock::duration elapsed) {
  char text[32];
  std::snprintf(text, sizeof text, "%.2f s", std::chrono::duration<double>(elapsed).count());
  return text;
}

std::string where(const Environment& env) {
  return "rank " + std::to_string(env.rank) + " of " + std::to_string(env.world_size);
}

// Which device Gloo binds to, as PyTorch picks it: GLOO_SOCKET_IFNAME first,
// the loopback when the job lives there, else this host's name.
std::shared_ptr<::gloo::transport::Device> gloo_device(const std::string& local_host) {
  if (const char* names = std::getenv("GLOO_SOCKET_IFNAME"); names != nullptr && *names != '\0') {
    std::string first(names);
    return c10d::ProcessGroupGloo::createDeviceForInterface(first.substr(0, first.find(',')));
  }
  if (detail::is_loopback(local_host)) {
    return c10d::ProcessGroupGloo::createDeviceForHostname(local_host);
  }
  return c10d::ProcessGroupGloo::createDefaultDevice();
}

// Gloo writes to its sockets with writev, without MSG_NOSIGNAL: a write to a
// peer that just died raises SIGPIPE, which kills a C++ program before any
// error can name the peer. Python ignores SIGPIPE at startup, so PyTorch
// users never meet this; we do the same, unless the program chose a handler.
void ignore_sigpipe_unless_handled() {
  struct sigaction current {};
  if (::sigaction(SIGPIPE, nullptr, &current) == 0 && current.sa_handler == SIG_DFL) {
    struct sigaction ignore {};
    ignore.sa_handler = SIG_IGN;
    ::sigemptyset(&ignore.sa_mask);
    ::sigaction(SIGPIPE, &ignore, nullptr);
  }
}

}  // namespace

struct Group::Impl {
  Environment env;
  milliseconds timeout{};
  std::string store_address;  // "host:port"; empty for an adopted group
  c10::intrusive_ptr<c10d::Store> store;
  c10::intrusive_ptr<c10d::ProcessGroup> group;
  std::vector<detail::Peer> peers;  // by rank: whose liveness port is where
  uint64_t collectives = 0;
  // Destroyed before `group`: a rank that leaves closes its liveness
  // connections before its Gloo connections drop.
  std::unique_ptr<detail::Watch> watch;  // one connection to each other rank
  std::unique_ptr<detail::LivenessPort> liveness;

  std::string context() const {
    std::string out = "timeout " + std::to_string(timeout.count()) + " ms";
    if (!store_address.empty()) out += ", store " + store_address;
    return out;
  }

  // What went wrong, after watching the liveness connections.
  DistributedError failure(const std::string& operation, const std::exception& error,
                           Clock::time_point start) const {
    const bool timed_out = looks_like_timeout(error);
    // A peer that died closed its liveness connections within moments of its
    // Gloo sockets; two seconds is ample, and only spent when nobody died.
    const milliseconds budget = std::min(timeout, milliseconds(2000));
    const std::vector<int> exited = watch ? watch->gone(budget) : std::vector<int>{};
    std::string text = "conveyor::distributed: " + operation + " (collective " +
                       std::to_string(collectives) + ") failed on " + where(env) + " after " +
                       seconds(Clock::now() - start) + " (" + context() + "): ";
    if (!watch) {
      text += "the ranks' liveness ports were not exchanged yet";
    } else if (exited.empty()) {
      text += "every other rank is still running (no liveness connection closed within " +
              std::to_string(budget.count()) +
              " ms): one may be stuck, or the ranks called different collectives";
    }
    for (size_t i = 0; i < exited.size(); ++i) {
      const detail::Peer& peer = peers[exited[i]];
      text += (i == 0 ? "" : "; ") + ranks_text({exited[i]}) + " has exited (pid " +
              std::to_string(peer.pid) + " on " + peer.hostname + ", liveness port " + peer.host +
              ":" + std::to_string(peer.port) + ": its connection closed)";
    }
    text += ". c10d: " + first_line(error.what());
    return DistributedError(text, exited, timed_out);
  }

  // Runs one collective; c10d's exceptions leave as DistributedError.
  template <class F>
  decltype(auto) collective(const std::string& operation, F&& body) {
    ++collectives;
    const Clock::time_point start = Clock::now();
    try {
      return body();
    } catch (const conveyor::Error&) {
      throw;
    } catch (const std::exception& error) {
      throw failure(operation, error, start);
    }
  }

  // Swaps liveness ports and builds the mesh on them: the group's first collective.
  void exchange_peers() {
    const std::string mine = detail::serialize(liveness->self());
    auto input = at::empty({static_cast<int64_t>(detail::kPeerRecordBytes)}, at::kByte);
    std::memcpy(input.data_ptr<uint8_t>(), mine.data(), mine.size());
    std::vector<at::Tensor> inputs{input};
    std::vector<std::vector<at::Tensor>> outputs(1);
    for (int rank = 0; rank < env.world_size; ++rank) outputs[0].push_back(at::empty_like(input));
    collective("exchange of liveness ports", [&] { group->allgather(outputs, inputs)->wait(); });
    for (const at::Tensor& record : outputs[0]) {
      peers.push_back(detail::deserialize(record.data_ptr<uint8_t>()));
    }
    try {
      watch = std::make_unique<detail::Watch>(peers, env.rank, *liveness,
                                              std::min(timeout, milliseconds(10000)));
    } catch (const std::exception& error) {
      rendezvous_failed("cannot watch the other ranks", &error, {}, false);
    }
    // No rank returns before every rank has its connection to every other:
    // a rank that is done right after the group is made (and exits) would
    // otherwise refuse a slower peer's connect and fail its init.
    collective("barrier after the exchange of liveness ports",
               [&] { group->barrier()->wait(); });
  }

  [[noreturn]] void rendezvous_failed(const std::string& problem, const std::exception* error,
                                      std::vector<int> lost, bool timed_out) const {
    std::string text = "conveyor::distributed: rendezvous failed on " + where(env) + " (" +
                       context() + "): " + problem;
    if (error != nullptr) text += ". c10d: " + first_line(error->what());
    throw DistributedError(text, std::move(lost), timed_out);
  }

  static std::string seen_rank_0_key(int rank) { return "conveyor/seen-rank-0/" + std::to_string(rank); }

  // Every rank announces itself and its WORLD_SIZE; a missing or mismatched
  // one is named here rather than left to hang in Gloo's connect.
  void join() {
    const std::string own = "conveyor/rank/" + std::to_string(env.rank);
    const std::string size = std::to_string(env.world_size);
    try {
      if (store->add("conveyor/claims/" + std::to_string(env.rank), 1) > 1) {
        throw ValueError("conveyor::distributed: two processes claim " + where(env) +
                         " at store " + store_address + ": RANK must differ on every rank");
      }
      store->set(own, std::vector<uint8_t>(size.begin(), size.end()));
      // Rank 0's first: a WORLD_SIZE of our own that differs is the likelier
      // mistake than a rank that never came.
      std::vector<uint8_t> zero = store->get("conveyor/rank/0");
      // Said before this rank raises a mismatch: rank 0 (the store's host
      // under a plain launch) waits for it before raising its own, so its
      // exit cannot cut this read short ("Broken pipe" instead of the
      // mismatch, seen on a loaded machine).
      store->set(seen_rank_0_key(env.rank), std::vector<uint8_t>{1});
      if (std::string(zero.begin(), zero.end()) != size) {
        throw ValueError("conveyor::distributed: WORLD_SIZE=" + size + " on " + where(env) +
                         " but WORLD_SIZE=" + std::string(zero.begin(), zero.end()) +
                         " on rank 0");
      }
    } catch (const conveyor::Error&) {
      throw;
    } catch (const std::exception& error) {
      rendezvous_failed("rank 0 never announced itself at the store", &error, {0},
                        looks_like_timeout(error));
    }
    std::vector<std::string> keys;
    for (int rank = 0; rank < env.world_size; ++rank) {
      keys.push_back("conveyor/rank/" + std::to_string(rank));
    }
    try {
      store->wait(keys, timeout);
    } catch (const std::exception& error) {
      std::vector<int> missing;
      try {
        for (int rank = 0; rank < env.world_size; ++rank) {
          if (!store->check({keys[rank]})) missing.push_back(rank);
        }
      } catch (const std::exception&) {
        // The store itself is gone (rank 0 exited): c10d's message says so.
      }
      rendezvous_failed(
          missing.empty() ? std::string("waiting for the other ranks failed")
                          : ranks_text(missing) + " did not join within " +
                                std::to_string(timeout.count()) +
                                " ms (not started, or started with another MASTER_ADDR, "
                                "MASTER_PORT or WORLD_SIZE)",
          &error, missing, looks_like_timeout(error));
    }
    // Each rank announced its WORLD_SIZE before checking it against rank
    // 0's: checked here against every rank's, or a rank whose peer is
    // failing on its mismatch would wait in Gloo's connect for its whole
    // timeout, then say only "Socket Timeout".
    for (int rank = 0; rank < env.world_size; ++rank) {
      if (rank == env.rank) continue;
      std::vector<uint8_t> theirs;
      try {
        theirs = store->get(keys[rank]);
      } catch (const std::exception& error) {
        rendezvous_failed("reading rank " + std::to_string(rank) + "'s WORLD_SIZE from the store failed", &error,
                          {}, looks_like_timeout(error));
      }
      if (std::string(theirs.begin(), theirs.end()) != size) {
        if (env.rank == 0) {
          try {
            store->wait({seen_rank_0_key(rank)}, timeout);
          } catch (const std::exception&) {
            // It never read rank 0's WORLD_SIZE: its own error says why.
          }
        }
        throw ValueError("conveyor::distributed: WORLD_SIZE=" + size + " on " + where(env) +
                         " but WORLD_SIZE=" + std::string(theirs.begin(), theirs.end()) + " on rank " +
                         std::to_string(rank));
      }
    }
  }
};

// c10d makes a nanosecond deadline of the timeout: milliseconds::max()
// (the C++ way to say "none") overflowed it, and every rank failed at once,
// blaming the port. A year is past any job's wait and far from overflow.
static void check_timeout(milliseconds timeout) {
  constexpr milliseconds kLongest = std::chrono::hours(24 * 365);
  if (timeout <= milliseconds(0) || timeout > kLongest) {
    throw ValueError("conveyor::distributed: timeout should be in [1, " + std::to_string(kLongest.count()) +
                     "] ms (a year at most), but got " + std::to_string(timeout.count()) + " ms");
  }
}

// An Environment given in GroupOptions, checked as read_environment() checks
// the launcher's variables: c10d took world_size -1 as "unspecified" and a
// rank past the world waited out the whole timeout on a store that was not
// its own.
// `serves_store`: init() (rendezvous at master_addr:master_port); adopt()
// uses neither, and leaves master_addr empty without MASTER_ADDR.
static void check_environment(const Environment& env, bool serves_store) {
  constexpr int kMaxRanks = 1 << 24;  // read_environment()'s bound
  const auto field = [](const char* name, long long value) {
    return std::string("Environment.") + name + "=" + std::to_string(value);
  };
  const auto bad = [](const std::string& what) { throw ValueError("conveyor::distributed: " + what); };
  if (env.world_size < 1 || env.world_size > kMaxRanks) {
    bad(field("world_size", env.world_size) + " should be in [1, " + std::to_string(kMaxRanks) + "]");
  }
  if (env.rank < 0 || env.rank >= env.world_size) {
    bad(field("rank", env.rank) + " should be in [0, " + field("world_size", env.world_size) + ")");
  }
  if (env.local_world_size < 1 || env.local_world_size > env.world_size) {
    bad(field("local_world_size", env.local_world_size) + " should be in [1, " +
        field("world_size", env.world_size) + "]");
  }
  // Against the world, not local_world_size: its default (1) is "not said",
  // and a single node's local_rank is its rank.
  if (env.local_rank < 0 || env.local_rank >= env.world_size) {
    bad(field("local_rank", env.local_rank) + " should be in [0, " + field("world_size", env.world_size) + ")");
  }
  if (env.restart_count < 0) bad(field("restart_count", env.restart_count) + " should not be negative");
  if (!serves_store) return;
  if (env.master_port == 0) bad(field("master_port", 0) + " should be in [1, 65535]");
  if (env.master_addr.empty()) bad("Environment.master_addr is empty");
}

Group Group::init(GroupOptions options) {
  auto impl = std::make_unique<Impl>();
  impl->env = options.environment ? *options.environment : read_environment();
  impl->timeout = options.timeout;
  const Environment& env = impl->env;
  impl->store_address = env.master_addr + ":" + std::to_string(env.master_port);
  check_timeout(options.timeout);
  if (options.environment) check_environment(env, /*serves_store=*/true);

  ignore_sigpipe_unless_handled();
  std::string local_host;
  try {
    local_host = detail::local_address_towards(env.master_addr);
    impl->liveness = std::make_unique<detail::LivenessPort>(local_host);
  } catch (const std::exception& error) {
    impl->rendezvous_failed("no local address reaches MASTER_ADDR=" + env.master_addr, &error,
                            {}, false);
  }

  const bool serve = env.rank == 0 && !env.agent_store;
  try {
    c10d::TCPStoreOptions store_options;
    store_options.port = env.master_port;
    store_options.isServer = serve;
    store_options.numWorkers = env.world_size;
    store_options.waitWorkers = false;  // join() waits, and names who is missing
    store_options.timeout = options.timeout;
    c10::intrusive_ptr<c10d::Store> store =
        c10::make_intrusive<c10d::TCPStore>(env.master_addr, store_options);
    if (env.agent_store) {
      // torchrun's agent store is shared by every restart: Python's env://
      // rendezvous keeps each attempt under its own prefix, and so do we.
      store = c10::make_intrusive<c10d::PrefixStore>(
          "/worker/attempt_" + std::to_string(env.restart_count), store);
    }
    impl->store = store;
  } catch (const std::exception& error) {
    impl->rendezvous_failed(
        serve ? "could not serve the store at MASTER_ADDR:MASTER_PORT (port in use, or not an "
                "address of this host?)"
              : "could not reach the store at MASTER_ADDR:MASTER_PORT within " +
                    std::to_string(options.timeout.count()) +
                    " ms (is rank 0 running, with the same MASTER_ADDR and MASTER_PORT?)",
        &error, serve ? std::vector<int>{} : std::vector<int>{0}, looks_like_timeout(error));
  }

  impl->join();

  try {
    auto gloo_options = c10d::ProcessGroupGloo::Options::create(options.timeout);
    gloo_options->devices.push_back(gloo_device(local_host));
    impl->group = c10::make_intrusive<c10d::ProcessGroupGloo>(
        c10::make_intrusive<c10d::PrefixStore>("conveyor/gloo", impl->store), env.rank,
        env.world_size, gloo_options);
  } catch (const std::exception& error) {
    impl->rendezvous_failed("Gloo could not connect every pair of ranks", &error, {},
                            looks_like_timeout(error));
  }
  impl->exchange_peers();
  return Group(std::move(impl));
}

Group Group::adopt_raw(c10d::ProcessGroup* group, GroupOptions options) {
  if (group == nullptr) throw ValueError("conveyor::distributed: adopt() of a null process group");
  ignore_sigpipe_unless_handled();
  auto impl = std::make_unique<Impl>();
  check_timeout(options.timeout);
  impl->group = c10::intrusive_ptr<c10d::ProcessGroup>::reclaim_copy(group);
  impl->timeout = options.timeout;
  if (options.environment) {
    impl->env = *options.environment;
    check_environment(impl->env, /*serves_store=*/false);
    if (impl->env.rank != group->getRank() || impl->env.world_size != group->getSize()) {
      throw ValueError("conveyor::distributed: the environment says " + where(impl->env) +
                       " but the process group is rank " + std::to_string(group->getRank()) +
                       " of " + std::to_string(group->getSize()));
    }
  } else {
    impl->env.rank = group->getRank();
    impl->env.world_size = group->getSize();
    impl->env.local_rank = impl->env.rank;
    impl->env.local_world_size = impl->env.world_size;
    impl->env.launcher = "adopted";
    const char* master = std::getenv("MASTER_ADDR");
    impl->env.master_addr = master != nullptr && *master != '\0' ? master : "";
  }
  try {
    // Reach peers the way we reach the master; without one, by this host's name.
    std::string local_host;
    if (!impl->env.master_addr.empty()) {
      local_host = detail::local_address_towards(impl->env.master_addr);
    } else {
      char name[256] = {};
      ::gethostname(name, sizeof name - 1);
      local_host = detail::local_address_towards(name);
    }
    impl->liveness = std::make_unique<detail::LivenessPort>(local_host);
  } catch (const std::exception& error) {
    impl->rendezvous_failed("no local address for the liveness port", &error, {}, false);
  }
  impl->exchange_peers();
  return Group(std::move(impl));
}

Group::Group(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Group::Group(Group&&) noexcept = default;
Group& Group::operator=(Group&&) noexcept = default;
Group::~Group() = default;

int Group::rank() const noexcept { return impl_->env.rank; }
int Group::world_size() const noexcept { return impl_->env.world_size; }
const Environment& Group::environment() const noexcept { return impl_->env; }
std::chrono::milliseconds Group::timeout() const noexcept { return impl_->timeout; }
c10d::ProcessGroup& Group::process_group() noexcept { return *impl_->group; }

uint64_t Group::agree_seed(std::optional<uint64_t> seed) {
  // Each rank offers (set?, seed); rank 0 offers a fresh draw when unset.
  // One allgather lets every rank check the same offers and throw alike.
  uint64_t offer = seed.value_or(0);
  if (!seed && rank() == 0) {
    std::random_device device;
    offer = (static_cast<uint64_t>(device()) << 32) ^ device();
  }
  auto input = at::empty({2}, at::kLong);
  input[0] = static_cast<int64_t>(seed.has_value());
  int64_t bits = 0;
  std::memcpy(&bits, &offer, sizeof bits);
  input[1] = bits;
  std::vector<at::Tensor> inputs{input};
  std::vector<std::vector<at::Tensor>> outputs(1);
  for (int rank = 0; rank < world_size(); ++rank) outputs[0].push_back(at::empty_like(input));
  impl_->collective("agree_seed", [&] { process_group().allgather(outputs, inputs)->wait(); });

  std::optional<uint64_t> chosen;
  std::string offers;
  bool disagree = false;
  uint64_t rank0 = 0;
  for (int rank = 0; rank < world_size(); ++rank) {
    const int64_t* values = outputs[0][rank].data_ptr<int64_t>();
    uint64_t value = 0;
    std::memcpy(&value, &values[1], sizeof value);
    if (rank == 0) rank0 = value;
    if (values[0] == 0) continue;
    offers += (offers.empty() ? "" : ", ") + std::string("rank ") + std::to_string(rank) + ": " +
              std::to_string(value);
    if (chosen && *chosen != value) disagree = true;
    if (!chosen) chosen = value;
  }
  if (disagree) {
    throw ValueError("conveyor::distributed: ranks set different seeds (" + offers +
                     "): set the same seed on every rank, or none");
  }
  return chosen.value_or(rank0);
}

BatchCounts Group::agree_batch_count(size_t local, UnevenBatches policy) {
  if (local > static_cast<size_t>(std::numeric_limits<int64_t>::max())) {
    throw ValueError("conveyor::distributed: batch count " + std::to_string(local) +
                     " does not fit an int64");
  }
  // MIN of (n, -n) gives the fewest and the most in one allreduce.
  auto counts = at::empty({2}, at::kLong);
  counts[0] = static_cast<int64_t>(local);
  counts[1] = -static_cast<int64_t>(local);
  std::vector<at::Tensor> tensors{counts};
  c10d::AllreduceOptions reduce;
  reduce.reduceOp = c10d::ReduceOp::MIN;
  impl_->collective("agree_batch_count",
                    [&] { process_group().allreduce(tensors, reduce)->wait(); });
  BatchCounts out;
  out.local = local;
  out.fewest = static_cast<size_t>(counts[0].item<int64_t>());
  out.most = static_cast<size_t>(-counts[1].item<int64_t>());
  out.agreed = policy == UnevenBatches::cut ? out.fewest : out.most;
  return out;
}

void Group::barrier() {
  impl_->collective("barrier", [&] { process_group().barrier()->wait(); });
}

void Group::run(const std::string& operation,
                const std::function<void(c10d::ProcessGroup&)>& collective) {
  impl_->collective(operation, [&] { collective(process_group()); });
}

}  // namespace conveyor::distributed
