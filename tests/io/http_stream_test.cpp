// Tar shards streamed over HTTP (http_opener) into untar and TarShardDataset,
// against a real nginx on loopback (nginx_server.h).
#include <gtest/gtest.h>

#ifdef CONVEYOR_IO_TEST_FORMATS
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <future>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <span>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "conveyor/data_error.h"
#include "conveyor/nodes/files.h"
#include "conveyor/nodes/http.h"
#include "conveyor/nodes/sources.h"
#include "conveyor/tar_shards.h"
#include "nginx_server.h"
#include "scripted_server.h"
#include "support/archive_events.h"

namespace conveyor::nodes {
namespace {

namespace fs = std::filesystem;
using conveyor::test::NginxServer;
using std::chrono::milliseconds;

constexpr int kShards = 3;
constexpr int kSamplesPerShard = 7;

// Sample i: a payload of a few KiB (varied, from an LCG) and its class.
conveyor::SampleFields sample_fields(int i) {
  std::vector<uint8_t> payload(1000 + static_cast<size_t>(i) * 613 % 9000);
  uint32_t state = 2654435761u * static_cast<uint32_t>(i + 1);
  for (uint8_t& byte : payload) {
    state = state * 1664525u + 1013904223u;
    byte = static_cast<uint8_t>(state >> 24);
  }
  const std::string label = std::to_string(i % 10);
  return {{"bin", payload}, {"cls", std::vector<uint8_t>(label.begin(), label.end())}};
}

std::string key_of(int i) {
  std::string name = std::to_string(i);
  return std::string(6 - name.size(), '0') + name;
}

class HttpShardTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    if (NginxServer::binary().empty()) return;
    server_ = std::make_unique<NginxServer>();
    const std::string shards = server_->www() + "/shards";
    fs::create_directories(shards);
    TarShardWriter writer(shards + "/part-", kSamplesPerShard);
    for (int i = 0; i < kShards * kSamplesPerShard; ++i) writer.write(key_of(i), sample_fields(i));
    local_ = writer.close();
    // One small sample in a shard served at 1 KiB/s (nginx's limit_rate).
    fs::create_directories(server_->www() + "/slow");
    TarShardWriter slow(server_->www() + "/slow/tiny-", 1);
    slow.write("000000", {{"bin", std::vector<uint8_t>(600, 7)}, {"cls", {'3'}}});
    slow.close();
    server_->write_file("resume-elsewhere/object.bin", std::string(8000, 'x'));
    server_->start();
  }
  static void TearDownTestSuite() { server_.reset(); }
  void SetUp() override {
    CONVEYOR_NGINX_SKIP_WITHOUT(server_ != nullptr);
  }

  static std::string url_pattern() {
    return server_->url("/shards/part-{000000..00000" + std::to_string(kShards - 1) + "}.tar");
  }
  static std::vector<std::string> urls() { return expand_shard_pattern(url_pattern()); }

  static std::unique_ptr<NginxServer> server_;
  static std::vector<std::string> local_;
};
std::unique_ptr<NginxServer> HttpShardTest::server_;
std::vector<std::string> HttpShardTest::local_;

std::vector<ShardSample> drain(IterableDataset<ShardSample>& dataset) {
  std::vector<ShardSample> samples;
  auto iterator = dataset.iter(nullptr);
  while (std::optional<ShardSample> sample = iterator->next()) samples.push_back(std::move(*sample));
  return samples;
}

TEST_F(HttpShardTest, ShardsOverHttpGiveWhatTheSameShardsOnDiskGive) {
  TarShardOptions local;
  local.shards = local_;
  TarShardDataset from_disk(local);
  const std::vector<ShardSample> expected = drain(from_disk);
  ASSERT_EQ(expected.size(), static_cast<size_t>(kShards * kSamplesPerShard));

  TarShardOptions remote;
  remote.shards = {url_pattern()};  // a brace pattern works where a shard path does
  remote.open = http_opener();
  TarShardDataset over_http(remote);
  ASSERT_EQ(over_http.options().shards, urls());
  for (int pass = 0; pass < 2; ++pass) {
    const std::vector<ShardSample> got = drain(over_http);
    ASSERT_EQ(got.size(), expected.size()) << "pass " << pass;
    for (size_t i = 0; i < got.size(); ++i) {
      EXPECT_EQ(got[i].key, expected[i].key);
      EXPECT_EQ(got[i].shard, urls()[i / kSamplesPerShard]);  // named by its URL
      EXPECT_EQ(got[i].fields, expected[i].fields) << got[i].key;
    }
  }
  // Each shard was asked for once per pass, whole (no range needed).
  for (int shard = 0; shard < kShards; ++shard) {
    const std::string path = "/shards/part-00000" + std::to_string(shard) + ".tar";
    EXPECT_EQ(server_->statuses_logged(path), (std::vector<int>{200, 200})) << path;
  }
}

