// http_get against a real nginx on loopback (nginx_server.h).
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <future>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "conveyor/data_error.h"
#include "conveyor/nodes/http.h"
#include "conveyor/nodes/sources.h"
#include "nginx_server.h"
#include "scripted_server.h"
#include "support/random_pipeline.h"
#ifdef CONVEYOR_IO_TEST_FORMATS
#include "conveyor/tar_shards.h"
#endif

namespace conveyor::nodes {
namespace {

using conveyor::test::NginxServer;
using std::chrono::milliseconds;

constexpr int kObjects = 200;
constexpr int kRangedObjects = 40;  // also served without Range support, for HttpRange

// Object i's bytes: a size from 0 to ~96 KiB, filled from an LCG seeded by i.
std::string object_bytes(int i) {
  const size_t size = (static_cast<size_t>(i) * 7919u) % (96u << 10);
  std::string bytes(size, '\0');
  uint32_t state = 2654435761u * static_cast<uint32_t>(i + 1);
  for (char& byte : bytes) {
    state = state * 1664525u + 1013904223u;
    byte = static_cast<char>(state >> 24);
  }
  return bytes;
}

// /slow/small.bin's: about a second at 1 KiB/s (nginx sends the first KiB at once).
std::string slow_small_bytes() { return std::string(1500, 's'); }

std::string object_path(int i) {
  std::string name = std::to_string(i);
  return "/obj/" + std::string(5 - name.size(), '0') + name + ".bin";
}

// One nginx for the suite (the stopped-server test starts its own).
class HttpGetTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    if (NginxServer::binary().empty()) return;
    server_ = std::make_unique<NginxServer>();
    for (int i = 0; i < kObjects; ++i) server_->write_file(object_path(i).substr(1), object_bytes(i));
    const std::string big(1 << 20, 'b');
    server_->write_file("big.bin", big);
    server_->write_file("slow/big.bin", big);
    server_->write_file("chunked/big.bin", big);
    server_->write_file("slow/small.bin", slow_small_bytes());
    // The same objects where the server ignores Range (max_ranges 0).
    for (int i = 0; i < kRangedObjects; ++i) server_->write_file("norange" + object_path(i), object_bytes(i));
    server_->start();
  }
  static void TearDownTestSuite() { server_.reset(); }
  void SetUp() override {
    CONVEYOR_NGINX_SKIP_WITHOUT(server_ != nullptr);
  }

  static std::vector<std::string> object_urls() {
    std::vector<std::string> urls;
    for (int i = 0; i < kObjects; ++i) urls.push_back(server_->url(object_path(i)));
    return urls;
  }

  static std::unique_ptr<NginxServer> server_;
};
std::unique_ptr<NginxServer> HttpGetTest::server_;

// The DataError a next() throws, or a failure.
template <class P>
DataError next_error(P& pass) {
  try {
    auto item = pass.next();
    ADD_FAILURE() << "expected a DataError, got " << (item ? "an object" : "the end");
  } catch (const DataError& error) {
    return error;
  }
  return DataError("none", "");
}

TEST_F(HttpGetTest, AnyWindowGivesTheSameBytesInInputOrder) {
  for (int window : {1, 8, 64}) {
    auto pipeline = from_vector(object_urls()) | http_get({.max_in_flight = window});
    for (int pass_number = 0; pass_number < 2; ++pass_number) {  // the second on kept connections
      int i = 0;
      for (HttpObject& object : pipeline.pass()) {
        ASSERT_LT(i, kObjects);
        EXPECT_EQ(object.url, server_->url(object_path(i))) << "window " << window;
        ASSERT_EQ(std::string(object.bytes.begin(), object.bytes.end()), object_bytes(i))
            << "window " << window << ", object " << i;
        ++i;
      }
      EXPECT_EQ(i, kObjects) << "window " << window;
      const NodeMetrics metrics = pipeline.metrics().back();
      EXPECT_EQ(metrics.items_in, uint64_t{kObjects});
      EXPECT_EQ(metrics.items_out, uint64_t{kObjects});
      EXPECT_EQ(metrics.window, static_cast<size_t>(window));
      EXPECT_LE(metrics.mean_in_flight, window);
    }
  }
}

TEST_F(HttpGetTest, TryNextGivesTheSameItemsAndCountsThem) {
  auto pipeline = from_vector(object_urls()) | http_get({.max_in_flight = 32});
  auto pass = pipeline.pass();
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  int i = 0;
  while (std::chrono::steady_clock::now() < deadline) {
    std::optional<HttpObject> object;
    const Poll poll = pass.try_next(object);
    if (poll == Poll::end) break;
    if (poll == Poll::pending) continue;  // a caller with other work would do it here
    ASSERT_EQ(std::string(object->bytes.begin(), object->bytes.end()), object_bytes(i)) << "object " << i;
    ++i;
  }
  EXPECT_EQ(i, kObjects);
  EXPECT_EQ(pipeline.metrics().back().items_out, uint64_t{kObjects});
}

TEST_F(HttpGetTest, TryNextDoesNotWaitForASlowObject) {
  auto pipeline = from_vector(std::vector<std::string>{server_->url("/slow/big.bin")}) |
                  http_get({.total_timeout = milliseconds(300), .retries = 0});
  auto pass = pipeline.pass();
  std::optional<HttpObject> object;
  const auto start = std::chrono::steady_clock::now();
  EXPECT_EQ(pass.try_next(object), Poll::pending);
  EXPECT_LT(std::chrono::steady_clock::now() - start, milliseconds(200));
  const DataError error = next_error(pass);  // next() waits: for the timeout
  EXPECT_EQ(error.file(), server_->url("/slow/big.bin"));
}

