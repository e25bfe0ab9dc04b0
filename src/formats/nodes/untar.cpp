// untar (conveyor/nodes/files.h): the regular members of tar archives, in
// archive order, one in memory at a time. The one tar reader of conveyor:
// TarShardDataset reads its shards through it.
#include <archive.h>
#include <archive_entry.h>

#include <algorithm>
#include <exception>
#include <limits>
#include <memory>
#include <new>
#include <optional>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "conveyor/nodes/files.h"
#include "conveyor/nodes/stage.h"
#include "../plain_tar.h"
#include "../tar_source.h"
#include "tar_members.h"

namespace conveyor::nodes {
namespace {

struct ArchiveFree {
  void operator()(struct archive* a) const noexcept { archive_read_free(a); }
};

using conveyor::detail::archive_reason;
using conveyor::detail::succeeded;

// An archive comes as bytes (FileBytes, from read_files) or as a path,
// streamed from its file in 64 KiB blocks.
//
// Two kinds of failure: a member refused from its header (over the limit,
// sparse, or by the gate) is an error at its place and the archive goes on
// after it; an archive that cannot be opened or read further (truncated,
// corrupt, out of memory) is an error at its place and the archive ends
// there. Under OnError::skip each is dropped and counted once.
template <class Input>
class Untar final : public Stage<Input, TarMember>, public detail::GatedMembers {
 public:
  Untar(NodePtr<Input> upstream, UntarOptions options)
      : Stage<Input, TarMember>(std::move(upstream)), options_(options) {}
  ~Untar() override { close(); }

  void set_gate(detail::MemberGate* gate) noexcept override { gate_ = gate; }

  std::optional<TarMember> produce() override {
    while (true) {
      if (!archive_ && !plain_) {
        std::optional<Input> input = next_input();
        if (!input) return std::nullopt;
        if (gate_ != nullptr) gate_->archive_started();
        try {
          open(std::move(*input));
        } catch (const DataError&) {
          close();
          if (options_.on_error == OnError::raise) throw;
          this->meter_.skipped.add(1);
          continue;
        }
      }
      try {
        if (std::optional<TarMember> member = read_member_checked()) return member;
        close();  // at its end: the next archive
      } catch (const DataError& error) {
        if (!member_refused_) close();  // the archive cannot be read further
        member_refused_ = false;
        // The gate's refusal is group_by_key's to raise or skip (it skips
        // without throwing): never swallowed here, or the sample would go
        // on without the member.
        if (std::exchange(gate_refused_, false) || options_.on_error == OnError::raise) throw;
        this->meter_.skipped.add(1);
        // Nor is a failure swallowed unannounced: its sample drops it.
        if (gate_ != nullptr) gate_->failure_dropped(error.file(), error.member());
      }
    }
  }
  std::string name() const override { return options_.on_error == OnError::skip ? "untar(on_error=skip)" : "untar"; }

 protected:
  void start_pass() override {
    close();
    ahead_.reset();
    ahead_stream_.reset();
    ahead_failure_ = nullptr;
    ahead_error_ = nullptr;
  }

