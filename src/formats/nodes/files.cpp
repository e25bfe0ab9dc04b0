// The file and image nodes (conveyor/nodes/files.h); untar and group_by_key
// have their own files.
#include "conveyor/nodes/files.h"

#include <fnmatch.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <optional>
#include <system_error>
#include <utility>

#include "conveyor/image.h"
#include "conveyor/nodes/sources.h"
#include "conveyor/nodes/stage.h"
#include "../regular_file.h"

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
  uint64_t skip(uint64_t count, bool) override {
    const uint64_t skipped = std::min<uint64_t>(count, paths_.size() - next_);
    next_ += static_cast<size_t>(skipped);
    return skipped;
  }

 private:
  // Into paths_ only when whole: a listing that fails part-way (EMFILE, a
  // network file system's hiccup) leaves nothing behind for the next
  // pass's listing to add to.
  void list() {
    std::error_code error;
    if (!fs::is_directory(root_, error)) throw DataError("list_files: not a directory", root_);
    std::vector<std::string> paths;
    auto consider = [&](const fs::directory_entry& entry) {
      if (!entry.is_regular_file(error)) return;
      const std::string file = entry.path().filename().string();
      if (fnmatch(glob_.c_str(), file.c_str(), 0) == 0) paths.push_back(entry.path().string());
    };
    if (options_.recursive) {
      for (fs::recursive_directory_iterator it(root_, error), end; !error && it != end; it.increment(error)) consider(*it);
    } else {
      for (fs::directory_iterator it(root_, error), end; !error && it != end; it.increment(error)) consider(*it);
    }
    if (error) throw DataError("list_files: cannot list: " + error.message(), root_);
    std::sort(paths.begin(), paths.end());  // the same order on every machine
    paths_ = std::move(paths);
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
    while (true) {
      std::optional<std::string> path = pull();
      if (!path) return std::nullopt;
      try {
        return FileBytes{*path, read(*path)};
      } catch (const DataError&) {
        if (options_.on_error == OnError::raise) throw;  // names the file already
        this->meter_.skipped.add(1);
      } catch (...) {
        conveyor::detail::throw_node_error(name(), position());
      }
    }
  }
  std::string name() const override {
    return options_.on_error == OnError::skip ? "read_files(on_error=skip)" : "read_files";
  }
  // One file a path, unread (a file that failed was an output too). A
  // skipped file is no output: those are read to be counted out.
  uint64_t skip(uint64_t count, bool clean) override {
    if (!clean || options_.on_error == OnError::skip) return Stage::skip(count, clean);
    return skip_upstream(count, clean);
  }

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

class DecodeImage final : public Stage<std::vector<uint8_t>, Array<uint8_t>> {
 public:
  DecodeImage(NodePtr<std::vector<uint8_t>> upstream, int channels, OnError on_error)
      : Stage(std::move(upstream)), channels_(channels), on_error_(on_error) {}
  std::optional<Array<uint8_t>> produce() override {
    while (true) {
      std::optional<std::vector<uint8_t>> bytes = pull();
      if (!bytes) return std::nullopt;
      try {
        return conveyor::decode_image(*bytes, "item " + std::to_string(position()), channels_);
      } catch (const DataError&) {
        if (on_error_ == OnError::raise) conveyor::detail::throw_node_error(name(), position());
        this->meter_.skipped.add(1);
      } catch (...) {
        conveyor::detail::throw_node_error(name(), position());
      }
    }
  }
  std::string name() const override { return on_error_ == OnError::skip ? "decode_image(on_error=skip)" : "decode_image"; }
  // One image an item; a skipped one is no output: those are decoded to be counted out.
  uint64_t skip(uint64_t count, bool clean) override {
    if (!clean || on_error_ == OnError::skip) return Stage::skip(count, clean);
    return skip_upstream(count, clean);
  }

 private:
  int channels_;
  OnError on_error_;
};

}  // namespace

Pipeline<std::string> from_shard_patterns(std::vector<std::string> patterns) {
  return from_vector(expand_shard_patterns(patterns));
}

Pipeline<std::string> list_files(std::string root, std::string glob, ListFilesOptions options) {
  return Pipeline<std::string>(std::make_unique<ListFiles>(std::move(root), std::move(glob), options));
}

std::function<Pipeline<FileBytes>(Pipeline<std::string>&&)> read_files(ReadFilesOptions options) {
  if (options.max_bytes == 0) throw ValueError("read_files: max_bytes should be at least 1, but got 0");
  return [options](Pipeline<std::string>&& upstream) {
    return Pipeline<FileBytes>(std::make_unique<ReadFiles>(std::move(upstream).release(), options));
  };
}

std::function<Pipeline<Array<uint8_t>>(Pipeline<std::vector<uint8_t>>&&)> decode_image(int channels,
                                                                                      OnError on_error) {
  check_image_channels(channels);  // here, not as every item's error
  return [channels, on_error](Pipeline<std::vector<uint8_t>>&& upstream) {
    return Pipeline<Array<uint8_t>>(std::make_unique<DecodeImage>(std::move(upstream).release(), channels, on_error));
  };
}

}  // namespace conveyor::nodes
