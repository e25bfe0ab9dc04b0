// read_files_async (conveyor/nodes/files_async.h) on both backends: the
// thread pool always (forced by option), io_uring where this kernel allows a
// ring (else those tests skip, saying why). Label "async".
#include <conveyor/nodes.h>
#include <conveyor/nodes/files_async.h>
#include <gtest/gtest.h>
#include <fcntl.h>
#include <stdlib.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#if CONVEYOR_IO_TEST_FORMATS
#include <conveyor/nodes/files.h>
#endif

namespace {

namespace fs = std::filesystem;
namespace nodes = conveyor::nodes;
using conveyor::DataError;
using conveyor::OnError;
using nodes::FileBytes;
using nodes::FileIoBackend;

class Dir {
 public:
  Dir() {
    char name[] = "/tmp/conveyor-files-async-XXXXXX";
    path_ = ::mkdtemp(name);
  }
  ~Dir() {
    std::error_code ignored;
    fs::remove_all(path_, ignored);
  }
  // A file of `size` bytes, each a function of its name and offset.
  std::string file(const std::string& name, size_t size) {
    const std::string path = path_ + "/" + name;
    std::ofstream out(path, std::ios::binary);
    for (size_t i = 0; i < size; ++i) out.put(static_cast<char>((i * 131 + name.size() * 7) & 0xff));
    return path;
  }
  std::string path(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

std::vector<uint8_t> contents(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

// The paths one whole pass reads, in order; a failed file throws.
std::vector<std::string> one_pass_paths(conveyor::Pipeline<FileBytes>& pipeline) {
  std::vector<std::string> paths;
  for (FileBytes& file : pipeline.pass()) paths.push_back(file.path);
  return paths;
}

// Under UBSan a process left with no descriptor gets false "invalid vptr"
// reports: the vptr check opens a pipe to test that memory is readable. The
// tests that take every descriptor skip there (TSan runs them).
#if defined(CONVEYOR_TESTS_UNDER_UBSAN)
constexpr bool kUbsanNeedsDescriptors = true;
#else
constexpr bool kUbsanNeedsDescriptors = false;
#endif
constexpr const char* kUbsanSkip =
    "UBSan's vptr check needs a descriptor of its own (a pipe), and this test leaves the process none";

// Descriptors this test holds, under RLIMIT_NOFILE lowered to 256, and a
// reader's wait for one shortened to 1.5 s; all given back at the end.
class HeldDescriptors {
 public:
  HeldDescriptors() {
    if (getrlimit(RLIMIT_NOFILE, &saved_) != 0) return;
    rlimit lowered = saved_;
    lowered.rlim_cur = std::min<rlim_t>(saved_.rlim_cur, 256);
    lowered_ = setrlimit(RLIMIT_NOFILE, &lowered) == 0;
    nodes::detail::descriptor_wait(std::chrono::milliseconds(1500));
  }
  ~HeldDescriptors() {
    release(SIZE_MAX);
    if (lowered_) setrlimit(RLIMIT_NOFILE, &saved_);
    nodes::detail::descriptor_wait(std::chrono::seconds(10));
  }
  HeldDescriptors(const HeldDescriptors&) = delete;
  HeldDescriptors& operator=(const HeldDescriptors&) = delete;
  bool lowered() const { return lowered_; }
  // Every descriptor the process has left; the errno that ended it.
  int take_all() {
    const std::lock_guard lock(mutex_);
    for (int fd; (fd = open("/dev/null", O_RDONLY | O_CLOEXEC)) >= 0;) fds_.push_back(fd);
    return errno;
  }
  void release(size_t count) {
    const std::lock_guard lock(mutex_);
    for (; count > 0 && !fds_.empty(); --count) {
      close(fds_.back());
      fds_.pop_back();
    }
  }

 private:
  rlimit saved_{};
  bool lowered_ = false;
  std::mutex mutex_;
  std::vector<int> fds_;
};

// One pass reads every one of `paths` (each `size` bytes), in order, and
// skips none.
void expect_one_whole_pass(conveyor::Pipeline<FileBytes>& pipeline, const std::vector<std::string>& paths,
                           size_t size) {
  size_t n = 0;
  for (FileBytes& file : pipeline.pass()) {
    if (n < paths.size()) {
      EXPECT_EQ(file.path, paths[n]);
    }
    EXPECT_EQ(file.bytes.size(), size);
    ++n;
  }
  EXPECT_EQ(n, paths.size());
  EXPECT_EQ(pipeline.metrics().back().skipped, 0u);
}

// One pass of `pipeline` with every descriptor taken, and another thread
// giving 8 back after 0.3 s (a shortage well within the 1.5 s wait): the
// paths read go to `got`; returns the pass's error text, "" for none.
std::string pass_through_a_short_shortage(conveyor::Pipeline<FileBytes>& pipeline, HeldDescriptors& held,
                                          std::vector<std::string>& got) {
  held.take_all();
  std::thread giver([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    held.release(8);
  });
  std::string error;
  try {
    got = one_pass_paths(pipeline);
  } catch (const std::exception& e) {
    error = e.what();
  }
  giver.join();
  return error;
}

class ReadFilesAsync : public ::testing::TestWithParam<FileIoBackend> {
 protected:
  void SetUp() override {
    if (GetParam() == FileIoBackend::io_uring && nodes::file_io_backend() != "io_uring") {
      GTEST_SKIP() << "io_uring is not usable here: " << nodes::file_io_backend();
    }
  }
  nodes::ReadFilesAsyncOptions options(int max_in_flight = 16) const {
    return {.max_in_flight = max_in_flight, .backend = GetParam()};
  }
};

TEST_P(ReadFilesAsync, ReadsEveryFileInOrder) {
  Dir dir;
  std::vector<std::string> paths;
  for (size_t size : {0, 1, 511, 4096, 4097, 65536, 1 << 20, 3}) {
    paths.push_back(dir.file("f" + std::to_string(paths.size()) + ".bin", size));
  }
  for (int i = 0; i < 100; ++i) paths.push_back(dir.file("small" + std::to_string(i), static_cast<size_t>(i * 37)));
  auto pipeline = nodes::from_vector(paths) | nodes::read_files_async(options(8));
  for (int pass = 0; pass < 2; ++pass) {
    size_t k = 0;
    for (FileBytes& file : pipeline.pass()) {
      ASSERT_LT(k, paths.size());
      EXPECT_EQ(file.path, paths[k]);
      EXPECT_EQ(file.bytes, contents(paths[k])) << paths[k];
      ++k;
    }
    EXPECT_EQ(k, paths.size());
  }
  const auto metrics = pipeline.metrics();
  EXPECT_EQ(metrics.back().name, "read_files_async(max_in_flight=8)");
  EXPECT_EQ(metrics.back().items_out, paths.size());
  EXPECT_EQ(metrics.back().window, 8u);
}

TEST_P(ReadFilesAsync, OutOfOrderGivesTheSameFiles) {
  Dir dir;
  std::vector<std::string> paths;
  for (int i = 0; i < 200; ++i) paths.push_back(dir.file("g" + std::to_string(i), static_cast<size_t>(i * 101)));
  auto opts = options(32);
  opts.in_order = false;
  auto pipeline = nodes::from_vector(paths) | nodes::read_files_async(opts);
  std::vector<std::string> seen;
  for (FileBytes& file : pipeline.pass()) {
    EXPECT_EQ(file.bytes, contents(file.path));
    seen.push_back(file.path);
  }
  std::sort(seen.begin(), seen.end());
  std::sort(paths.begin(), paths.end());
  EXPECT_EQ(seen, paths);
}

TEST_P(ReadFilesAsync, RefusesWhatReadFilesRefusesNamingThePath) {
  Dir dir;
  const std::string good = dir.file("good", 10);
  const std::string big = dir.file("big", 1001);
  const std::string missing = dir.path("missing");
  const std::string fifo = dir.path("fifo");
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);  // no writer: opening it must not wait
  const std::string directory = dir.path("sub");
  fs::create_directory(directory);
  auto opts = options();
  opts.max_bytes = 1000;
  auto pipeline = nodes::from_vector(std::vector<std::string>{good, missing, fifo, directory, big, good}) |
                  nodes::read_files_async(opts);
  auto pass = pipeline.pass();
  EXPECT_EQ(pass.next()->bytes.size(), 10u);
  auto expect_error = [&](const std::string& path, const std::string& why) {
    try {
      pass.next();
      ADD_FAILURE() << "no error for " << path;
    } catch (const DataError& e) {
      EXPECT_EQ(e.file(), path);
      EXPECT_EQ(std::string(e.what()), path + ": " + why);
    }
  };
  expect_error(missing, "cannot open: No such file or directory");
  expect_error(fifo, "not a regular file (a FIFO (named pipe))");
  expect_error(directory, "not a regular file (a directory)");
  expect_error(big, "the file holds 1001 bytes, more than read_files_async's max_bytes 1000");
  EXPECT_EQ(pass.next()->path, good);
  EXPECT_EQ(pass.next(), std::nullopt);
}

TEST_P(ReadFilesAsync, SkipCountsTheRefused) {
  Dir dir;
  std::vector<std::string> paths;
  for (int i = 0; i < 30; ++i) {
    paths.push_back(i % 3 == 0 ? dir.path("absent" + std::to_string(i)) : dir.file("h" + std::to_string(i), 100));
  }
  auto opts = options(4);
  opts.on_error = OnError::skip;
  auto pipeline = nodes::from_vector(paths) | nodes::read_files_async(opts);
  size_t n = 0;
  for (FileBytes& file : pipeline.pass()) {
    EXPECT_EQ(file.bytes.size(), 100u);
    ++n;
  }
  EXPECT_EQ(n, 20u);
  EXPECT_EQ(pipeline.metrics().back().skipped, 10u);
}

TEST_P(ReadFilesAsync, ResetAndDestructionWithReadsInFlight) {
  Dir dir;
  std::vector<std::string> paths;
  for (int i = 0; i < 300; ++i) paths.push_back(dir.file("r" + std::to_string(i), 20000));
  for (int round = 0; round < 5; ++round) {
    auto pipeline = nodes::from_vector(paths) | nodes::read_files_async(options(64));
    {
      auto pass = pipeline.pass();
      for (int k = 0; k < 3 * round; ++k) ASSERT_TRUE(pass.next());
    }
    // A new pass abandons the window with reads in flight; it starts over.
    auto pass = pipeline.pass();
    for (size_t k = 0; k < 10; ++k) {
      auto file = pass.next();
      ASSERT_TRUE(file);
      EXPECT_EQ(file->path, paths[k]);
      EXPECT_EQ(file->bytes, contents(paths[k]));
    }
    // The node goes with reads in flight: its destructor waits for them.
  }
}

// A window wider than the process may hold descriptors. io_uring kept one
// descriptor per file in flight: with 1024 in flight under a limit of 256,
// good files failed with "Too many open files" and OnError::skip dropped
// them without a word (the thread pool holds one per thread). It now opens
// at most a share of the limit at once; the others wait their turn. A pass
// left early with files still waiting drops them.
TEST_P(ReadFilesAsync, AWindowWiderThanTheDescriptorLimitReadsEveryFile) {
  Dir dir;
  std::vector<std::string> paths;
  for (int i = 0; i < 1500; ++i) paths.push_back(dir.file("n" + std::to_string(i), 64));
  rlimit saved{};
  ASSERT_EQ(getrlimit(RLIMIT_NOFILE, &saved), 0);
  rlimit lowered = saved;
  lowered.rlim_cur = std::min<rlim_t>(saved.rlim_cur, 256);
  ASSERT_EQ(setrlimit(RLIMIT_NOFILE, &lowered), 0);
  struct Restore {
    rlimit limit;
    ~Restore() { setrlimit(RLIMIT_NOFILE, &limit); }
  } restore{saved};
  auto opts = options(1024);
  opts.on_error = OnError::skip;
  auto pipeline = nodes::from_vector(paths) | nodes::read_files_async(opts);
  {
    auto early = pipeline.pass();
    for (int k = 0; k < 10; ++k) ASSERT_TRUE(early.next());
  }
  expect_one_whole_pass(pipeline, paths, 64);
}

// The program holds all but 24 of its descriptors, fewer than the io_uring
// reader's share (a quarter of the limit, 64): its opens met EMFILE, and
// the good files failed (OnError::skip dropped them; so did several readers
// at once, each within its share). A file now waits, at the queue's front,
// until one of the reader's own descriptors is released.
TEST_P(ReadFilesAsync, FilesWaitForADescriptorWhenTheProcessHasRunOut) {
  if (kUbsanNeedsDescriptors) GTEST_SKIP() << kUbsanSkip;
  Dir dir;
  std::vector<std::string> paths;
  for (int i = 0; i < 600; ++i) paths.push_back(dir.file("d" + std::to_string(i), 64));
  HeldDescriptors held;
  ASSERT_TRUE(held.lowered()) << "cannot lower RLIMIT_NOFILE";
  ASSERT_EQ(held.take_all(), EMFILE);
  held.release(24);
  auto opts = options(1024);
  opts.on_error = OnError::skip;
  auto pipeline = nodes::from_vector(paths) | nodes::read_files_async(opts);
  expect_one_whole_pass(pipeline, paths, 64);
}

// The process has no descriptor left (other readers or the program hold
// them all) and another thread gives some back after 0.3 s: the reader waits
// for one (here up to 1.5 s) and reads the file. Before, the open's EMFILE
// failed it at once (OnError::skip dropped it), on either backend.
TEST_P(ReadFilesAsync, AReaderWaitsForADescriptorWhileTheProcessHasNone) {
  if (kUbsanNeedsDescriptors) GTEST_SKIP() << kUbsanSkip;
  Dir dir;
  const std::string file = dir.file("w0", 64);
  HeldDescriptors held;
  ASSERT_TRUE(held.lowered()) << "cannot lower RLIMIT_NOFILE";
  auto pipeline = nodes::from_vector(std::vector<std::string>{file}) | nodes::read_files_async(options(4));
  // The backend started (the ring made, the threads running) while there
  // are descriptors to spare: making a ring takes one.
  EXPECT_EQ(one_pass_paths(pipeline), std::vector<std::string>{file});
  std::vector<std::string> got;
  EXPECT_EQ(pass_through_a_short_shortage(pipeline, held, got), "");
  EXPECT_EQ(got, std::vector<std::string>{file});
}

// A reader holding no descriptor waits for one (here 1.5 s), then fails
// the file. Its wait then ended with it: the next time the process runs out,
// the reader waits afresh. It used to keep the old wait's start, so the next
// shortage's first file failed at once ("Too many open files"; OnError::skip
// would drop it), however short that shortage was.
TEST(ReadFilesAsyncUring, AShortageLongOverIsNotHeldAgainstTheNext) {
  if (kUbsanNeedsDescriptors) GTEST_SKIP() << kUbsanSkip;
  if (nodes::file_io_backend() != "io_uring") GTEST_SKIP() << "io_uring is not usable here";
  if (!nodes::detail::uring_stop_is_bounded()) GTEST_SKIP() << "the ring thread has no periodic look here";
  Dir dir;
  const std::string file = dir.file("g0", 64);
  HeldDescriptors held;
  ASSERT_TRUE(held.lowered()) << "cannot lower RLIMIT_NOFILE";
  auto pipeline = nodes::from_vector(std::vector<std::string>{file}) |
                  nodes::read_files_async({.max_in_flight = 4, .backend = FileIoBackend::io_uring});
  EXPECT_EQ(one_pass_paths(pipeline), std::vector<std::string>{file}) << "the ring made, with descriptors to spare";
  held.take_all();
  try {
    (void)one_pass_paths(pipeline);
    ADD_FAILURE() << "read a file with no descriptor free for 1.5 s";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("g0: cannot open: Too many open files"), std::string::npos) << e.what();
  }
  // Still none free: a shortage shorter than the wait.
  std::vector<std::string> got;
  EXPECT_EQ(pass_through_a_short_shortage(pipeline, held, got), "");
  EXPECT_EQ(got, std::vector<std::string>{file});
}

// open() stops at a NUL: "dir/a\0missing" read dir/a, labelled with the
// bad path, with no error. Refused now, naming the offset.
TEST_P(ReadFilesAsync, APathHoldingANulByteIsRefusedNotReadAsAnotherFile) {
  Dir dir;
  const std::string a = dir.file("a", 4);
  const std::string bad = a + std::string(1, '\0') + "missing";
  auto pipeline = nodes::from_vector(std::vector<std::string>{bad, a}) | nodes::read_files_async(options());
  auto pass = pipeline.pass();
  try {
    (void)pass.next();
    FAIL() << "read a file under a path with a NUL byte";
  } catch (const DataError& e) {
    EXPECT_EQ(e.file(), bad);
    EXPECT_NE(std::string(e.what()).find("the path holds a NUL byte at offset " + std::to_string(a.size())),
              std::string::npos)
        << e.what();
  }
  EXPECT_EQ(pass.next()->bytes, contents(a));  // the pass goes on
#if CONVEYOR_IO_TEST_FORMATS
  auto serial = nodes::from_vector(std::vector<std::string>{bad}) | nodes::read_files();
  auto serial_pass = serial.pass();
  EXPECT_THROW((void)serial_pass.next(), DataError);
#endif
}

#if CONVEYOR_IO_TEST_FORMATS
TEST_P(ReadFilesAsync, GivesWhatReadFilesGives) {
  Dir dir;
  std::vector<std::string> paths;
  for (int i = 0; i < 50; ++i) paths.push_back(dir.file("c" + std::to_string(i), static_cast<size_t>(i * i * 13)));
  auto async = nodes::from_vector(paths) | nodes::read_files_async(options(8));
  auto serial = nodes::from_vector(paths) | nodes::read_files();
  auto a = async.pass();
  auto s = serial.pass();
  while (true) {
    auto x = a.next();
    auto y = s.next();
    ASSERT_EQ(x.has_value(), y.has_value());
    if (!x) break;
    EXPECT_EQ(x->path, y->path);
    EXPECT_EQ(x->bytes, y->bytes);
  }
}
#endif

INSTANTIATE_TEST_SUITE_P(Backends, ReadFilesAsync, ::testing::Values(FileIoBackend::threads, FileIoBackend::io_uring),
                         [](const ::testing::TestParamInfo<FileIoBackend>& info) {
                           return info.param == FileIoBackend::threads ? "threads" : "io_uring";
                         });

// io_uring_submit failing, as the kernel fails it when short of memory
// (detail::fail_uring_submits), its entries left in the ring, not taken.
class UringSubmitFails : public ::testing::Test {
 protected:
  void SetUp() override {
    if (nodes::file_io_backend() != "io_uring") {
      GTEST_SKIP() << "io_uring is not usable here: " << nodes::file_io_backend();
    }
  }
  void TearDown() override { nodes::detail::fail_uring_submits(0, 0); }
  static constexpr const char* kWhy = ": io_uring_submit failed: Resource temporarily unavailable";
};

// The submit of a file's open (the node's thread), of its statx or of its
// read (the ring thread) fails: that file is a DataError naming it and why,
// the others are read whole, and nothing waits for an entry the kernel did
// not take. One file in flight: three submits each.
TEST_F(UringSubmitFails, TheFileWhoseStepWasNotTakenFailsAndTheOthersAreRead) {
  Dir dir;
  std::vector<std::string> paths;
  for (int i = 0; i < 8; ++i) paths.push_back(dir.file("s" + std::to_string(i), static_cast<size_t>(100 + i)));
  for (int step = 0; step < 3; ++step) {
    SCOPED_TRACE(std::string("the submit of file 3's ") + (step == 0 ? "open" : step == 1 ? "statx" : "read") + " fails");
    auto pipeline = nodes::from_vector(paths) |
                    nodes::read_files_async({.max_in_flight = 1, .backend = FileIoBackend::io_uring});
    nodes::detail::fail_uring_submits(3 * 3 + step, 1);
    auto pass = pipeline.pass();
    for (size_t k = 0; k < paths.size(); ++k) {
      if (k == 3) {
        try {
          pass.next();
          ADD_FAILURE() << "no error for " << paths[k];
        } catch (const DataError& e) {
          EXPECT_EQ(e.file(), paths[k]);
          EXPECT_EQ(std::string(e.what()), paths[k] + kWhy);
        }
        continue;
      }
      auto file = pass.next();
      ASSERT_TRUE(file) << paths[k];
      EXPECT_EQ(file->path, paths[k]);
      EXPECT_EQ(file->bytes, contents(paths[k]));
    }
    EXPECT_EQ(pass.next(), std::nullopt);
  }
}

// Failed submits among many files in flight (a ring thread's submit holds
// several steps): each file is whole or a DataError naming it and why (its
// step not taken, or no entry free for it: the ring's entries held by steps
// not taken), in its place; the pass ends; the next pass reads every file.
TEST_F(UringSubmitFails, FailedSubmitsAmongManyInFlightFailOnlyTheirFiles) {
  Dir dir;
  std::vector<std::string> paths;
  for (int i = 0; i < 300; ++i) paths.push_back(dir.file("m" + std::to_string(i), static_cast<size_t>(i * 97 % 5000)));
  auto pipeline = nodes::from_vector(paths) |
                  nodes::read_files_async({.max_in_flight = 16, .backend = FileIoBackend::io_uring});
  nodes::detail::fail_uring_submits(40, 6);
  size_t errors = 0;
  {
    auto pass = pipeline.pass();
    for (size_t k = 0; k < paths.size(); ++k) {
      try {
        auto file = pass.next();
        ASSERT_TRUE(file) << paths[k];
        EXPECT_EQ(file->path, paths[k]);
        EXPECT_EQ(file->bytes, contents(paths[k]));
      } catch (const DataError& e) {
        EXPECT_EQ(e.file(), paths[k]);
        const std::string what = e.what();
        EXPECT_TRUE(what == paths[k] + kWhy || what == paths[k] + ": io_uring: no submission queue entry free") << what;
        ++errors;
      }
    }
    EXPECT_EQ(pass.next(), std::nullopt);
  }
  EXPECT_GE(errors, 1u);
  size_t k = 0;
  for (FileBytes& file : pipeline.pass()) {
    ASSERT_LT(k, paths.size());
    EXPECT_EQ(file.path, paths[k]);
    EXPECT_EQ(file.bytes, contents(paths[k]));
    ++k;
  }
  EXPECT_EQ(k, paths.size());
}

// A node that read its files, then is destroyed with the next
// `failed_submits` io_uring_submit calls failing: returns once it went.
void read_then_destroy_with_failing_submits(int failed_submits) {
  Dir dir;
  std::vector<std::string> paths;
  for (int i = 0; i < 4; ++i) paths.push_back(dir.file("t" + std::to_string(i), 1000));
  auto pipeline = nodes::from_vector(paths) |
                  nodes::read_files_async({.max_in_flight = 4, .backend = FileIoBackend::io_uring});
  size_t k = 0;
  for (FileBytes& file : pipeline.pass()) EXPECT_EQ(file.bytes, contents(paths[k++]));
  EXPECT_EQ(k, paths.size());
  nodes::detail::fail_uring_submits(0, failed_submits);
}

// The destructor's stop entry not taken at first: the node goes (its ring
// thread does not wait for it for ever).
TEST_F(UringSubmitFails, TheStopIsSubmittedAgainUntilTaken) {
  read_then_destroy_with_failing_submits(3);
  SUCCEED() << "the node went";
}

// The kernel never takes the stop entry (every submit fails from the
// destructor on): the node still goes, its ring thread seeing the stop at
// its next timed wait, where the kernel has them.
TEST_F(UringSubmitFails, TheNodeGoesEvenIfTheStopIsNeverTaken) {
  if (!nodes::detail::uring_stop_is_bounded()) {
    GTEST_SKIP() << "this kernel's io_uring waits without a timeout (IORING_FEAT_EXT_ARG, Linux 5.11)";
  }
  read_then_destroy_with_failing_submits(1'000'000'000);
  SUCCEED() << "the node went";
}

TEST(ReadFilesAsyncOptions, OutOfRangeNamesTheValue) {
  try {
    nodes::read_files_async({.max_in_flight = 0});
    ADD_FAILURE();
  } catch (const conveyor::ValueError& e) {
    EXPECT_STREQ(e.what(), "read_files_async: max_in_flight should be in [1, 65536], but got 0");
  }
  try {
    nodes::read_files_async({.threads = 300});
    ADD_FAILURE();
  } catch (const conveyor::ValueError& e) {
    EXPECT_STREQ(e.what(), "read_files_async: threads should be in [1, 256], but got 300");
  }
  EXPECT_THROW(nodes::read_files_async({.max_bytes = 0}), conveyor::ValueError);
}

TEST(ReadFilesAsyncOptions, TheBackendIsNamed) {
  const std::string backend = nodes::file_io_backend();
  std::printf("file_io_backend(): %s\n", backend.c_str());
  EXPECT_TRUE(backend == "io_uring" || backend.rfind("threads (", 0) == 0) << backend;
  if (backend != "io_uring") {
    EXPECT_THROW(nodes::read_files_async({.backend = FileIoBackend::io_uring}), conveyor::Error);
  }
}

// The automatic backend falls back to the thread pool where io_uring may
// not be used (here: CONVEYOR_IO_URING=0, as for a seccomp-filtered
// container), says so in one line, and reads every file. In a child
// process (a death test re-run from the start): the line is printed once
// per process.
TEST(ReadFilesAsyncOptions, TheAutomaticBackendFallsBackToThreadsSayingSoOnceAndReadsEverything) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(
      {
        ::setenv("CONVEYOR_IO_URING", "0", 1);
        Dir dir;
        std::vector<std::string> paths;
        for (size_t size : {0, 100, 70000}) paths.push_back(dir.file("f" + std::to_string(size), size));
        bool same = nodes::file_io_backend() == "threads (CONVEYOR_IO_URING=0)";
        for (int pass = 0; pass < 2; ++pass) {  // two pipelines: still one line
          auto pipeline = nodes::from_vector(paths) | nodes::read_files_async({.threads = 3});
          size_t k = 0;
          for (FileBytes& file : pipeline.pass()) same = same && file.bytes == contents(paths[k++]);
          same = same && k == paths.size();
        }
        std::fflush(stderr);
        std::_Exit(same ? 0 : 1);
      },
      ::testing::ExitedWithCode(0),
      "^conveyor: read_files_async: a pool of 3 threads \\(CONVEYOR_IO_URING=0\\)\n$");
}

}  // namespace