// A stream's connection serves the next one. untar stops reading a shard at
// its first end-of-archive block, before the end of the response: the rest
// is read and dropped rather than the connection closed. Two connections at
// most: untar opens the next shard while it reads this one.
TEST_F(HttpShardTest, ShardsReuseTheirConnections) {
  // The suite's server has answered other tests too: only this test's
  // requests, the log's lines after `before`, count.
  const auto logged = [] {
    std::vector<std::vector<uint64_t>> connections;
    for (int shard = 0; shard < kShards; ++shard) {
      connections.push_back(server_->connections_logged("/shards/part-00000" + std::to_string(shard) + ".tar"));
    }
    return connections;
  };
  const std::vector<std::vector<uint64_t>> before = logged();
  constexpr int kPasses = 3;
  auto members = from_vector(urls()) | untar({.open = http_opener()});
  for (int pass = 0; pass < kPasses; ++pass) {
    size_t count = 0;
    for (auto& member : members.pass()) {
      EXPECT_FALSE(member.bytes.empty());
      ++count;
    }
    ASSERT_EQ(count, 2u * kShards * kSamplesPerShard);
  }
  const std::vector<std::vector<uint64_t>> after = logged();
  std::set<uint64_t> used;
  for (int shard = 0; shard < kShards; ++shard) {
    ASSERT_EQ(after[shard].size(), before[shard].size() + kPasses) << "shard " << shard;
    used.insert(after[shard].begin() + static_cast<std::ptrdiff_t>(before[shard].size()), after[shard].end());
  }
  EXPECT_LE(used.size(), 2u) << kPasses * kShards << " requests on " << used.size() << " connections";
}

TEST_F(HttpShardTest, UntarOverUrlsAndPathsMixed) {
  // The opener declines what is not a URL: untar reads it from disk.
  auto members = from_vector(std::vector<std::string>{urls()[0], local_[1]}) | untar({.open = http_opener()});
  size_t count = 0;
  for (auto& member : members.pass()) {
    EXPECT_EQ(member.archive, count < 2 * kSamplesPerShard ? urls()[0] : local_[1]);
    ++count;
  }
  EXPECT_EQ(count, 4u * kSamplesPerShard);
}

// A URL pattern reaching untar as one path is refused in its place, and no
// request goes out for it (untar opens the next URL ahead: not a pattern).
TEST_F(HttpShardTest, AUrlPatternGivenToUntarIsRefusedWithoutARequest) {
  const std::string pattern_path = "/shards/part-{000000..00000" + std::to_string(kShards - 1) + "}.tar";
  const auto requested = [&] {
    return server_->requests_logged(pattern_path) + server_->requests_logged("/shards/part-%7B000000..00000" +
                                                                             std::to_string(kShards - 1) + "%7D.tar");
  };
  const int before = requested();
  auto members = from_vector(std::vector<std::string>{urls()[0], url_pattern(), urls()[1]}) |
                 untar({.open = http_opener()});
  auto pass = members.pass();
  const std::vector<std::string> events = conveyor::testing::archive_events(pass, [](const DataError& e) {
    EXPECT_EQ(e.file(), url_pattern());
    EXPECT_NE(std::string(e.what()).find("from_shard_patterns"), std::string::npos) << e.what();
  });
  EXPECT_EQ(events, (std::vector<std::string>{urls()[0], "error", urls()[1]}));
  EXPECT_EQ(requested(), before);
}

// A 404 and a closed connection (nginx's 444) between two shards: each is
// a DataError in its place naming the URL, or skipped and counted once.
TEST_F(HttpShardTest, MissingShardIsADataErrorNamingTheUrlAndStatusOrSkipped) {
  TarShardOptions options;
  options.shards = {urls()[0], server_->url("/shards/absent.tar"), server_->url("/reset/part-000001.tar"),
                    urls()[1]};
  options.open = http_opener({.retries = 0});
  TarShardDataset raising(options);
  auto iterator = raising.iter(nullptr);
  std::vector<std::string> events;
  while (true) {
    try {
      std::optional<ShardSample> sample = iterator->next();
      if (!sample) break;
      events.push_back(sample->key);
    } catch (const DataError& error) {
      const bool missing = events.size() == kSamplesPerShard;
      EXPECT_EQ(error.file(), options.shards[missing ? 1 : 2]);
      EXPECT_NE(std::string(error.what()).find(missing ? "HTTP 404" : "Server returned nothing"), std::string::npos)
          << error.what();
      events.push_back("error");
    }
  }
  ASSERT_EQ(events.size(), 2u * kSamplesPerShard + 2);
  EXPECT_EQ(events[kSamplesPerShard], "error");
  EXPECT_EQ(events[kSamplesPerShard + 1], "error");

  options.on_error = OnError::skip;
  TarShardDataset skipping(options);
  const std::vector<ShardSample> kept = drain(skipping);
  ASSERT_EQ(kept.size(), 2u * kSamplesPerShard);
  for (size_t i = 0; i < kept.size(); ++i) EXPECT_EQ(kept[i].key, key_of(static_cast<int>(i)));
  EXPECT_EQ(skipping.skipped(), 2u);
}

