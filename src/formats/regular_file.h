// src/formats/regular_file.h: how the readers open a data file (internal).
#pragma once

#include <cstdint>
#include <string>

namespace conveyor::detail {

// strerror's text, without strerror's shared buffer.
std::string os_reason(int error_number);

// A file opened for reading, or why it could not be.
struct OpenedFile {
  int fd = -1;        // owned by the caller when `problem` is empty
  uint64_t size = 0;  // from fstat
  uint64_t stored = 0;  // st_blocks' bytes: fewer than `size` where the file is sparse
  std::string problem;
};

// Opens `path` for reading if it is a regular file. Anything else is refused
// before a byte is read ("not a regular file (a FIFO (named pipe))"):
// /dev/zero or /dev/urandom never end, a FIFO with no writer hangs open(),
// and none has a size to check the data against. O_NONBLOCK keeps open()
// from waiting for a FIFO's writer (cleared again for reading); fstat of the
// descriptor, not the path, checks the very file that is read.
OpenedFile open_regular_file(const std::string& path);

}  // namespace conveyor::detail
