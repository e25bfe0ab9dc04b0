// Liveness connections: how a rank whose collective failed tells "that
// peer's process is gone" from "that peer is slow or stuck", and names it.
// Gloo's own errors name only a socket address, not a rank.
//
// Every rank listens on a TCP port; when the group is made the ranks swap the
// addresses and build a mesh: each rank connects to every lower rank's port
// and says who it is, and accepts the connections of every higher rank. One
// connection per pair, watched from both ends. When a process ends, however
// it ends (exit, crash, SIGKILL), the kernel closes its sockets, so its peers'
// ends report a hang-up within moments of Gloo's own sockets dropping. A
// stuck process keeps its connections open. Waiting on those connections, not
// probing once, matters: a dying process's descriptors are released in an
// order the kernel does not promise, so its Gloo sockets may drop first.
//
// Accepting matters too: a listener that never accepts holds at most
// net.core.somaxconn + 1 connections (128 on kernels before 5.4), and every
// connection past that would wait for an answer that never comes.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

namespace conveyor::distributed::detail {

// Where a rank's liveness port is, and who holds it (for messages).
struct Peer {
  std::string host;  // numeric address the others connect to
  uint16_t port = 0;
  long pid = 0;
  std::string hostname;
};

// Fixed size of a serialized Peer: one allgather of equal tensors swaps them.
inline constexpr size_t kPeerRecordBytes = 256;

std::string serialize(const Peer& peer);  // exactly kPeerRecordBytes
Peer deserialize(const uint8_t* bytes);   // kPeerRecordBytes of them

// The local address this host uses to reach `remote_host` (a UDP connect
// sends nothing): the address peers can reach us at, 127.0.0.1 when the
// master is on the loopback. Throws std::runtime_error when it cannot.
std::string local_address_towards(const std::string& remote_host);

bool is_loopback(const std::string& numeric_host);

// A listening socket held for the life of the process's group. `backlog`
// is listen()'s, 0 for SOMAXCONN (the kernel caps it at net.core.somaxconn);
// tests shrink it.
class LivenessPort {
 public:
  // Throws std::system_error.
  explicit LivenessPort(const std::string& local_host, int backlog = 0);
  LivenessPort(const LivenessPort&) = delete;
  LivenessPort& operator=(const LivenessPort&) = delete;
  ~LivenessPort();

  const Peer& self() const noexcept { return self_; }
  int listening_fd() const noexcept { return fd_; }  // non-blocking

 private:
  int fd_ = -1;
  Peer self_;
};

// One connection to each other rank: made to each lower rank's port,
// accepted on `port` from each higher rank.
class Watch {
 public:
  // Builds this rank's part of the mesh within `budget`, while every other
  // rank builds its own. A connection that does not say it comes from a
  // higher rank of this job (its rank and pid, as `peers` has them) is closed
  // and not counted. Throws std::runtime_error naming the ranks it could not
  // reach or that never connected.
  Watch(const std::vector<Peer>& peers, int self, const LivenessPort& port,
        std::chrono::milliseconds budget);
  Watch(const Watch&) = delete;
  Watch& operator=(const Watch&) = delete;
  ~Watch();

  // The ranks whose connection hung up, in rank order: waits up to `budget`
  // for the first, then up to `settle` more for others. One death brings
  // down the ranks that talk to it, and the first hang-up seen may be one of
  // those (a rank that failed fast and exited) while the rank that died first
  // is still closing its sockets: waiting `settle` names it too. Empty when
  // none hung up.
  std::vector<int> gone(std::chrono::milliseconds budget,
                        std::chrono::milliseconds settle = std::chrono::milliseconds(500)) const;

 private:
  std::vector<int> fds_;  // by rank; -1 for self
};

}  // namespace conveyor::distributed::detail
