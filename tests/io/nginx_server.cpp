#include "nginx_server.h"

#include <arpa/inet.h>
#include <grp.h>
#include <netinet/in.h>
#include <poll.h>
#include <pwd.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <stdexcept>
#include <vector>

extern char** environ;

namespace conveyor::test {
namespace {

namespace fs = std::filesystem;

// A TCP socket bound to a free 127.0.0.1 port (bind to port 0), and the port.
int bound_loopback_socket(uint16_t& port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) throw std::runtime_error("socket() failed");
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t length = sizeof address;
  if (::bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof address) != 0 ||
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&address), &length) != 0) {
    ::close(fd);
    throw std::runtime_error("cannot bind a loopback port");
  }
  port = ntohs(address.sin_port);
  return fd;
}

// A port nothing listens on now: bound, read back, closed. Another process
// could take it before nginx does: start() retries then.
uint16_t free_port() {
  uint16_t port = 0;
  ::close(bound_loopback_socket(port));
  return port;
}

bool accepts(uint16_t port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return false;
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  address.sin_port = htons(port);
  const bool connected = ::connect(fd, reinterpret_cast<sockaddr*>(&address), sizeof address) == 0;
  ::close(fd);
  return connected;
}

std::string read_text(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

}  // namespace

bool NginxServer::required() {
  const char* value = std::getenv("CONVEYOR_REQUIRE_NGINX");
  return value != nullptr && std::string(value) == "1";
}

std::string NginxServer::binary() {
  for (const std::string& candidate : {std::string(CONVEYOR_NGINX), std::string("/usr/sbin/nginx")}) {
    if (!candidate.empty() && ::access(candidate.c_str(), X_OK) == 0) return candidate;
  }
  return "";
}

NginxServer::NginxServer() {
  std::string pattern = (fs::temp_directory_path() / "conveyor-io-XXXXXX").string();
  if (!::mkdtemp(pattern.data())) throw std::runtime_error("mkdtemp failed");
  dir_ = pattern;
  www_ = dir_ + "/www";
  fs::create_directories(www_);
  fs::create_directories(dir_ + "/tmp");
}

NginxServer::~NginxServer() {
  stop();
  std::error_code ignored;
  fs::remove_all(dir_, ignored);
}

void NginxServer::write_file(const std::string& relative, const std::string& bytes) const {
  const fs::path path = fs::path(www_) / relative;
  fs::create_directories(path.parent_path());
  std::ofstream out(path, std::ios::binary);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  if (!out) throw std::runtime_error("cannot write " + path.string());
}

void NginxServer::start() { start_on(0); }

void NginxServer::restart() {
  const uint16_t port = port_;
  stop();
  start_on(port);
}

