// The file, tar and image nodes (conveyor/nodes/files.h).
#include "conveyor/nodes/files.h"

#include <archive.h>
#include <archive_entry.h>
#include <fnmatch.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <optional>
#include <system_error>
#include <utility>

#include "conveyor/image.h"
#include "conveyor/nodes/stage.h"
#include "../regular_file.h"
#include "../tar_source.h"

namespace conveyor::nodes {
namespace {

namespace fs = std::filesystem;

class ListFiles final : public Source<std::string> {
 public:
  ListFiles(std::string root, std::string glob, ListFilesOptions options)
      : root_(std::move(root)), glob_(std::move(glob)), options_(options) {}
  using Node<std::string>::reset;
  void reset(const PassContext& pass, conveyor::detail::ResetWalk& walk) override {
    start_metering(pass, walk.next_id++);  // not shardable: every rank lists the same files
    if (!listed_) list();  // lazily, at the first pass; a listing serves every pass
    next_ = 0;
  }
  std::optional<std::string> produce() override {
    if (next_ == paths_.size()) return std::nullopt;
    return paths_[next_++];
  }
  std::string name() const override { return "list_files"; }

 private:
  void list() {
    std::error_code error;
    if (!fs::is_directory(root_, error)) throw DataError("list_files: not a directory", root_);
    auto consider = [&](const fs::directory_entry& entry) {
      if (!entry.is_regular_file(error)) return;
      const std::string file = entry.path().filename().string();
      if (fnmatch(glob_.c_str(), file.c_str(), 0) == 0) paths_.push_back(entry.path().string());
    };
    if (options_.recursive) {
      for (fs::recursive_directory_iterator it(root_, error), end; !error && it != end; it.increment(error)) consider(*it);
    } else {
      for (fs::directory_iterator it(root_, error), end; !error && it != end; it.increment(error)) consider(*it);
    }
    if (error) throw DataError("list_files: cannot list: " + error.message(), root_);
    std::sort(paths_.begin(), paths_.end());  // the same order on every machine
    listed_ = true;
  }

  std::string root_, glob_;
  ListFilesOptions options_;
  std::vector<std::string> paths_;
  bool listed_ = false;
  size_t next_ = 0;
};

class ReadFiles final : public Stage<std::string, FileBytes> {
 public:
  ReadFiles(NodePtr<std::string> upstream, ReadFilesOptions options)
      : Stage(std::move(upstream)), options_(options) {}
  std::optional<FileBytes> produce() override {
    std::optional<std::string> path = pull();
    if (!path) return std::nullopt;
    try {
      return FileBytes{*path, read(*path)};
    } catch (const DataError&) {
      throw;  // names the file already
    } catch (...) {
      conveyor::detail::throw_node_error(name(), position());
    }
  }
  std::string name() const override { return "read_files"; }

 private:
  std::vector<uint8_t> read(const std::string& path) const {
    conveyor::detail::OpenedFile file = conveyor::detail::open_regular_file(path);
    if (!file.problem.empty()) throw DataError(file.problem, path);
    struct Closer {
      int fd;
      ~Closer() { ::close(fd); }
    } closer{file.fd};
    if (file.size > options_.max_bytes) {
      throw DataError("the file holds " + std::to_string(file.size) + " bytes, more than read_files' max_bytes " +
                      std::to_string(options_.max_bytes), path);
    }
    std::vector<uint8_t> bytes(static_cast<size_t>(file.size));
    size_t done = 0;
    while (done < bytes.size()) {
      const ssize_t got = ::read(file.fd, bytes.data() + done, bytes.size() - done);
      if (got < 0 && errno == EINTR) continue;
      if (got < 0) throw DataError("cannot read: " + conveyor::detail::os_reason(errno), path);
      if (got == 0) break;  // shrank meanwhile
      done += static_cast<size_t>(got);
    }
    bytes.resize(done);
    return bytes;
  }
  ReadFilesOptions options_;
};

struct ArchiveFree {
  void operator()(struct archive* a) const noexcept { archive_read_free(a); }
};

// The members of each archive in turn, one in memory at a time. An archive
// comes as bytes (FileBytes, from read_files) or as a path, streamed from
// its file in blocks: only the member being read is ever in memory.
template <class Input>
class Untar final : public Stage<Input, TarMember> {
 public:
  Untar(NodePtr<Input> upstream, UntarOptions options) : Stage<Input, TarMember>(std::move(upstream)), options_(options) {}
  ~Untar() override { close(); }
  std::optional<TarMember> produce() override {
    while (true) {
      try {
        if (!archive_) {
          std::optional<Input> input = this->pull();
          if (!input) return std::nullopt;
          open(std::move(*input));
        }
        if (std::optional<TarMember> member = read_member()) return member;
        close();  // at its end: the next archive
      } catch (const DataError&) {
        close();  // a corrupt archive ends here
        if (options_.on_error == OnError::raise) throw;
        this->meter_.skipped.add(1);
      }
    }
  }
  std::string name() const override { return "untar"; }