TEST_F(HttpGetTest, NotFoundIsADataErrorAtItsPlaceAndThePassGoesOn) {
  const std::string missing = server_->url("/obj/missing.bin");
  auto pipeline = from_vector(std::vector<std::string>{server_->url(object_path(1)), missing,
                                                       server_->url(object_path(2))}) |
                  http_get({.max_in_flight = 8});
  auto pass = pipeline.pass();
  auto first = pass.next();
  ASSERT_TRUE(first);
  EXPECT_EQ(first->url, server_->url(object_path(1)));
  const DataError error = next_error(pass);
  EXPECT_EQ(error.file(), missing);
  EXPECT_NE(std::string(error.what()).find("HTTP 404"), std::string::npos) << error.what();
  EXPECT_NE(std::string(error.what()).find(missing), std::string::npos) << error.what();
  auto third = pass.next();
  ASSERT_TRUE(third);
  EXPECT_EQ(std::string(third->bytes.begin(), third->bytes.end()), object_bytes(2));
  EXPECT_FALSE(pass.next());
}

TEST_F(HttpGetTest, ServerErrorIsRetriedThenReported) {
  const std::string path = "/error500/a";
  auto pipeline = from_vector(std::vector<std::string>{server_->url(path)}) |
                  http_get({.retries = 2, .backoff = milliseconds(5)});
  auto pass = pipeline.pass();
  const DataError error = next_error(pass);
  EXPECT_EQ(error.file(), server_->url(path));
  EXPECT_NE(std::string(error.what()).find("HTTP 500 (after 3 attempts)"), std::string::npos) << error.what();
  // Any request after the last attempt's answer: its log line is written by then.
  auto sentinel = from_vector(std::vector<std::string>{server_->url(object_path(0))}) | http_get();
  for ([[maybe_unused]] auto& object : sentinel.pass()) {
  }
  EXPECT_EQ(server_->requests_logged(path), 3);
}

TEST_F(HttpGetTest, ClosedConnectionIsRetriedThenReported) {
  const std::string path = "/reset/a";  // nginx's 444: closes without answering
  auto pipeline = from_vector(std::vector<std::string>{server_->url(path)}) |
                  http_get({.retries = 1, .backoff = milliseconds(5)});
  auto pass = pipeline.pass();
  const DataError error = next_error(pass);
  EXPECT_EQ(error.file(), server_->url(path));
  EXPECT_NE(std::string(error.what()).find("(after 2 attempts)"), std::string::npos) << error.what();
}

TEST_F(HttpGetTest, ClientErrorIsNotRetried) {
  const std::string path = "/obj/not-there-either.bin";
  auto pipeline = from_vector(std::vector<std::string>{server_->url(path)}) | http_get({.retries = 3});
  auto pass = pipeline.pass();
  const DataError error = next_error(pass);
  EXPECT_EQ(std::string(error.what()).find("attempts"), std::string::npos) << error.what();
  auto sentinel = from_vector(std::vector<std::string>{server_->url(object_path(0))}) | http_get();
  for ([[maybe_unused]] auto& object : sentinel.pass()) {
  }
  EXPECT_EQ(server_->requests_logged(path), 1);
}

TEST_F(HttpGetTest, DeclaredLengthOverMaxBytesIsADataError) {
  auto pipeline = from_vector(std::vector<std::string>{server_->url("/big.bin"), server_->url(object_path(0))}) |
                  http_get({.max_bytes = 1000});
  auto pass = pipeline.pass();
  const DataError error = next_error(pass);
  EXPECT_EQ(error.file(), server_->url("/big.bin"));
  EXPECT_NE(std::string(error.what()).find("declares 1048576 bytes"), std::string::npos) << error.what();
  auto next = pass.next();  // the pass goes on
  ASSERT_TRUE(next);
  EXPECT_EQ(next->url, server_->url(object_path(0)));  // 0 bytes
}

TEST_F(HttpGetTest, BytesOverMaxBytesWithoutALengthStopTheTransfer) {
  // sub_filter drops Content-Length: only the bytes received can tell.
  auto pipeline = from_vector(std::vector<std::string>{server_->url("/chunked/big.bin")}) |
                  http_get({.max_bytes = 1000});
  auto pass = pipeline.pass();
  const DataError error = next_error(pass);
  EXPECT_EQ(error.file(), server_->url("/chunked/big.bin"));
  const std::string what = error.what();
  EXPECT_NE(what.find("more than http_get's max_bytes 1000: the transfer was stopped after "), std::string::npos)
      << what;
}

TEST_F(HttpGetTest, ThrottledObjectTimesOutNamingTheUrl) {
  const std::string url = server_->url("/slow/big.bin");  // 1 MiB at 1 KiB/s
  auto pipeline =
      from_vector(std::vector<std::string>{url}) | http_get({.total_timeout = milliseconds(250), .retries = 1,
                                                             .backoff = milliseconds(5)});
  auto pass = pipeline.pass();
  const auto start = std::chrono::steady_clock::now();
  const DataError error = next_error(pass);
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(5));
  EXPECT_EQ(error.file(), url);
  const std::string what = error.what();
  EXPECT_NE(what.find("Timeout was reached"), std::string::npos) << what;
  EXPECT_NE(what.find("(after 2 attempts)"), std::string::npos) << what;
}

