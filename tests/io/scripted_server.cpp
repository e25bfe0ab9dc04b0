#include "scripted_server.h"

#include <arpa/inet.h>
#include <linux/sockios.h>
#include <netinet/in.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <stdexcept>

namespace conveyor::test {

std::string ScriptedServer::Request::header(std::string_view name) const {
  for (size_t at = head.find("\r\n"); at != std::string::npos; at = head.find("\r\n", at + 2)) {
    const size_t begin = at + 2, end = std::min(head.find("\r\n", begin), head.size());
    const std::string_view line(head.data() + begin, end - begin);
    if (line.size() <= name.size() || line[name.size()] != ':') continue;
    bool same = true;
    for (size_t i = 0; i < name.size() && same; ++i) {
      same = std::tolower(static_cast<unsigned char>(line[i])) == std::tolower(static_cast<unsigned char>(name[i]));
    }
    if (!same) continue;
    std::string_view value = line.substr(name.size() + 1);
    while (!value.empty() && value.front() == ' ') value.remove_prefix(1);
    return std::string(value);
  }
  return "";
}

ScriptedServer::ScriptedServer(Respond respond) : respond_(std::move(respond)) {
  fd_ = ::socket(AF_INET, SOCK_STREAM, 0);
  if (fd_ < 0) throw std::runtime_error("socket() failed");
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t length = sizeof address;
  if (::bind(fd_, reinterpret_cast<sockaddr*>(&address), sizeof address) != 0 ||
      ::getsockname(fd_, reinterpret_cast<sockaddr*>(&address), &length) != 0 || ::listen(fd_, 16) != 0) {
    ::close(fd_);
    throw std::runtime_error("cannot listen on a loopback port");
  }
  port_ = ntohs(address.sin_port);
  thread_ = std::thread([this] { serve(); });
}

ScriptedServer::~ScriptedServer() {
  stop_ = true;
  ::shutdown(fd_, SHUT_RDWR);  // accept() returns
  {
    std::lock_guard lock(mutex_);
    if (client_ >= 0) ::shutdown(client_, SHUT_RDWR);  // recv() returns
  }
  thread_.join();
  ::close(fd_);
}

std::string ScriptedServer::url(const std::string& path) const {
  return "http://127.0.0.1:" + std::to_string(port_) + path;
}

std::vector<ScriptedServer::Request> ScriptedServer::requests() const {
  std::lock_guard lock(mutex_);
  return requests_;
}

void ScriptedServer::send_all(int fd, std::string_view bytes) {
  for (size_t sent = 0; sent < bytes.size();) {
    const ssize_t n = ::send(fd, bytes.data() + sent, bytes.size() - sent, MSG_NOSIGNAL);
    if (n <= 0) return;
    sent += static_cast<size_t>(n);
  }
}

void ScriptedServer::wait_acknowledged(int fd) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  int queued = 0;
  while (::ioctl(fd, SIOCOUTQ, &queued) == 0 && queued > 0) {
    if (std::chrono::steady_clock::now() > deadline) throw std::runtime_error("the client acknowledged nothing");
    std::this_thread::sleep_for(std::chrono::milliseconds(1));  // polling a condition, not a race
  }
}

void ScriptedServer::serve() {
  int number = 0, connection = 0;
  while (!stop_) {
    const int client = ::accept(fd_, nullptr, nullptr);
    if (client < 0) return;
    {
      std::lock_guard lock(mutex_);
      client_ = client;
    }
    ++connection;
    std::string pending;
    bool keep = !stop_;
    while (keep) {
      size_t end;
      while ((end = pending.find("\r\n\r\n")) == std::string::npos) {
        char buffer[4096];
        const ssize_t n = ::recv(client, buffer, sizeof buffer, 0);
        if (n <= 0) {
          keep = false;
          break;
        }
        pending.append(buffer, static_cast<size_t>(n));
      }
      if (!keep) break;
      Request request{number++, connection, pending.substr(0, end), std::nullopt};
      pending.erase(0, end + 4);
      const std::string range = request.header("Range");
      if (range.starts_with("bytes=")) request.range_start = std::stoull(range.substr(6));
      {
        std::lock_guard lock(mutex_);
        requests_.push_back(request);
      }
      keep = respond_(client, request);
    }
    linger reset{1, 0};  // closed with a reset: a connection cut mid-body
    ::setsockopt(client, SOL_SOCKET, SO_LINGER, &reset, sizeof reset);
    {
      std::lock_guard lock(mutex_);
      client_ = -1;
    }
    ::close(client);
  }
}

}  // namespace conveyor::test
