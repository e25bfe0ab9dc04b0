// group_by_key (conveyor/nodes/files.h): consecutive tar members of one key
// as one ShardSample, checked as WebDataset's shards must be.
#include <algorithm>
#include <functional>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>
#include <utility>

#include "conveyor/nodes/files.h"
#include "conveyor/nodes/stage.h"
#include "tar_members.h"

namespace conveyor::nodes {

namespace detail {

MemberName split_member_name(std::string_view name) {
  const size_t slash = name.rfind('/');
  const size_t base = slash == std::string_view::npos ? 0 : slash + 1;
  const size_t dot = name.find('.', base);
  if (dot == std::string_view::npos) return {name, {}, false};
  MemberName split{name.substr(0, dot), name.substr(dot + 1), false};
  split.valid = dot > base && !split.field.empty();
  return split;
}

}  // namespace detail

namespace {

char ascii_lower(char c) { return c >= 'A' && c <= 'Z' ? static_cast<char>(c - 'A' + 'a') : c; }

// The sample being assembled. (At namespace scope: clang cannot use a nested
// class's default member initializers inside its enclosing class, so
// std::optional<OpenSample>::emplace() would not compile there.)
struct OpenSample {
  ShardSample sample;
  int64_t index = 0;  // within its archive
  uint64_t bytes = 0;
  bool whole = false;  // a later key's member was refused: nothing more joins it
};

// The keys met in one archive. Open addressing in vectors that keep their
// size, and their strings' capacity, from one archive to the next: once as
// large as an archive's samples, a key costs no allocation (a node-based set
// allocated one per sample, on the thread that feeds the workers).
class KeySet {
 public:
  // False when `key` is there already.
  bool insert(std::string_view key) {
    if (2 * (size_ + 1) > keys_.size()) grow();
    for (size_t slot = hash(key) & mask();; slot = (slot + 1) & mask()) {
      if (!used_[slot]) {
        keys_[slot].assign(key);  // first: a bad_alloc leaves the slot free
        used_[slot] = true;
        ++size_;
        return true;
      }
      if (keys_[slot] == key) return false;
    }
  }
  void clear() noexcept {
    if (size_ == 0) return;
    std::fill(used_.begin(), used_.end(), false);
    size_ = 0;
  }

 private:
  static size_t hash(std::string_view key) noexcept { return std::hash<std::string_view>{}(key); }
  size_t mask() const noexcept { return keys_.size() - 1; }

  // Doubles the slots (a power of two, at most half of them used).
  void grow() {
    std::vector<std::string> keys(std::max<size_t>(64, 2 * keys_.size()));
    std::vector<bool> used(keys.size(), false);
    for (size_t old = 0; old < keys_.size(); ++old) {
      if (!used_[old]) continue;
      size_t slot = hash(keys_[old]) & (keys.size() - 1);
      while (used[slot]) slot = (slot + 1) & (keys.size() - 1);
      used[slot] = true;
      keys[slot] = std::move(keys_[old]);
    }
    keys_ = std::move(keys);
    used_ = std::move(used);
  }

  std::vector<std::string> keys_;
  std::vector<bool> used_;
  size_t size_ = 0;
};

// A bad sample, whose other members are dropped.
struct Rejected {
  std::string archive;
  uint64_t opening = 0;  // which reading of it (GroupByKey::opening_)
  std::string key;
  int64_t index = 0;
};

// A sample ends where the next key (or archive) starts, so it is handed out
// one member late. Samples are numbered within their archive, bad ones
// included, and every error names that number.
//
// An error from upstream names an archive and maybe a member. A member of
// the open sample, or an archive that fails while the sample is open with no
// member named: the sample is cut short and dropped with the error. Anything
// else (another member, another archive, a failure after the gate refused a
// later sample): the open sample is whole and goes out first, the error at
// the next call. Either way the rest of the failed member's sample is
// dropped. A failure untar drops under OnError::skip drops its sample the
// same way (MemberGate::failure_dropped), counted here.
class GroupByKey final : public Stage<TarMember, ShardSample>, private detail::MemberGate {
 public:
  GroupByKey(NodePtr<TarMember> upstream, GroupByKeyOptions options)
      : Stage(std::move(upstream)), options_(std::move(options)) {
    // Straight after untar: sizes are checked from the headers, and the
    // members' archive comes from admit() (see MemberGate).
    if (auto* untar = dynamic_cast<detail::GatedMembers*>(upstream_.get())) {
      untar->set_gate(this);
      gated_ = true;
    }
  }