// Every fault the server can give (404, 500, a closed connection, a
// response throttled past total_timeout) is dropped and counted once; the
// objects around them arrive whole, in order.
TEST_F(HttpGetTest, SkipDropsFailuresAndCountsThem) {
  std::vector<std::string> urls = {server_->url(object_path(4)), server_->url("/obj/gone-1"),
                                   server_->url("/error500/b"),  server_->url("/reset/c"),
                                   server_->url("/slow/big.bin"), server_->url(object_path(5))};
  auto pipeline = from_vector(urls) |
                  http_get({.total_timeout = milliseconds(300), .retries = 0, .on_error = OnError::skip});
  std::vector<std::string> got;
  for (HttpObject& object : pipeline.pass()) {
    got.push_back(object.url);
    EXPECT_EQ(std::string(object.bytes.begin(), object.bytes.end()), object_bytes(object.url == urls[0] ? 4 : 5));
  }
  EXPECT_EQ(got, (std::vector<std::string>{urls[0], urls[5]}));
  EXPECT_EQ(pipeline.metrics().back().skipped, 4u);
  EXPECT_EQ(pipeline.metrics().back().items_out, 2u);
}

TEST_F(HttpGetTest, ABadUrlIsADataErrorNamingIt) {
  auto pipeline = from_vector(std::vector<std::string>{"ftp://127.0.0.1/x", server_->url(object_path(6))}) |
                  http_get();
  auto pass = pipeline.pass();
  const DataError error = next_error(pass);
  EXPECT_EQ(error.file(), "ftp://127.0.0.1/x");
  auto next = pass.next();
  ASSERT_TRUE(next);
  EXPECT_EQ(std::string(next->bytes.begin(), next->bytes.end()), object_bytes(6));
}

// Random ranges of random objects (past their end, to their end, empty),
// against a server that answers Range (206) and one that ignores it (200,
// the whole object, cut here): the same bytes, in input order; a range
// starting at or past the end is a DataError naming the URL and the range,
// in its place, or skipped and counted.
TEST_F(HttpGetTest, RangesGiveTheirBytesWhetherOrNotTheServerAnswersRange) {
  std::mt19937_64 rng = conveyor::testing::property_rng("HttpGetTest.Ranges");
  for (const char* prefix : {"", "/norange"}) {
    SCOPED_TRACE(std::string("server prefix '") + prefix + "'");
    std::vector<HttpRange> ranges;
    std::vector<std::optional<std::string>> expected;  // none: a DataError
    for (int i = 0; i < 60; ++i) {
      const int object = static_cast<int>(rng() % kRangedObjects);
      const std::string bytes = object_bytes(object);
      HttpRange range{server_->url(prefix + object_path(object))};
      range.offset = rng() % (bytes.size() + 100);  // past the end for the smallest objects
      if (i % 10 == 0) range.offset = bytes.size() + (i % 20 == 0 ? 0 : 50);  // at or past the end: nothing to give
      if (rng() % 4 != 0) range.length = rng() % 5 == 0 ? 0 : 1 + rng() % 40'000;
      const bool empty = range.length == uint64_t{0};
      if (!empty && range.offset >= bytes.size()) {
        expected.push_back(std::nullopt);
      } else {
        expected.push_back(empty ? std::string() : bytes.substr(range.offset, range.length.value_or(std::string::npos)));
      }
      ranges.push_back(range);
    }
    for (int window : {1, 8}) {
      auto pipeline = from_vector(ranges) | http_get({.max_in_flight = window, .retries = 0});
      auto pass = pipeline.pass();
      for (size_t i = 0; i < ranges.size(); ++i) {
        const std::string range_text = "bytes " + std::to_string(ranges[i].offset) + "-";
        if (!expected[i]) {
          const DataError error = next_error(pass);
          EXPECT_EQ(error.file(), ranges[i].url) << "item " << i;
          EXPECT_NE(std::string(error.what()).find(range_text), std::string::npos) << error.what();
          continue;
        }
        std::optional<HttpObject> object = pass.next();
        ASSERT_TRUE(object) << "item " << i;
        EXPECT_EQ(object->url, ranges[i].url);
        EXPECT_EQ(object->offset, ranges[i].offset);
        ASSERT_EQ(std::string(object->bytes.begin(), object->bytes.end()), *expected[i])
            << "item " << i << ": " << range_text << " of " << ranges[i].url << ", window " << window;
      }
      EXPECT_FALSE(pass.next());
    }
    auto skipping = from_vector(ranges) | http_get({.max_in_flight = 8, .retries = 0, .on_error = OnError::skip});
    size_t got = 0;
    for (HttpObject& object : skipping.pass()) got += object.url.empty() ? 0 : 1;
    const auto failures = static_cast<uint64_t>(std::count(expected.begin(), expected.end(), std::nullopt));
    EXPECT_EQ(got, ranges.size() - failures);
    EXPECT_EQ(skipping.metrics().back().skipped, failures);
  }
  // Each server answered as meant: ranges (206) from one, whole objects (200) from the other.
  int partial = 0, partial_from_norange = 0;
  for (int i = 0; i < kRangedObjects; ++i) {
    for (int status : server_->statuses_logged(object_path(i))) partial += status == 206;
    for (int status : server_->statuses_logged("/norange" + object_path(i))) partial_from_norange += status == 206;
  }
  EXPECT_GT(partial, 0);
  EXPECT_EQ(partial_from_norange, 0);
}

// max_bytes bounds what a range keeps, whether the server answers Range (its
// Content-Length) or sends the whole object (cut as it arrives): a range
// over it is a DataError naming max_bytes, not a shorter object.
TEST_F(HttpGetTest, ARangeOverMaxBytesIsADataErrorWithOrWithoutRangeSupport) {
  for (const char* prefix : {"", "/norange"}) {
    const std::string url = server_->url(prefix + object_path(30));  // 30 x 7919 bytes
    for (const uint64_t offset : {uint64_t{0}, uint64_t{5000}}) {
      auto pipeline = from_vector(std::vector<HttpRange>{{url, offset, 3000}, {url, offset, 1000}}) |
                      http_get({.retries = 0, .max_bytes = 2000});
      auto pass = pipeline.pass();
      const std::string what = next_error(pass).what();
      EXPECT_NE(what.find("max_bytes 2000"), std::string::npos) << prefix << ": " << what;
      std::optional<HttpObject> fits = pass.next();
      ASSERT_TRUE(fits) << prefix;
      EXPECT_EQ(std::string(fits->bytes.begin(), fits->bytes.end()), object_bytes(30).substr(offset, 1000)) << prefix;
    }
  }
}

