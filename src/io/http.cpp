// http_get (conveyor/nodes/http.h): GETs on libcurl's multi interface,
// driven on the thread that advances the node.
//
// The window. Items are numbered as they are taken from upstream (seq);
// item s lives in slot s % max_in_flight from its admission until it is
// handed out. head_ is the next seq to hand out, tail_ the next to admit:
// tail_ - head_ <= max_in_flight (admission stops when the ring is full), so
// a slot is never reused while it holds an item, and memory is bounded by
// max_in_flight objects of at most max_bytes each. Order is restored in this
// one place: only the slot at head_ is ever handed out.
//
// A slot's states: idle -> running (in the multi handle) -> done (bytes or
// an error), or running -> waiting (a retry's backoff) -> running. Every
// field of the node and of its slots is owned by the thread advancing the
// node; libcurl calls write_body only from inside curl_multi_perform on that
// same thread.
#include "conveyor/nodes/http.h"

#include <curl/curl.h>

#include <algorithm>
#include <cctype>
#include <exception>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>

#include "conveyor/nodes/stage.h"
#include "curl_common.h"

namespace conveyor::nodes {
namespace {

using SteadyClock = std::chrono::steady_clock;

using io::detail::init_curl;
using io::detail::retryable;

struct Transfer {
  enum class State { idle, running, waiting, done };
  State state = State::idle;
  CURL* easy = nullptr;  // created at the slot's first use, reused by every item after
  std::string url;
  // A ranged item: its first byte and length (none: to the object's end).
  bool ranged = false;
  uint64_t offset = 0;
  std::optional<uint64_t> length;
  // A server that ignores Range answers 200 with the whole object: write_body
  // drops its first `skip_left` bytes and stops once `length` are kept
  // (`enough`: the transfer was stopped on purpose).
  uint64_t skip_left = 0;
  bool enough = false;
  // A ranged item's 206: its Content-Range, and whether it answers the
  // range asked for (read_header).
  std::string content_range;
  bool range_answered = false;
  uint64_t range_bytes = 0;  // what that Content-Range promises of the item: a shorter body is cut short
  int attempts = 0;
  // Garbage for a status line on a kept connection is tried again once on a
  // new one (finish()).
  bool fresh_connect = false;
  bool retried_fresh = false;
  SteadyClock::time_point retry_at;
  std::vector<uint8_t> body;
  uint64_t max_bytes = 0;
  bool too_big = false;      // write_body refused more bytes than max_bytes
  bool error_status = false;  // write_body stopped an error status's body
  uint64_t redirect_bytes = 0;  // of a 3xx's own body, which libcurl hands on when it does not follow it
  int64_t declared = -1;     // a 2xx response's Content-Length when over max_bytes (read_header)
  std::exception_ptr error;  // done with an error
  bool own_error = false;    // this node's (skippable), not upstream's
  char error_text[CURL_ERROR_SIZE] = {};
};

// A ranged item answered with the whole object (a server without Range
// support): keeps bytes [offset, offset + length) of it, stopping the
// transfer once they are in (returning less than given).
size_t keep_slice(Transfer& transfer, const char* data, size_t bytes) {
  const size_t skipped = static_cast<size_t>(std::min<uint64_t>(bytes, transfer.skip_left));
  transfer.skip_left -= skipped;
  size_t keep = bytes - skipped;
  bool enough = false;
  if (transfer.length && keep >= *transfer.length - transfer.body.size()) {
    keep = static_cast<size_t>(*transfer.length - transfer.body.size());
    enough = true;
  }
  if (keep > transfer.max_bytes - transfer.body.size()) {  // before `enough`: finish() reports it
    transfer.too_big = true;
    return 0;
  }
  transfer.enough = enough;
  transfer.body.insert(transfer.body.end(), data + skipped, data + skipped + keep);
  return transfer.enough ? 0 : bytes;
}

// CURLOPT_WRITEFUNCTION. Keeps a 2xx body up to max_bytes; a longer one
// aborts the transfer (returning less than given is CURLE_WRITE_ERROR). An
// error status (4xx, 5xx) aborts at its body's first bytes: only the status
// is reported, and a server's gigabyte 404 page is not read through.
size_t write_body(char* data, size_t size, size_t count, void* user) {
  Transfer& transfer = *static_cast<Transfer*>(user);
  const size_t bytes = size * count;
  long status = 0;
  curl_easy_getinfo(transfer.easy, CURLINFO_RESPONSE_CODE, &status);
  if (status >= 400) {
    transfer.error_status = true;
    return 0;
  }
  if (status >= 300) {
    // Not kept; stopped past max_bytes (finish() names the status).
    transfer.redirect_bytes += bytes;
    if (transfer.redirect_bytes <= transfer.max_bytes) return bytes;
    transfer.error_status = true;
    return 0;
  }
  if (!transfer.ranged && status == 206) return 0;  // part of the object, not asked for: finish() says so
  if (transfer.ranged && status != 206) return keep_slice(transfer, data, bytes);
  if (bytes > transfer.max_bytes - transfer.body.size()) {  // body.size() <= max_bytes always
    transfer.too_big = true;
    return 0;
  }
  if (transfer.body.empty()) {
    curl_off_t declared = -1;  // -1: no Content-Length
    curl_easy_getinfo(transfer.easy, CURLINFO_CONTENT_LENGTH_DOWNLOAD_T, &declared);
    if (declared > 0 && static_cast<uint64_t>(declared) <= transfer.max_bytes) {
      transfer.body.reserve(static_cast<size_t>(declared));
    }
  }
  transfer.body.insert(transfer.body.end(), data, data + bytes);
  return bytes;
}

// A header's value when its name is `name` (lower case, with the colon).
std::optional<std::string_view> header_value(const char* data, size_t bytes, std::string_view name) {
  if (bytes <= name.size()) return std::nullopt;
  for (size_t i = 0; i < name.size(); ++i) {
    if (std::tolower(static_cast<unsigned char>(data[i])) != name[i]) return std::nullopt;
  }
  size_t i = name.size();
  while (i < bytes && (data[i] == ' ' || data[i] == '\t')) ++i;
  return std::string_view(data + i, bytes - i);
}

// "bytes FIRST-LAST/TOTAL" (TOTAL may be '*'): FIRST is the item's offset and
// LAST reaches the range's end, or the object's.
bool answers_range(const Transfer& transfer, std::string_view range) {
  const std::optional<io::detail::ContentRange> answered = io::detail::parse_content_range(range);
  if (!answered || answered->first != transfer.offset) return false;
  uint64_t wanted_end = transfer.length ? transfer.offset + *transfer.length : std::numeric_limits<uint64_t>::max();
  if (answered->total) wanted_end = std::min(wanted_end, *answered->total);
  return answered->last + 1 >= wanted_end || (!answered->total && !transfer.length);
}

// CURLOPT_HEADERFUNCTION. A 2xx response whose Content-Length exceeds
// max_bytes stops here, before its body.
// A ranged item's 206 must answer the range asked for ("Content-Range:
// bytes 100-199/1000"): from its offset, to its end or the object's; one
// that does not stops here (finish() names what it answered).
size_t read_header(char* data, size_t size, size_t count, void* user) {
  Transfer& transfer = *static_cast<Transfer*>(user);
  const size_t bytes = size * count;
  long status = 0;
  curl_easy_getinfo(transfer.easy, CURLINFO_RESPONSE_CODE, &status);
  if (status < 200 || status >= 300) return bytes;
  if (!transfer.ranged && status == 206) {  // kept for finish()'s message
    if (const std::optional<std::string_view> range = header_value(data, bytes, "content-range:")) {
      std::string_view text = *range;
      while (!text.empty() && (text.back() == '\r' || text.back() == '\n' || text.back() == ' ')) text.remove_suffix(1);
      transfer.content_range.assign(text);
    }
    return bytes;
  }
  if (transfer.ranged && status == 206) {
    if (const std::optional<std::string_view> range = header_value(data, bytes, "content-range:")) {
      std::string_view text = *range;
      while (!text.empty() && (text.back() == '\r' || text.back() == '\n' || text.back() == ' ')) text.remove_suffix(1);
      transfer.content_range.assign(text);
      if (!answers_range(transfer, text)) return 0;  // CURLE_WRITE_ERROR
      transfer.range_answered = true;
      const io::detail::ContentRange answered = *io::detail::parse_content_range(text);  // answers_range parsed it
      transfer.range_bytes = answered.last - answered.first + 1;
      if (transfer.length) transfer.range_bytes = std::min(transfer.range_bytes, *transfer.length);
    }
  }
  // A whole object (200) for a ranged item is cut by keep_slice: its length is not the item's.
  if (transfer.ranged && status != 206) return bytes;
  const std::optional<std::string_view> value = header_value(data, bytes, "content-length:");
  if (!value) return bytes;
  const std::optional<uint64_t> length = io::detail::leading_number(*value);  // none: absurd, libcurl refuses it
  if (length && *length > transfer.max_bytes) {
    transfer.declared = static_cast<int64_t>(std::min<uint64_t>(*length, std::numeric_limits<int64_t>::max()));
    return 0;  // CURLE_WRITE_ERROR
  }
  return bytes;
}

// What an item asks for: a URL (the whole object) or an HttpRange.
HttpRange request_of(std::string&& url) { return HttpRange{std::move(url), 0, std::nullopt}; }
HttpRange request_of(HttpRange&& range) { return std::move(range); }
bool is_ranged(const std::string&) { return false; }
bool is_ranged(const HttpRange&) { return true; }

// "bytes 100-199" / "bytes 100-", for errors.
std::string range_text(const Transfer& transfer) {
  std::string text = "bytes " + std::to_string(transfer.offset) + "-";
  if (transfer.length) text += std::to_string(transfer.offset + *transfer.length - 1);
  return text;
}

template <class Input>
class HttpGet final : public Stage<Input, HttpObject> {
  using Stage<Input, HttpObject>::pull;
  using Stage<Input, HttpObject>::upstream_;
  using Stage<Input, HttpObject>::meter_;
  using Stage<Input, HttpObject>::position_;
  using Stage<Input, HttpObject>::counted;