 protected:
  void start_pass() override { close(); }

 private:
  void open(FileBytes&& file) {
    current_ = std::move(file);
    source_ = std::make_unique<conveyor::detail::TarSource>(current_.bytes);
    start_reading();
  }
  void open(std::string&& path) {
    current_.path = std::move(path);
    source_ = std::make_unique<conveyor::detail::TarSource>(std::span<const uint8_t>());
    const std::string problem = source_->open_file(current_.path);
    if (!problem.empty()) {
      source_.reset();
      throw DataError("untar: " + problem, current_.path);
    }
    start_reading();
  }
  // The archive reads through the source, which tells a tar cut short at a
  // member boundary (libarchive takes it for a whole one) from a whole tar.
  void start_reading() {
    archive_.reset(archive_read_new());
    if (!archive_ || archive_read_support_format_tar(archive_.get()) != ARCHIVE_OK) {
      close();
      throw DataError("untar: cannot read the archive: out of memory", current_.path);
    }
    if (archive_read_open(archive_.get(), source_.get(), nullptr, &conveyor::detail::TarSource::read_callback,
                          nullptr) != ARCHIVE_OK) {
      const char* reason = archive_error_string(archive_.get());
      const std::string why = reason ? reason : "?";
      close();
      throw DataError("untar: cannot read the archive: " + why, current_.path);
    }
  }
  void close() noexcept {
    archive_.reset();  // before the source it reads from
    source_.reset();
    current_.bytes = {};
  }

  std::optional<TarMember> read_member() {
    while (true) {
      struct archive_entry* entry = nullptr;
      const int status = archive_read_next_header(archive_.get(), &entry);
      if (status == ARCHIVE_EOF) {
        if (source_->ends_mid_archive(archive_filter_bytes(archive_.get(), -1))) {
          throw DataError("untar: truncated tar: the archive stops after a member, without the end-of-archive blocks",
                          current_.path, last_member_);
        }
        return std::nullopt;
      }
      if (status != ARCHIVE_OK && status != ARCHIVE_WARN) {
        throw DataError(std::string("untar: corrupt tar header: ") + archive_error_string(archive_.get()), current_.path);
      }
      if (archive_entry_filetype(entry) != AE_IFREG || archive_entry_hardlink(entry) != nullptr) continue;
      const char* path = archive_entry_pathname(entry);
      TarMember member{current_.path, path ? path : "", {}};
      last_member_ = member.name;
      const int64_t declared = archive_entry_size_is_set(entry) ? archive_entry_size(entry) : 0;
      if (declared < 0 || static_cast<uint64_t>(declared) > options_.max_member_bytes) {
        throw DataError("untar: the member declares " + std::to_string(declared) +
                            " bytes, more than untar's max_member_bytes " + std::to_string(options_.max_member_bytes),
                        current_.path, member.name);
      }
      member.bytes.resize(static_cast<size_t>(declared));
      const la_ssize_t got = archive_read_data(archive_.get(), member.bytes.data(), member.bytes.size());
      if (got < 0 || static_cast<size_t>(got) != member.bytes.size()) {
        throw DataError(std::string("untar: truncated member: ") +
                            (got < 0 ? archive_error_string(archive_.get()) : "short data"),
                        current_.path, member.name);
      }
      return member;
    }
  }

