// conveyor/nodes/files_async.h: local files read asynchronously (target
// conveyor::io; io_uring where liburing was found at build time and the
// kernel allows it).
//
//   list_files(root, "*.jpg") | read_files_async({.max_in_flight = 256})
//       | map(decode, {.workers = 4}) | batch(64)
//
//   read_files_async(options)   path -> FileBytes, as read_files (files.h):
//                               regular files only, at most max_bytes, a
//                               DataError naming the path otherwise; up to
//                               max_in_flight files opened and read at once.
//
// Built on async_map (conveyor/nodes/async.h): its order, window, errors
// (an own error is the DataError naming the path, as read_files throws it;
// OnError::skip drops and counts it), metrics and reset semantics.
//
// Backends. io_uring: one ring and one thread per node; each file is an
// openat (O_NONBLOCK: a FIFO never blocks it), a statx of the descriptor
// (the very file that is read), reads until the size statx gave, all
// submitted to the ring; the thread only waits for completions and submits
// the next step. A step the kernel does not take (io_uring_submit failing,
// as when it is short of memory) fails its file: a DataError naming the
// path and the reason. Where io_uring_queue_init fails (an old kernel,
// seccomp, a container that blocks it) or was not built, a pool of
// `threads` threads does the same with plain system calls. The first node
// to start says which on stderr, once per process; file_io_backend() tells
// it too.
// CONVEYOR_IO_URING=0 in the environment makes `automatic` take the pool.
//
// A node's backend starts at its first pass and stops with the node: its
// destructor waits for the reads in flight (local reads: short), whose
// completions then go nowhere. A reset leaves them to finish unwanted;
// requests not yet begun for an abandoned pass are skipped.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <string>

#include "conveyor/data_error.h"
#include "conveyor/node.h"
#include "conveyor/nodes/files.h"

namespace conveyor::nodes {

enum class FileIoBackend {
  automatic,  // io_uring if it works here, else the thread pool
  io_uring,   // io_uring or an Error at read_files_async()
  threads,    // the thread pool
};

struct ReadFilesAsyncOptions {
  // Files opened or read at once, and the window. [1, 65536].
  int max_in_flight = 64;
  // A larger file is a DataError (checked from statx, before reading).
  uint64_t max_bytes = uint64_t{1} << 32;
  bool in_order = true;
  OnError on_error = OnError::raise;
  FileIoBackend backend = FileIoBackend::automatic;
  // The pool's threads, where it is used. [1, 256].
  int threads = 4;
};

// Pipeline<std::string> (paths) -> Pipeline<FileBytes>. Throws ValueError
// for options out of range, Error when io_uring is asked for and unavailable.
std::function<Pipeline<FileBytes>(Pipeline<std::string>&&)> read_files_async(ReadFilesAsyncOptions options = {});

// What `automatic` uses in this process: "io_uring", or "threads (" the
// reason ")", e.g. "threads (io_uring_queue_init failed: Operation not
// permitted)". Probes once.
std::string file_io_backend();

namespace detail {
// Fault injection for tests: of the io_uring_submit calls that
// read_files_async's rings make from now on (any node, any thread), the
// first `after` go through, then `count` fail with EAGAIN (as a kernel short
// of memory fails them), their entries left in the ring, not taken.
void fail_uring_submits(int after, int count);
// For tests: how long a reader waits for a descriptor while the process has
// none (EMFILE), before failing the file; 10 s unless set. Any node, either
// backend, from now on.
void descriptor_wait(std::chrono::milliseconds wait);
// Whether a ring's thread waits with a timeout here (IORING_FEAT_EXT_ARG,
// Linux 5.11): a node's destructor then returns even if the kernel never
// takes its stop entry. Elsewhere it submits that entry until taken.
bool uring_stop_is_bounded();
}  // namespace detail

}  // namespace conveyor::nodes