 public:
  HttpGet(NodePtr<Input> upstream, HttpOptions options)
      : Stage<Input, HttpObject>(std::move(upstream)),
        options_(options),
        capacity_(static_cast<uint64_t>(options.max_in_flight)),
        slots_(std::make_unique<Transfer[]>(static_cast<size_t>(options.max_in_flight))) {}

  ~HttpGet() override {
    abandon();
    for (uint64_t i = 0; i < capacity_; ++i) {
      if (slots_[i].easy) curl_easy_cleanup(slots_[i].easy);
    }
    if (multi_) curl_multi_cleanup(multi_);
  }

  std::optional<HttpObject> produce() override {
    std::optional<HttpObject> out;
    while (true) {
      fill(/*blocking=*/true);
      if (head_ == tail_) return std::nullopt;
      if (slot(head_).state == Transfer::State::done) {
        if (take(out)) return out;
        continue;  // skipped
      }
      drive(/*wait=*/true);
    }
  }

  Poll try_next(std::optional<HttpObject>& out) override { return counted(poll(out)); }

  std::string name() const override {
    return "http_get(max_in_flight=" + std::to_string(capacity_) +
           (options_.on_error == OnError::skip ? ", on_error=skip" : "") + ")";
  }

  // One object a URL, not requested (a failed GET was an output too). A
  // skipped GET is no output: those are requested to be counted out. A
  // resume skips right after the reset, whose abandon() emptied the window;
  // should items be admitted, they are the next outputs: pulled and dropped.
  uint64_t skip(uint64_t count, bool clean) override {
    if (!clean || options_.on_error == OnError::skip || head_ != tail_) {
      return Stage<Input, HttpObject>::skip(count, clean);
    }
    return this->skip_upstream(count, clean);
  }