// A 206 must answer the range asked for: one starting elsewhere, one with
// fewer bytes than asked (of an object that has them) or one without a
// Content-Range is a DataError naming the URL and the range, not bytes of
// the wrong place.
TEST_F(HttpGetTest, A206ThatDoesNotAnswerTheRangeIsADataError) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"/range-from-7/x", "with Content-Range 'bytes 7-9/100'"},
      {"/range-short/x", "with Content-Range 'bytes 0-2/100'"},
      {"/range-none/x", "has no Content-Range"}};
  for (const auto& [path, why] : cases) {
    auto pipeline = from_vector(std::vector<HttpRange>{{server_->url(path), 0, 10}}) | http_get({.retries = 0});
    auto pass = pipeline.pass();
    const DataError error = next_error(pass);
    EXPECT_EQ(error.file(), server_->url(path));
    EXPECT_NE(std::string(error.what()).find(why), std::string::npos) << error.what();
    EXPECT_NE(std::string(error.what()).find("bytes 0-9"), std::string::npos) << error.what();
  }
  // A range to the object's end must reach it: bytes 0-2 of 100 do not.
  auto tail = from_vector(std::vector<HttpRange>{{server_->url("/range-short/x"), 0, std::nullopt}}) |
              http_get({.retries = 0});
  auto tail_pass = tail.pass();
  EXPECT_THROW(tail_pass.next(), DataError);
}

// A ranged GET is retried as the whole item was (5xx here), and its final
// error names the range.
TEST_F(HttpGetTest, ARangeIsRetriedThenReportedNamingIt) {
  auto pipeline = from_vector(std::vector<HttpRange>{{server_->url("/error500/r"), 10, 20}}) |
                  http_get({.retries = 2, .backoff = milliseconds(5)});
  auto pass = pipeline.pass();
  const std::string what = next_error(pass).what();
  EXPECT_NE(what.find("HTTP 500 (bytes 10-29)"), std::string::npos) << what;
  EXPECT_NE(what.find("(after 3 attempts)"), std::string::npos) << what;
}

// The outputs of a pass as text: an object's URL and bytes, or the error's
// URL; each next() taken from `pass` until the end, or `count` of them.
template <class P>
std::vector<std::string> outputs(P& pass, size_t count = SIZE_MAX) {
  std::vector<std::string> out;
  while (out.size() < count) {
    try {
      std::optional<HttpObject> object = pass.next();
      if (!object) break;
      out.push_back(object->url + " " + std::string(object->bytes.begin(), object->bytes.end()));
    } catch (const DataError& error) {
      out.push_back("error " + error.file());
    }
  }
  return out;
}

// A pass resumed from a state in a new pipeline (a new process) hands out
// the rest of the uninterrupted pass without requesting what it passes
// over: resuming mid-epoch downloads none of those objects again. The URLs
// carry a query of their own: the log counts this test's GETs only.
TEST_F(HttpGetTest, AResumedPassDoesNotRequestTheObjectsItPassesOver) {
  constexpr size_t kTaken = 37;
  std::vector<std::string> paths, urls;
  for (int i = 0; i < 100; ++i) {
    paths.push_back(object_path(i) + "?resumed");
    urls.push_back(server_->url(paths.back()));
  }
  auto make = [&urls] { return from_vector(urls) | http_get({.max_in_flight = 8}); };
  auto uninterrupted = make();
  auto whole_pass = uninterrupted.pass();
  const std::vector<std::string> whole = outputs(whole_pass);
  ASSERT_EQ(whole.size(), urls.size());
  std::string saved;
  {
    auto pipeline = make();
    auto pass = pipeline.pass();
    ASSERT_EQ(outputs(pass, kTaken), std::vector<std::string>(whole.begin(), whole.begin() + kTaken));
    saved = pipeline.state().to_json();
  }  // left with the window's transfers in flight
  std::vector<int> before;
  for (const std::string& path : paths) before.push_back(server_->requests_logged(path));

  auto resumed = make();
  resumed.load_state(State::from_json(saved));
  auto pass = resumed.pass();
  EXPECT_EQ(outputs(pass), std::vector<std::string>(whole.begin() + kTaken, whole.end()));
  std::vector<std::string> requested_again, not_requested;
  for (size_t i = 0; i < paths.size(); ++i) {
    const int requests = server_->requests_logged(paths[i]) - before[i];
    if (i < kTaken && requests != 0) requested_again.push_back(paths[i]);
    if (i >= kTaken && requests == 0) not_requested.push_back(paths[i]);
  }
  EXPECT_EQ(requested_again, std::vector<std::string>()) << "passed over by the resumed pass, requested again";
  EXPECT_EQ(not_requested, std::vector<std::string>());
  EXPECT_EQ(resumed.metrics().back().items_in, urls.size() - kTaken);
}

