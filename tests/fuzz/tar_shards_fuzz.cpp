// libFuzzer target: the input is one tar shard, read from memory as
// TarShardDataset reads a file. conveyor::Error is the expected answer to bad
// input; any other exception, a crash, a leak or a broken invariant below is
// a bug.
#include <conveyor/data_error.h>
#include <conveyor/nodes.h>
#include <conveyor/nodes/files.h>
#include <conveyor/tar_shards.h>

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

namespace {

bool same_samples(const std::vector<conveyor::ShardSample>& a,
                  const std::vector<conveyor::ShardSample>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    if (a[i].key != b[i].key || a[i].shard != b[i].shard || a[i].fields != b[i].fields) {
      return false;
    }
  }
  return true;
}

// What any sample read from `size` input bytes must look like.
void check_samples(const std::vector<conveyor::ShardSample>& samples, size_t size,
                   const std::vector<std::string>& required) {
  size_t payload = 0;
  for (const conveyor::ShardSample& sample : samples) {
    if (sample.key.empty() || sample.fields.empty() || sample.shard != "fuzz.tar") {
      __builtin_trap();
    }
    for (const std::string& field : required) {
      if (!sample.fields.contains(field)) __builtin_trap();
    }
    for (const auto& [field, bytes] : sample.fields) {
      if (field.empty()) __builtin_trap();
      payload += bytes.size();
    }
  }
  // Plain tar stores member data verbatim: it cannot exceed the input.
  if (payload > size) __builtin_trap();
}

// What untar makes of the input with one reader: members and the places of
// errors (their texts end in libarchive's words, which may differ).
std::vector<std::string> untar_trace(std::span<const uint8_t> bytes, conveyor::nodes::TarReader reader) {
  namespace nodes = conveyor::nodes;
  nodes::UntarOptions options;
  options.reader = reader;
  auto pipeline = nodes::from_vector(std::vector<nodes::FileBytes>{
                      nodes::FileBytes{"fuzz.tar", std::vector<uint8_t>(bytes.begin(), bytes.end())}}) |
                  nodes::untar(options);
  std::vector<std::string> events;
  auto pass = pipeline.pass();
  while (true) {
    try {
      std::optional<nodes::TarMember> member = pass.next();
      if (!member) return events;
      events.push_back("member " + member->name + " " +
                       std::string(member->bytes.begin(), member->bytes.end()));
    } catch (const conveyor::DataError& error) {
      const std::string what = error.what();
      events.push_back("error " + error.member() + " " + what.substr(0, what.rfind(": ")));
    }
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::span<const uint8_t> bytes(data, size);
  for (const std::vector<std::string>& required :
       {std::vector<std::string>{}, std::vector<std::string>{"cls"}}) {
    std::vector<conveyor::ShardSample> strict;
    bool raised = false;
    try {
      strict = conveyor::read_shard(bytes, "fuzz.tar", required);
    } catch (const conveyor::Error&) {
      raised = true;
    }
    // Skipping never throws, counts a skip exactly when raising threw, and
    // reads what raising reads when nothing is wrong.
    uint64_t skipped = 0;
    const std::vector<conveyor::ShardSample> lenient =
        conveyor::read_shard(bytes, "fuzz.tar", required, conveyor::OnError::skip, &skipped);
    if (raised != (skipped > 0)) __builtin_trap();
    if (!raised && !same_samples(strict, lenient)) __builtin_trap();
    check_samples(strict, size, required);
    check_samples(lenient, size, required);
  }
  // A small max_sample_bytes: every sample read stays within it, and the
  // ones over it are skipped and counted, never thrown.
  constexpr uint64_t kSmallLimit = 64;
  uint64_t skipped = 0;
  const std::vector<conveyor::ShardSample> bounded =
      conveyor::read_shard(bytes, "fuzz.tar", {}, conveyor::OnError::skip, &skipped, kSmallLimit);
  check_samples(bounded, size, {});
  for (const conveyor::ShardSample& sample : bounded) {
    uint64_t sample_bytes = 0;
    for (const auto& [field, field_bytes] : sample.fields) sample_bytes += field_bytes.size();
    if (sample_bytes > kSmallLimit) __builtin_trap();
  }
  // conveyor's plain tar reader reads what libarchive reads, failures
  // included (plain_tar.h).
  if (untar_trace(bytes, conveyor::nodes::TarReader::automatic) !=
      untar_trace(bytes, conveyor::nodes::TarReader::libarchive)) {
    __builtin_trap();
  }
  return 0;
}