 protected:
  void stop_pass() override { abandon(); }
  void start_pass() override {
    upstream_done_ = false;
    takes_.clear();
    in_flight_sum_.clear();
  }
  void add_own_metrics(NodeMetrics& metrics) const override {
    metrics.window = static_cast<size_t>(capacity_);
    const uint64_t takes = takes_.get();
    metrics.mean_in_flight = takes ? static_cast<double>(in_flight_sum_.get()) / static_cast<double>(takes) : 0;
  }

 private:
  Transfer& slot(uint64_t seq) noexcept { return slots_[seq % capacity_]; }

  Poll poll(std::optional<HttpObject>& out) {
    while (true) {
      fill(/*blocking=*/false);
      if (head_ == tail_) return upstream_done_ ? Poll::end : Poll::pending;
      if (slot(head_).state != Transfer::State::done) {
        drive(/*wait=*/false);
        if (slot(head_).state != Transfer::State::done) return Poll::pending;
      }
      if (take(out)) return Poll::ready;
    }
  }

  // Admits upstream items until the window is full or upstream has none
  // (now, when not blocking). An upstream error takes a slot of its own, so
  // that it is thrown at its place.
  void fill(bool blocking) {
    while (!upstream_done_ && tail_ - head_ < capacity_) {
      std::optional<Input> item;
      try {
        if (blocking) {
          item = pull();
        } else {
          const Poll poll = upstream_->try_next(item);
          if (poll == Poll::pending) return;
          if (poll == Poll::ready) {
            meter_.in.add(1);
            ++position_;
          }
        }
      } catch (...) {
        Transfer& transfer = slot(tail_++);
        transfer.state = Transfer::State::done;
        transfer.error = std::current_exception();
        transfer.own_error = false;
        continue;
      }
      if (!item) {
        upstream_done_ = true;
        return;
      }
      admit(std::move(*item));
    }
  }