 private:
  void open(FileBytes&& file) {
    current_ = std::move(file);
    last_member_.clear();
    source_ = std::make_unique<conveyor::detail::TarSource>(current_.bytes);
    start_reading();
  }
  void open(std::string&& path) {
    current_.path = std::move(path);
    last_member_.clear();
    const std::exception_ptr failed_ahead = std::exchange(ahead_failure_, nullptr);
    std::unique_ptr<ByteStream> opened_ahead = std::exchange(ahead_stream_, nullptr);
    // A brace range among the paths was meant to stand for several shards,
    // but expanded past shard() it would be read whole by every rank: it is
    // refused at its place, naming where to expand it. Braces that are no
    // range ("a{b}.tar") are a plain name.
    if (is_shard_pattern(current_.path)) {
      throw DataError("a brace pattern is not a shard: untar does not expand it; expand it where the shards "
                      "are listed, before shard() splits them (nodes::from_shard_patterns)", current_.path);
    }
    if (failed_ahead) std::rethrow_exception(failed_ahead);
    if (opened_ahead || options_.open) {
      if (std::unique_ptr<ByteStream> stream = opened_ahead ? std::move(opened_ahead) : options_.open(current_.path)) {
        source_ = std::make_unique<conveyor::detail::TarSource>(std::move(stream));
        open_ahead();  // before this one's first read, which may wait
        start_reading();
        return;
      }
    }
    source_ = std::make_unique<conveyor::detail::TarSource>(std::span<const uint8_t>());
    // Only a regular file is read (a FIFO would block, /dev/zero reads as an
    // empty archive): the reason names what it is.
    const std::string problem = source_->open_file(current_.path);
    if (!problem.empty()) throw DataError(problem, current_.path);
    start_reading();
  }
  // The plain reader takes the archive first (plain_tar.h); libarchive
  // takes it from the first header the plain reader leaves to it, or from
  // the start with TarReader::libarchive.
  void start_reading() {
    if (options_.reader == TarReader::automatic) {
      plain_.emplace(*source_);
    } else {
      start_libarchive(/*from_start=*/true);
    }
  }
  // libarchive reads through the source, which tells a tar cut short at a
  // member boundary (libarchive takes it for a whole one) from a whole tar.
  // Mid-archive, the format is set rather than detected: detection wants an
  // archive's first header, and would refuse what libarchive reads well
  // after one.
  void start_libarchive(bool from_start) {
    last_entry_end_ = 0;
    archive_.reset(archive_read_new());
    if (!archive_) throw DataError("cannot allocate a libarchive reader", current_.path);
    const int status = from_start ? archive_read_support_format_tar(archive_.get())
                                  : archive_read_set_format(archive_.get(), ARCHIVE_FORMAT_TAR);
    if (status != ARCHIVE_OK) {
      throw DataError("cannot enable tar reading: " + archive_reason(archive_.get()), current_.path);
    }
    if (archive_read_open(archive_.get(), source_.get(), nullptr, &conveyor::detail::TarSource::read_callback,
                          nullptr) != ARCHIVE_OK) {
      throw DataError("cannot read shard: " + archive_reason(archive_.get()), current_.path);
    }
  }
  // The next archive: the one taken ahead, or upstream's next. An upstream
  // error met ahead is thrown here, in its place.
  std::optional<Input> next_input() {
    if (ahead_error_) std::rethrow_exception(std::exchange(ahead_error_, nullptr));
    if (ahead_) return std::exchange(ahead_, std::nullopt);
    return this->pull();
  }

  // With an opener (remote archives), the next archive's stream is opened
  // while this one is read, so its first bytes are on their way before they
  // are needed: a shard's request no longer waits for the previous shard's
  // end. At most one archive ahead, opened (an HTTP stream buffers nothing
  // until it is read: the kernel's socket buffer holds what arrives).
  void open_ahead() {
    if constexpr (std::is_same_v<Input, std::string>) {
      if (!options_.open || ahead_ || ahead_error_) return;
      try {
        ahead_ = this->pull();
        if (ahead_ && !is_shard_pattern(*ahead_)) ahead_stream_ = options_.open(*ahead_);
      } catch (const detail::UpstreamPending&) {
        // Polled (try_next) and upstream has no next archive yet: nothing
        // is opened ahead of this one.
      } catch (...) {
        // Thrown at the next archive's turn: a failed open as the open it
        // stands for, an upstream error in its place.
        if (ahead_) {
          ahead_failure_ = std::current_exception();
        } else {
          ahead_error_ = std::current_exception();
        }
      }
    }
  }

  void close() noexcept {
    plain_.reset();
    archive_.reset();  // before the source it reads from
    source_.reset();
    current_.bytes = {};
  }

  // Only DataError leaves: std::bad_alloc (a member as large as memory) or
  // any other failure becomes one naming the archive and the member, so that
  // OnError::skip can skip it. The archive's state is then unknown: it ends.
  std::optional<TarMember> read_member_checked() {
    try {
      return read_member();
    } catch (const DataError&) {
      throw;
    } catch (const std::bad_alloc&) {
      member_refused_ = false;
      throw DataError("out of memory reading the shard (std::bad_alloc)", current_.path, last_member_);
    } catch (const std::exception& error) {
      member_refused_ = false;
      throw DataError(std::string("cannot read shard: ") + error.what(), current_.path, last_member_);
    }
  }

  [[noreturn]] void refuse(const std::string& what, const std::string& member) {
    member_refused_ = true;
    throw DataError(what, current_.path, member);
  }