// Passes of one pipeline, each left with its window full (a slow transfer
// running in it, others done and waiting their turn): the next pass, from
// the start or resumed in place from a state, is complete and in order,
// every object whole, and the resumed one requests nothing it passes over.
TEST_F(HttpGetTest, APassLeftWithTransfersInFlightLeavesNothingToTheNext) {
  constexpr size_t kSlow = 11;
  std::vector<std::string> urls = object_urls();
  urls.resize(60);
  urls[kSlow] = server_->url("/slow/small.bin");
  auto pipeline = from_vector(urls) | http_get({.max_in_flight = 16});
  std::vector<std::string> expected;
  for (size_t i = 0; i < urls.size(); ++i) {
    expected.push_back(urls[i] + " " + (i == kSlow ? slow_small_bytes() : object_bytes(static_cast<int>(i))));
  }
  {
    auto pass = pipeline.pass();
    ASSERT_EQ(outputs(pass, 9), std::vector<std::string>(expected.begin(), expected.begin() + 9));
  }  // left while the slow object (in the window: 9 to 24) still arrives
  std::string saved;
  {
    auto pass = pipeline.pass();
    std::vector<std::string> got = outputs(pass, 13);  // past the slow one
    saved = pipeline.state().to_json();
    for (std::string& output : outputs(pass)) got.push_back(std::move(output));
    EXPECT_EQ(got, expected);
  }
  {
    auto pass = pipeline.pass();
    ASSERT_EQ(outputs(pass, 2), std::vector<std::string>(expected.begin(), expected.begin() + 2));
  }  // left again with the slow object in flight
  // nginx logs an abandoned response once it finds the connection closed:
  // at its next send, up to a second later (limit_rate).
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (server_->requests_logged("/slow/small.bin") < 3 && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(milliseconds(50));
  }
  ASSERT_EQ(server_->requests_logged("/slow/small.bin"), 3) << "one request by each of the three passes";
  pipeline.load_state(State::from_json(saved));
  auto resumed = pipeline.pass();
  EXPECT_EQ(outputs(resumed), std::vector<std::string>(expected.begin() + 13, expected.end()));
  EXPECT_EQ(server_->requests_logged("/slow/small.bin"), 3) << "the resumed pass requested what it passed over";
}

// Where a failure was among the outputs passed over (the consumer saw an
// error) or OnError::skip drops failures, the URLs do not say which outputs
// were passed over: the resumed pass requests them again, and hands out
// exactly the rest of the pass.
TEST_F(HttpGetTest, AResumeOverFailuresHandsOutTheRestOfThePass) {
  std::vector<std::string> urls;
  for (int i = 0; i < 30; ++i) {
    urls.push_back(i % 7 == 3 ? server_->url("/obj/gone-" + std::to_string(i)) : server_->url(object_path(i)));
  }
  for (const OnError on_error : {OnError::raise, OnError::skip}) {
    SCOPED_TRACE(on_error == OnError::raise ? "OnError::raise" : "OnError::skip");
    auto make = [&] { return from_vector(urls) | http_get({.max_in_flight = 4, .on_error = on_error}); };
    auto uninterrupted = make();
    auto whole_pass = uninterrupted.pass();
    const std::vector<std::string> whole = outputs(whole_pass);
    std::vector<std::string> got;
    std::string saved;
    {
      auto pipeline = make();
      auto pass = pipeline.pass();
      got = outputs(pass, 12);  // past two failures
      saved = pipeline.state().to_json();
    }
    auto resumed = make();
    resumed.load_state(State::from_json(saved));
    auto pass = resumed.pass();
    for (std::string& output : outputs(pass)) got.push_back(std::move(output));
    EXPECT_EQ(got, whole);
    EXPECT_EQ(whole.size(), on_error == OnError::raise ? urls.size() : urls.size() - 4);
  }
}

// https:// against nginx with a self-signed certificate: trusted through
// ca_file, the same bytes as over http, whole, ranged and streamed; without
// it, a DataError naming the URL and the certificate, not retried.
TEST(HttpsGet, ACertificateTrustedThroughCaFileGivesTheSameBytesAndAnUntrustedOneIsRefused) {
  CONVEYOR_NGINX_SKIP_WITHOUT(!NginxServer::binary().empty());
  NginxServer server;
  for (int i = 0; i < 20; ++i) server.write_file(object_path(i).substr(1), object_bytes(i));
  const std::string ca_file = server.enable_tls();
  CONVEYOR_SKIP_WITHOUT(!ca_file.empty(), "openssl");
  server.start();
  std::vector<std::string> urls;
  for (int i = 0; i < 20; ++i) urls.push_back(server.https_url(object_path(i)));

  auto pipeline = from_vector(urls) | http_get({.max_in_flight = 4, .ca_file = ca_file});
  for (int pass_number = 0; pass_number < 2; ++pass_number) {
    int i = 0;
    for (HttpObject& object : pipeline.pass()) {
      EXPECT_EQ(object.url, urls[static_cast<size_t>(i)]);
      ASSERT_EQ(std::string(object.bytes.begin(), object.bytes.end()), object_bytes(i)) << "object " << i;
      ++i;
    }
    EXPECT_EQ(i, 20);
  }
  auto ranged = from_vector(std::vector<HttpRange>{{urls[9], 100, 1000}}) | http_get({.ca_file = ca_file});
  auto ranged_pass = ranged.pass();
  std::optional<HttpObject> range = ranged_pass.next();
  ASSERT_TRUE(range);
  EXPECT_EQ(std::string(range->bytes.begin(), range->bytes.end()), object_bytes(9).substr(100, 1000));
  const std::unique_ptr<ByteStream> stream = http_opener({.ca_file = ca_file})(urls[7]);
  ASSERT_TRUE(stream);
  std::string streamed;
  std::vector<uint8_t> buffer(4096);
  while (const size_t got = stream->read(buffer)) streamed.append(buffer.begin(), buffer.begin() + static_cast<std::ptrdiff_t>(got));
  EXPECT_EQ(streamed, object_bytes(7));

  auto untrusted = from_vector(std::vector<std::string>{urls[1]}) | http_get({.retries = 3});
  auto untrusted_pass = untrusted.pass();
  const DataError error = next_error(untrusted_pass);
  EXPECT_EQ(error.file(), urls[1]);
  EXPECT_NE(std::string(error.what()).find("certificate"), std::string::npos) << error.what();
  EXPECT_EQ(std::string(error.what()).find("attempts"), std::string::npos) << "retried: " << error.what();
}

