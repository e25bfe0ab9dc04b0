#include "liveness.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <memory>
#include <sstream>
#include <stdexcept>
#include <system_error>
#include <utility>

namespace conveyor::distributed::detail {
namespace {

[[noreturn]] void fail_errno(const std::string& what) {
  throw std::system_error(errno, std::generic_category(), what);
}

class Fd {
 public:
  explicit Fd(int fd) : fd_(fd) {}
  Fd(Fd&& other) noexcept : fd_(other.release()) {}
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  ~Fd() {
    if (fd_ >= 0) ::close(fd_);
  }
  int get() const { return fd_; }
  int release() { return std::exchange(fd_, -1); }

 private:
  int fd_;
};

std::string numeric(const sockaddr* address, socklen_t length) {
  char host[NI_MAXHOST];
  if (::getnameinfo(address, length, host, sizeof host, nullptr, 0, NI_NUMERICHOST) != 0) {
    throw std::runtime_error("getnameinfo failed");
  }
  return host;
}

struct Resolved {
  sockaddr_storage address{};
  socklen_t length = 0;
};

Resolved resolve(const std::string& host, uint16_t port, int socktype) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = socktype;
  addrinfo* found = nullptr;
  const std::string service = std::to_string(port);
  if (int rc = ::getaddrinfo(host.c_str(), service.c_str(), &hints, &found); rc != 0) {
    throw std::runtime_error("cannot resolve '" + host + "': " + ::gai_strerror(rc));
  }
  Resolved out;
  std::memcpy(&out.address, found->ai_addr, found->ai_addrlen);
  out.length = found->ai_addrlen;
  ::freeaddrinfo(found);
  return out;
}

uint16_t port_of(const sockaddr_storage& address) {
  return address.ss_family == AF_INET6
             ? ntohs(reinterpret_cast<const sockaddr_in6&>(address).sin6_port)
             : ntohs(reinterpret_cast<const sockaddr_in&>(address).sin_port);
}

}  // namespace

std::string serialize(const Peer& peer) {
  std::ostringstream text;
  text << peer.host << ' ' << peer.port << ' ' << peer.pid << ' ' << peer.hostname;
  std::string out = text.str();
  out.resize(kPeerRecordBytes, '\0');  // a host name past ~200 bytes is cut: messages only
  out.back() = '\0';
  return out;
}

Peer deserialize(const uint8_t* bytes) {
  std::string text(reinterpret_cast<const char*>(bytes), kPeerRecordBytes);
  text.resize(std::strlen(text.c_str()));
  std::istringstream in(text);
  Peer peer;
  in >> peer.host >> peer.port >> peer.pid;
  std::getline(in >> std::ws, peer.hostname);
  return peer;
}

std::string local_address_towards(const std::string& remote_host) {
  Resolved remote = resolve(remote_host, 9, SOCK_DGRAM);
  Fd udp(::socket(remote.address.ss_family, SOCK_DGRAM | SOCK_CLOEXEC, 0));
  if (udp.get() < 0) fail_errno("socket");
  if (::connect(udp.get(), reinterpret_cast<sockaddr*>(&remote.address), remote.length) != 0) {
    fail_errno("no route to " + remote_host);
  }
  sockaddr_storage local{};
  socklen_t length = sizeof local;
  if (::getsockname(udp.get(), reinterpret_cast<sockaddr*>(&local), &length) != 0) {
    fail_errno("getsockname");
  }
  return numeric(reinterpret_cast<sockaddr*>(&local), length);
}

bool is_loopback(const std::string& numeric_host) {
  in_addr v4{};
  if (::inet_pton(AF_INET, numeric_host.c_str(), &v4) == 1) {
    return (ntohl(v4.s_addr) >> 24) == 127;
  }
  in6_addr v6{};
  return ::inet_pton(AF_INET6, numeric_host.c_str(), &v6) == 1 && IN6_IS_ADDR_LOOPBACK(&v6);
}

