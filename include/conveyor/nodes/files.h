// conveyor/nodes/files.h: files, tar archives and images as pipeline nodes
// (target conveyor::formats). WebDataset's tar-shard reading, built from
// small nodes:
//
//   list_files(root, "*.tar") | shard() | untar() | group_by_key()
//       | map(decode, {.workers = 8}) | shuffle(1000) | batch(64) | collate()
//
//   from_shard_patterns({pattern, ...})    the shards brace ranges stand for
//                                          ("train-{000000..000011}.tar"),
//                                          in order; paths or URLs
//   list_files(root, glob, {.recursive})   paths under root matching glob
//                                          (fnmatch on the name), sorted; lists
//                                          at the first pass, not before
//   read_files()                           path -> FileBytes (regular files only)
//   untar({.open})                         a tar's FileBytes, or its path or URL
//                                          -> its regular members in archive
//                                          order; a path is streamed from the
//                                          file (a URL through `open`), one
//                                          member in memory at a time
//   group_by_key({.required_fields})       consecutive members of one key (the
//                                          name up to its first '.' after the
//                                          last '/') -> ShardSample, checked;
//                                          fields in lower case ("0.JPG" is
//                                          "jpg"), as WebDataset reads them
//   decode_image(channels)                 encoded bytes -> Array<uint8_t> [C, H, W]
//
// Malformed input is a DataError naming the file and member, raised at the
// item's place (the pass goes on) or, with OnError::skip where a node takes
// it, dropped and counted. Memory: one file (read_files), one member
// (untar) and one sample (group_by_key) at a time, each bounded by its
// node's limit whatever a header claims.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "conveyor/array.h"
#include "conveyor/byte_stream.h"
#include "conveyor/data_error.h"
#include "conveyor/node.h"
#include "conveyor/tar_shards.h"

namespace conveyor::nodes {

struct FileBytes {
  std::string path;
  std::vector<uint8_t> bytes;
};

struct TarMember {
  std::string archive;  // the tar's path
  std::string name;     // the member's name inside it
  std::vector<uint8_t> bytes;
};

struct ListFilesOptions {
  bool recursive = false;
};
Pipeline<std::string> list_files(std::string root, std::string glob = "*", ListFilesOptions options = {});

// Each pattern's shards (expand_shard_patterns(), tar_shards.h), as a source
// that takes the shard as from_vector does: brace ranges expand here, where
// the shards are listed, so that each rank and worker reads its own. untar
// refuses a pattern as a path (DataError): expanded after the split, every
// rank would read every shard. Throws ValueError for a malformed range.
Pipeline<std::string> from_shard_patterns(std::vector<std::string> patterns);

struct ReadFilesOptions {
  uint64_t max_bytes = uint64_t{1} << 32;  // a larger file is a DataError
  // A file that cannot be read (missing, not a regular file, over max_bytes,
  // a read error): raise, a DataError naming it at its place; skip, dropped
  // and counted (metrics().back().skipped).
  OnError on_error = OnError::raise;
};
// Pipeline<std::string> -> Pipeline<FileBytes>.
std::function<Pipeline<FileBytes>(Pipeline<std::string>&&)> read_files(ReadFilesOptions options = {});

// Who reads a tar's headers. Either way untar yields the same members and
// the same errors in the same places.
enum class TarReader {
  // conveyor's reader for plain ustar and GNU headers (regular files,
  // directories, links to skip), libarchive from the first other header on
  // (pax or GNU extensions, hard links, sparse members, old formats).
  automatic,
  // libarchive for every header: slower per member.
  libarchive,
};

struct UntarOptions {
  // The most bytes one member may hold (0: no limit). A larger member is
  // refused from its header, before its data is read; the archive goes on.
  uint64_t max_member_bytes = kDefaultMaxSampleBytes;
  // skip: a refused member is dropped and counted; an archive that cannot be
  // read further (truncated, corrupt) ends there, counted once.
  OnError on_error = OnError::raise;
  // Paths go through it first (http_opener() streams http(s):// URLs); a
  // path it declines is read as a local file.
  StreamOpener open = {};
  TarReader reader = TarReader::automatic;
};
// Pipeline<FileBytes> or Pipeline<std::string> (paths) -> Pipeline<TarMember>.
struct UntarAdaptor {
  UntarOptions options;
  Pipeline<TarMember> operator()(Pipeline<FileBytes>&& upstream) const;
  Pipeline<TarMember> operator()(Pipeline<std::string>&& upstream) const;
};
UntarAdaptor untar(UntarOptions options = {});

struct GroupByKeyOptions {
  // Every sample must have these fields; a sample missing one is bad. In
  // lower case, as fields are read (ValueError otherwise).
  std::vector<std::string> required_fields = {};  // "= {}": designated initializers may leave it out
  // The most bytes one sample's members may hold together (0: no limit).
  // Straight after untar a member that would take its sample over it is
  // refused from its header, so memory stays within it whatever the headers
  // claim; elsewhere the member is refused once read.
  uint64_t max_sample_bytes = kDefaultMaxSampleBytes;
  // A bad sample: a member name without the key.field form, a field twice,
  // a key met again later in the same archive, a missing required field, or
  // over max_sample_bytes. raise: a DataError naming the archive, the member
  // (or the key) and the sample's index in its archive; skip: dropped and
  // counted. Either way its other members are dropped (unread, straight
  // after untar). Errors from upstream keep their place and are always
  // thrown, with the sample's index added. Straight after an untar that
  // skips its failures, the sample a dropped member (or an archive's
  // failure) cut short is dropped too, and counted here; behind another
  // node it cannot be told from a whole one: require its fields.
  OnError on_error = OnError::raise;
};
// Pipeline<TarMember> -> Pipeline<ShardSample>: TarShardDataset's reader is
// from_vector(shards) | untar() | group_by_key(). Straight after untar, the
// same shard read twice in a row (repeat(), a list naming it twice) is two
// archives; with a node between them, members tell archives apart by
// TarMember::archive alone, so such a repeat reads as keys met again.
std::function<Pipeline<ShardSample>(Pipeline<TarMember>&&)> group_by_key(GroupByKeyOptions options = {});

// Pipeline<std::vector<uint8_t>> -> Pipeline<Array<uint8_t>>; `channels` as
// decode_image's (0 keeps the stored count). An image that does not decode
// (corrupt, truncated, over the pixel limit: image.h): raise, a NodeError
// naming the node and the item's position, the decoder's DataError nested;
// skip, dropped and counted.
std::function<Pipeline<Array<uint8_t>>(Pipeline<std::vector<uint8_t>>&&)> decode_image(
    int channels = 0, OnError on_error = OnError::raise);

}  // namespace conveyor::nodes