  std::optional<ShardSample> produce() override {
    if (error_) std::rethrow_exception(std::exchange(error_, nullptr));
    while (true) {
      std::optional<TarMember> member;
      if (pending_) {
        member = std::exchange(pending_, std::nullopt);
      } else {
        try {
          member = pull();
        } catch (const DataError& error) {
          // The open sample, when whole, goes out before the error.
          if (std::optional<ShardSample> whole = on_upstream_error(error)) return whole;
          std::rethrow_exception(std::exchange(error_, nullptr));
        }
      }
      if (!member) {
        if (!open_) return std::nullopt;
        if (std::optional<ShardSample> sample = finish()) return sample;
        return std::nullopt;
      }
      // (A pending member is still the last one untar admitted.)
      const std::string& member_archive = gated_ ? admitted_archive_ : member->archive;
      if (member_archive != archive_ || admitted_opening_ != opening_) {
        if (open_) {
          pending_ = std::move(member);  // starts the next archive
          if (std::optional<ShardSample> sample = finish()) return sample;
          continue;
        }
        start_archive(member_archive);
      }
      const detail::MemberName name = detail::split_member_name(member->name);
      if (rejected_) {
        if (rejected_->key == name.key) continue;  // the rest of a bad sample
        rejected_.reset();
      }
      if (open_ && (open_->sample.key != name.key || open_->whole)) {
        pending_ = std::move(member);  // starts the next sample
        if (std::optional<ShardSample> sample = finish()) return sample;
        continue;
      }
      try {
        if (!open_) start_sample(name.key, member->name);
        add(name, std::move(*member));
      } catch (const DataError&) {
        if (options_.on_error == OnError::raise) throw;
        meter_.skipped.add(1);
      }
    }
  }
  std::string name() const override {
    return options_.on_error == OnError::skip ? "group_by_key(on_error=skip)" : "group_by_key";
  }

 protected:
  void start_pass() override {
    open_.reset();
    pending_.reset();
    error_ = nullptr;
    rejected_.reset();  // a sample refused last pass must not swallow this pass's members
    admitted_archive_.clear();
    start_archive({});
  }

 private:
  uint64_t limit() const {
    return options_.max_sample_bytes == 0 ? std::numeric_limits<uint64_t>::max() : options_.max_sample_bytes;
  }

  // The gate may have refused the archive's first samples before any of its
  // members came here: they keep their numbers.
  void start_archive(const std::string& archive) {
    archive_ = archive;
    opening_ = admitted_opening_;
    seen_keys_.clear();
    next_index_ = 0;
    if (rejected_ && rejected_->archive == archive && rejected_->opening == opening_) {
      for (const std::string& key : keys_refused_ahead_) seen_keys_.insert(key);
      seen_keys_.insert(rejected_->key);
      next_index_ = rejected_->index + 1;
    } else {
      rejected_.reset();
    }
    keys_refused_ahead_.clear();
  }

  // A bad sample: its remaining members are dropped unread.
  [[noreturn]] void reject(const std::string& what, const std::string& member_or_key, std::string_view key,
                           int64_t index) {
    rejected_ = Rejected{archive_, opening_, std::string(key), index};
    open_.reset();
    throw DataError(what, archive_, member_or_key, index);
  }

  void start_sample(std::string_view key, const std::string& member) {
    open_.emplace();
    open_->sample.key = key;
    open_->sample.shard = archive_;
    // As many fields as the sample before: one allocation for all of them.
    open_->sample.fields.reserve(fields_per_sample_);
    open_->index = next_index_++;
    if (!seen_keys_.insert(key)) {
      reject("key '" + std::string(key) + "' appears again: a sample's members must be consecutive in the shard",
             member, key, open_->index);
    }
  }