TEST(HttpGetOptions, OutOfRangeIsAValueError) {
  EXPECT_THROW(http_get({.max_in_flight = 0}), ValueError);
  EXPECT_THROW(http_get({.retries = -1}), ValueError);
  EXPECT_THROW(http_get({.connect_timeout = milliseconds(0)}), ValueError);
  EXPECT_THROW(http_get({.max_bytes = 0}), ValueError);
  try {
    (void)http_get({.ca_file = "/no/such/ca.pem"});
    ADD_FAILURE() << "a missing ca_file was accepted";
  } catch (const ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("/no/such/ca.pem"), std::string::npos) << e.what();
  }
  EXPECT_THROW(http_opener({.ca_file = "/"}), ValueError);
  try {
    (void)http_get({.stall_timeout = std::chrono::seconds(-1)});
    ADD_FAILURE() << "a negative stall_timeout was accepted";
  } catch (const ValueError& e) {
    EXPECT_STREQ(e.what(), "http_get: stall_timeout should be in [0, 86400] s, but got -1");
  }
}

// A server that accepted the connections and went silent: each object is
// cut after stall_timeout and retried, then a DataError naming its URL, in
// its place, with no total_timeout at all.
TEST(HttpGetStalled, ASilentServerIsCutByTheStallTimeout) {
  conveyor::test::SilentServer silent;
  const std::vector<std::string> urls = {silent.url("/a.bin"), silent.url("/b.bin")};
  auto pipeline = from_vector(urls) | http_get({.total_timeout = milliseconds(0), .stall_timeout = std::chrono::seconds(1),
                                                .retries = 1, .backoff = milliseconds(1)});
  auto pass = pipeline.pass();
  for (const std::string& url : urls) {
    const DataError error = next_error(pass);
    EXPECT_EQ(error.file(), url);
    const std::string what = error.what();
    EXPECT_NE(what.find("Operation too slow"), std::string::npos) << what;
    EXPECT_NE(what.find("(after 2 attempts)"), std::string::npos) << what;
  }
  EXPECT_FALSE(pass.next());
}

// The server stopped mid-pass: every object is either whole or a DataError
// naming its URL, in its place; none lost or duplicated; no hang.
TEST(HttpGetServerStopped, MidPassGivesErrorsNotHangs) {
  CONVEYOR_NGINX_SKIP_WITHOUT(!NginxServer::binary().empty());
  NginxServer server;
  std::vector<std::string> urls;
  for (int i = 0; i < kObjects; ++i) {
    server.write_file(object_path(i).substr(1), object_bytes(i));
  }
  server.start();
  for (int i = 0; i < kObjects; ++i) urls.push_back(server.url(object_path(i)));
  auto pipeline = from_vector(urls) | http_get({.max_in_flight = 8, .connect_timeout = milliseconds(2000),
                                                .total_timeout = milliseconds(5000), .retries = 1,
                                                .backoff = milliseconds(5)});
  auto pass = pipeline.pass();
  const auto start = std::chrono::steady_clock::now();
  int objects = 0, errors = 0;
  for (int i = 0; i < kObjects; ++i) {
    if (i == 20) server.stop();
    try {
      auto object = pass.next();
      ASSERT_TRUE(object) << "item " << i;
      EXPECT_EQ(object->url, urls[static_cast<size_t>(i)]);
      EXPECT_EQ(std::string(object->bytes.begin(), object->bytes.end()), object_bytes(i)) << "item " << i;
      ++objects;
    } catch (const DataError& error) {
      EXPECT_GE(i, 20);
      EXPECT_EQ(error.file(), urls[static_cast<size_t>(i)]);
      ++errors;
    }
  }
  EXPECT_FALSE(pass.next());
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(10));
  EXPECT_GE(objects, 20);
  EXPECT_GT(errors, 0);
  EXPECT_EQ(objects + errors, kObjects);
}

// A response sends 500 bytes past its Content-Length once the client has
// read it whole (scripted_server.h); the next object's GET on that kept
// connection finds them where its status line should be ("Received
// HTTP/0.9") and is tried again on a new connection, uncounted.
TEST(HttpGetScripted, BytesPastAContentLengthDoNotFailTheNextObject) {
  using conveyor::test::ScriptedServer;
  const std::string second(1000, 'b');
  std::promise<void> send_stray, stray_sent;
  ScriptedServer server([&](int fd, const ScriptedServer::Request& request) {
    if (request.number == 0) {
      ScriptedServer::send_all(fd, "HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\n" + std::string(1000, 'a'));
      send_stray.get_future().wait_for(std::chrono::seconds(10));
      ScriptedServer::send_all(fd, std::string(500, 'x'));  // past the length
      ScriptedServer::wait_acknowledged(fd);
      stray_sent.set_value();
      return true;
    }
    ScriptedServer::send_all(fd, "HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\n" + second);
    return true;
  });
  const std::vector<std::string> urls = {server.url("/first.bin"), server.url("/second.bin")};
  auto pipeline = from_vector(urls) | http_get({.max_in_flight = 1, .retries = 0});
  auto pass = pipeline.pass();
  std::optional<HttpObject> first = pass.next();  // the second is not asked for before this one is handed out
  ASSERT_TRUE(first);
  EXPECT_EQ(first->bytes, std::vector<uint8_t>(1000, 'a'));
  send_stray.set_value();
  stray_sent.get_future().wait();
  try {
    std::optional<HttpObject> object = pass.next();
    ASSERT_TRUE(object);
    EXPECT_EQ(object->url, urls[1]);
    EXPECT_EQ(std::string(object->bytes.begin(), object->bytes.end()), second);
  } catch (const DataError& error) {
    ADD_FAILURE() << error.what();
  }
  // The second object's request on the kept connection (unless the server
  // saw it closed first), then on a new one.
  const std::vector<ScriptedServer::Request> requests = server.requests();
  ASSERT_GE(requests.size(), 2u);
  EXPECT_TRUE(requests.back().head.starts_with("GET /second.bin ")) << requests.back().head;
  EXPECT_EQ(requests.back().connection, 2);
}