TEST_F(HttpShardTest, ServerErrorsAreRetriedThenReported) {
  const std::string url = server_->url("/error500/part-000000.tar");
  TarShardOptions options;
  options.shards = {url};
  options.open = http_opener({.retries = 2, .backoff = milliseconds(1)});
  TarShardDataset dataset(options);
  try {
    drain(dataset);
    FAIL() << "no DataError";
  } catch (const DataError& error) {
    EXPECT_EQ(error.file(), url);
    EXPECT_NE(std::string(error.what()).find("HTTP 500 (after 3 attempts)"), std::string::npos) << error.what();
  }
  EXPECT_EQ(server_->statuses_logged("/error500/part-000000.tar"), (std::vector<int>{500, 500, 500}));
}

// An error with an empty body (Content-Length: 0) is named by its status,
// as one with a body is, and a 5xx is retried.
TEST_F(HttpShardTest, AnErrorWithAnEmptyBodyIsNamedByItsStatus) {
  std::vector<uint8_t> block(4096);
  for (const int status : {503, 404}) {
    const std::string path = "/empty" + std::to_string(status) + "/part-000000.tar";
    const std::string url = server_->url(path);
    std::unique_ptr<ByteStream> stream = http_opener({.retries = 2, .backoff = milliseconds(1)})(url);
    ASSERT_NE(stream, nullptr);
    try {
      stream->read(block);
      ADD_FAILURE() << "no DataError for " << path;
    } catch (const DataError& error) {
      EXPECT_EQ(error.file(), url);
      const std::string expected = status == 503 ? "HTTP 503 (after 3 attempts)" : "HTTP 404";
      EXPECT_NE(std::string(error.what()).find(expected), std::string::npos) << error.what();
    }
    EXPECT_EQ(server_->statuses_logged(path), std::vector<int>(status == 503 ? 3 : 1, status));
  }
}

// A chunked response (no length to check a resume by) is cut by
// total_timeout and resumed with a range, which the server answers from
// byte 0 (Content-Range: bytes 0-2/3): refused, not spliced onto the bytes
// already read.
TEST_F(HttpShardTest, AResumeAnsweredFromAnotherByteIsRefused) {
  const std::string path = "/resume-elsewhere/object.bin";
  const std::string url = server_->url(path);
  std::unique_ptr<ByteStream> stream =
      http_opener({.total_timeout = milliseconds(700), .retries = 3, .backoff = milliseconds(1)})(url);
  ASSERT_NE(stream, nullptr);
  std::vector<uint8_t> block(4096);
  uint64_t got = 0;
  try {
    while (const size_t count = stream->read(block)) got += count;
    ADD_FAILURE() << "the stream ended after " << got << " bytes without an error";
  } catch (const DataError& error) {
    EXPECT_EQ(error.file(), url);
    EXPECT_NE(std::string(error.what()).find("was answered with Content-Range: bytes 0-2/3"), std::string::npos)
        << error.what();
  }
  EXPECT_GT(got, 0u) << "the first attempt brought no byte: nothing was resumed";
  EXPECT_LT(got, 8000u);
  const std::vector<int> statuses = server_->statuses_logged(path);
  ASSERT_FALSE(statuses.empty());
  EXPECT_EQ(statuses.back(), 206);
}

// A server that accepted the connection and went silent is cut after
// stall_timeout and retried, then reported, with no total_timeout at all.
// A reader slower than the server is not a stall: its paused transfer
// goes on, on one request.
TEST_F(HttpShardTest, ASilentServerIsCutByTheStallTimeoutAndASlowReaderIsNot) {
  conveyor::test::SilentServer silent;
  const std::string url = silent.url("/part-000000.tar");
  const HttpOptions options{.total_timeout = milliseconds(0), .stall_timeout = std::chrono::seconds(1),
                            .retries = 1, .backoff = milliseconds(1)};
  std::unique_ptr<ByteStream> stream = http_opener(options)(url);
  ASSERT_NE(stream, nullptr);
  std::vector<uint8_t> block(4096);
  try {
    stream->read(block);
    ADD_FAILURE() << "a silent server gave no DataError";
  } catch (const DataError& error) {
    EXPECT_EQ(error.file(), url);
    EXPECT_NE(std::string(error.what()).find("(after 2 attempts)"), std::string::npos) << error.what();
  }

  // 8 MiB: far past what the stream buffers (1 MiB) before it pauses.
  const std::string object(8u << 20, 'y');
  const std::string path = "/stall/big.bin";
  server_->write_file(path.substr(1), object);
  std::unique_ptr<ByteStream> slow_reader = http_opener(options)(server_->url(path));
  uint64_t got = slow_reader->read(block);
  std::this_thread::sleep_for(std::chrono::milliseconds(2500));  // the reader away, past stall_timeout
  while (const size_t count = slow_reader->read(block)) got += count;
  EXPECT_EQ(got, object.size());
  EXPECT_EQ(server_->statuses_logged(path), std::vector<int>{200});
}

