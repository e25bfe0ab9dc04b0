// http_opener (conveyor/nodes/http.h): an HTTP(S) object as a ByteStream,
// read front to back on the reader's thread through a private multi handle.
//
// Memory: at most kStreamBuffer + kReceiveBytes bytes wait for the reader,
// in a buffer that stays with the pooled connection; read_in_place() lends
// them to the reader (untar) instead of copying them out. When kStreamBuffer are
// buffered the write callback pauses the transfer (CURL_WRITEFUNC_PAUSE:
// libcurl keeps the chunk and hands it again once unpaused), and read()
// unpauses it when the buffer has drained.
//
// Failures: a transfer that fails where a retry may help (timeouts, resets,
// refused connections, 5xx) starts again where it stopped, asking for
// `Range: bytes=received-`: a 206 goes on from there; a 200 (a server that
// ignores ranges) is read from the start, dropping what was already
// received. `retries` counts consecutive attempts without a new byte, so a
// long shard survives any number of separate interruptions. A final failure
// is a DataError naming the URL, and every later read() throws it again.
//
// A resume must read the same object: it carries If-Range with the first
// response's strong ETag (else its Last-Modified), and a response whose
// ETag, Last-Modified or length (Content-Range's total) differs is a
// DataError, never spliced onto the bytes already read. A 206 that stops
// short of the object's end is followed by a range for the rest.
#include <curl/curl.h>
#include <poll.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <exception>
#include <limits>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include "conveyor/data_error.h"
#include "conveyor/nodes/http.h"
#include "curl_common.h"

namespace conveyor::nodes {
namespace {

constexpr size_t kStreamBuffer = size_t{1} << 20;
// libcurl's receive buffer (CURLOPT_BUFFERSIZE): the most one write
// callback hands over. Larger than its 16 KiB default: fewer calls and recv()s.
constexpr size_t kReceiveBytes = size_t{256} << 10;
// A stream closed this close to its response's end reads the rest and drops
// it, so that its connection can serve the next request (~HttpStream).
constexpr uint64_t kDrainBytes = uint64_t{64} << 10;
constexpr std::chrono::milliseconds kDrainTime{10};

// A transfer's handles: the multi handle keeps the connection cache, so a
// pair handed back after a stream keeps its connection open for the next.
// The buffer goes with them: warm memory for the next stream.
struct Connection {
  CURLM* multi = nullptr;
  CURL* easy = nullptr;
  std::vector<uint8_t> buffer;
  // The HTTP/1 connection the last stream left open (none: unknown, HTTP/2,
  // or closed), checked before it is reused (ConnectionPool::take).
  curl_socket_t kept_socket = CURL_SOCKET_BAD;
};

// An idle HTTP/1 connection has nothing to say: a byte waiting on it (sent
// past a Content-Length by a server that miscounted) would be read as the
// start of the next response, under the next stream's URL ("Received
// HTTP/0.9"), or taken for it; EOF or a reset means it is gone. libcurl 7.x
// reuses it regardless (8.x refuses a connection with input pending too).
bool quiet(const Connection& connection) noexcept {
  if (connection.kept_socket == CURL_SOCKET_BAD) return true;
  pollfd socket{connection.kept_socket, POLLIN, 0};
  return ::poll(&socket, 1, 0) == 0;
}

// The pairs an opener's streams share, taken and given back under a mutex
// (streams are opened on the loader's workers).
class ConnectionPool {
 public:
  ~ConnectionPool() {
    for (Connection& connection : idle_) {
      curl_easy_cleanup(connection.easy);
      curl_multi_cleanup(connection.multi);
    }
  }
  Connection take(const std::string& url) {
    while (true) {
      std::optional<Connection> idle;
      {
        std::lock_guard lock(mutex_);
        if (idle_.empty()) break;
        idle = std::move(idle_.back());
        idle_.pop_back();
      }
      if (!quiet(*idle)) {
        // Closing the multi handle closes the connections it keeps; the easy
        // handle and the warm buffer stay.
        curl_multi_cleanup(idle->multi);
        idle->multi = curl_multi_init();
        if (!idle->multi) {
          curl_easy_cleanup(idle->easy);
          continue;
        }
      }
      idle->kept_socket = CURL_SOCKET_BAD;
      return std::move(*idle);
    }
    io::detail::init_curl();
    Connection connection{curl_multi_init(), curl_easy_init(), {}};
    if (!connection.multi || !connection.easy) {
      if (connection.easy) curl_easy_cleanup(connection.easy);
      if (connection.multi) curl_multi_cleanup(connection.multi);
      throw DataError("http stream: cannot allocate a libcurl handle (out of memory)", url);
    }
    return connection;
  }
  void give_back(Connection connection) noexcept {
    curl_easy_reset(connection.easy);  // keeps the connection, forgets the options
    connection.buffer.clear();         // keeps the capacity
    try {
      std::lock_guard lock(mutex_);
      if (idle_.size() < kMaxIdle) {
        idle_.push_back(std::move(connection));
        return;
      }
    } catch (...) {
    }
    curl_easy_cleanup(connection.easy);
    curl_multi_cleanup(connection.multi);
  }