  std::string after_last_member() const {
    return last_member_.empty() ? std::string() : " (after member '" + last_member_ + "')";
  }

  std::optional<TarMember> read_member() {
    while (true) {
      if (plain_) {
        std::optional<std::optional<TarMember>> member = read_plain_member();
        if (member) return std::move(*member);
        continue;  // libarchive has the rest of the archive
      }
      struct archive_entry* entry = nullptr;
      const int status = archive_read_next_header(archive_.get(), &entry);
      if (status == ARCHIVE_EOF) {
        if (source_->ends_mid_archive(archive_filter_bytes(archive_.get(), -1), last_entry_end_)) {
          throw cut_at_member_boundary();
        }
        return std::nullopt;
      }
      if (!succeeded(status)) {
        // libarchive names no reason where a pax or GNU header's own data
        // is cut short.
        const bool no_reason = archive_error_string(archive_.get()) == nullptr;
        throw corrupt_header(no_reason && source_->exhausted()
                                 ? "the archive ends inside a header's extended data (truncated)"
                                 : archive_reason(archive_.get()));
      }
      // Where this entry's padded data ends: libarchive consumes it by the
      // next header, and an end-of-archive block must follow.
      const int64_t data_bytes = archive_entry_size_is_set(entry) ? std::max<int64_t>(archive_entry_size(entry), 0) : 0;
      last_entry_end_ = archive_filter_bytes(archive_.get(), -1) +
                        (data_bytes + static_cast<int64_t>(conveyor::detail::kTarBlockBytes) - 1) /
                            static_cast<int64_t>(conveyor::detail::kTarBlockBytes) *
                            static_cast<int64_t>(conveyor::detail::kTarBlockBytes);
      // Directories, links and devices carry no sample data (WebDataset
      // skips them too); libarchive skips their data at the next header.
      if (archive_entry_filetype(entry) != AE_IFREG || archive_entry_hardlink(entry) != nullptr) continue;
      const char* path = archive_entry_pathname(entry);
      if (path == nullptr) path = archive_entry_pathname_utf8(entry);
      if (path == nullptr) throw DataError("a member's name cannot be decoded" + after_last_member(), current_.path);
      last_member_ = path;
      const int64_t declared_signed = archive_entry_size_is_set(entry) ? archive_entry_size(entry) : 0;
      const auto declared = static_cast<uint64_t>(std::max<int64_t>(declared_signed, 0));
      if (archive_entry_sparse_count(entry) > 0) refuse("sparse tar members are not supported", last_member_);
      if (!admit(declared)) continue;  // libarchive skips its data at the next header
      return TarMember{archive_for_member(), last_member_, read_data(declared)};
    }
  }

  // The plain reader's next member; an empty optional when it hands the
  // rest of the archive to libarchive. Its failures are libarchive's, in
  // the same words and places.
  std::optional<std::optional<TarMember>> read_plain_member() {
    using Next = conveyor::detail::PlainTarReader::Next;
    while (true) {
      Next next = Next::end;
      try {
        next = plain_->next();
      } catch (const conveyor::detail::PlainTarFailure& failure) {
        throw corrupt_header(failure.what());
      }
      if (next == Next::end) {
        if (plain_->ended_without_end_block()) throw cut_at_member_boundary();
        return std::optional<TarMember>();
      }
      if (next == Next::hand_over) {
        const bool from_start = plain_->at_start();
        plain_->hand_over();
        plain_.reset();
        start_libarchive(from_start);
        return std::nullopt;
      }
      last_member_ = plain_->name();
      const uint64_t declared = plain_->size();
      if (!admit(declared)) continue;  // skipped at the next header
      std::vector<uint8_t> bytes;
      bytes.reserve(reserved_for(declared));
      try {
        plain_->read_data(bytes);
      } catch (const conveyor::detail::PlainTarFailure& failure) {
        throw DataError(std::string("cannot read member data: ") + failure.what(), current_.path, last_member_);
      }
      return TarMember{archive_for_member(), last_member_, std::move(bytes)};
    }
  }

  // The gate was told the archive in admit() (tar_members.h).
  std::string archive_for_member() const { return gate_ != nullptr ? std::string() : current_.path; }