LivenessPort::LivenessPort(const std::string& local_host, int backlog) {
  Resolved local = resolve(local_host, 0, SOCK_STREAM);
  Fd fd(::socket(local.address.ss_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
  if (fd.get() < 0) fail_errno("liveness port: socket");
  if (::bind(fd.get(), reinterpret_cast<sockaddr*>(&local.address), local.length) != 0) {
    fail_errno("liveness port: bind to " + local_host);
  }
  if (::listen(fd.get(), backlog > 0 ? backlog : SOMAXCONN) != 0) {
    fail_errno("liveness port: listen");
  }
  sockaddr_storage bound{};
  socklen_t length = sizeof bound;
  if (::getsockname(fd.get(), reinterpret_cast<sockaddr*>(&bound), &length) != 0) {
    fail_errno("liveness port: getsockname");
  }
  self_.host = numeric(reinterpret_cast<sockaddr*>(&bound), length);
  self_.port = port_of(bound);
  self_.pid = static_cast<long>(::getpid());
  char name[256] = {};
  ::gethostname(name, sizeof name - 1);
  self_.hostname = name;
  fd_ = fd.release();
}

LivenessPort::~LivenessPort() {
  if (fd_ >= 0) ::close(fd_);
}

namespace {

// What a connecting rank sends first, and the only bytes ever sent on a
// liveness connection: "cnvL", its rank and its pid, big-endian.
constexpr size_t kHelloBytes = 16;

std::array<uint8_t, kHelloBytes> hello_of(int rank, long pid) {
  std::array<uint8_t, kHelloBytes> out{'c', 'n', 'v', 'L'};
  const auto r = static_cast<uint32_t>(rank);
  const auto p = static_cast<uint64_t>(pid);
  for (int i = 0; i < 4; ++i) out[4 + i] = static_cast<uint8_t>(r >> (24 - 8 * i));
  for (int i = 0; i < 8; ++i) out[8 + i] = static_cast<uint8_t>(p >> (56 - 8 * i));
  return out;
}

// The rank a hello names when it is one of `peers` above `self`; -1 when not.
int rank_of_hello(const std::array<uint8_t, kHelloBytes>& hello, const std::vector<Peer>& peers,
                  int self) {
  if (std::memcmp(hello.data(), "cnvL", 4) != 0) return -1;
  uint32_t rank = 0;
  uint64_t pid = 0;
  for (int i = 0; i < 4; ++i) rank = (rank << 8) | hello[4 + i];
  for (int i = 0; i < 8; ++i) pid = (pid << 8) | hello[8 + i];
  if (rank <= static_cast<uint32_t>(self) || rank >= peers.size()) return -1;
  if (pid != static_cast<uint64_t>(peers[rank].pid)) return -1;
  return static_cast<int>(rank);
}

std::string port_name(const std::vector<Peer>& peers, size_t rank) {
  return "rank " + std::to_string(rank) + "'s liveness port " + peers[rank].host + ":" +
         std::to_string(peers[rank].port);
}

// Up to four ranks, then how many more: "1, 2, 3, 4 and 6 more".
std::string list_of(const std::vector<int>& ranks) {
  std::string out;
  for (size_t i = 0; i < ranks.size() && i < 4; ++i) {
    out += (i == 0 ? "" : ", ") + std::to_string(ranks[i]);
  }
  if (ranks.size() > 4) out += " and " + std::to_string(ranks.size() - 4) + " more";
  return out;
}

}  // namespace

Watch::Watch(const std::vector<Peer>& peers, int self, const LivenessPort& port,
             std::chrono::milliseconds budget)
    : fds_(peers.size(), -1) {
  // A throw below leaks nothing: the descriptors are owned by `connecting`
  // and `greeting` until placed in fds_, which this guard closes (the
  // destructor does not run when the constructor throws).
  struct CloseOnThrow {
    std::vector<int>& fds;
    bool built = false;
    ~CloseOnThrow() {
      for (int& fd : fds) {
        if (!built && fd >= 0) ::close(std::exchange(fd, -1));
      }
    }
  } guard{fds_};
  struct Connecting {
    int rank;
    Fd fd;
  };
  struct Greeting {  // accepted; its hello not read in full yet
    Fd fd;
    std::array<uint8_t, kHelloBytes> hello{};
    size_t received = 0;
  };
  std::vector<std::unique_ptr<Connecting>> connecting;
  std::vector<std::unique_ptr<Greeting>> greeting;
  auto established = [&](int rank, Fd& fd) { fds_[static_cast<size_t>(rank)] = fd.release(); };

  for (int rank = 0; rank < self; ++rank) {
    const Peer& peer = peers[static_cast<size_t>(rank)];
    Resolved remote = resolve(peer.host, peer.port, SOCK_STREAM);
    Fd fd(::socket(remote.address.ss_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
    if (fd.get() < 0) fail_errno("socket");
    if (::connect(fd.get(), reinterpret_cast<sockaddr*>(&remote.address), remote.length) != 0 &&
        errno != EINPROGRESS) {
      fail_errno("cannot connect to " + port_name(peers, static_cast<size_t>(rank)));
    }
    connecting.push_back(std::make_unique<Connecting>(Connecting{rank, std::move(fd)}));
  }
  size_t to_accept = peers.size() - static_cast<size_t>(self) - 1;

  using Clock = std::chrono::steady_clock;
  const auto deadline = Clock::now() + budget;
  std::vector<pollfd> polling;
  while (!connecting.empty() || to_accept > 0) {
    polling.clear();
    for (const auto& c : connecting) polling.push_back({c->fd.get(), POLLOUT, 0});
    for (const auto& g : greeting) polling.push_back({g->fd.get(), POLLIN, 0});
    if (to_accept > 0) polling.push_back({port.listening_fd(), POLLIN, 0});
    const auto left =
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
    const int ready = left.count() <= 0
                          ? 0
                          : ::poll(polling.data(), polling.size(), static_cast<int>(left.count()));
    if (ready < 0 && errno == EINTR) continue;
    if (ready < 0) fail_errno("poll");
    if (ready == 0) {
      std::vector<int> silent;
      for (const auto& c : connecting) silent.push_back(c->rank);
      if (!silent.empty()) {
        const std::string others =
            silent.size() > 1 ? " (silent: ranks " + list_of(silent) + ")" : "";
        throw std::runtime_error("no answer from " +
                                 port_name(peers, static_cast<size_t>(silent[0])) + others +
                                 " within " + std::to_string(budget.count()) + " ms");
      }
      std::vector<int> absent;
      for (size_t rank = static_cast<size_t>(self) + 1; rank < peers.size(); ++rank) {
        if (fds_[rank] < 0) absent.push_back(static_cast<int>(rank));
      }
      throw std::runtime_error(std::string(absent.size() == 1 ? "rank " : "ranks ") +
                               list_of(absent) + " did not connect to this rank's liveness port " +
                               port.self().host + ":" + std::to_string(port.self().port) +
                               " within " + std::to_string(budget.count()) + " ms");
    }

    size_t at = 0;
    for (auto it = connecting.begin(); it != connecting.end(); ++at) {
      if (polling[at].revents == 0) {
        ++it;
        continue;
      }
      Connecting& c = **it;
      int error = 0;
      socklen_t length = sizeof error;
      if (::getsockopt(c.fd.get(), SOL_SOCKET, SO_ERROR, &error, &length) != 0) error = errno;
      if (error != 0) {
        errno = error;
        fail_errno("cannot connect to " + port_name(peers, static_cast<size_t>(c.rank)));
      }
      // Sixteen bytes on a fresh connection: the send buffer takes them whole.
      const auto hello = hello_of(self, port.self().pid);
      if (::send(c.fd.get(), hello.data(), hello.size(), MSG_NOSIGNAL) !=
          static_cast<ssize_t>(hello.size())) {
        fail_errno("cannot greet " + port_name(peers, static_cast<size_t>(c.rank)));
      }
      established(c.rank, c.fd);
      it = connecting.erase(it);
    }
    for (auto it = greeting.begin(); it != greeting.end(); ++at) {
      if (polling[at].revents == 0) {
        ++it;
        continue;
      }
      Greeting& g = **it;
      const ssize_t got =
          ::recv(g.fd.get(), g.hello.data() + g.received, kHelloBytes - g.received, 0);
      if (got < 0 && (errno == EAGAIN || errno == EINTR)) {
        ++it;
        continue;
      }
      if (got > 0) g.received += static_cast<size_t>(got);
      if (got > 0 && g.received < kHelloBytes) {
        ++it;
        continue;
      }
      // A whole hello, or a connection that closed or failed before one.
      const int rank = got > 0 ? rank_of_hello(g.hello, peers, self) : -1;
      if (rank >= 0 && fds_[static_cast<size_t>(rank)] < 0) {
        established(rank, g.fd);
        --to_accept;
      }
      it = greeting.erase(it);  // a stranger's or a duplicate's connection closes here
    }
    if (at < polling.size() && polling[at].revents != 0) {
      for (;;) {
        Fd accepted(
            ::accept4(port.listening_fd(), nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK));
        if (accepted.get() < 0) {
          if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR || errno == ECONNABORTED) {
            break;
          }
          fail_errno("liveness port: accept");
        }
        // Strangers that never speak are bounded: the oldest goes first.
        if (greeting.size() >= peers.size() + 64) greeting.erase(greeting.begin());
        greeting.push_back(std::make_unique<Greeting>(Greeting{std::move(accepted), {}, 0}));
      }
    }
  }
  guard.built = true;
}

Watch::~Watch() {
  for (int fd : fds_) {
    if (fd >= 0) ::close(fd);
  }
}

std::vector<int> Watch::gone(std::chrono::milliseconds budget, std::chrono::milliseconds settle) const {
  std::vector<pollfd> watching;
  std::vector<int> ranks;  // beside `watching`
  for (size_t rank = 0; rank < fds_.size(); ++rank) {
    if (fds_[rank] < 0) continue;
    // Nothing is ever sent on these: any event is the peer's end closing.
    watching.push_back({fds_[rank], POLLIN | POLLRDHUP, 0});
    ranks.push_back(static_cast<int>(rank));
  }
  std::vector<int> out;
  using Clock = std::chrono::steady_clock;
  auto deadline = Clock::now() + budget;
  while (!watching.empty()) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
    const int ready = ::poll(watching.data(), watching.size(), static_cast<int>(std::max<long>(0, left.count())));
    if (ready < 0 && errno == EINTR) continue;
    if (ready <= 0) break;  // the deadline (or a poll error: report what is known)
    if (out.empty()) deadline = std::min(deadline, Clock::now() + settle);
    for (size_t i = 0; i < watching.size();) {
      if (watching[i].revents == 0) {
        ++i;
        continue;
      }
      out.push_back(ranks[i]);
      watching.erase(watching.begin() + static_cast<std::ptrdiff_t>(i));
      ranks.erase(ranks.begin() + static_cast<std::ptrdiff_t>(i));
    }
  }
  std::sort(out.begin(), out.end());
  return out;
}

}  // namespace conveyor::distributed::detail
