// A scripted HTTP/1.1 server for conveyor::io's tests: what nginx will not
// do (a replaced object between a request and its resume, short 206s,
// bytes past a Content-Length, garbage for a status line). One thread on a
// free 127.0.0.1 port serves one connection at a time, its requests in
// turn; each request's head is handed to a test's `respond`, which writes
// the raw response.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

namespace conveyor::test {

class ScriptedServer {
 public:
  struct Request {
    int number = 0;         // 0, 1, ... over all connections
    int connection = 0;     // 1, 2, ...: the connection it came on
    std::string head;       // the request line and headers, without the blank line
    std::optional<uint64_t> range_start;  // Range: bytes=N-
    // A header's value ("" when absent), the name matched ignoring case.
    std::string header(std::string_view name) const;
  };
  // Writes the response to `fd` (send_all); returns whether the connection
  // stays open for the next request (false: closed with a reset, as a
  // connection cut mid-body).
  using Respond = std::function<bool(int fd, const Request& request)>;

  explicit ScriptedServer(Respond respond);  // throws std::runtime_error
  ~ScriptedServer();  // closes the listener and the connection being served
  ScriptedServer(const ScriptedServer&) = delete;
  ScriptedServer& operator=(const ScriptedServer&) = delete;

  std::string url(const std::string& path) const;  // path starts with '/'
  std::vector<Request> requests() const;           // so far, in order

  static void send_all(int fd, std::string_view bytes);
  // Returns once the peer has acknowledged every byte sent on `fd` (the
  // socket's send queue is empty): they wait in the client's socket.
  static void wait_acknowledged(int fd);

 private:
  void serve();

  Respond respond_;
  int fd_ = -1;
  uint16_t port_ = 0;
  std::atomic<bool> stop_{false};
  mutable std::mutex mutex_;
  std::vector<Request> requests_;
  int client_ = -1;  // the connection being served (under mutex_)
  std::thread thread_;
};

}  // namespace conveyor::test
