// src/formats/nodes/tar_members.h: what untar and group_by_key share
// (internal to conveyor::formats).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

namespace conveyor::nodes::detail {

// WebDataset's naming: "a/b/000123.seg.png" is field "seg.png" of the sample
// keyed "a/b/000123" (the name up to the first '.' after the last '/').
struct MemberName {
  std::string_view key;  // views into the name split, which outlives them
  std::string_view field;
  bool valid = false;  // both parts present: a name of the form key.field
};
MemberName split_member_name(std::string_view name);

// What untar does with a member, decided from its header before its data is
// read. Refusing is throwing DataError from admit().
enum class Admission {
  read,  // read it and hand it out
  skip,  // leave its data unread and go on (the rest of a rejected sample)
};

// A check untar runs on each regular member's header. group_by_key installs
// itself when its upstream is an untar node, so that a member taking its
// sample over max_sample_bytes is refused before its bytes are read, and the
// members of a rejected sample are never read at all. Called on the thread
// advancing untar, which is group_by_key's: they are adjacent, with nothing
// between to run either elsewhere.
//
// The member untar hands out next is always the last one admitted, so the
// gate knows its archive from admit(): a gated untar leaves
// TarMember::archive empty rather than copy the path into every member
// (two allocations per sample on the thread that feeds the workers).
//
// An archive is told apart from the one before it by archive_started(), not
// by its path: the same shard read twice in a row (repeat(), a shard list
// that names it twice) is two archives, whose keys may repeat.
class MemberGate {
 public:
  virtual Admission admit(const std::string& archive, const std::string& member, uint64_t declared_bytes) = 0;
  // untar takes its next archive, before opening it: an error opening it,
  // and the members after, are that archive's.
  virtual void archive_started() noexcept = 0;
  // untar dropped a failure under OnError::skip: `member`'s sample lacks
  // it, or, with no member, the archive ended there, and a sample open in
  // it may lack members that followed. The gate drops that sample: handed
  // on, it would pass for whole.
  virtual void failure_dropped(const std::string& archive, const std::string& member) = 0;

 protected:
  ~MemberGate() = default;
};

// Implemented by untar.
class GatedMembers {
 public:
  virtual void set_gate(MemberGate* gate) noexcept = 0;

 protected:
  ~GatedMembers() = default;
};

}  // namespace conveyor::nodes::detail