// Every attempt is cut by total_timeout long before the throttled shard is
// through; each resumes with a range where the last stopped, so the shard
// arrives whole. (retries counts attempts in a row without a new byte.)
TEST_F(HttpShardTest, AThrottledShardCutByTimeoutsResumesUntilWhole) {
  TarShardOptions options;
  options.shards = {server_->url("/slow/tiny-000000.tar")};
  options.open = http_opener({.total_timeout = milliseconds(700), .retries = 2, .backoff = milliseconds(1)});
  TarShardDataset dataset(options);
  const std::vector<ShardSample> samples = drain(dataset);
  ASSERT_EQ(samples.size(), 1u);
  EXPECT_EQ(samples[0].fields.at("bin"), std::vector<uint8_t>(600, 7));
  EXPECT_EQ(samples[0].fields.at("cls"), std::vector<uint8_t>{'3'});
  const std::vector<int> statuses = server_->statuses_logged("/slow/tiny-000000.tar");
  EXPECT_GE(std::count(statuses.begin(), statuses.end(), 206), 1) << "no attempt resumed with a range";
}

TEST_F(HttpShardTest, AClosedConnectionIsRetriedThenReported) {
  const std::string url = server_->url("/reset/part-000000.tar");  // nginx's 444: closed, no answer
  TarShardOptions options;
  options.shards = {url};
  options.open = http_opener({.retries = 1, .backoff = milliseconds(1)});
  TarShardDataset dataset(options);
  try {
    drain(dataset);
    FAIL() << "no DataError";
  } catch (const DataError& error) {
    EXPECT_EQ(error.file(), url);
    EXPECT_NE(std::string(error.what()).find("(after 2 attempts)"), std::string::npos) << error.what();
  }
}

// The server stops for good in the middle of a shard: the samples before
// the cut arrive once each, in order, then the shard's retries find nothing
// listening and it ends as a DataError naming its URL; under
// OnError::skip the same samples arrive and the cut shard is counted.
TEST(HttpShardServerStopped, MidShardTheSamplesBeforeTheCutArriveOnceThenADataErrorOrASkip) {
  CONVEYOR_NGINX_SKIP_WITHOUT(!NginxServer::binary().empty());
  constexpr int kBigSamples = 40;  // 1 MiB each: most of the shard is still on the server at the cut
  for (const OnError on_error : {OnError::raise, OnError::skip}) {
    NginxServer server;
    const std::string shards = server.www() + "/big";
    fs::create_directories(shards);
    TarShardWriter writer(shards + "/part-", kBigSamples);
    for (int i = 0; i < kBigSamples; ++i) {
      writer.write(key_of(i), {{"bin", std::vector<uint8_t>(1u << 20, static_cast<uint8_t>(i))}, {"cls", {'1'}}});
    }
    writer.close();
    server.start();
    const std::string url = server.url("/big/part-000000.tar");
    TarShardOptions options;
    options.shards = {url};
    options.open = http_opener({.retries = 2, .backoff = milliseconds(1)});
    options.on_error = on_error;
    TarShardDataset dataset(options);
    auto iterator = dataset.iter(nullptr);
    std::vector<std::string> keys;
    for (int i = 0; i < 2; ++i) {
      std::optional<ShardSample> sample = iterator->next();
      ASSERT_TRUE(sample);
      keys.push_back(sample->key);
    }
    server.stop();
    bool raised = false;
    while (true) {
      try {
        std::optional<ShardSample> sample = iterator->next();
        if (!sample) break;
        EXPECT_EQ(sample->fields.at("bin"), std::vector<uint8_t>(1u << 20, static_cast<uint8_t>(keys.size())))
            << "sample " << sample->key;
        keys.push_back(sample->key);
      } catch (const DataError& error) {
        EXPECT_EQ(error.file(), url);
        EXPECT_NE(std::string(error.what()).find("(after 3 attempts)"), std::string::npos) << error.what();
        raised = true;
      }
    }
    const bool skipping = on_error == OnError::skip;
    EXPECT_EQ(raised, !skipping);
    EXPECT_EQ(dataset.skipped(), skipping ? 1u : 0u);
    ASSERT_LT(keys.size(), static_cast<size_t>(kBigSamples)) << "the whole shard arrived: the stop cut nothing";
    for (size_t i = 0; i < keys.size(); ++i) EXPECT_EQ(keys[i], key_of(static_cast<int>(i)));  // once, in order
    std::printf("%s: %zu of %d samples before the cut\n", skipping ? "skip" : "raise", keys.size(), kBigSamples);
  }
}