 private:
  static constexpr size_t kMaxIdle = 64;
  std::mutex mutex_;
  std::vector<Connection> idle_;
};

// A pooled connection held for a stream's life and given back (its
// transfer stopped) however the stream ends: a member, so a constructor that
// throws gives it back too.
struct Lease {
  Lease(std::shared_ptr<ConnectionPool> from, const std::string& url)
      : pool(std::move(from)), connection(pool->take(url)) {}
  ~Lease() {
    if (in_multi) curl_multi_remove_handle(connection.multi, connection.easy);  // closes a transfer cut short
    pool->give_back(std::move(connection));
  }
  Lease(const Lease&) = delete;
  Lease& operator=(const Lease&) = delete;

  std::shared_ptr<ConnectionPool> pool;
  Connection connection;
  bool in_multi = false;  // the easy handle is in the multi handle
};

class HttpStream final : public ByteStream {
 public:
  HttpStream(std::string url, const HttpOptions& options, std::shared_ptr<ConnectionPool> pool)
      : url_(std::move(url)),
        options_(options),
        lease_(std::move(pool), url_),
        connection_(lease_.connection),
        buffer_(connection_.buffer) {
    buffer_.reserve(kStreamBuffer + kReceiveBytes);  // the most it holds: appends never reallocate
    // The request goes out now and the response waits in the socket until
    // the first read: a stream opened ahead costs no thread and no buffer.
    start_attempt();
    int running = 0;
    curl_multi_perform(connection_.multi, &running);
  }

  // A connection is only reused once its response has been read to the
  // end: one cut short is closed (Lease). Readers stop just short of it
  // (untar stops at a tar's first end-of-archive block and leaves the
  // second, and whatever pads the last record), and every shard then paid
  // for a new connection (50 connects for 60 requests in a W5 run). A rest
  // of at most kDrainBytes is read and dropped instead, for at most
  // kDrainTime; a failure meanwhile closes the connection as before.
  ~HttpStream() override {
    // Not in the multi handle: done, failed, or waiting to retry.
    if (failure_ || !lease_.in_multi || !size_ || *size_ - received_ > kDrainBytes) return;
    try {
      draining_ = true;
      if (paused_) {
        paused_ = false;
        curl_easy_pause(connection_.easy, CURLPAUSE_CONT);  // draining: never paused again
      }
      const auto deadline = std::chrono::steady_clock::now() + kDrainTime;
      while (lease_.in_multi && std::chrono::steady_clock::now() < deadline) {
        perform();  // throws when the attempt fails for good
        if (lease_.in_multi) curl_multi_poll(connection_.multi, nullptr, 0, 1, nullptr);
      }
    } catch (...) {
    }
  }

  size_t read(std::span<uint8_t> out) override {
    if (out.empty()) return 0;
    reclaim_lent();
    pump([this] { return buffered() > 0; });
    const size_t count = std::min(out.size(), buffered());
    std::memcpy(out.data(), buffer_.data() + begin_, count);
    begin_ += count;
    if (begin_ == buffer_.size()) {
      buffer_.clear();
      begin_ = 0;
    }
    return count;
  }