// A 206 whose body stops short of its own Content-Range ("bytes
// 100-199/1000" with 50 bytes, by a Content-Length of 50 or by chunks) is
// a short transfer: tried again, then a DataError naming what it carried.
// Before, the 50 bytes were handed out as the 100-byte range, no error.
TEST(HttpGetScripted, A206ShorterThanItsContentRangeIsRetriedThenADataError) {
  using conveyor::test::ScriptedServer;
  std::string object(1000, '\0');
  for (size_t i = 0; i < object.size(); ++i) object[i] = static_cast<char>('a' + i % 26);
  for (const bool chunked : {false, true}) {
    SCOPED_TRACE(chunked ? "chunked" : "Content-Length: 50");
    ScriptedServer server([&](int fd, const ScriptedServer::Request&) {
      const std::string body = object.substr(100, 50);
      ScriptedServer::send_all(fd, "HTTP/1.1 206 Partial Content\r\nContent-Range: bytes 100-199/1000\r\n" +
                                       (chunked ? "Transfer-Encoding: chunked\r\n\r\n32\r\n" + body + "\r\n0\r\n\r\n"
                                                : "Content-Length: 50\r\n\r\n" + body));
      return true;
    });
    const std::string url = server.url("/object.bin");
    auto pipeline = from_vector(std::vector<HttpRange>{{url, 100, 100}}) |
                    http_get({.max_in_flight = 1, .retries = 2, .backoff = milliseconds(1)});
    auto pass = pipeline.pass();
    try {
      std::optional<HttpObject> got = pass.next();
      ADD_FAILURE() << "got " << (got ? got->bytes.size() : 0) << " bytes for the 100-byte range, no error";
    } catch (const DataError& error) {
      EXPECT_EQ(error.file(), url);
      EXPECT_NE(std::string(error.what())
                    .find("the server's 206 for the range bytes 100-199 (Content-Range 'bytes 100-199/1000') ended "
                          "after 50 of its 100 bytes (after 3 attempts)"),
                std::string::npos)
          << error.what();
    }
    EXPECT_EQ(server.requests().size(), 3u);
  }
}

// An error status's body is not read through: a server's endless 404 page
// (chunked, so no length to refuse it by) ends the item at its first bytes,
// while the server still holds the rest back.
TEST(HttpGetScripted, AnErrorStatusStopsAtItsBodysFirstBytes) {
  using conveyor::test::ScriptedServer;
  std::promise<void> error_seen;
  std::shared_future<void> seen = error_seen.get_future().share();
  std::atomic<bool> server_gave_up{false};
  ScriptedServer server([&](int fd, const ScriptedServer::Request&) {
    ScriptedServer::send_all(fd, "HTTP/1.1 404 Not Found\r\nTransfer-Encoding: chunked\r\n\r\n1000\r\n" +
                                     std::string(0x1000, 'x') + "\r\n");
    if (seen.wait_for(std::chrono::seconds(10)) != std::future_status::ready) server_gave_up = true;
    return false;
  });
  auto pipeline = from_vector(std::vector<std::string>{server.url("/missing.bin")}) | http_get({.retries = 0});
  auto pass = pipeline.pass();
  try {
    (void)pass.next();
    ADD_FAILURE() << "a 404 gave an object";
  } catch (const DataError& error) {
    EXPECT_NE(std::string(error.what()).find("HTTP 404"), std::string::npos) << error.what();
  }
  EXPECT_FALSE(server_gave_up) << "the 404's body was read until the server gave up";
  error_seen.set_value();
  EXPECT_FALSE(pass.next());
}

// An error status whose Content-Length is over max_bytes is that status,
// not "the object is too big".
TEST(HttpGetScripted, AnErrorStatusOverMaxBytesIsNamedByItsStatus) {
  using conveyor::test::ScriptedServer;
  ScriptedServer server([&](int fd, const ScriptedServer::Request&) {
    ScriptedServer::send_all(fd, "HTTP/1.1 503 Service Unavailable\r\nContent-Length: 5000\r\n\r\n" +
                                     std::string(5000, 'x'));
    return true;
  });
  auto pipeline = from_vector(std::vector<std::string>{server.url("/busy.bin")}) |
                  http_get({.retries = 1, .backoff = milliseconds(1), .max_bytes = 1000});
  auto pass = pipeline.pass();
  try {
    (void)pass.next();
    ADD_FAILURE() << "a 503 gave an object";
  } catch (const DataError& error) {
    const std::string what = error.what();
    EXPECT_NE(what.find("HTTP 503 (after 2 attempts)"), std::string::npos) << what;
    EXPECT_EQ(what.find("max_bytes"), std::string::npos) << what;
  }
  EXPECT_EQ(server.requests().size(), 2u);  // a 5xx is tried again
}

