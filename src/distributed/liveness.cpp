#include "liveness.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
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

LivenessPort::LivenessPort(const std::string& local_host) {
  Resolved local = resolve(local_host, 0, SOCK_STREAM);
  Fd fd(::socket(local.address.ss_family, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (fd.get() < 0) fail_errno("liveness port: socket");
  if (::bind(fd.get(), reinterpret_cast<sockaddr*>(&local.address), local.length) != 0) {
    fail_errno("liveness port: bind to " + local_host);
  }
  if (::listen(fd.get(), SOMAXCONN) != 0) fail_errno("liveness port: listen");
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

Watch::Watch(const std::vector<Peer>& peers, int self, std::chrono::milliseconds budget)
    : fds_(peers.size(), -1) {
  for (size_t rank = 0; rank < peers.size(); ++rank) {
    if (static_cast<int>(rank) == self) continue;
    const Peer& peer = peers[rank];
    const std::string name = "rank " + std::to_string(rank) + "'s liveness port " + peer.host +
                             ":" + std::to_string(peer.port);
    Resolved remote = resolve(peer.host, peer.port, SOCK_STREAM);
    Fd fd(::socket(remote.address.ss_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
    if (fd.get() < 0) fail_errno("socket");
    if (::connect(fd.get(), reinterpret_cast<sockaddr*>(&remote.address), remote.length) != 0) {
      if (errno != EINPROGRESS) fail_errno("cannot connect to " + name);
      pollfd entry{fd.get(), POLLOUT, 0};
      if (::poll(&entry, 1, static_cast<int>(budget.count())) <= 0) {
        throw std::runtime_error("no answer from " + name + " within " +
                                 std::to_string(budget.count()) + " ms");
      }
      int error = 0;
      socklen_t length = sizeof error;
      ::getsockopt(fd.get(), SOL_SOCKET, SO_ERROR, &error, &length);
      if (error != 0) {
        errno = error;
        fail_errno("cannot connect to " + name);
      }
    }
    fds_[rank] = fd.release();
  }
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