TEST(HttpOpenerOptions, OutOfRangeIsAValueError) {
  EXPECT_THROW(http_opener({.retries = -1}), ValueError);
  EXPECT_THROW(http_opener({.max_bytes = 0}), ValueError);
  try {
    http_opener({.receive_buffer = (uint64_t{1} << 30) + 1});
    ADD_FAILURE() << "a receive buffer over 1 GiB was taken";
  } catch (const ValueError& e) {
    EXPECT_STREQ(e.what(), "http_opener: receive_buffer should be in [0, 1073741824] bytes, but got 1073741825");
  }
  EXPECT_NO_THROW(http_opener({.receive_buffer = 0}));  // the kernel's autotuning
  // Not a URL: declined, read as a local file by the caller.
  EXPECT_EQ(http_opener()("/data/part-000000.tar"), nullptr);
}

// A stream cut mid-object (the server restarted on its port) resumes with a
// byte range, or from the start where the server refuses ranges, and gives
// exactly the object's bytes, copied out or lent in place.
class HttpStreamResume : public ::testing::TestWithParam<bool> {};

TEST_P(HttpStreamResume, AStreamCutMidObjectResumesWhereItStopped) {
  CONVEYOR_NGINX_SKIP_WITHOUT(!NginxServer::binary().empty());
  const bool ranges = GetParam();
  NginxServer server;
  // 32 MiB: far more than the stream buffers (1 MiB) and loopback's socket
  // buffers hold, so most of it is still on the server when it goes away.
  std::string object(32u << 20, '\0');
  uint32_t state = 12345;
  for (char& byte : object) {
    state = state * 1664525u + 1013904223u;
    byte = static_cast<char>(state >> 24);
  }
  const std::string path = ranges ? "/big.bin" : "/norange/big.bin";
  server.write_file(path.substr(1), object);
  server.start();
  std::unique_ptr<ByteStream> stream = http_opener({.backoff = milliseconds(1)})(server.url(path));
  ASSERT_NE(stream, nullptr);
  std::string got;
  std::vector<uint8_t> block(64 << 10);
  // Copied out (read) and lent (read_in_place) by turns: the bytes a view
  // lends stay the object's until the next call, whichever it is.
  size_t calls = 0;
  const auto take = [&] {
    if (++calls % 2 == 0) {
      const std::optional<std::span<const uint8_t>> lent = stream->read_in_place();
      if (!lent) throw std::logic_error("an HTTP stream that does not lend its buffer");
      got.append(reinterpret_cast<const char*>(lent->data()), lent->size());
      return lent->size();
    }
    const size_t count = stream->read(block);
    got.append(reinterpret_cast<const char*>(block.data()), count);
    return count;
  };
  EXPECT_EQ(stream->size(), std::nullopt);  // known once the response has begun
  take();
  EXPECT_EQ(stream->size(), std::optional<uint64_t>(object.size()));
  while (got.size() < (1u << 20)) {  // a first part, then the server goes away
    ASSERT_GT(take(), 0u);
  }
  ASSERT_TRUE(server.statuses_logged(path).empty()) << "the object was served whole before the cut";
  server.restart();
  while (take() > 0) {
  }
  EXPECT_EQ(got.size(), object.size());
  EXPECT_TRUE(got == object) << "the bytes differ";
  // A request answered after the restart: the resumed one, a range (206),
  // or the whole object again (200) where ranges are refused. (The cut one
  // may be logged at nginx's shutdown, or not.)
  const std::vector<int> statuses = server.statuses_logged(path);
  ASSERT_FALSE(statuses.empty());
  EXPECT_LE(statuses.size(), 2u);
  EXPECT_EQ(statuses.back(), ranges ? 206 : 200);
}

INSTANTIATE_TEST_SUITE_P(Ranges, HttpStreamResume, ::testing::Values(true, false),
                         [](const auto& info) { return info.param ? "WithRanges" : "ServerIgnoresRanges"; });

// Against a scripted server (scripted_server.h): what nginx will not do.
using conveyor::test::ScriptedServer;

// An object of `size` bytes; another version differs in its bytes, not its length.
std::string versioned_object(size_t size, int version) {
  std::string bytes(size, '\0');
  for (size_t i = 0; i < size; ++i) bytes[i] = static_cast<char>((i * (version == 0 ? 7 : 13)) >> 3);
  return bytes;
}

std::string read_all(ByteStream& stream) {
  std::string got;
  std::vector<uint8_t> block(4096);
  while (const size_t count = stream.read(block)) got.append(reinterpret_cast<const char*>(block.data()), count);
  return got;
}

// The DataError reading `stream` to its end throws, or a failure.
DataError read_error(ByteStream& stream) {
  try {
    const std::string got = read_all(stream);
    ADD_FAILURE() << "the stream ended after " << got.size() << " bytes without an error";
  } catch (const DataError& error) {
    return error;
  }
  return DataError("none", "");
}

// A first response of `head` (its status line and headers) and the first
// half of `body`, then a reset once the client has the half: its resume
// asks for the rest.
void send_half_then_reset(int fd, const std::string& head, const std::string& body) {
  ScriptedServer::send_all(fd, head + "\r\n" + body.substr(0, body.size() / 2));
  ScriptedServer::wait_acknowledged(fd);
}