void NginxServer::start_on(uint16_t fixed_port) {
  const std::string nginx = binary();
  if (nginx.empty()) throw std::runtime_error("nginx is not installed");
  write_file("empty-body", "");  // the body of /empty503/ and /empty404/
  std::string last_error;
  for (int attempt = 0; attempt < 5; ++attempt) {  // another process may take the free port first
    port_ = fixed_port != 0 ? fixed_port : free_port();
    if (tls_port_ != 0 && fixed_port == 0 && attempt > 0) tls_port_ = free_port();  // it may be the one taken
    std::ofstream conf(dir_ + "/nginx.conf");
    conf << "daemon off;\nmaster_process on;\nworker_processes 1;\n"
         << "pid " << dir_ << "/nginx.pid;\n"
         << "error_log " << dir_ << "/error.log warn;\n";
    if (::geteuid() == 0) {
      // As root the workers would switch to nobody, who cannot read a 0700
      // temporary directory: run them as the current user.
      const passwd* user = ::getpwuid(::geteuid());
      const group* group = user ? ::getgrgid(user->pw_gid) : nullptr;
      if (user && group) conf << "user " << user->pw_name << " " << group->gr_name << ";\n";
    }
    conf << "events { worker_connections 1024; }\n"
         << "http {\n"
         // combined, then the connection's serial number (connections_logged)
         << "  log_format conveyor '$remote_addr - $remote_user [$time_local] \"$request\" $status "
            "$body_bytes_sent \"$http_referer\" \"$http_user_agent\" connection=$connection';\n"
         << "  access_log " << dir_ << "/access.log conveyor;\n"
         << "  client_body_temp_path " << dir_ << "/tmp/body;\n"
         << "  proxy_temp_path " << dir_ << "/tmp/proxy;\n"
         << "  fastcgi_temp_path " << dir_ << "/tmp/fastcgi;\n"
         << "  uwsgi_temp_path " << dir_ << "/tmp/uwsgi;\n"
         << "  scgi_temp_path " << dir_ << "/tmp/scgi;\n"
         << "  default_type application/octet-stream;\n"
         << "  keepalive_requests 100000;\n"
         << "  server {\n"
         << "    listen 127.0.0.1:" << port_ << ";\n";
    if (tls_port_ != 0) {
      conf << "    listen 127.0.0.1:" << tls_port_ << " ssl;\n"
           << "    ssl_certificate " << dir_ << "/tls/cert.pem;\n"
           << "    ssl_certificate_key " << dir_ << "/tls/key.pem;\n";
    }
    conf
         << "    root " << www_ << ";\n"
         << "    location /error500/ { return 500; }\n"
         << "    location /reset/ { return 444; }\n"
         << "    location /slow/ { limit_rate 1k; }\n"
         << "    location /norange/ { max_ranges 0; }\n"
         // 206s that do not answer the range asked for: a wrong start, too few bytes, no Content-Range.
         << "    location /range-from-7/ { add_header Content-Range \"bytes 7-9/100\"; return 206 \"abc\"; }\n"
         << "    location /range-short/ { add_header Content-Range \"bytes 0-2/100\"; return 206 \"abc\"; }\n"
         << "    location /range-none/ { return 206 \"abc\"; }\n"
         << "    location /chunked/ { sub_filter 'no-such-text' 'x'; sub_filter_once off; sub_filter_types *; }\n"
         // (return's text cannot be empty: nginx sends its error page then)
         << "    location = /empty-body { internal; }\n"
         << "    location /empty503/ { error_page 503 /empty-body; return 503; }\n"
         << "    location /empty404/ { error_page 404 /empty-body; return 404; }\n"
         << "    location /resume-elsewhere/ {\n"
         << "      if ($http_range) { add_header Content-Range \"bytes 0-2/3\"; return 206 \"abc\"; }\n"
         << "      limit_rate 1k; sub_filter 'no-such-text' 'x'; sub_filter_once off; sub_filter_types *;\n"
         << "    }\n"
         << "  }\n"
         << "}\n";
    conf.close();
    if (!conf) throw std::runtime_error("cannot write " + dir_ + "/nginx.conf");

    const std::string prefix = dir_ + "/", config = dir_ + "/nginx.conf", error_log = dir_ + "/error.log";
    std::vector<std::string> args = {nginx, "-p", prefix, "-c", config, "-e", error_log};
    std::vector<char*> argv;
    for (std::string& arg : args) argv.push_back(arg.data());
    argv.push_back(nullptr);
    pid_t pid = -1;
    if (const int error = ::posix_spawn(&pid, nginx.c_str(), nullptr, nullptr, argv.data(), environ); error != 0) {
      throw std::runtime_error("cannot start " + nginx + ": errno " + std::to_string(error));
    }
    pid_ = pid;
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while (std::chrono::steady_clock::now() < deadline) {
      int status = 0;
      if (::waitpid(pid_, &status, WNOHANG) == pid_) {  // exited: a taken port, a bad configuration
        pid_ = -1;
        break;
      }
      if (accepts(port_)) return;
      ::poll(nullptr, 0, 5);  // the connect() poll's pace, not a race fix
    }
    last_error = read_text(error_log);
    if (pid_ > 0) {
      stop();
      break;  // running but not accepting within the deadline: no retry
    }
    if (fixed_port != 0) break;  // the port was asked for: no other
  }
  throw std::runtime_error("nginx did not start; its error log:\n" + last_error);
}