  void admit(Input&& item) {
    Transfer& transfer = slot(tail_++);
    transfer.ranged = is_ranged(item);
    HttpRange request = request_of(std::move(item));
    transfer.url = std::move(request.url);
    transfer.offset = request.offset;
    transfer.length = request.length;
    transfer.attempts = 0;
    transfer.fresh_connect = transfer.retried_fresh = false;
    transfer.error = nullptr;
    transfer.own_error = true;
    try {
      if (transfer.length == uint64_t{0}) {  // no bytes to ask for (HTTP has no empty range)
        transfer.body.clear();
        transfer.state = Transfer::State::done;
        return;
      }
      if (transfer.length && *transfer.length > std::numeric_limits<uint64_t>::max() - transfer.offset) {
        throw DataError("http_get: the range " + range_text(transfer) + " ends past 2^64", transfer.url);
      }
      if (!transfer.easy) configure(transfer);
      if (curl_easy_setopt(transfer.easy, CURLOPT_URL, transfer.url.c_str()) != CURLE_OK) {
        throw DataError("http_get: libcurl refused the URL", transfer.url);
      }
      // Set or cleared per item: the slot's handle serves every item after.
      const std::string range = transfer.ranged ? range_text(transfer).substr(6) : std::string();
      // No CURLOPT_MAXFILESIZE: libcurl applies it to a redirect's own page
      // too. read_header refuses a 2xx Content-Length over max_bytes, and
      // write_body bounds what is kept.
      if (curl_easy_setopt(transfer.easy, CURLOPT_RANGE, transfer.ranged ? range.c_str() : nullptr) != CURLE_OK) {
        throw DataError("http_get: libcurl refused the range " + range_text(transfer), transfer.url);
      }
      start(transfer);
    } catch (...) {
      transfer.state = Transfer::State::done;
      transfer.error = std::current_exception();
    }
  }

  // The options every item of the slot shares.
  void configure(Transfer& transfer) {
    CURL* easy = curl_easy_init();
    if (!easy) throw DataError("http_get: curl_easy_init failed (out of memory)", transfer.url);
    transfer.easy = easy;
    transfer.max_bytes = options_.max_bytes;
    const bool ok = io::detail::set_transfer_options(easy, options_, "conveyor-http_get") &&
                    curl_easy_setopt(easy, CURLOPT_WRITEFUNCTION, &write_body) == CURLE_OK &&
                    curl_easy_setopt(easy, CURLOPT_WRITEDATA, &transfer) == CURLE_OK &&
                    curl_easy_setopt(easy, CURLOPT_HEADERFUNCTION, &read_header) == CURLE_OK &&
                    curl_easy_setopt(easy, CURLOPT_HEADERDATA, &transfer) == CURLE_OK &&
                    curl_easy_setopt(easy, CURLOPT_PRIVATE, &transfer) == CURLE_OK &&
                    curl_easy_setopt(easy, CURLOPT_ERRORBUFFER, transfer.error_text) == CURLE_OK;
    if (!ok) throw DataError("http_get: libcurl refused an option (out of memory?)", transfer.url);
  }