const HttpOptions kQuick{.retries = 2, .backoff = milliseconds(1)};

// The object is replaced (same length) between a cut attempt and its
// resume. The resume asks If-Range with the first response's validator; a
// server that answers the new version, as a 206 from the byte asked (one
// that ignores If-Range) or whole (200, one that honours it), is refused:
// its bytes are not spliced onto the old version's.
TEST(HttpStreamScripted, AResumeOfAReplacedObjectIsRefusedNotSpliced) {
  constexpr size_t kSize = 100000;
  const std::string before = versioned_object(kSize, 0), after = versioned_object(kSize, 1);
  for (const bool etags : {true, false}) {
    for (const bool honours_if_range : {false, true}) {
      SCOPED_TRACE(std::string(etags ? "ETag" : "Last-Modified") + (honours_if_range ? ", 200" : ", 206"));
      const std::string old_validator = etags ? "\"v1\"" : "Mon, 01 Jan 2024 00:00:00 GMT";
      const std::string new_validator = etags ? "\"v2\"" : "Tue, 02 Jan 2024 00:00:00 GMT";
      const std::string validator_header = etags ? "ETag: " : "Last-Modified: ";
      ScriptedServer server([&](int fd, const ScriptedServer::Request& request) {
        if (!request.range_start) {
          send_half_then_reset(fd,
                               "HTTP/1.1 200 OK\r\n" + validator_header + old_validator +
                                   "\r\nContent-Length: " + std::to_string(kSize) + "\r\n",
                               before);
          return false;
        }
        const uint64_t start = honours_if_range ? 0 : *request.range_start;
        std::string head = honours_if_range ? "HTTP/1.1 200 OK\r\n"
                                            : "HTTP/1.1 206 Partial Content\r\nContent-Range: bytes " +
                                                  std::to_string(start) + "-" + std::to_string(kSize - 1) + "/" +
                                                  std::to_string(kSize) + "\r\n";
        head += validator_header + new_validator + "\r\nContent-Length: " + std::to_string(kSize - start) + "\r\n\r\n";
        ScriptedServer::send_all(fd, head + after.substr(start));
        return true;
      });
      const std::string url = server.url("/shard.tar");
      std::unique_ptr<ByteStream> stream = http_opener(kQuick)(url);
      const DataError error = read_error(*stream);
      EXPECT_EQ(error.file(), url);
      EXPECT_NE(std::string(error.what()).find("the object changed between attempts"), std::string::npos)
          << error.what();
      const std::vector<ScriptedServer::Request> requests = server.requests();
      ASSERT_EQ(requests.size(), 2u);
      EXPECT_EQ(requests[1].range_start, std::optional<uint64_t>(kSize / 2));
      EXPECT_EQ(requests[1].header("If-Range"), old_validator);
    }
  }
}

// The same object (its ETag) resumed: If-Range asked, the 206 taken.
// A 206 whose Content-Range says another total length (the object grew)
// is refused, though it starts at the byte asked and its own length fits.
TEST(HttpStreamScripted, AResumeIsTakenOnlyWhenItsTotalLengthIsTheObjects) {
  constexpr size_t kSize = 100000;
  const std::string object = versioned_object(kSize, 0);
  for (const uint64_t total : {uint64_t{kSize}, uint64_t{2 * kSize}}) {
    SCOPED_TRACE("Content-Range total " + std::to_string(total));
    ScriptedServer server([&](int fd, const ScriptedServer::Request& request) {
      if (!request.range_start) {
        send_half_then_reset(fd, "HTTP/1.1 200 OK\r\nETag: \"v1\"\r\nContent-Length: " + std::to_string(kSize) + "\r\n",
                             object);
        return false;
      }
      const uint64_t start = *request.range_start;
      ScriptedServer::send_all(fd, "HTTP/1.1 206 Partial Content\r\nETag: \"v1\"\r\nContent-Range: bytes " +
                                       std::to_string(start) + "-" + std::to_string(kSize - 1) + "/" +
                                       std::to_string(total) + "\r\nContent-Length: " + std::to_string(kSize - start) +
                                       "\r\n\r\n" + object.substr(start));
      return true;
    });
    const std::string url = server.url("/shard.tar");
    std::unique_ptr<ByteStream> stream = http_opener(kQuick)(url);
    if (total == kSize) {
      EXPECT_TRUE(read_all(*stream) == object) << "the bytes differ";
    } else {
      const DataError error = read_error(*stream);
      EXPECT_EQ(error.file(), url);
      EXPECT_NE(std::string(error.what()).find("the object changed between attempts (100000 bytes, now 200000)"),
                std::string::npos)
          << error.what();
    }
    const std::vector<ScriptedServer::Request> requests = server.requests();
    ASSERT_EQ(requests.size(), 2u);
    EXPECT_EQ(requests[1].header("If-Range"), "\"v1\"");
  }
}