  // The member just named (last_member_), declaring `declared` bytes: read
  // it (true), skip it (false), or refuse it (throws). Its data is unread
  // either way.
  bool admit(uint64_t declared) {
    if (gate_ != nullptr) {
      try {
        if (gate_->admit(current_.path, last_member_, declared) == detail::Admission::skip) return false;
      } catch (const DataError&) {
        member_refused_ = true;
        gate_refused_ = true;
        throw;
      }
    }
    if (declared > limit()) {
      refuse("the member declares " + std::to_string(declared) + " bytes, more than untar's max_member_bytes " +
                 std::to_string(options_.max_member_bytes),
             last_member_);
    }
    return true;
  }

  DataError cut_at_member_boundary() const {
    return DataError("truncated tar: the shard stops after a member, without the end-of-archive blocks",
                     current_.path, last_member_);
  }
  DataError corrupt_header(const std::string& reason) const {
    return DataError("truncated or corrupt tar header" + after_last_member() + ": " + reason, current_.path);
  }

  // The header's size is only a hint: a corrupt one could claim terabytes,
  // more than the file holds (a sparse file holds terabytes of zeros).
  size_t reserved_for(uint64_t declared) const {
    return static_cast<size_t>(
        std::min<uint64_t>({declared, source_->size().value_or(conveyor::detail::kTarReadBlockBytes), limit()}));
  }

  uint64_t limit() const {
    return options_.max_member_bytes == 0 ? std::numeric_limits<uint64_t>::max() : options_.max_member_bytes;
  }

  std::vector<uint8_t> read_data(uint64_t declared) {
    std::vector<uint8_t> bytes;
    bytes.reserve(reserved_for(declared));
    while (true) {
      const void* block = nullptr;
      size_t size = 0;
      la_int64_t offset = 0;
      const int status = archive_read_data_block(archive_.get(), &block, &size, &offset);
      if (status == ARCHIVE_EOF) return bytes;
      if (!succeeded(status)) {
        throw DataError("cannot read member data: " + archive_reason(archive_.get()), current_.path,
                        last_member_);
      }
      if (offset < 0 || static_cast<uint64_t>(offset) != bytes.size()) {
        throw DataError("member data arrives out of order (a sparse member?)", current_.path, last_member_);
      }
      // The data, too, stays within the limit, whatever the header said.
      if (size > limit() - bytes.size()) {
        throw DataError("the member holds more than untar's max_member_bytes " + std::to_string(options_.max_member_bytes),
                        current_.path, last_member_);
      }
      if (size > 0) {
        const auto* first = static_cast<const uint8_t*>(block);
        bytes.insert(bytes.end(), first, first + size);
      }
    }
  }

  UntarOptions options_;
  std::optional<Input> ahead_;                 // the next archive, taken from upstream ahead of its turn
  std::unique_ptr<ByteStream> ahead_stream_;   // its stream, opened ahead
  std::exception_ptr ahead_failure_;           // its open failed: thrown at its turn
  std::exception_ptr ahead_error_;             // upstream threw instead: thrown at its turn
  detail::MemberGate* gate_ = nullptr;
  bool member_refused_ = false;  // the error being thrown is one member's: the archive goes on
  bool gate_refused_ = false;    // ... and the gate's (group_by_key's) refusal
  FileBytes current_;            // the archive's path, and its bytes when it came as bytes
  std::string last_member_;
  std::unique_ptr<conveyor::detail::TarSource> source_;  // not movable: archive_ points at it
  std::optional<conveyor::detail::PlainTarReader> plain_;  // reads the archive until it hands it to archive_
  std::unique_ptr<struct archive, ArchiveFree> archive_;
  int64_t last_entry_end_ = 0;  // libarchive's count where its last entry's padded data ends
};

}  // namespace

Pipeline<TarMember> UntarAdaptor::operator()(Pipeline<FileBytes>&& upstream) const {
  return Pipeline<TarMember>(std::make_unique<Untar<FileBytes>>(std::move(upstream).release(), options));
}
Pipeline<TarMember> UntarAdaptor::operator()(Pipeline<std::string>&& upstream) const {
  return Pipeline<TarMember>(std::make_unique<Untar<std::string>>(std::move(upstream).release(), options));
}

UntarAdaptor untar(UntarOptions options) { return UntarAdaptor{options}; }

}  // namespace conveyor::nodes