  // All that is buffered, lent until the next call: the buffer is only
  // written in pump(), which no call reaches before reclaiming it.
  std::optional<std::span<const uint8_t>> read_in_place() override {
    reclaim_lent();
    pump([this] { return buffered() > 0; });
    const std::span<const uint8_t> lent(buffer_.data() + begin_, buffered());
    begin_ = buffer_.size();
    lent_ = true;
    return lent;
  }

  std::optional<uint64_t> size() const override { return size_; }

 private:
  size_t buffered() const noexcept { return buffer_.size() - begin_; }

  // The bytes read_in_place() lent are the caller's until its next call:
  // only then is their room reused.
  void reclaim_lent() noexcept {
    if (!lent_) return;
    lent_ = false;
    buffer_.clear();
    begin_ = 0;
  }

  // Drives the transfer until `ready()`, the end of the body, or a final
  // failure (thrown).
  template <class Ready>
  void pump(Ready ready) {
    while (true) {
      if (failure_) std::rethrow_exception(failure_);
      if (ready() || done_) return;
      if (paused_ && buffered() < kStreamBuffer) {
        paused_ = false;
        curl_easy_pause(connection_.easy, CURLPAUSE_CONT);  // may hand the kept chunk at once
        continue;
      }
      if (retry_at_) {
        std::this_thread::sleep_until(*retry_at_);  // the reader has nothing else to do
        retry_at_.reset();
        start_attempt();
      }
      perform();
      if (ready() || done_ || failure_ || retry_at_) continue;
      curl_multi_poll(connection_.multi, nullptr, 0, 1000, nullptr);
    }
  }

  // Moves the transfer on as far as it can without waiting; an attempt that
  // ended is finished (a final failure throws).
  void perform() {
    int running = 0;
    const CURLMcode code = curl_multi_perform(connection_.multi, &running);
    if (code != CURLM_OK) fail(std::string("curl_multi_perform: ") + curl_multi_strerror(code));
    int left = 0;
    while (CURLMsg* message = curl_multi_info_read(connection_.multi, &left)) {
      if (message->msg == CURLMSG_DONE) finish(message->data.result);
    }
  }

  void start_attempt() {
    ++attempts_;
    received_at_start_ = received_;
    response_checked_ = false;
    discard_ = 0;
    status_ = 0;
    too_big_ = false;
    wrong_range_.clear();
    unasked_part_.clear();
    error_text_[0] = '\0';
    CURL* easy = connection_.easy;
    const std::string range = std::to_string(received_) + "-";
    // A resume asks for the rest of the object it began: a server that holds
    // another now answers with the whole of that (200), refused below.
    const std::string& validator = strong_etag() ? etag_ : last_modified_;
    if (received_ > 0 && !validator.empty() && !if_range_) {
      if_range_.reset(curl_slist_append(nullptr, ("If-Range: " + validator).c_str()));
      if (!if_range_) fail("cannot allocate a request header (out of memory)");
    }
    const bool ok = io::detail::set_transfer_options(easy, options_, "conveyor-http-stream") &&
                    curl_easy_setopt(easy, CURLOPT_URL, url_.c_str()) == CURLE_OK &&
                    curl_easy_setopt(easy, CURLOPT_WRITEFUNCTION, &HttpStream::on_body) == CURLE_OK &&
                    curl_easy_setopt(easy, CURLOPT_WRITEDATA, this) == CURLE_OK &&
                    curl_easy_setopt(easy, CURLOPT_ERRORBUFFER, error_text_) == CURLE_OK &&
                    curl_easy_setopt(easy, CURLOPT_BUFFERSIZE, static_cast<long>(kReceiveBytes)) == CURLE_OK &&
                    curl_easy_setopt(easy, CURLOPT_RANGE, received_ > 0 ? range.c_str() : nullptr) == CURLE_OK &&
                    curl_easy_setopt(easy, CURLOPT_HTTPHEADER, received_ > 0 ? if_range_.get() : nullptr) == CURLE_OK &&
                    curl_easy_setopt(easy, CURLOPT_FRESH_CONNECT, std::exchange(fresh_connect_, false) ? 1L : 0L) ==
                        CURLE_OK;
    if (!ok) fail("libcurl refused an option or the URL");
    const CURLMcode code = curl_multi_add_handle(connection_.multi, easy);
    if (code != CURLM_OK) fail(std::string("curl_multi_add_handle: ") + curl_multi_strerror(code));
    lease_.in_multi = true;
  }