  // One attempt: into the multi handle; curl_multi_perform starts it.
  void start(Transfer& transfer) {
    transfer.body.clear();
    transfer.too_big = false;
    transfer.error_status = false;
    transfer.redirect_bytes = 0;
    transfer.declared = -1;
    transfer.skip_left = transfer.ranged ? transfer.offset : 0;
    transfer.enough = false;
    transfer.content_range.clear();
    transfer.range_answered = false;
    transfer.range_bytes = 0;
    transfer.error_text[0] = '\0';
    ++transfer.attempts;
    // Set or cleared per attempt: the slot's handle serves every item after.
    if (curl_easy_setopt(transfer.easy, CURLOPT_FRESH_CONNECT, std::exchange(transfer.fresh_connect, false) ? 1L : 0L) !=
        CURLE_OK) {
      throw DataError("http_get: libcurl refused an option (out of memory?)", transfer.url);
    }
    const CURLMcode code = curl_multi_add_handle(multi(), transfer.easy);
    if (code != CURLM_OK) {
      throw DataError(std::string("http_get: curl_multi_add_handle: ") + curl_multi_strerror(code), transfer.url);
    }
    transfer.state = Transfer::State::running;
  }

  CURLM* multi() {
    if (!multi_) {  // lazily: nothing is opened before the first pass asks
      init_curl();
      multi_ = curl_multi_init();
      if (!multi_) throw Error("http_get: curl_multi_init failed (out of memory)");
      // The connection cache: one per transfer in flight, kept across items and passes.
      curl_multi_setopt(multi_, CURLMOPT_MAXCONNECTS, static_cast<long>(capacity_));
    }
    return multi_;
  }

  // Starts retries that are due, advances every transfer without waiting,
  // collects the finished ones; with `wait`, then waits (curl_multi_poll) for
  // activity, curl's next timeout or the next retry, whichever comes first.
  void drive(bool wait) {
    if (waiting_ > 0) start_due_retries();
    int running = 0;
    const CURLMcode code = curl_multi_perform(multi(), &running);
    if (code != CURLM_OK) throw Error(std::string("http_get: curl_multi_perform: ") + curl_multi_strerror(code));
    harvest();
    if (!wait || slot(head_).state == Transfer::State::done) return;
    int timeout_ms = 1000;
    if (waiting_ > 0) {
      const auto now = SteadyClock::now();
      for (uint64_t seq = head_; seq != tail_; ++seq) {
        const Transfer& transfer = slot(seq);
        if (transfer.state != Transfer::State::waiting) continue;
        const auto until = std::chrono::ceil<std::chrono::milliseconds>(transfer.retry_at - now).count();
        timeout_ms = std::min<int>(timeout_ms, static_cast<int>(std::max<int64_t>(0, until)));
      }
    }
    if (timeout_ms > 0) curl_multi_poll(multi_, nullptr, 0, timeout_ms, nullptr);
  }

  void start_due_retries() {
    const auto now = SteadyClock::now();
    for (uint64_t seq = head_; seq != tail_; ++seq) {
      Transfer& transfer = slot(seq);
      if (transfer.state != Transfer::State::waiting || transfer.retry_at > now) continue;
      --waiting_;
      try {
        start(transfer);
      } catch (...) {
        transfer.state = Transfer::State::done;
        transfer.error = std::current_exception();
      }
    }
  }