// A chunked first response (no length) is cut; the resume's 206 answers
// only 10 bytes of the rest ("bytes 50000-50009/100000"). The object's
// length is Content-Range's total: the stream goes on with a range for the
// rest, and does not end there as if the object were whole.
TEST(HttpStreamScripted, A206ThatStopsShortOfTheObjectIsNotItsEnd) {
  constexpr size_t kSize = 100000;
  const std::string object = versioned_object(kSize, 0);
  ScriptedServer server([&](int fd, const ScriptedServer::Request& request) {
    if (!request.range_start) {
      char chunk_size[32];
      std::snprintf(chunk_size, sizeof chunk_size, "%zx\r\n", kSize / 2);
      ScriptedServer::send_all(fd, "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + std::string(chunk_size) +
                                       object.substr(0, kSize / 2) + "\r\n");
      ScriptedServer::wait_acknowledged(fd);
      return false;
    }
    const uint64_t start = *request.range_start;
    const uint64_t end = request.number == 1 ? start + 10 : kSize;  // the first resume: 10 bytes
    ScriptedServer::send_all(fd, "HTTP/1.1 206 Partial Content\r\nContent-Length: " + std::to_string(end - start) +
                                     "\r\nContent-Range: bytes " + std::to_string(start) + "-" +
                                     std::to_string(end - 1) + "/" + std::to_string(kSize) + "\r\n\r\n" +
                                     object.substr(start, end - start));
    return true;
  });
  std::unique_ptr<ByteStream> stream = http_opener(kQuick)(server.url("/shard.tar"));
  const std::string got = read_all(*stream);
  EXPECT_EQ(got.size(), kSize);
  EXPECT_TRUE(got == object) << "the bytes differ";
  EXPECT_EQ(stream->size(), std::optional<uint64_t>(kSize));
  std::vector<std::optional<uint64_t>> ranges;
  for (const ScriptedServer::Request& request : server.requests()) ranges.push_back(request.range_start);
  EXPECT_EQ(ranges, (std::vector<std::optional<uint64_t>>{std::nullopt, kSize / 2, kSize / 2 + 10}));
}