  static size_t on_body(char* data, size_t size, size_t count, void* self) {
    return static_cast<HttpStream*>(self)->take_body(data, size * count);
  }

  // Returning less than `bytes` aborts the transfer (CURLE_WRITE_ERROR).
  size_t take_body(const char* data, size_t bytes) {
    if (!response_checked_) {
      long status = 0;
      curl_easy_getinfo(connection_.easy, CURLINFO_RESPONSE_CODE, &status);
      if (status < 200 || status >= 300) {
        status_ = status;
        return 0;
      }
      curl_off_t length = -1;  // of this response's body; -1: not said
      curl_easy_getinfo(connection_.easy, CURLINFO_CONTENT_LENGTH_DOWNLOAD_T, &length);
      std::optional<uint64_t> total;  // the object's length, where this response says it
      const std::string etag = response_header("ETag"), last_modified = response_header("Last-Modified");
      if (received_ == 0 && status == 206) {
        // Part of the object where the whole was asked for (no Range sent):
        // read as the whole, it would end the stream early or splice.
        const std::string header = response_header("Content-Range");
        unasked_part_ = header.empty() ? "no Content-Range" : "Content-Range: " + header;
        return 0;
      }
      if (received_ == 0) {
        // The reader's bytes begin with this response: every resume must
        // come from the same object.
        etag_ = etag;
        last_modified_ = last_modified;
        size_.reset();
        if (length >= 0) total = static_cast<uint64_t>(length);
      } else {
        changed_ = changed_since(etag, last_modified);
        if (!changed_.empty()) return 0;
        if (status == 206) {
          // A resume's 206 must begin where the last attempt stopped: one
          // answering another range would splice the wrong bytes in (a
          // chunked first response left no length to catch it by). Its
          // total is the object's length; it may end before it (finish()).
          const std::string header = response_header("Content-Range");
          const std::optional<io::detail::ContentRange> range = io::detail::parse_content_range(header);
          if (!range || range->first != received_ || (range->total && range->last >= *range->total) ||
              (length >= 0 && static_cast<uint64_t>(length) != range->last - range->first + 1)) {
            wrong_range_ = header.empty() ? "no Content-Range" : "Content-Range: " + header;
            return 0;
          }
          total = range->total;
        } else {
          discard_ = received_;  // the server sent it all again
          if (length >= 0) total = static_cast<uint64_t>(length);
        }
      }
      if (total) {
        if (size_ && *size_ != *total) {
          changed_ = std::to_string(*size_) + " bytes, now " + std::to_string(*total);
          return 0;
        }
        size_ = total;
        if (*total > options_.max_bytes) {
          too_big_ = true;
          return 0;
        }
      }
      response_checked_ = true;
    }
    if (!draining_ && buffered() >= kStreamBuffer) {
      paused_ = true;
      return CURL_WRITEFUNC_PAUSE;
    }
    const size_t dropped = static_cast<size_t>(std::min<uint64_t>(discard_, bytes));
    discard_ -= dropped;
    const size_t kept = bytes - dropped;
    if (kept > options_.max_bytes - received_) {  // received_ <= max_bytes always
      too_big_ = true;
      return 0;
    }
    if (draining_) {  // the reader is gone: counted, not kept
      received_ += kept;
      return bytes;
    }
    if (buffer_.size() + kept > buffer_.capacity() && begin_ > 0) {  // reuse the front instead of growing
      buffer_.erase(buffer_.begin(), buffer_.begin() + static_cast<std::ptrdiff_t>(begin_));
      begin_ = 0;
    }
    const auto* first = reinterpret_cast<const uint8_t*>(data) + dropped;  // bytes: inserted by memcpy
    buffer_.insert(buffer_.end(), first, first + kept);
    received_ += kept;
    return bytes;
  }