void NginxServer::stop() {
  if (pid_ <= 0) return;
  ::kill(pid_, SIGTERM);
  int status = 0;
  while (::waitpid(pid_, &status, 0) < 0 && errno == EINTR) {
  }
  pid_ = -1;
}

std::string NginxServer::url(const std::string& path) const {
  return "http://127.0.0.1:" + std::to_string(port_) + path;
}

std::string NginxServer::enable_tls() {
  if (std::system("command -v openssl > /dev/null 2>&1") != 0) return "";
  const std::string tls = dir_ + "/tls";
  fs::create_directories(tls);
  const std::string command = "openssl req -x509 -newkey rsa:2048 -nodes -days 2 -subj /CN=127.0.0.1 "
                              "-addext subjectAltName=IP:127.0.0.1 -keyout " + tls + "/key.pem -out " + tls +
                              "/cert.pem > " + tls + "/openssl.log 2>&1";
  if (std::system(command.c_str()) != 0) {
    throw std::runtime_error("openssl could not make a certificate: " + read_text(tls + "/openssl.log"));
  }
  tls_port_ = free_port();
  return tls + "/cert.pem";
}

std::string NginxServer::https_url(const std::string& path) const {
  return "https://127.0.0.1:" + std::to_string(tls_port_) + path;
}

void NginxServer::sync_log() const {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) throw std::runtime_error("socket() failed");
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  address.sin_port = htons(port_);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&address), sizeof address) != 0) {
    ::close(fd);
    return;  // stopped: nothing more will be answered or logged
  }
  const std::string request = "GET /conveyor-log-sync HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n";
  bool sent = ::send(fd, request.data(), request.size(), MSG_NOSIGNAL) == static_cast<ssize_t>(request.size());
  // Read to the end: nginx closes once it has answered.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  char buffer[4096];
  while (sent) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    pollfd readable{fd, POLLIN, 0};
    if (left.count() <= 0 || ::poll(&readable, 1, static_cast<int>(left.count())) <= 0) {
      ::close(fd);
      throw std::runtime_error("nginx did not answer the log sync request within 10 s");
    }
    if (::recv(fd, buffer, sizeof buffer, 0) <= 0) break;
  }
  ::close(fd);
}

std::vector<std::string> NginxServer::requests_in_log(const std::string& path) const {
  sync_log();
  const std::string log = read_text(dir_ + "/access.log");
  const std::string needle = "\"GET " + path + " ";
  std::vector<std::string> requests;  // each from its request line to the end of its log line
  for (size_t at = log.find(needle); at != std::string::npos; at = log.find(needle, at + 1)) {
    requests.push_back(log.substr(at, log.find('\n', at) - at));
  }
  return requests;
}

std::vector<int> NginxServer::statuses_logged(const std::string& path) const {
  std::vector<int> statuses;
  for (const std::string& request : requests_in_log(path)) {
    const size_t quote = request.find('"', 1);  // the request line's end, then " 206 "
    if (quote != std::string::npos) statuses.push_back(std::atoi(request.c_str() + quote + 2));
  }
  return statuses;
}

std::vector<uint64_t> NginxServer::connections_logged(const std::string& path) const {
  std::vector<uint64_t> connections;
  for (const std::string& request : requests_in_log(path)) {
    const size_t field = request.rfind(" connection=");
    if (field != std::string::npos) connections.push_back(std::strtoull(request.c_str() + field + 12, nullptr, 10));
  }
  return connections;
}

int NginxServer::requests_logged(const std::string& path) const {
  return static_cast<int>(requests_in_log(path).size());
}

SilentServer::SilentServer() {
  fd_ = bound_loopback_socket(port_);
  if (::listen(fd_, 16) != 0) {
    ::close(fd_);
    throw std::runtime_error("listen() failed on 127.0.0.1:" + std::to_string(port_));
  }
}

SilentServer::~SilentServer() { ::close(fd_); }

std::string SilentServer::url(const std::string& path) const {
  return "http://127.0.0.1:" + std::to_string(port_) + path;
}

}  // namespace conveyor::test