  void harvest() {
    int left = 0;
    while (CURLMsg* message = curl_multi_info_read(multi_, &left)) {
      if (message->msg != CURLMSG_DONE) continue;
      char* pointer = nullptr;  // CURLOPT_PRIVATE: the slot
      curl_easy_getinfo(message->easy_handle, CURLINFO_PRIVATE, &pointer);
      Transfer* transfer = reinterpret_cast<Transfer*>(pointer);
      const CURLcode result = message->data.result;  // read before the handle is removed
      curl_multi_remove_handle(multi_, message->easy_handle);
      finish(*transfer, result);
    }
  }

  // An attempt ended: the object, a retry after backoff, or the error.
  void finish(Transfer& transfer, CURLcode result) {
    long status = 0;
    curl_easy_getinfo(transfer.easy, CURLINFO_RESPONSE_CODE, &status);
    if (!transfer.retried_fresh && io::detail::garbled_on_reuse(transfer.easy, result)) {
      // Most likely the bytes an earlier response sent past its length, not
      // this response: once, at once, on a new connection, uncounted.
      transfer.retried_fresh = transfer.fresh_connect = true;
      --transfer.attempts;
      transfer.body = {};
      transfer.state = Transfer::State::waiting;
      transfer.retry_at = SteadyClock::now();
      ++waiting_;
      return;
    }
    std::string why;
    bool retry = false;
    const bool whole = result == CURLE_OK || (result == CURLE_WRITE_ERROR && transfer.enough && !transfer.too_big);
    // More than the range asked for, or than its 206's Content-Range says
    // (an open range: no length of its own).
    const bool over_length = (transfer.length && transfer.body.size() > *transfer.length) ||
                             (transfer.ranged && status == 206 && transfer.range_answered &&
                              transfer.body.size() > transfer.range_bytes);
    // A 206 where the whole object was asked for: a part handed out as the
    // whole. Not retried: the server answers the same again.
    const bool unasked_part = !transfer.ranged && status == 206;
    // A whole object cut to the range must reach into it (as a 206 does: a
    // range starting at or past the end is a 416).
    const bool before_range = transfer.ranged && status != 206 && transfer.body.empty();
    const bool unanswered = transfer.ranged && status == 206 && !transfer.range_answered;
    // A 206 whose body (a Content-Length, or chunks, of its own) stops
    // short of its Content-Range.
    const bool short_range = transfer.ranged && status == 206 && transfer.range_answered &&
                             transfer.body.size() < transfer.range_bytes;
    if (whole && status >= 200 && status < 300 && !over_length && !before_range && !unanswered && !short_range &&
        !unasked_part) {
      transfer.state = Transfer::State::done;
      return;
    }
    if (unasked_part && (whole || result == CURLE_WRITE_ERROR)) {
      why = "the server answered a request for the whole object with 206 Partial Content (Content-Range '" +
            transfer.content_range + "')";
    } else if (whole && unanswered) {
      why = "the server's 206 for the range " + range_text(transfer) + " has no Content-Range";
    } else if (whole && over_length) {
      why = "the server sent " + std::to_string(transfer.body.size()) + " bytes for the range " + range_text(transfer);
      if (!transfer.content_range.empty()) why += " (Content-Range '" + transfer.content_range + "')";
    } else if (whole && short_range) {
      why = "the server's 206 for the range " + range_text(transfer) + " (Content-Range '" + transfer.content_range +
            "') ended after " + std::to_string(transfer.body.size()) + " of its " +
            std::to_string(transfer.range_bytes) + " bytes";
      retry = true;
    } else if (whole && status >= 200 && status < 300) {
      // A server without Range support sent the whole object, which ends
      // before the range's first byte.
      why = "the object ends at byte " + std::to_string(transfer.offset - transfer.skip_left) + ", before the range " +
            range_text(transfer);
    } else if (transfer.ranged && status == 206 && !transfer.content_range.empty() && !transfer.range_answered) {
      why = "the server answered the range " + range_text(transfer) + " with Content-Range '" +
            transfer.content_range + "'";
    } else if (result == CURLE_OK || (result == CURLE_WRITE_ERROR && transfer.error_status)) {
      // An error status: its body stopped at its first bytes.
      why = "HTTP " + std::to_string(status);
      retry = status >= 500;
    } else if (transfer.too_big) {
      why = "the object holds more than http_get's max_bytes " + std::to_string(options_.max_bytes) +
            ": the transfer was stopped after " + std::to_string(transfer.body.size()) + " bytes";
    } else if (transfer.declared >= 0) {
      why = "the server declares " + std::to_string(transfer.declared) +
            " bytes (Content-Length), more than http_get's max_bytes " + std::to_string(options_.max_bytes);
    } else {
      why = curl_easy_strerror(result);
      if (transfer.error_text[0] != '\0') why += std::string(" (") + transfer.error_text + ")";
      if (status != 0) why += ", HTTP " + std::to_string(status);
      retry = retryable(result);
    }
    transfer.body = {};
    if (retry && transfer.attempts <= options_.retries) {
      transfer.state = Transfer::State::waiting;
      transfer.retry_at = SteadyClock::now() + backoff(transfer.attempts);
      ++waiting_;
      return;
    }
    if (transfer.ranged && why.find(" range ") == std::string::npos) why += " (" + range_text(transfer) + ")";
    if (transfer.attempts > 1) why += " (after " + std::to_string(transfer.attempts) + " attempts)";
    transfer.error = std::make_exception_ptr(DataError("http_get: " + why, transfer.url));
    transfer.state = Transfer::State::done;
  }