  UntarOptions options_;
  FileBytes current_;  // the archive's path, and its bytes when it came as bytes
  std::string last_member_;
  std::unique_ptr<conveyor::detail::TarSource> source_;  // not movable: archive_ points at it
  std::unique_ptr<struct archive, ArchiveFree> archive_;
};

// WebDataset's key: the member name up to the first '.' after the last '/'.
std::pair<std::string, std::string> split_key(const std::string& name) {
  const size_t slash = name.rfind('/');
  const size_t base = slash == std::string::npos ? 0 : slash + 1;
  const size_t dot = name.find('.', base);
  if (dot == std::string::npos) return {name, ""};
  return {name.substr(0, dot), name.substr(dot + 1)};
}

// A sample ends where the next key (or archive) starts, so it is handed out
// one member late. An error from upstream while a sample is open: if it
// names another file, the open sample is whole (its archive ended) and goes
// out first, the error at the next call; if it names the sample's own
// archive, the sample is cut short and dropped with it.
class GroupByKey final : public Stage<TarMember, ShardSample> {
 public:
  explicit GroupByKey(NodePtr<TarMember> upstream) : Stage(std::move(upstream)) {}
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
          if (open_ && error.file() != open_->shard) {
            error_ = std::current_exception();
            return std::exchange(open_, std::nullopt);
          }
          open_.reset();
          throw;
        }
      }
      if (!member) {
        if (!open_) return std::nullopt;
        return std::exchange(open_, std::nullopt);
      }
      auto [key, field] = split_key(member->name);
      if (open_ && (open_->key != key || open_->shard != member->archive)) {
        pending_ = std::move(member);  // starts the next sample
        return std::exchange(open_, std::nullopt);
      }
      if (!open_) open_ = ShardSample{key, member->archive, {}};
      open_->fields[field] = std::move(member->bytes);
    }
  }
  std::string name() const override { return "group_by_key"; }

 protected:
  void start_pass() override {
    open_.reset();
    pending_.reset();
    error_ = nullptr;
  }

 private:
  std::optional<ShardSample> open_;
  std::optional<TarMember> pending_;
  std::exception_ptr error_;  // thrown at the next call, after the sample before it
};

class DecodeImage final : public Stage<std::vector<uint8_t>, Array<uint8_t>> {
 public:
  DecodeImage(NodePtr<std::vector<uint8_t>> upstream, int channels) : Stage(std::move(upstream)), channels_(channels) {}
  std::optional<Array<uint8_t>> produce() override {
    std::optional<std::vector<uint8_t>> bytes = pull();
    if (!bytes) return std::nullopt;
    try {
      return conveyor::decode_image(*bytes, "item " + std::to_string(position()), channels_);
    } catch (...) {
      conveyor::detail::throw_node_error(name(), position());
    }
  }
  std::string name() const override { return "decode_image"; }

 private:
  int channels_;
};

}  // namespace

Pipeline<std::string> list_files(std::string root, std::string glob, ListFilesOptions options) {
  return Pipeline<std::string>(std::make_unique<ListFiles>(std::move(root), std::move(glob), options));
}

std::function<Pipeline<FileBytes>(Pipeline<std::string>&&)> read_files(ReadFilesOptions options) {
  return [options](Pipeline<std::string>&& upstream) {
    return Pipeline<FileBytes>(std::make_unique<ReadFiles>(std::move(upstream).release(), options));
  };
}

Pipeline<TarMember> UntarAdaptor::operator()(Pipeline<FileBytes>&& upstream) const {
  return Pipeline<TarMember>(std::make_unique<Untar<FileBytes>>(std::move(upstream).release(), options));
}
Pipeline<TarMember> UntarAdaptor::operator()(Pipeline<std::string>&& upstream) const {
  return Pipeline<TarMember>(std::make_unique<Untar<std::string>>(std::move(upstream).release(), options));
}

UntarAdaptor untar(UntarOptions options) { return UntarAdaptor{options}; }

std::function<Pipeline<ShardSample>(Pipeline<TarMember>&&)> group_by_key() {
  return [](Pipeline<TarMember>&& upstream) {
    return Pipeline<ShardSample>(std::make_unique<GroupByKey>(std::move(upstream).release()));
  };
}

std::function<Pipeline<Array<uint8_t>>(Pipeline<std::vector<uint8_t>>&&)> decode_image(int channels) {
  return [channels](Pipeline<std::vector<uint8_t>>&& upstream) {
    return Pipeline<Array<uint8_t>>(std::make_unique<DecodeImage>(std::move(upstream).release(), channels));
  };
}

}  // namespace conveyor::nodes