// A chunked first response without validators is cut after half the
// object; the resume is answered with a whole object (200) of a fifth of
// its length: the object the stream began is gone. Before, the 200's bytes
// were all dropped as already read and the stream ended cleanly at the
// cut, short of the object with no error.
TEST(HttpStreamScripted, AResumeAnsweredWithAWholeObjectEndingBeforeTheCutIsRefused) {
  constexpr size_t kSize = 100000;
  const std::string object = versioned_object(kSize, 0);
  const auto chunk = [](const std::string& bytes) {
    char size[32];
    std::snprintf(size, sizeof size, "%zx\r\n", bytes.size());
    return std::string(size) + bytes + "\r\n";
  };
  ScriptedServer server([&](int fd, const ScriptedServer::Request& request) {
    if (!request.range_start) {
      ScriptedServer::send_all(fd, "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + chunk(object.substr(0, kSize / 2)));
      ScriptedServer::wait_acknowledged(fd);
      return false;
    }
    ScriptedServer::send_all(fd, "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" +
                                     chunk(object.substr(0, kSize / 5)) + "0\r\n\r\n");
    return true;
  });
  const std::string url = server.url("/shard.tar");
  std::unique_ptr<ByteStream> stream = http_opener(kQuick)(url);
  const DataError error = read_error(*stream);
  EXPECT_EQ(error.file(), url);
  EXPECT_NE(std::string(error.what())
                .find("the object changed between attempts (it now ends at byte 20000, but 50000 bytes of it were read)"),
            std::string::npos)
      << error.what();
  EXPECT_EQ(server.requests().size(), 2u) << "not retried: another object";
}

// A response sends 500 bytes past its Content-Length once the client has
// read it whole. The next stream of the opener does not reuse that
// connection (the bytes would be read as its response: "Received
// HTTP/0.9", or worse, taken for it): a new one gives its own object.
TEST(HttpStreamScripted, BytesPastAContentLengthDoNotReachTheNextStream) {
  const std::string second = versioned_object(1000, 1);
  std::promise<void> send_stray, stray_sent;
  ScriptedServer server([&](int fd, const ScriptedServer::Request& request) {
    if (request.number == 0) {
      ScriptedServer::send_all(fd, "HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\n" + std::string(1000, 'A'));
      send_stray.get_future().wait_for(std::chrono::seconds(10));
      ScriptedServer::send_all(fd, std::string(500, 'B'));  // past the length
      ScriptedServer::wait_acknowledged(fd);
      stray_sent.set_value();
      return true;
    }
    ScriptedServer::send_all(fd, "HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\n" + second);
    return true;
  });
  StreamOpener open = http_opener(kQuick);
  EXPECT_EQ(read_all(*open(server.url("/first.tar"))), std::string(1000, 'A'));  // its connection kept
  send_stray.set_value();
  stray_sent.get_future().wait();
  const std::string url = server.url("/second.tar");
  try {
    EXPECT_TRUE(read_all(*open(url)) == second) << "the bytes differ";
  } catch (const DataError& error) {
    ADD_FAILURE() << error.what();
  }
  const std::vector<ScriptedServer::Request> requests = server.requests();
  ASSERT_EQ(requests.size(), 2u);
  EXPECT_EQ(requests[1].connection, 2);
}

// Garbage where a kept connection's next response should begin (what
// bytes past an earlier response's length look like when they arrive after
// the connection was taken) is tried again on a new connection, once.
TEST(HttpStreamScripted, GarbageOnAKeptConnectionIsRetriedOnANewOne) {
  const std::string object = versioned_object(1000, 0);
  ScriptedServer server([&](int fd, const ScriptedServer::Request& request) {
    if (request.number == 1) {
      ScriptedServer::send_all(fd, "garbage, not a status line\r\n\r\n");
      return true;
    }
    ScriptedServer::send_all(fd, "HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\n" + object);
    return true;
  });
  // No retries: the one on a new connection is not counted.
  StreamOpener open = http_opener({.retries = 0});
  EXPECT_TRUE(read_all(*open(server.url("/first.tar"))) == object);
  try {
    EXPECT_TRUE(read_all(*open(server.url("/second.tar"))) == object) << "the bytes differ";
  } catch (const DataError& error) {
    ADD_FAILURE() << error.what();
  }
  const std::vector<ScriptedServer::Request> requests = server.requests();
  ASSERT_EQ(requests.size(), 3u);
  EXPECT_EQ(requests[1].connection, 1);
  EXPECT_EQ(requests[2].connection, 2);
}

// A redirect to file:// and a redirect loop are refused; the error says
// why (libcurl's reason), with the status, not only "HTTP 302".
TEST(HttpStreamScripted, ARefusedRedirectIsNamedByItsReason) {
  ScriptedServer server([&](int fd, const ScriptedServer::Request& request) {
    const bool loop = request.head.starts_with("GET /loop");
    ScriptedServer::send_all(fd, std::string("HTTP/1.1 302 Found\r\nLocation: ") +
                                     (loop ? "/loop" : "file:///etc/passwd") + "\r\nContent-Length: 0\r\n\r\n");
    return true;
  });
  for (const std::string path : {"/file", "/loop"}) {
    const std::string url = server.url(path);
    std::unique_ptr<ByteStream> stream = http_opener(kQuick)(url);
    const DataError error = read_error(*stream);
    EXPECT_EQ(error.file(), url);
    const std::string what = error.what();
    EXPECT_NE(what.find(path == "/loop" ? "redirects" : "\"file\""), std::string::npos) << what;
    EXPECT_NE(what.find(", HTTP 302"), std::string::npos) << what;
  }
}

// A 206 to the first request, which asks for no range: part of the object.
// Read as the whole, the stream ended after those 10 bytes of 1000, no
// error. It is refused, naming its Content-Range, and not asked again.
TEST(HttpStreamScripted, A206ToARequestForTheWholeObjectIsRefused) {
  ScriptedServer server([&](int fd, const ScriptedServer::Request&) {
    ScriptedServer::send_all(
        fd, "HTTP/1.1 206 Partial Content\r\nContent-Range: bytes 500-509/1000\r\nContent-Length: 10\r\n\r\n0123456789");
    return true;
  });
  const std::string url = server.url("/object.bin");
  std::unique_ptr<ByteStream> stream = http_opener(kQuick)(url);
  const DataError error = read_error(*stream);
  EXPECT_EQ(error.file(), url);
  EXPECT_NE(std::string(error.what())
                .find("the server answered a request for the whole object with 206 Partial Content "
                      "(Content-Range: bytes 500-509/1000)"),
            std::string::npos)
      << error.what();
  EXPECT_EQ(server.requests().size(), 1u);
}

// The same with an empty body, which never reaches the body callback: it
// ended the stream as a 0-byte object.
TEST(HttpStreamScripted, AnEmpty206ToARequestForTheWholeObjectIsRefused) {
  ScriptedServer server([&](int fd, const ScriptedServer::Request&) {
    ScriptedServer::send_all(fd, "HTTP/1.1 206 Partial Content\r\nContent-Length: 0\r\n\r\n");
    return true;
  });
  const std::string url = server.url("/object.bin");
  std::unique_ptr<ByteStream> stream = http_opener(kQuick)(url);
  const DataError error = read_error(*stream);
  EXPECT_NE(std::string(error.what())
                .find("the server answered a request for the whole object with 206 Partial Content "
                      "(no Content-Range)"),
            std::string::npos)
      << error.what();
  EXPECT_EQ(server.requests().size(), 1u);
}

}  // namespace
}  // namespace conveyor::nodes
#endif