  std::chrono::milliseconds backoff(int retry) const noexcept { return io::detail::backoff(options_, retry); }

  // Hands out the item at head_ (done). False when it was skipped.
  bool take(std::optional<HttpObject>& out) {
    takes_.add(1);
    in_flight_sum_.add(tail_ - head_);
    Transfer& transfer = slot(head_++);
    transfer.state = Transfer::State::idle;
    if (std::exception_ptr error = std::exchange(transfer.error, nullptr)) {
      transfer.body = {};
      if (transfer.own_error && options_.on_error == OnError::skip) {
        meter_.skipped.add(1);
        return false;
      }
      std::rethrow_exception(error);
    }
    out.emplace(HttpObject{std::exchange(transfer.url, {}), std::exchange(transfer.body, {}), transfer.offset});
    return true;
  }

  // Drops every item in the window, stopping its transfer (its connection
  // is closed, the others stay cached for the next pass).
  void abandon() noexcept {
    for (uint64_t seq = head_; seq != tail_; ++seq) {
      Transfer& transfer = slot(seq);
      if (transfer.state == Transfer::State::running) curl_multi_remove_handle(multi_, transfer.easy);
      transfer.state = Transfer::State::idle;
      transfer.error = nullptr;
      transfer.body = {};
    }
    head_ = tail_ = 0;
    waiting_ = 0;
  }

  HttpOptions options_;
  uint64_t capacity_;                  // options_.max_in_flight: the window
  std::unique_ptr<Transfer[]> slots_;  // never moves: libcurl holds pointers into it
  CURLM* multi_ = nullptr;
  uint64_t head_ = 0;     // the next seq to hand out
  uint64_t tail_ = 0;     // the next seq to admit; tail_ - head_ <= capacity_
  uint64_t waiting_ = 0;  // slots in State::waiting
  bool upstream_done_ = false;
  detail::Counter<uint64_t> takes_;          // metrics: items handed out (or skipped)
  detail::Counter<uint64_t> in_flight_sum_;  // the window's fill at each take, summed
};

}  // namespace

Pipeline<HttpObject> HttpGetAdaptor::operator()(Pipeline<std::string>&& upstream) const {
  io::detail::validate(options, "http_get");  // options is public: checked again where it is used
  return Pipeline<HttpObject>(std::make_unique<HttpGet<std::string>>(std::move(upstream).release(), options));
}

Pipeline<HttpObject> HttpGetAdaptor::operator()(Pipeline<HttpRange>&& upstream) const {
  io::detail::validate(options, "http_get");
  return Pipeline<HttpObject>(std::make_unique<HttpGet<HttpRange>>(std::move(upstream).release(), options));
}

HttpGetAdaptor http_get(HttpOptions options) {
  io::detail::validate(options, "http_get");
  return HttpGetAdaptor{options};
}

}  // namespace conveyor::nodes