  void add(const detail::MemberName& name, TarMember&& member) {
    const int64_t index = open_->index;
    if (!name.valid) {
      reject("member name has no 'key.field' form (key '" + std::string(name.key) + "')", member.name, name.key,
             index);
    }
    // Field names in lower case, as WebDataset's group_by_keys(lcase=True)
    // reads "0.JPG" as field "jpg". Into a kept string: no allocation once
    // warm.
    field_name_.assign(name.field);
    for (char& c : field_name_) c = ascii_lower(c);
    // One lookup: a refused sample is dropped whole, the new field with it.
    const auto [field, added] = open_->sample.fields.try_emplace(field_name_);
    if (!added) {
      reject("field '" + field_name_ + "' appears twice in sample '" + std::string(name.key) + "'", member.name,
             name.key, index);
    }
    // Checked here too when untar is not straight upstream (no gate).
    if (member.bytes.size() > limit() - std::min(limit(), open_->bytes)) {
      reject(oversized(member.bytes.size(), name.key, open_->bytes), member.name, name.key, index);
    }
    open_->bytes += member.bytes.size();
    field->second = std::move(member.bytes);
  }

  std::string oversized(uint64_t member_bytes, std::string_view key, uint64_t before) const {
    return "member of " + std::to_string(member_bytes) + " bytes takes sample '" + std::string(key) + "' (" +
           std::to_string(before) + " bytes before it) over max_sample_bytes = " +
           std::to_string(options_.max_sample_bytes) + " (0 lifts the limit)";
  }

  // Closes the open sample: returns it, or, when it lacks a required field,
  // throws (OnError::raise) or counts it and returns nothing (skip).
  std::optional<ShardSample> finish() {
    OpenSample open = std::move(*open_);
    open_.reset();
    fields_per_sample_ = std::max<size_t>(1, open.sample.fields.size());
    for (const std::string& field : options_.required_fields) {
      if (!open.sample.fields.contains(field)) {
        DataError error("sample '" + open.sample.key + "' has no required field '" + field + "'", open.sample.shard,
                        open.sample.key, open.index);
        if (options_.on_error == OnError::raise) throw error;
        meter_.skipped.add(1);
        return std::nullopt;
      }
    }
    return std::move(open.sample);
  }

  void archive_started() noexcept override { ++admitted_opening_; }

  // untar asks before reading a member's data.
  detail::Admission admit(const std::string& archive, const std::string& member, uint64_t declared) override {
    if (archive != admitted_archive_) admitted_archive_ = archive;
    const detail::MemberName name = detail::split_member_name(member);
    const bool rejected_archive = rejected_ && rejected_->archive == archive && rejected_->opening == admitted_opening_;
    if (rejected_archive && rejected_->key == name.key) return detail::Admission::skip;
    const bool same_archive = archive == archive_ && admitted_opening_ == opening_;
    const bool joins_open = same_archive && open_ && !open_->whole && open_->sample.key == name.key;
    const uint64_t before = joins_open ? open_->bytes : 0;
    if (declared <= limit() - std::min(limit(), before)) return detail::Admission::read;
    // raise: untar throws it, and on_upstream_error numbers it.
    if (options_.on_error == OnError::raise) throw DataError(oversized(declared, name.key, before), archive, member);
    drop_sample_of(archive, name.key);
    return detail::Admission::skip;
  }

  void failure_dropped(const std::string& archive, const std::string& member) override {
    if (member.empty()) {
      // The archive ended: a sample open in it may have had more members.
      const bool same_archive = archive == archive_ && admitted_opening_ == opening_;
      if (same_archive && open_ && !open_->whole) {
        open_.reset();
        meter_.skipped.add(1);
      }
      return;
    }
    const detail::MemberName name = detail::split_member_name(member);
    const bool rejected_archive = rejected_ && rejected_->archive == archive && rejected_->opening == admitted_opening_;
    if (!(rejected_archive && rejected_->key == name.key)) drop_sample_of(archive, name.key);
  }

