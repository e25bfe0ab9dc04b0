// What conveyor::io's libcurl users share (src/io/curl_common.h).
#include "curl_common.h"

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <limits>
#include <string>
#include <system_error>

#include <sys/socket.h>
#include <unistd.h>

#include "conveyor/errors.h"

namespace conveyor::io::detail {

void init_curl() {
  // libcurl asks for it before any other thread uses libcurl; a magic static
  // makes concurrent first calls wait for the one that runs it.
  static const CURLcode code = curl_global_init(CURL_GLOBAL_DEFAULT);
  if (code != CURLE_OK) throw Error(std::string("conveyor::io: curl_global_init failed: ") + curl_easy_strerror(code));
}

bool retryable(CURLcode code) noexcept {
  switch (code) {
    case CURLE_OPERATION_TIMEDOUT:  // connect, total or stall timeout
    case CURLE_COULDNT_CONNECT:     // refused: a server restarting
    case CURLE_RECV_ERROR:          // connection reset
    case CURLE_SEND_ERROR:
    case CURLE_GOT_NOTHING:         // closed without a response
    case CURLE_PARTIAL_FILE:        // closed mid-body
    case CURLE_SSL_CONNECT_ERROR:   // reset during the handshake
    case CURLE_HTTP2:
    case CURLE_HTTP2_STREAM:
      return true;
    default:
      return false;
  }
}

bool garbled_on_reuse(CURL* easy, CURLcode code) noexcept {
  if (code != CURLE_UNSUPPORTED_PROTOCOL && code != CURLE_WEIRD_SERVER_REPLY) return false;
  long status = 0, connects = 0;  // status 0: no status line (a refused redirect has its 3xx)
  return curl_easy_getinfo(easy, CURLINFO_RESPONSE_CODE, &status) == CURLE_OK && status == 0 &&
         curl_easy_getinfo(easy, CURLINFO_NUM_CONNECTS, &connects) == CURLE_OK && connects == 0;
}

std::chrono::milliseconds backoff(const nodes::HttpOptions& options, int retry) noexcept {
  // Doubled in integers (no pow), saturating.
  std::chrono::milliseconds wait = options.backoff;
  for (int k = 1; k < retry && wait < options.max_backoff; ++k) wait *= 2;
  return std::min(wait, options.max_backoff);
}

void validate(const nodes::HttpOptions& options, const std::string& who) {
  auto fail = [&](const std::string& what) { throw ValueError(who + ": " + what); };
  if (options.max_in_flight < 1 || options.max_in_flight > 65536) {
    fail("max_in_flight should be in [1, 65536], but got " + std::to_string(options.max_in_flight));
  }
  if (options.retries < 0 || options.retries > 100) {
    fail("retries should be in [0, 100], but got " + std::to_string(options.retries));
  }
  constexpr int64_t kMaxMs = std::numeric_limits<int32_t>::max();  // what a long holds everywhere
  auto check_ms = [&](const char* name, std::chrono::milliseconds value, bool zero_ok) {
    if (value.count() < (zero_ok ? 0 : 1) || value.count() > kMaxMs) {
      fail(std::string(name) + " should be in [" + (zero_ok ? "0" : "1") + ", " + std::to_string(kMaxMs) +
           "] ms, but got " + std::to_string(value.count()));
    }
  };
  check_ms("connect_timeout", options.connect_timeout, false);
  check_ms("total_timeout", options.total_timeout, true);
  if (options.stall_timeout.count() < 0 || options.stall_timeout.count() > 86400) {
    fail("stall_timeout should be in [0, 86400] s, but got " + std::to_string(options.stall_timeout.count()));
  }
  check_ms("backoff", options.backoff, true);
  check_ms("max_backoff", options.max_backoff, true);
  if (options.max_bytes == 0) fail("max_bytes should be at least 1");
  if (!options.ca_file.empty()) {
    std::error_code error;
    if (!std::filesystem::is_regular_file(options.ca_file, error) || ::access(options.ca_file.c_str(), R_OK) != 0) {
      fail("ca_file '" + options.ca_file + "' is not a readable file");
    }
  }
  if (options.receive_buffer > kMaxReceiveBuffer) {
    fail("receive_buffer should be in [0, " + std::to_string(kMaxReceiveBuffer) + "] bytes, but got " +
         std::to_string(options.receive_buffer));
  }
}

namespace {

// CURLOPT_SOCKOPTFUNCTION: on each new connection's socket, before it
// connects. The size travels in the callback's pointer, so no object has to
// outlive the transfer. A refusal (an unprivileged request above rmem_max is
// capped, not refused) leaves the kernel's default: a hint, not a failure.
int set_receive_buffer(void* bytes, curl_socket_t socket, curlsocktype purpose) {
  if (purpose == CURLSOCKTYPE_IPCXN) {
    const int size = static_cast<int>(reinterpret_cast<intptr_t>(bytes));
    (void)setsockopt(socket, SOL_SOCKET, SO_RCVBUF, &size, sizeof size);
  }
  return CURL_SOCKOPT_OK;
}

}  // namespace

std::optional<uint64_t> leading_number(std::string_view text) noexcept {
  uint64_t value = 0;
  size_t i = 0;
  for (; i < text.size() && text[i] >= '0' && text[i] <= '9'; ++i) {
    if (value > (std::numeric_limits<uint64_t>::max() - 9) / 10) return std::nullopt;
    value = value * 10 + static_cast<uint64_t>(text[i] - '0');
  }
  if (i == 0) return std::nullopt;
  return value;
}

std::optional<ContentRange> parse_content_range(std::string_view text) noexcept {
  if (!text.starts_with("bytes ")) return std::nullopt;
  text.remove_prefix(6);
  const size_t dash = text.find('-'), slash = text.find('/');
  if (dash == std::string_view::npos || slash == std::string_view::npos || slash < dash) return std::nullopt;
  const std::optional<uint64_t> first = leading_number(text.substr(0, dash));
  const std::optional<uint64_t> last = leading_number(text.substr(dash + 1, slash - dash - 1));
  if (!first || !last || *last < *first) return std::nullopt;
  return ContentRange{*first, *last, leading_number(text.substr(slash + 1))};
}

bool set_transfer_options(CURL* easy, const nodes::HttpOptions& options, const char* user_agent) noexcept {
  if (options.receive_buffer > 0) {
    if (curl_easy_setopt(easy, CURLOPT_SOCKOPTFUNCTION, &set_receive_buffer) != CURLE_OK ||
        curl_easy_setopt(easy, CURLOPT_SOCKOPTDATA,
                         reinterpret_cast<void*>(static_cast<intptr_t>(options.receive_buffer))) != CURLE_OK) {
      return false;
    }
  }
  bool ok = curl_easy_setopt(easy, CURLOPT_NOSIGNAL, 1L) == CURLE_OK &&
            curl_easy_setopt(easy, CURLOPT_CONNECTTIMEOUT_MS, static_cast<long>(options.connect_timeout.count())) ==
                CURLE_OK &&
            curl_easy_setopt(easy, CURLOPT_TIMEOUT_MS, static_cast<long>(options.total_timeout.count())) == CURLE_OK &&
            // Under 1 byte/s for stall_timeout: nothing came (0 turns the check off).
            curl_easy_setopt(easy, CURLOPT_LOW_SPEED_LIMIT, options.stall_timeout.count() > 0 ? 1L : 0L) == CURLE_OK &&
            curl_easy_setopt(easy, CURLOPT_LOW_SPEED_TIME, static_cast<long>(options.stall_timeout.count())) ==
                CURLE_OK &&
            curl_easy_setopt(easy, CURLOPT_FOLLOWLOCATION, 1L) == CURLE_OK &&
            curl_easy_setopt(easy, CURLOPT_MAXREDIRS, 10L) == CURLE_OK &&
            curl_easy_setopt(easy, CURLOPT_USERAGENT, user_agent) == CURLE_OK &&
            (options.ca_file.empty() ||
             // In place of the system's authorities: the bundle and the directory libcurl was built with.
             (curl_easy_setopt(easy, CURLOPT_CAINFO, options.ca_file.c_str()) == CURLE_OK &&
              curl_easy_setopt(easy, CURLOPT_CAPATH, nullptr) == CURLE_OK));
#if LIBCURL_VERSION_NUM >= 0x075500  // 7.85: the string form
  ok = ok && curl_easy_setopt(easy, CURLOPT_PROTOCOLS_STR, "http,https") == CURLE_OK &&
       curl_easy_setopt(easy, CURLOPT_REDIR_PROTOCOLS_STR, "http,https") == CURLE_OK;
#else
  ok = ok && curl_easy_setopt(easy, CURLOPT_PROTOCOLS, static_cast<long>(CURLPROTO_HTTP | CURLPROTO_HTTPS)) ==
                 CURLE_OK &&
       curl_easy_setopt(easy, CURLOPT_REDIR_PROTOCOLS, static_cast<long>(CURLPROTO_HTTP | CURLPROTO_HTTPS)) ==
           CURLE_OK;
#endif
  return ok;
}

}  // namespace conveyor::io::detail