// A 206 where the whole object was asked for (no Range sent) is part of
// it: handed out as the object before, 10 bytes of 1000, no error. Not
// tried again: the server answers the same.
TEST(HttpGetScripted, A206ToARequestForTheWholeObjectIsADataError) {
  using conveyor::test::ScriptedServer;
  ScriptedServer server([&](int fd, const ScriptedServer::Request&) {
    ScriptedServer::send_all(
        fd, "HTTP/1.1 206 Partial Content\r\nContent-Range: bytes 0-9/1000\r\nContent-Length: 10\r\n\r\n0123456789");
    return true;
  });
  const std::string url = server.url("/object.bin");
  auto pipeline = from_vector(std::vector<std::string>{url}) |
                  http_get({.max_in_flight = 1, .retries = 2, .backoff = milliseconds(1)});
  auto pass = pipeline.pass();
  try {
    std::optional<HttpObject> got = pass.next();
    ADD_FAILURE() << "handed out " << (got ? got->bytes.size() : 0) << " bytes of a 1000-byte object as the object";
  } catch (const DataError& error) {
    EXPECT_EQ(error.file(), url);
    EXPECT_NE(std::string(error.what())
                  .find("http_get: the server answered a request for the whole object with 206 Partial Content "
                        "(Content-Range 'bytes 0-9/1000')"),
              std::string::npos)
        << error.what();
  }
  EXPECT_EQ(server.requests().size(), 1u);
}

// An open range ("bytes 100-") answered by a 206 whose body runs past its
// own Content-Range: the bytes past it are not the object's. Before, all
// 1000 were handed out for the 100-byte range the server promised.
TEST(HttpGetScripted, AnOpenRangesBodyPastItsContentRangeIsADataError) {
  using conveyor::test::ScriptedServer;
  ScriptedServer server([&](int fd, const ScriptedServer::Request&) {
    ScriptedServer::send_all(fd,
                             "HTTP/1.1 206 Partial Content\r\nContent-Range: bytes 100-199/200\r\nContent-Length: "
                             "1000\r\n\r\n" +
                                 std::string(1000, 'x'));
    return true;
  });
  const std::string url = server.url("/object.bin");
  auto pipeline = from_vector(std::vector<HttpRange>{{url, 100, std::nullopt}}) |
                  http_get({.max_in_flight = 1, .retries = 0});
  auto pass = pipeline.pass();
  try {
    std::optional<HttpObject> got = pass.next();
    ADD_FAILURE() << "handed out " << (got ? got->bytes.size() : 0) << " bytes for 'bytes 100-199/200'";
  } catch (const DataError& error) {
    EXPECT_NE(std::string(error.what())
                  .find("the server sent 1000 bytes for the range bytes 100- (Content-Range 'bytes 100-199/200')"),
              std::string::npos)
        << error.what();
  }
}

// max_bytes bounds the object, not a redirect's own page on the way: a 302
// with a 200-byte page to a 10-byte object under max_bytes 100 was refused
// as "the server declares more bytes than max_bytes" (libcurl's
// CURLOPT_MAXFILESIZE checks every response).
TEST(HttpGetScripted, ARedirectsPageOverMaxBytesDoesNotCountAsTheObject) {
  using conveyor::test::ScriptedServer;
  ScriptedServer server([&](int fd, const ScriptedServer::Request& request) {
    if (request.head.starts_with("GET /a ")) {
      ScriptedServer::send_all(fd, "HTTP/1.1 302 Found\r\nLocation: /b\r\nContent-Length: 200\r\n\r\n" +
                                       std::string(200, 'r'));
    } else {
      ScriptedServer::send_all(fd, "HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\n0123456789");
    }
    return true;
  });
  auto pipeline = from_vector(std::vector<std::string>{server.url("/a")}) |
                  http_get({.max_in_flight = 1, .retries = 0, .max_bytes = 100});
  auto pass = pipeline.pass();
  std::optional<HttpObject> got = pass.next();
  ASSERT_TRUE(got);
  EXPECT_EQ(std::string(got->bytes.begin(), got->bytes.end()), "0123456789");
}

// A 3xx that is not followed (no Location) hands its own body on: it is
// not kept, and past max_bytes it is stopped, as an error status's body is,
// not read through (a chunked page here, so no length to refuse it by).
TEST(HttpGetScripted, AnUnfollowedRedirectsBodyStopsPastMaxBytes) {
  using conveyor::test::ScriptedServer;
  std::promise<void> error_seen;
  std::shared_future<void> seen = error_seen.get_future().share();
  std::atomic<bool> server_gave_up{false};
  ScriptedServer server([&](int fd, const ScriptedServer::Request&) {
    ScriptedServer::send_all(fd, "HTTP/1.1 300 Multiple Choices\r\nTransfer-Encoding: chunked\r\n\r\n1000\r\n" +
                                     std::string(0x1000, 'x') + "\r\n");
    if (seen.wait_for(std::chrono::seconds(10)) != std::future_status::ready) server_gave_up = true;
    return false;
  });
  auto pipeline = from_vector(std::vector<std::string>{server.url("/choices")}) |
                  http_get({.retries = 0, .max_bytes = 1000});
  auto pass = pipeline.pass();
  try {
    (void)pass.next();
    ADD_FAILURE() << "a 300 gave an object";
  } catch (const DataError& error) {
    EXPECT_NE(std::string(error.what()).find("HTTP 300"), std::string::npos) << error.what();
  }
  EXPECT_FALSE(server_gave_up) << "the 300's body was read until the server gave up";
  error_seen.set_value();
}

#ifdef CONVEYOR_IO_TEST_FORMATS
TEST(HttpShardPattern, BracesExpandInUrls) {
  EXPECT_EQ(expand_shard_pattern("http://127.0.0.1:8080/data/shard-{000008..000010}.tar"),
            (std::vector<std::string>{"http://127.0.0.1:8080/data/shard-000008.tar",
                                      "http://127.0.0.1:8080/data/shard-000009.tar",
                                      "http://127.0.0.1:8080/data/shard-000010.tar"}));
  EXPECT_EQ(expand_shard_pattern("https://host/a?x=1"), (std::vector<std::string>{"https://host/a?x=1"}));
}
#endif

}  // namespace
}  // namespace conveyor::nodes