  // Drops, and counts, the sample `key` names from the member of it that
  // untar is on: the open one if the member joins it, else a new one,
  // numbered next. Its other members are left unread (rejected_).
  void drop_sample_of(const std::string& archive, std::string_view key) {
    const bool rejected_archive = rejected_ && rejected_->archive == archive && rejected_->opening == admitted_opening_;
    const bool same_archive = archive == archive_ && admitted_opening_ == opening_;
    const bool joins_open = same_archive && open_ && !open_->whole && open_->sample.key == key;
    int64_t index = 0;
    if (joins_open) {
      index = open_->index;
      open_.reset();
    } else if (same_archive) {
      if (open_) open_->whole = true;  // a new key started: the open sample ended before it
      index = next_index_++;
      seen_keys_.insert(key);
    } else {
      // The next archive's samples, refused before any member reached
      // here: every key is kept for start_archive(), or a later member of
      // one would pass for a sample of its own.
      if (!rejected_archive) keys_refused_ahead_.clear();
      keys_refused_ahead_.emplace_back(key);
      if (rejected_archive) index = rejected_->index + 1;
    }
    rejected_ = Rejected{archive, admitted_opening_, std::string(key), index};
    meter_.skipped.add(1);
  }

  // Stores the error (with the sample's index) in error_; returns the open
  // sample when it is whole and goes out first.
  std::optional<ShardSample> on_upstream_error(const DataError& error) {
    std::optional<OpenSample> whole;
    int64_t index = error.sample();
    const bool same_archive = error.file() == archive_ && admitted_opening_ == opening_;
    if (!error.member().empty()) {
      const detail::MemberName name = detail::split_member_name(error.member());
      if (!same_archive) {
        whole = std::exchange(open_, std::nullopt);
        start_archive(error.file());
      }
      if (open_ && !open_->whole && open_->sample.key == name.key) {
        index = open_->index;  // cut short
        open_.reset();
      } else {
        if (!whole) whole = std::exchange(open_, std::nullopt);
        index = next_index_++;
        seen_keys_.insert(name.key);
      }
      rejected_ = Rejected{error.file(), opening_, std::string(name.key), index};
    } else if (same_archive && open_ && !open_->whole) {
      index = open_->index;  // the archive failed inside the open sample
      open_.reset();
    } else if (same_archive && open_) {
      // It failed after a later sample the gate refused: that one's error.
      whole = std::exchange(open_, std::nullopt);
      if (rejected_ && rejected_->archive == error.file() && rejected_->opening == opening_) index = rejected_->index;
    } else {
      whole = std::exchange(open_, std::nullopt);
    }
    error_ = std::make_exception_ptr(DataError(error.reason(), error.file(), error.member(), index));
    if (!whole) return std::nullopt;
    open_ = std::move(whole);
    return finish();
  }

  GroupByKeyOptions options_;
  std::string archive_;  // of the members seen last
  bool gated_ = false;   // straight after untar, whose members carry no archive
  std::string admitted_archive_;  // the archive of untar's last member (gated_)
  // Archives untar has started (gated_; 0 without a gate), and the count at
  // the start of archive_: a shard read twice in a row is two archives.
  uint64_t admitted_opening_ = 0;
  uint64_t opening_ = 0;
  KeySet seen_keys_;
  int64_t next_index_ = 0;
  size_t fields_per_sample_ = 2;  // of the last sample finished
  std::optional<Rejected> rejected_;  // a bad sample, whose other members are dropped
  std::vector<std::string> keys_refused_ahead_;  // by admit(), in the archive before start_archive() reached it
  std::optional<OpenSample> open_;
  std::string field_name_;  // the member's field, in lower case
  std::optional<TarMember> pending_;
  std::exception_ptr error_;  // thrown at the next call, after the sample before it
};

}  // namespace

std::function<Pipeline<ShardSample>(Pipeline<TarMember>&&)> group_by_key(GroupByKeyOptions options) {
  // Fields are read in lower case: a required "JPG" could never be met.
  for (const std::string& field : options.required_fields) {
    std::string lower = field;
    for (char& c : lower) c = ascii_lower(c);
    if (lower != field) {
      throw ValueError("group_by_key: required field '" + field +
                       "' has upper-case letters, but field names are read in lower case (as WebDataset "
                       "reads them): require '" + lower + "'");
    }
  }
  return [options](Pipeline<TarMember>&& upstream) {
    return Pipeline<ShardSample>(std::make_unique<GroupByKey>(std::move(upstream).release(), options));
  };
}

}  // namespace conveyor::nodes
