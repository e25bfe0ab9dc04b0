// src/io/curl_common.h: what conveyor::io's libcurl users share (internal):
// global initialisation, which failures are worth a retry, the backoff, and
// the options every transfer sets.
#pragma once

#include <curl/curl.h>

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "conveyor/nodes/http.h"

namespace conveyor::io::detail {

// curl_global_init once per process, before the first handle. Throws Error.
void init_curl();

// Transient failures: the next attempt may well succeed.
bool retryable(CURLcode code) noexcept;

// A transfer that found no HTTP where its response should begin (no status
// line: "Received HTTP/0.9", a weird reply) on a connection kept from an
// earlier one: most likely bytes that response sent past its length, worth
// one more attempt on a new connection (CURLOPT_FRESH_CONNECT).
bool garbled_on_reuse(CURL* easy, CURLcode code) noexcept;

// Before retry k (k = 1, 2, ...): min(backoff x 2^(k-1), max_backoff).
std::chrono::milliseconds backoff(const nodes::HttpOptions& options, int retry) noexcept;

// HttpOptions::receive_buffer's bound: what a setsockopt int holds once
// Linux has doubled it.
inline constexpr uint64_t kMaxReceiveBuffer = uint64_t{1} << 30;

// Throws ValueError naming `who` and the option out of range.
void validate(const nodes::HttpOptions& options, const std::string& who);

// Timeouts, http(s) only (redirects too), redirects followed, no signals,
// the user agent, the receive buffer of new connections, the CA file. False when libcurl refused one (out of memory).
bool set_transfer_options(CURL* easy, const nodes::HttpOptions& options, const char* user_agent) noexcept;

// The decimal number `text` starts with; none without a digit or past uint64_t.
std::optional<uint64_t> leading_number(std::string_view text) noexcept;

// A Content-Range header's value, "bytes FIRST-LAST/TOTAL" (TOTAL may be
// '*', unknown); none when it is not of that form or LAST < FIRST.
struct ContentRange {
  uint64_t first = 0;
  uint64_t last = 0;
  std::optional<uint64_t> total;
};
std::optional<ContentRange> parse_content_range(std::string_view text) noexcept;

}  // namespace conveyor::io::detail
