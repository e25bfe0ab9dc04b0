// conveyor/nodes/http.h: objects over HTTP(S) as a pipeline node (target
// conveyor::io, built when libcurl is found).
//
//   from_vector(expand_shard_pattern("http://host/img-{00000..09999}.jpg"))
//       | http_get({.max_in_flight = 64}) | map(decode, {.workers = 4}) | batch(64)
//
//   http_get(options)   URL -> HttpObject{url, bytes}: GET of each URL, up to
//                       max_in_flight transfers outstanding on ONE thread (the
//                       caller's: libcurl's multi interface, no thread parked
//                       per request), handed out in input order.
//                       HttpRange{url, offset, length} -> the object's bytes
//                       [offset, offset + length): random access by Range.
//
// Contract (as every node, conveyor/node.h):
// - next() waits (curl_multi_poll) for the next object in input order;
//   try_next() never waits: it drives the transfers (curl_multi_perform) and
//   answers Poll::pending while the next-in-order object is not complete.
//   Upstream is pulled on the calling thread (try_next uses upstream's
//   try_next).
// - Memory: at most max_in_flight objects (in transfer or waiting for their
//   turn), each at most max_bytes whatever its Content-Length claims: a
//   transfer is aborted as soon as the header or the bytes received exceed it.
// - Errors: a failed GET is a DataError whose file() is the URL and whose
//   message names the HTTP status or libcurl's reason, thrown at the item's
//   place; the pass goes on with the next URL. With OnError::skip it is
//   dropped and counted (metrics().back().skipped). Errors from upstream
//   keep their place and are always thrown.
// - Retries: timeouts, connection failures and resets, and HTTP 5xx are
//   retried up to `retries` times, after backoff, 2 x backoff, 4 x ... (at
//   most max_backoff); 4xx and max_bytes are final.
// - Connections are kept and reused across items and passes (HTTP/1.1
//   keep-alive, HTTP/2 multiplexing where the server offers it).
// - A reset (a new pass) abandons the transfers in flight. A pass resumed
//   from a state (Pipeline::load_state) does not request the objects it
//   passes over, unless its consumer had seen errors or on_error is
//   OnError::skip (a dropped failure is no output: only the GETs tell which
//   URLs gave the outputs).
//
// Thread-safety: one thread advances the node at a time (as every node).
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "conveyor/byte_stream.h"
#include "conveyor/data_error.h"
#include "conveyor/node.h"

namespace conveyor::nodes {

struct HttpObject {
  std::string url;
  std::vector<uint8_t> bytes;  // the response body (2xx): the object, or the range asked for
  uint64_t offset = 0;         // the first byte's place in the object (an HttpRange's offset)
};

// Part of an object, for random access (a member inside a tar shard, a
// record of an indexed file): `length` bytes from byte `offset`, or to the
// object's end when `length` is none. Asked for with a Range header, the
// 206's Content-Range checked to answer it; a server that ignores Range and
// sends the whole object is cut to the range (its bytes before `offset` read
// and dropped). A range that reaches past the object's end gives the bytes
// up to it, as pread() does; one that starts at or past the end is a
// DataError (HTTP 416). A length of 0 gives no bytes, without a request
// (the URL is not checked).
struct HttpRange {
  std::string url;
  uint64_t offset = 0;
  std::optional<uint64_t> length = std::nullopt;
};

struct HttpOptions {
  // Transfers outstanding at once, and the reorder window: objects complete
  // out of order and wait here for their turn. [1, 65536].
  int max_in_flight = 16;
  // Per attempt: to establish the connection, and for the whole transfer
  // (0: no limit on the whole transfer).
  std::chrono::milliseconds connect_timeout{10'000};
  std::chrono::milliseconds total_timeout{300'000};
  // Per attempt: a transfer that receives nothing for this long (a server
  // that accepted and went silent, a peer gone without a reset) is cut and
  // retried like a timeout. A stream paused for a slow reader is not
  // stalled. Whole seconds, as libcurl counts them (0: no limit; then only
  // total_timeout bounds a silent server). [0, 86400].
  std::chrono::seconds stall_timeout{60};
  // Retries after the first attempt, for timeouts, connection failures and
  // resets, and HTTP 5xx. The k-th retry waits min(backoff x 2^(k-1),
  // max_backoff) without holding the thread.
  int retries = 3;
  std::chrono::milliseconds backoff{100};
  std::chrono::milliseconds max_backoff{10'000};
  // The most bytes one object may hold; a larger one is a DataError.
  uint64_t max_bytes = uint64_t{1} << 30;
  // The kernel's receive buffer asked for each new connection (SO_RCVBUF:
  // Linux doubles it for its own bookkeeping and caps the request at
  // net.core.rmem_max). 0, the default, leaves the kernel's autotuning,
  // which a fixed size turns off: over long round trips (a remote object
  // store) autotuning grows further (net.ipv4.tcp_rmem) than most systems'
  // rmem_max lets a request reach. Near the server (a LAN, the loopback) a
  // fixed large one lets it send a shard ahead of the reader without
  // waiting for acknowledgements: W5's shards over loopback gave 3-4% more
  // samples/s at 2 MiB than autotuned (perf/README.md). Kernel memory,
  // used only as data waits in it. [0, 1 GiB].
  uint64_t receive_buffer = 0;
  OnError on_error = OnError::raise;
  // https:// trusts the system's certificate authorities; a PEM file here
  // replaces them, bundle and directory (a private CA, a self-signed test
  // server). A certificate
  // that does not verify is a DataError naming the URL, not retried. Must
  // be readable when the node or opener is made (ValueError).
  std::string ca_file = {};
};

// Pipeline<std::string> (URLs: http:// or https://) or Pipeline<HttpRange>
// -> Pipeline<HttpObject>. max_bytes bounds what an item keeps (a range's
// bytes). Errors for a range name it ("HTTP 416 (bytes 100-199)").
struct HttpGetAdaptor {
  HttpOptions options;
  Pipeline<HttpObject> operator()(Pipeline<std::string>&& upstream) const;
  Pipeline<HttpObject> operator()(Pipeline<HttpRange>&& upstream) const;
};
// Throws ValueError for options out of range.
HttpGetAdaptor http_get(HttpOptions options = {});

// Streams http(s):// URLs for untar and TarShardDataset (their `open`):
// a tar shard is read as it arrives, never stored whole, with at most
// 1.25 MiB waiting for the reader (the transfer pauses past 1 MiB). Opening
// sends the request and returns; the first read waits for the response (so
// untar, opening the next shard ahead, overlaps its request with this one). Other locations are
// declined (read as local files). A failed transfer (timeout, reset, refused
// connection, 5xx) resumes where it stopped with a byte range (Range:
// bytes=N-, If-Range: the first response's ETag or Last-Modified), after
// backoff; `retries` bounds consecutive attempts that bring no new byte. A
// resume that finds another object (its ETag, Last-Modified or length
// differs) is a DataError, never spliced onto the bytes already read.
// max_bytes bounds the object; total_timeout bounds each attempt, and an
// attempt cut by it resumes like any other. max_in_flight
// and on_error are not used (one transfer per stream; the reader decides
// what to skip). Connections are kept for the next stream opened by the same
// opener. The opener may be called from several threads at once. Throws
// ValueError for options out of range.
StreamOpener http_opener(HttpOptions options = {});

}  // namespace conveyor::nodes
