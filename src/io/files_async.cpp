// read_files_async (conveyor/nodes/files_async.h): async_map over a file
// reader, io_uring's or a thread pool's. The reader calls each item's
// Completion from its own thread(s); async_map does the rest.
#include "conveyor/nodes/files_async.h"

#include <fcntl.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <limits>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <system_error>
#include <thread>
#include <utility>
#include <vector>

#include "conveyor/nodes/async.h"

#if CONVEYOR_IO_HAVE_URING
#include <liburing.h>
#endif

namespace conveyor::nodes {
namespace {

using Done = Completion<FileBytes>;

// ---- what both backends share: read_files' checks and messages -------------

std::string os_reason(int error_number) { return std::generic_category().message(error_number); }

std::string file_type_name(mode_t mode) {
  if (S_ISDIR(mode)) return "a directory";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  if (S_ISFIFO(mode)) return "a FIFO (named pipe)";
  if (S_ISSOCK(mode)) return "a socket";
  return "file type " + std::to_string(mode & S_IFMT);
}

// Why a file of this type and size is refused, or "".
std::string refuse(mode_t mode, uint64_t size, uint64_t max_bytes) {
  if (!S_ISREG(mode)) return "not a regular file (" + file_type_name(mode) + ")";
  if (size > max_bytes) {
    return "the file holds " + std::to_string(size) + " bytes, more than read_files_async's max_bytes " +
           std::to_string(max_bytes);
  }
  return {};
}

// The descriptor was opened O_NONBLOCK (so that opening a FIFO cannot wait
// for a writer); reads of the regular file must block (io_uring would answer
// EAGAIN instead of waiting for the disk).
std::string clear_nonblock(int fd) {
  const int flags = ::fcntl(fd, F_GETFL);
  if (flags < 0 || ::fcntl(fd, F_SETFL, flags & ~O_NONBLOCK) != 0) return "cannot clear O_NONBLOCK: " + os_reason(errno);
  return {};
}

// The exception_ptr is made in a statement of its own: the temporary
// DataError (whose message string is reference-counted, shared with the
// copy inside the exception_ptr) is destroyed before fail() publishes the
// copy to the consumer's thread, not after.
void fail(Done& done, const std::string& why, const std::string& path) {
  std::exception_ptr error = std::make_exception_ptr(DataError(why, path));
  done.fail(std::move(error));
}

class FileReader {
 public:
  virtual ~FileReader() = default;
  virtual void read(std::string path, Done done) = 0;
};

// detail::descriptor_wait: how long a reader waits for a descriptor while
// the process has none (10 s unless a test shortens it). relaxed: read when
// a shortage is met, set by a test between passes; it publishes nothing.
std::atomic<int64_t> descriptor_wait_ms{10'000};
// How often a reader waiting for a descriptor, or to stop, looks again.
constexpr std::chrono::milliseconds kLookAgain{200};

bool out_of_descriptors(int error) { return error == EMFILE || error == ENFILE; }

// ---- the thread pool -----------------------------------------------------------

class PoolReader final : public FileReader {
 public:
  PoolReader(int threads, uint64_t max_bytes) : max_bytes_(max_bytes) {
    for (int i = 0; i < threads; ++i) threads_.emplace_back([this] { loop(); });
  }
  ~PoolReader() override {
    {
      std::lock_guard lock(mutex_);
      stopping_ = true;
    }
    wake_.notify_all();
    closed_.notify_all();
    for (auto& thread : threads_) thread.join();
    // Requests still queued belong to a node that is going: their
    // completions are dropped with the queue, delivering nothing.
  }
  void read(std::string path, Done done) override {
    {
      std::lock_guard lock(mutex_);
      queue_.push_back({std::move(path), std::move(done)});
    }
    wake_.notify_one();
  }

 private:
  struct Request {
    std::string path;
    Done done;
  };

  void loop() {
    std::unique_lock lock(mutex_);
    while (true) {
      wake_.wait(lock, [this] { return stopping_ || !queue_.empty(); });
      if (stopping_) return;
      Request request = std::move(queue_.front());
      queue_.pop_front();
      lock.unlock();
      if (!request.done.cancelled()) serve(request);  // else its pass is over: skip the read
      lock.lock();
    }
  }

  // The file's descriptor, or -1 with errno. Where the process has none
  // left (EMFILE, ENFILE: other readers or the program hold them), it waits
  // for one, as the io_uring reader does, rather than failing a good file:
  // looking again when another thread of the pool closes its file, or every
  // kLookAgain, for at most the descriptor wait (descriptor_wait_ms).
  int open_waiting_for_a_descriptor(const Request& request) {
    std::optional<std::chrono::steady_clock::time_point> since;
    while (true) {
      int fd;
      do {
        fd = ::open(request.path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
      } while (fd < 0 && errno == EINTR);
      if (fd >= 0 || !out_of_descriptors(errno)) return fd;
      const int error = errno;
      const auto now = std::chrono::steady_clock::now();
      if (!since) since = now;
      std::unique_lock lock(mutex_);
      if (stopping_ || request.done.cancelled() ||
          now - *since > std::chrono::milliseconds(descriptor_wait_ms.load(std::memory_order_relaxed))) {
        errno = error;
        return -1;
      }
      closed_.wait_for(lock, kLookAgain);
    }
  }

  void serve(Request& request) {
    const int fd = open_waiting_for_a_descriptor(request);
    if (fd < 0) return fail(request.done, "cannot open: " + os_reason(errno), request.path);
    struct Closer {
      PoolReader& pool;
      int fd;
      ~Closer() {
        ::close(fd);
        pool.closed_.notify_all();  // a thread waiting for a descriptor may take this one
      }
    } closer{*this, fd};
    struct stat status {};
    if (::fstat(fd, &status) != 0) return fail(request.done, "cannot stat: " + os_reason(errno), request.path);
    const auto size = static_cast<uint64_t>(status.st_size);
    std::string why = refuse(status.st_mode, size, max_bytes_);
    if (why.empty()) why = clear_nonblock(fd);
    if (!why.empty()) return fail(request.done, why, request.path);
    std::vector<uint8_t> bytes;
    try {
      bytes.resize(static_cast<size_t>(size));
    } catch (...) {
      request.done.fail(std::current_exception());
      return;
    }
    size_t got = 0;
    while (got < bytes.size()) {
      const ssize_t n = ::pread(fd, bytes.data() + got, bytes.size() - got, static_cast<off_t>(got));
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) return fail(request.done, "cannot read: " + os_reason(errno), request.path);
      if (n == 0) break;  // shrank meanwhile
      got += static_cast<size_t>(n);
    }
    bytes.resize(got);
    request.done(FileBytes{std::move(request.path), std::move(bytes)});
  }

  uint64_t max_bytes_;
  std::mutex mutex_;
  std::condition_variable wake_;
  std::condition_variable closed_;  // a file closed: a descriptor is free
  std::deque<Request> queue_;
  bool stopping_ = false;
  std::vector<std::thread> threads_;
};

// ---- io_uring ------------------------------------------------------------------

// detail::fail_uring_submits: how many submits go through, then how many fail.
// relaxed throughout: plain counters, read and decremented under a ring's
// mutex (submit_locked) and set by a test between passes; they publish no
// other data, and the tests use one ring at a time.
std::atomic<int> submits_to_pass{0};
std::atomic<int> submits_to_fail{0};

#if CONVEYOR_IO_HAVE_URING

// -EAGAIN where a test asked this submit to fail (detail::fail_uring_submits), else 0.
int injected_submit_failure() {
  if (submits_to_fail.load(std::memory_order_relaxed) == 0) return 0;
  if (submits_to_pass.load(std::memory_order_relaxed) > 0) {
    submits_to_pass.fetch_sub(1, std::memory_order_relaxed);
    return 0;
  }
  submits_to_fail.fetch_sub(1, std::memory_order_relaxed);
  return -EAGAIN;
}

// The user_data of an entry whose request failed before the kernel took it
// (submit_locked): its completion is dropped.
char dropped_entry;

// One ring, one thread waiting on its completion queue. Submissions come from
// the node's thread (an openat per new file) and from the ring thread (each
// next step), under one mutex: the submission queue has a single producer at
// a time; the completion queue is the ring thread's alone, which handles
// each batch of completions under the mutex too (completions only deliver
// into async_map's window: nothing calls back into the reader).
//
// A request belongs to the ring from the moment an entry points at it
// until its last completion: only then is it deleted. An entry the kernel
// did not take stays in the ring, and the next io_uring_submit (if any)
// hands it over; submit_locked() makes it point at nothing first.
class UringReader final : public FileReader {
 public:
  // nullptr and `why` when the ring cannot be set up.
  static std::unique_ptr<UringReader> create(unsigned entries, uint64_t max_bytes, std::string& why) {
    auto reader = std::unique_ptr<UringReader>(new UringReader(max_bytes));
    const int rc = io_uring_queue_init(entries, &reader->ring_, 0);
    if (rc < 0) {
      why = "io_uring_queue_init failed: " + os_reason(-rc);
      return nullptr;
    }
    reader->ring_ready_ = true;
    reader->timed_waits_ = (reader->ring_.features & IORING_FEAT_EXT_ARG) != 0;
    // queued_ holds at most a submission queue's worth: reserved now, a
    // push never allocates (nor throws) with an entry already pointing at
    // its request.
    reader->queued_.reserve(*reader->ring_.sq.kring_entries);
    reader->thread_ = std::thread([raw = reader.get()] { raw->loop(); });
    return reader;
  }

  ~UringReader() override {
    if (!ring_ready_) return;
    // The thread ends once stopping_ is set and no request is in flight. A
    // stop entry, a no-op, wakes it if it waits with nothing in flight.
    // Where the kernel waits with a timeout (IORING_FEAT_EXT_ARG, 5.11) the
    // thread also looks at stopping_ every kStopCheck, so a stop entry the
    // kernel does not take (a submit failing for as long as it likes)
    // delays the join by at most that. Elsewhere it is submitted again
    // until taken (the thread drains completions meanwhile, which is what a
    // busy kernel lacks).
    bool queued = false;
    for (auto pause = std::chrono::milliseconds(1);; pause = std::min(2 * pause, std::chrono::milliseconds(100))) {
      {
        std::lock_guard lock(mutex_);
        stopping_ = true;
        // Files not opened yet belong to a node that is going: dropped,
        // delivering nothing (as the thread pool drops its queue).
        for (Request* waiting : waiting_) delete waiting;
        outstanding_ -= waiting_.size();
        waiting_.clear();
        if (!queued) {
          if (io_uring_sqe* sqe = sqe_locked()) {
            io_uring_prep_nop(sqe);
            io_uring_sqe_set_data(sqe, nullptr);
            queued = true;
          }
        }
        submit_locked();
        if (timed_waits_ || (queued && io_uring_sq_ready(&ring_) == 0)) break;
      }
      std::this_thread::sleep_for(pause);
    }
    // The thread drains every request in flight first: the kernel writes
    // into their buffers until their completions arrive.
    thread_.join();
    io_uring_queue_exit(&ring_);
  }

  void read(std::string path, Done done) override {
    auto request = std::make_unique<Request>();
    request->path = std::move(path);
    request->done = std::move(done);
    std::lock_guard lock(mutex_);
    ++outstanding_;
    waiting_.push_back(request.release());  // opened once a place is free
    pump_locked();
  }

 private:
  struct Request {
    enum class Step { open, stat, read } step = Step::open;
    std::string path;
    Done done;
    int fd = -1;
    struct statx stx {};
    std::vector<uint8_t> bytes;
    size_t got = 0;
  };

  explicit UringReader(uint64_t max_bytes) : max_bytes_(max_bytes), open_limit_(open_limit()) {}

  // How many files may be open at once: a share of the process's descriptor
  // limit, whatever max_in_flight is. The window keeps a descriptor from
  // each file's open to its last read, so a window near RLIMIT_NOFILE made
  // good files fail with EMFILE (and OnError::skip dropped them).
  static size_t open_limit() {
    rlimit limit{};
    if (getrlimit(RLIMIT_NOFILE, &limit) != 0 || limit.rlim_cur == RLIM_INFINITY) return kMaxOpen;
    return std::clamp<size_t>(static_cast<size_t>(limit.rlim_cur) / 4, kMinOpen, kMaxOpen);
  }

  // Opens waiting files in the free places, then submits what is prepared,
  // until neither moves on. An open place is held from a file's openat
  // until its request is over (release_locked). Under mutex_.
  void pump_locked() {
    while (true) {
      const size_t waiting_before = waiting_.size();
      const size_t open_before = open_;
      admit_locked();
      if (io_uring_sq_ready(&ring_) == 0) return;
      submit_locked();
      if (waiting_.empty() || open_ >= admission_limit()) return;
      // No entry was free, or the kernel took none: where nothing changed,
      // the next completion (or the ring thread's periodic look) pumps again.
      if (waiting_.size() == waiting_before && open_ == open_before) return;
    }
  }

  // Prepares openats for waiting files while places and entries are free;
  // submits nothing. Under mutex_.
  void admit_locked() {
    if (short_of_descriptors_) return;  // until the ring thread's next periodic look
    while (open_ < admission_limit() && !waiting_.empty()) {
      Request* next = waiting_.front();
      if (next->done.cancelled()) {  // its pass is over: nobody wants the bytes
        waiting_.pop_front();
        delete next;
        --outstanding_;
        idle_locked();
        continue;
      }
      io_uring_sqe* sqe = io_uring_get_sqe(&ring_);
      if (!sqe) return;
      waiting_.pop_front();
      io_uring_prep_openat(sqe, AT_FDCWD, next->path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK, 0);
      queue_locked(sqe, *next);  // the ring's now, until its last step
      ++open_;
    }
  }

  // How many may be open now: the share of the descriptor limit, less
  // while the process has run out of descriptors (other readers hold them).
  size_t admission_limit() const noexcept { return std::min(open_limit_, shortage_limit_); }

  // An open failed with EMFILE or ENFILE: the process, not the file, is out
  // of descriptors (each reader's share is its own, and other readers and
  // the program hold theirs). The file goes back to the front of the queue
  // instead of failing: while this reader holds open files, until one of
  // them is released, and its admissions are capped at what it holds;
  // holding none, until the ring thread's next periodic look (every
  // kStopCheck), for at most 10 s (descriptor_wait_ms) without an open
  // succeeding: one wait, counted from this reader's first EMFILE since it
  // last had nothing to do (idle_locked).
  // False when it must fail: that wait is over, or the kernel has no timed
  // wait to look with. Under mutex_.
  bool requeue_for_a_descriptor_locked(Request& r) {
    const auto now = std::chrono::steady_clock::now();
    if (!shortage_since_) shortage_since_ = now;
    --open_;
    const std::chrono::milliseconds wait(descriptor_wait_ms.load(std::memory_order_relaxed));
    if (open_ == 0 && (!timed_waits_ || now - *shortage_since_ > wait)) {
      ++open_;  // released with the request
      return false;
    }
    shortage_limit_ = std::max<size_t>(open_, 1);
    if (open_ == 0) short_of_descriptors_ = true;
    waiting_.push_front(&r);
    return true;
  }
  // An open succeeded: the shortage, if any, is easing.
  void opened_locked() noexcept {
    shortage_since_.reset();
    if (shortage_limit_ < open_limit_) ++shortage_limit_;
  }

  // A request that held an open place is over. Under mutex_.
  void release_locked(Request* r) {
    delete r;
    --outstanding_;
    --open_;
    idle_locked();
  }
  // With nothing left to do, a shortage met before is over: the next one is
  // waited out afresh, not failed at once for a wait that ended long ago
  // (its file dropped with a pass left early, or failed). Under mutex_.
  void idle_locked() noexcept {
    if (outstanding_ != 0) return;
    shortage_since_.reset();
    short_of_descriptors_ = false;
    shortage_limit_ = std::numeric_limits<size_t>::max();
  }

  // A free entry, submitting what is queued when there is none. Under mutex_.
  io_uring_sqe* sqe_locked() {
    io_uring_sqe* sqe = io_uring_get_sqe(&ring_);
    if (!sqe) {
      submit_locked();
      sqe = io_uring_get_sqe(&ring_);
    }
    return sqe;
  }

  // `sqe`, prepared, now points at `r`: submit_locked() hands it over. Under mutex_.
  void queue_locked(io_uring_sqe* sqe, Request& r) {
    io_uring_sqe_set_data(sqe, &r);
    queued_.push_back({sqe, &r});
  }

  // Submits the queued entries. One the kernel did not take (io_uring_submit
  // failed, or took only some) stays in the ring for a later submit that may
  // never come: it becomes a no-op that points at nothing, and its request
  // fails now, saying why. So no request waits for ever, and none is deleted
  // while an entry still points at it. Under mutex_.
  void submit_locked() {
    int rc = injected_submit_failure();
    if (rc == 0) {
      do {
        rc = io_uring_submit(&ring_);
      } while (rc == -EINTR);
    }
    // The ring hands entries over in order: those left are the last queued.
    const unsigned left = io_uring_sq_ready(&ring_);
    const size_t untaken = std::min<size_t>(left, queued_.size());
    for (size_t k = queued_.size() - untaken; k < queued_.size(); ++k) {
      auto [sqe, request] = queued_[k];
      io_uring_prep_nop(sqe);
      io_uring_sqe_set_data(sqe, &dropped_entry);
      finish_error(*request, rc < 0 ? "io_uring_submit failed: " + os_reason(-rc)
                                    : "io_uring_submit took " + std::to_string(rc) + " of " +
                                          std::to_string(static_cast<unsigned>(rc) + left) + " entries, not this one's");
      release_locked(request);
    }
    queued_.clear();
  }

  void loop() {
    bool wait_failed = false;
    std::vector<Request*> next;  // requests whose next step to submit
    std::vector<Request*> over;  // requests delivered or failed
    while (true) {
      io_uring_cqe* cqe = nullptr;
      // With EXT_ARG the timeout travels with the wait, no entry submitted
      // (this thread touches the submission queue only under the mutex).
      __kernel_timespec stop_check{.tv_sec = 0, .tv_nsec = kStopCheck.count()};
      const int rc =
          timed_waits_ ? io_uring_wait_cqe_timeout(&ring_, &cqe, &stop_check) : io_uring_wait_cqe(&ring_, &cqe);
      if (rc == -EINTR) continue;
      if (rc == -ETIME) {
        std::lock_guard lock(mutex_);
        if (stopping_ && outstanding_ == 0) return;
        short_of_descriptors_ = false;  // try the waiting file again
        pump_locked();  // waiting files a failing submit left behind, or a descriptor
        continue;
      }
      if (rc < 0) {
        // Not expected with a working ring; say so once and keep draining.
        if (!wait_failed) std::fprintf(stderr, "conveyor: read_files_async: io_uring_wait_cqe: %s\n", os_reason(-rc).c_str());
        wait_failed = true;
        std::lock_guard lock(mutex_);
        if (stopping_ && outstanding_ == 0) return;
        continue;
      }
      // Under the mutex: read() wrote each request before submitting it under
      // the mutex; the kernel's completion is no happens-before edge that
      // ThreadSanitizer can see, the mutex is.
      std::lock_guard lock(mutex_);
      unsigned head;
      unsigned seen = 0;
      io_uring_for_each_cqe(&ring_, head, cqe) {
        ++seen;
        void* data = io_uring_cqe_get_data(cqe);
        if (data == &dropped_entry) continue;  // its request failed when it was not taken
        auto* request = static_cast<Request*>(data);
        if (!request) continue;  // the stop entry: stopping_ is set
        if (request->step == Request::Step::open) {
          if (out_of_descriptors(-cqe->res) && requeue_for_a_descriptor_locked(*request)) continue;
          if (cqe->res >= 0) opened_locked();
        }
        if (advance(*request, cqe->res)) {
          next.push_back(request);
        } else {
          over.push_back(request);
        }
      }
      io_uring_cq_advance(&ring_, seen);
      for (Request* request : next) {
        if (!submit_step_locked(*request)) over.push_back(request);
      }
      next.clear();
      for (Request* request : over) release_locked(request);
      over.clear();
      pump_locked();  // the next steps, and waiting files in the places freed
      // Stopping, with nothing in flight: no completion of a request can
      // still arrive (the stop entry's may, and goes with the ring).
      if (stopping_ && outstanding_ == 0) return;
    }
  }

  // A step finished with `res`: true when the request has a next step to
  // submit; false when it is over (delivered or failed here).
  bool advance(Request& r, int res) {
    switch (r.step) {
      case Request::Step::open:
        if (res < 0) return finish_error(r, "cannot open: " + os_reason(-res));
        r.fd = res;
        if (r.done.cancelled()) return finish_quietly(r);
        r.step = Request::Step::stat;
        return true;
      case Request::Step::stat: {
        if (res < 0) return finish_error(r, "cannot stat: " + os_reason(-res));
        const uint64_t size = r.stx.stx_size;
        std::string why = refuse(static_cast<mode_t>(r.stx.stx_mode), size, max_bytes_);
        if (why.empty()) why = clear_nonblock(r.fd);
        if (!why.empty()) return finish_error(r, why);
        if (r.done.cancelled()) return finish_quietly(r);
        try {
          r.bytes.resize(static_cast<size_t>(size));
        } catch (...) {
          close_fd(r);
          r.done.fail(std::current_exception());
          return false;
        }
        if (size == 0) return finish(r);
        r.step = Request::Step::read;
        return true;
      }
      case Request::Step::read:
        if (res == -EAGAIN || res == -EINTR) return true;  // again, from where it was
        if (res < 0) return finish_error(r, "cannot read: " + os_reason(-res));
        if (res == 0) {  // shrank meanwhile
          r.bytes.resize(r.got);
          return finish(r);
        }
        r.got += static_cast<size_t>(res);
        if (r.got < r.bytes.size()) return true;
        return finish(r);
    }
    return false;
  }

  // Prepares the request's current step. Under mutex_.
  bool submit_step_locked(Request& r) {
    io_uring_sqe* sqe = sqe_locked();
    if (!sqe) return finish_error(r, "io_uring: no submission queue entry free");
    switch (r.step) {
      case Request::Step::open:
        break;  // submitted by read()
      case Request::Step::stat:
        io_uring_prep_statx(sqe, r.fd, "", AT_EMPTY_PATH, STATX_TYPE | STATX_MODE | STATX_SIZE, &r.stx);
        break;
      case Request::Step::read:
        io_uring_prep_read(sqe, r.fd, r.bytes.data() + r.got, static_cast<unsigned>(std::min<size_t>(
                                                                   r.bytes.size() - r.got, size_t{1} << 30)),
                           r.got);
        break;
    }
    queue_locked(sqe, r);
    return true;
  }

  void close_fd(Request& r) {
    if (r.fd >= 0) ::close(r.fd);
    r.fd = -1;
  }
  bool finish(Request& r) {
    close_fd(r);
    r.done(FileBytes{std::move(r.path), std::move(r.bytes)});
    return false;
  }
  bool finish_error(Request& r, const std::string& why) {
    close_fd(r);
    fail(r.done, why, r.path);
    return false;
  }
  bool finish_quietly(Request& r) {  // its pass is over: nobody wants the bytes
    close_fd(r);
    return false;
  }

  uint64_t max_bytes_;
  io_uring ring_{};
  // How often a thread waiting with nothing to do looks at stopping_.
  static constexpr std::chrono::nanoseconds kStopCheck{200'000'000};
  bool ring_ready_ = false;
  bool timed_waits_ = false;  // set before the thread starts
  std::mutex mutex_;  // the submission queue, queued_, outstanding_, stopping_
  bool stopping_ = false;  // the destructor runs
  // Entries prepared since the last submit, in order, and their requests.
  std::vector<std::pair<io_uring_sqe*, Request*>> queued_;
  size_t outstanding_ = 0;  // requests the reader holds: in the ring or waiting
  static constexpr size_t kMinOpen = 8, kMaxOpen = 1024;
  const size_t open_limit_;
  // Out of descriptors: how many may be open meanwhile (regrown by one each
  // open that succeeds), since when, and whether admitting waits for the
  // periodic look (none of this reader's own files is open to release one).
  size_t shortage_limit_ = std::numeric_limits<size_t>::max();
  std::optional<std::chrono::steady_clock::time_point> shortage_since_;
  bool short_of_descriptors_ = false;
  size_t open_ = 0;  // requests in the ring: opening, open, or reading
  std::deque<Request*> waiting_;  // not opened yet: no place, or no entry, was free
  std::thread thread_;
};

#endif  // CONVEYOR_IO_HAVE_URING

// ---- choosing -------------------------------------------------------------------

struct Probe {
  bool uring = false;
  bool timed_waits = false;  // IORING_FEAT_EXT_ARG
  std::string why;  // when not
};

// Once per process: can this process set up a ring?
const Probe& probe() {
  static const Probe result = [] {
    Probe p;
#if CONVEYOR_IO_HAVE_URING
    io_uring ring{};
    const int rc = io_uring_queue_init(8, &ring, 0);
    if (rc == 0) {
      p.timed_waits = (ring.features & IORING_FEAT_EXT_ARG) != 0;
      io_uring_queue_exit(&ring);
      p.uring = true;
    } else {
      p.why = "io_uring_queue_init failed: " + os_reason(-rc);
    }
#else
    p.why = "conveyor::io was built without liburing";
#endif
    return p;
  }();
  return result;
}

bool env_forbids_uring() {
  const char* value = std::getenv("CONVEYOR_IO_URING");
  return value && std::string(value) == "0";
}

void say_once(const std::string& line) {
  static std::once_flag once;
  std::call_once(once, [&] { std::fprintf(stderr, "conveyor: read_files_async: %s\n", line.c_str()); });
}

std::unique_ptr<FileReader> make_reader(const ReadFilesAsyncOptions& options) {
  std::string why;
  if (options.backend == FileIoBackend::threads) {
    why = "asked for";
  } else if (options.backend == FileIoBackend::automatic && env_forbids_uring()) {
    why = "CONVEYOR_IO_URING=0";
  } else {
#if CONVEYOR_IO_HAVE_URING
    unsigned entries = 8;
    while (entries < static_cast<unsigned>(options.max_in_flight) && entries < 4096) entries *= 2;
    if (auto reader = UringReader::create(entries, options.max_bytes, why)) {
      say_once("io_uring");
      return reader;
    }
    if (options.backend == FileIoBackend::io_uring) throw Error("read_files_async: io_uring was asked for, but " + why);
#else
    why = probe().why;
    if (options.backend == FileIoBackend::io_uring) throw Error("read_files_async: io_uring was asked for, but " + why);
#endif
  }
  say_once("a pool of " + std::to_string(options.threads) + " threads (" + why + ")");
  return std::make_unique<PoolReader>(options.threads, options.max_bytes);
}

// async_map's fn: starts the backend at the first file (nothing is opened
// before the first pass asks), then hands it each path.
struct StartRead {
  ReadFilesAsyncOptions options;
  std::shared_ptr<FileReader> reader;
  void operator()(std::string path, Done done) {
    // open() would stop at the NUL and read another file under this name.
    if (const size_t nul = path.find('\0'); nul != std::string::npos) {
      return fail(done, "cannot open: the path holds a NUL byte at offset " + std::to_string(nul), path);
    }
    if (!reader) reader = make_reader(options);
    reader->read(std::move(path), std::move(done));
  }
};

void validate(const ReadFilesAsyncOptions& options) {
  auto fail_option = [](const std::string& what) { throw ValueError("read_files_async: " + what); };
  if (options.max_in_flight < 1 || options.max_in_flight > 65536) {
    fail_option("max_in_flight should be in [1, 65536], but got " + std::to_string(options.max_in_flight));
  }
  if (options.threads < 1 || options.threads > 256) {
    fail_option("threads should be in [1, 256], but got " + std::to_string(options.threads));
  }
  if (options.max_bytes == 0) fail_option("max_bytes should be at least 1");
  if (options.backend == FileIoBackend::io_uring && !probe().uring) {
    throw Error("read_files_async: io_uring was asked for, but " + probe().why);
  }
}

}  // namespace

namespace detail {
void fail_uring_submits(int after, int count) {
  submits_to_pass.store(after, std::memory_order_relaxed);
  submits_to_fail.store(count, std::memory_order_relaxed);
}
void descriptor_wait(std::chrono::milliseconds wait) {
  descriptor_wait_ms.store(wait.count(), std::memory_order_relaxed);
}
bool uring_stop_is_bounded() { return probe().timed_waits; }
}  // namespace detail

std::string file_io_backend() {
  if (env_forbids_uring()) return "threads (CONVEYOR_IO_URING=0)";
  return probe().uring ? "io_uring" : "threads (" + probe().why + ")";
}

std::function<Pipeline<FileBytes>(Pipeline<std::string>&&)> read_files_async(ReadFilesAsyncOptions options) {
  validate(options);
  return [options](Pipeline<std::string>&& upstream) {
    using Node = AsyncMap<std::string, FileBytes, StartRead>;
    return Pipeline<FileBytes>(std::make_unique<Node>(
        std::move(upstream).release(), StartRead{options, nullptr},
        AsyncOptions{.max_in_flight = options.max_in_flight, .in_order = options.in_order, .on_error = options.on_error},
        "read_files_async", detail::AsyncErrors::data_error_as_is));
  };
}

}  // namespace conveyor::nodes
