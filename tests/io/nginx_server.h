// A real nginx for conveyor::io's tests: started on a free 127.0.0.1 port
// with a configuration written into a temporary directory (daemon off, pid,
// logs and temp paths there, running as the current user), serving
// DIR/www. Locations beyond the plain files:
//   /error500/...  return 500
//   /reset/...     return 444 (nginx closes the connection, no response)
//   /slow/...      DIR/www/slow/..., limit_rate 1k
//   /chunked/...   DIR/www/chunked/..., through sub_filter: no Content-Length
//   /norange/...   DIR/www/norange/..., max_ranges 0: a Range is answered 200
//   /range-from-7/, /range-short/, /range-none/   206 "abc" with Content-Range
//                  bytes 7-9/100, bytes 0-2/100, or none
//   /empty503/..., /empty404/...   503 or 404 with an empty body (Content-Length: 0)
//   /resume-elsewhere/...  DIR/www/resume-elsewhere/..., chunked and at 1k/s
//                  as /chunked/ and /slow/; a request with a Range is
//                  answered 206 "abc", Content-Range bytes 0-2/3, whatever it asked
// and, after enable_tls(), all of it over https on a second port.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <string>
#include <vector>

// In a test or a fixture's SetUp: without a tool the test needs
// (`available` false), skip the test saying so, or fail it where
// NginxServer::required() (scripts/setup installs nginx-light and openssl).
#define CONVEYOR_SKIP_WITHOUT(available, tool)                                                          \
  do {                                                                                                 \
    if (!(available)) {                                                                                \
      if (::conveyor::test::NginxServer::required()) {                                                 \
        FAIL() << tool << " is not installed and CONVEYOR_REQUIRE_NGINX is set (scripts/setup installs it)"; \
      }                                                                                                \
      GTEST_SKIP() << tool << " is not installed (scripts/setup installs it)";                         \
    }                                                                                                  \
  } while (0)
#define CONVEYOR_NGINX_SKIP_WITHOUT(available) CONVEYOR_SKIP_WITHOUT(available, "nginx (Debian: nginx-light)")

namespace conveyor::test {

class NginxServer {
 public:
  // The nginx binary, or "" when none is installed: the tests skip then,
  // or fail where required() (CONVEYOR_NGINX_SKIP_WITHOUT).
  static std::string binary();
  // CONVEYOR_REQUIRE_NGINX=1 in the environment (scripts/test sets it, as
  // scripts/setup installs nginx): a missing nginx fails the tests.
  static bool required();

  // Makes the temporary directory with an empty www/; start() serves it.
  NginxServer();
  ~NginxServer();  // stops the server, removes the directory
  NginxServer(const NginxServer&) = delete;
  NginxServer& operator=(const NginxServer&) = delete;

  const std::string& www() const noexcept { return www_; }
  // Writes www()/relative (directories made as needed).
  void write_file(const std::string& relative, const std::string& bytes) const;

  // Starts nginx and returns once it accepts connections (a connect() poll
  // with a 10 s deadline). Throws std::runtime_error with nginx's error log.
  void start();
  // SIGTERM (nginx's fast shutdown: open connections are closed) and waits.
  void stop();
  // stop(), then start() on the same port: clients' URLs stay valid.
  void restart();

  uint16_t port() const noexcept { return port_; }
  std::string url(const std::string& path) const;  // path starts with '/'

  // Before start(): also serve the same locations over TLS, on a second
  // port, with a self-signed certificate for 127.0.0.1 made by the openssl
  // command. Returns the certificate's PEM path (a client's CA file), or ""
  // where no openssl command is installed. Throws std::runtime_error when
  // openssl fails.
  std::string enable_tls();
  std::string https_url(const std::string& path) const;  // after enable_tls()
  // How many requests for `path` the access log holds, counting every
  // request answered so far: nginx's only worker writes a request's log
  // line after sending its response, so a client can be done before the
  // line is; both first make a round trip of their own (sync_log()).
  int requests_logged(const std::string& path) const;
  // The statuses of those requests, in log order (200, 206, ...).
  std::vector<int> statuses_logged(const std::string& path) const;
  // The connections they came on (nginx's serial numbers), in log order.
  std::vector<uint64_t> connections_logged(const std::string& path) const;
  // A request on a new connection, answered (with a 404) only after the
  // worker has logged every request it answered before. Does nothing while
  // the server is stopped.
  void sync_log() const;

 private:
  void start_on(uint16_t port);  // 0: a free one
  // The access log's lines for GETs of `path`, each from its request line on.
  std::vector<std::string> requests_in_log(const std::string& path) const;

  std::string dir_, www_;
  uint16_t port_ = 0;
  uint16_t tls_port_ = 0;  // 0: no TLS
  pid_t pid_ = -1;
};

// A server that hung: a TCP listener on a free 127.0.0.1 port that never
// accepts. The kernel completes each connection from its backlog and keeps
// what the client sends; no byte ever comes back.
class SilentServer {
 public:
  SilentServer();  // throws std::runtime_error
  ~SilentServer();  // closes the listener
  SilentServer(const SilentServer&) = delete;
  SilentServer& operator=(const SilentServer&) = delete;
  std::string url(const std::string& path) const;  // path starts with '/'

 private:
  int fd_ = -1;
  uint16_t port_ = 0;
};

}  // namespace conveyor::test