  // An attempt ended: the end of the body, a retry, or the final failure.
  void finish(CURLcode result) {
    // The connection libcurl keeps is found through the multi handle: asked
    // before the easy handle leaves it.
    curl_socket_t socket = CURL_SOCKET_BAD;
    long version = 0;
    if (result == CURLE_OK && (curl_easy_getinfo(connection_.easy, CURLINFO_ACTIVESOCKET, &socket) != CURLE_OK ||
                               curl_easy_getinfo(connection_.easy, CURLINFO_HTTP_VERSION, &version) != CURLE_OK)) {
      socket = CURL_SOCKET_BAD;
    }
    curl_multi_remove_handle(connection_.multi, connection_.easy);
    lease_.in_multi = false;
    long status = status_;
    if (status == 0) curl_easy_getinfo(connection_.easy, CURLINFO_RESPONSE_CODE, &status);
    if (result == CURLE_OK && !response_checked_ && status >= 200 && status < 300) response_checked_ = true;  // empty body
    if (result == CURLE_OK && status >= 200 && status < 300 && discard_ > 0) {
      // Sent whole again, and ending before the bytes already read: not the
      // object this stream began (a first response without validators or
      // length left nothing else to tell them apart by).
      changed_ = "it now ends at byte " + std::to_string(received_ - discard_) + ", but " +
                 std::to_string(received_) + " bytes of it were read";
    } else if (result == CURLE_OK && status == 206 && received_at_start_ == 0) {
      // An empty 206 to a request for the whole object: take_body never saw it.
      const std::string header = response_header("Content-Range");
      unasked_part_ = header.empty() ? "no Content-Range" : "Content-Range: " + header;
    } else if (result == CURLE_OK && status >= 200 && status < 300) {
      if (!size_ || received_ == *size_) {
        done_ = true;
        if (version == CURL_HTTP_VERSION_1_0 || version == CURL_HTTP_VERSION_1_1) connection_.kept_socket = socket;
        return;
      }
      if (status == 206 && received_ > received_at_start_) {
        // A whole 206 that ends before the object does (a server that caps
        // its ranges): no failure; the rest is asked for at once.
        attempts_ = 0;
        retry_at_ = std::chrono::steady_clock::now();
        return;
      }
      result = CURLE_PARTIAL_FILE;  // ended short of its Content-Length
    }
    std::string why;
    bool retry = false;
    if (too_big_) {
      why = "the object holds more than max_bytes " + std::to_string(options_.max_bytes);
    } else if (!changed_.empty()) {
      why = "the object changed between attempts (" + changed_ + ")";
    } else if (!wrong_range_.empty()) {
      why = "the resume from byte " + std::to_string(received_) + " was answered with " + wrong_range_;
    } else if (!unasked_part_.empty()) {
      why = "the server answered a request for the whole object with 206 Partial Content (" + unasked_part_ + ")";
    } else if (status_ != 0 || (result == CURLE_OK && status != 0 && (status < 200 || status >= 300))) {
      // An error status, with a body (refused by take_body) or without.
      why = "HTTP " + std::to_string(status);
      retry = status >= 500;
    } else {
      // libcurl's reason first: a refused redirect (a loop, file://) ends
      // on its 3xx, which alone would not say why.
      why = curl_easy_strerror(result);
      if (error_text_[0] != '\0') why += std::string(" (") + error_text_ + ")";
      if (status != 0 && (status < 200 || status >= 300)) why += ", HTTP " + std::to_string(status);
      retry = io::detail::retryable(result);
      if (!retried_fresh_ && io::detail::garbled_on_reuse(connection_.easy, result)) {
        // Most likely the bytes an earlier response sent past its length,
        // not this response: once, at once, on a new connection, uncounted.
        retried_fresh_ = fresh_connect_ = true;
        --attempts_;
        retry_at_ = std::chrono::steady_clock::now();
        return;
      }
    }
    if (received_ > received_at_last_failure_) attempts_ = 1;  // progress since: a fresh run of retries
    received_at_last_failure_ = received_;
    if (retry && attempts_ <= options_.retries) {
      retry_at_ = std::chrono::steady_clock::now() + io::detail::backoff(options_, attempts_);
      return;
    }
    if (attempts_ > 1) why += " (after " + std::to_string(attempts_) + " attempts)";
    if (received_ > 0) why += ", " + std::to_string(received_) + " bytes in";
    fail(why);
  }

  std::string response_header(const char* name) const {
    curl_header* header = nullptr;
    if (curl_easy_header(connection_.easy, name, 0, CURLH_HEADER, -1, &header) != CURLHE_OK) return "";
    return header->value;
  }

  // If-Range takes only a strong ETag (RFC 9110 13.1.5).
  bool strong_etag() const noexcept { return !etag_.empty() && !etag_.starts_with("W/"); }

  // How a resume's response shows another object than the first's ("": it
  // does not, or cannot tell). ETags are compared weakly (a W/ aside): any
  // difference is another object. Last-Modified decides where either lacks
  // an ETag.
  std::string changed_since(const std::string& etag, const std::string& last_modified) const {
    const auto opaque = [](std::string_view tag) { return tag.starts_with("W/") ? tag.substr(2) : tag; };
    if (!etag_.empty() && !etag.empty()) {
      return opaque(etag_) == opaque(etag) ? "" : "ETag " + etag_ + ", now " + etag;
    }
    if (!last_modified_.empty() && !last_modified.empty() && last_modified_ != last_modified) {
      return "Last-Modified " + last_modified_ + ", now " + last_modified;
    }
    return "";
  }

  [[noreturn]] void fail(const std::string& why) {
    failure_ = std::make_exception_ptr(DataError("http: " + why, url_));
    std::rethrow_exception(failure_);
  }

  struct FreeSlist {
    void operator()(curl_slist* list) const noexcept { curl_slist_free_all(list); }
  };

  std::string url_;
  HttpOptions options_;
  // A resume's If-Range header; before lease_, so that it outlives the
  // easy handle's use of it (the Lease resets the handle).
  std::unique_ptr<curl_slist, FreeSlist> if_range_;
  Lease lease_;
  Connection& connection_;        // lease_'s
  std::vector<uint8_t>& buffer_;  // connection_'s; buffer_[begin_, size()) waits for read()
  size_t begin_ = 0;
  bool lent_ = false;  // buffer_[0, begin_) is lent by read_in_place()
  uint64_t received_ = 0;  // bytes of the object taken into the buffer, all attempts
  uint64_t received_at_last_failure_ = 0;
  uint64_t received_at_start_ = 0;  // received_ when this attempt began
  uint64_t discard_ = 0;   // bytes of this response already received before
  std::optional<uint64_t> size_;
  int attempts_ = 0;
  std::optional<std::chrono::steady_clock::time_point> retry_at_;
  bool response_checked_ = false;  // this attempt's status and length were checked
  bool paused_ = false;
  bool draining_ = false;  // closed near the end: the rest is dropped (~HttpStream)
  bool done_ = false;
  bool too_big_ = false;
  bool fresh_connect_ = false;  // the next attempt opens a new connection
  bool retried_fresh_ = false;  // once per stream (finish())
  std::string etag_, last_modified_;  // the validators of the response the reader's bytes began with
  std::string changed_;  // how a resume's response showed another object (changed_since, or its length)
  std::string wrong_range_;  // a resume answered from another byte: what the 206 said
  std::string unasked_part_;  // a 206 to the first request (no range asked): what it said
  long status_ = 0;  // an attempt's non-2xx status
  std::exception_ptr failure_;
  char error_text_[CURL_ERROR_SIZE] = {};
};

bool is_url(const std::string& location) {
  return location.starts_with("http://") || location.starts_with("https://");
}

}  // namespace

StreamOpener http_opener(HttpOptions options) {
  io::detail::validate(options, "http_opener");
  auto pool = std::make_shared<ConnectionPool>();
  return [options, pool](const std::string& location) -> std::unique_ptr<ByteStream> {
    if (!is_url(location)) return nullptr;
    return std::make_unique<HttpStream>(location, options, pool);
  };
}

}  // namespace conveyor::nodes
