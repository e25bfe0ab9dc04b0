#include "regular_file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <string>
#include <system_error>

namespace conveyor::detail {
namespace {

// What a file that is not a regular one is, for the error that refuses it.
std::string file_type_name(mode_t mode) {
  if (S_ISDIR(mode)) return "a directory";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  if (S_ISFIFO(mode)) return "a FIFO (named pipe)";
  if (S_ISSOCK(mode)) return "a socket";
  return "file type " + std::to_string(mode & S_IFMT);
}

}  // namespace

std::string os_reason(int error_number) { return std::generic_category().message(error_number); }

OpenedFile open_regular_file(const std::string& path) {
  OpenedFile file;
  // open() would stop at the NUL and read another file under this name.
  if (const size_t nul = path.find('\0'); nul != std::string::npos) {
    file.problem = "cannot open: the path holds a NUL byte at offset " + std::to_string(nul);
    return file;
  }
  do {
    file.fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  } while (file.fd < 0 && errno == EINTR);
  if (file.fd < 0) {
    file.problem = "cannot open: " + os_reason(errno);
    return file;
  }
  struct stat status {};
  if (::fstat(file.fd, &status) != 0) {
    file.problem = "cannot stat: " + os_reason(errno);
  } else if (!S_ISREG(status.st_mode)) {
    file.problem = "not a regular file (" + file_type_name(status.st_mode) + ")";
  } else if (const int flags = ::fcntl(file.fd, F_GETFL);
             flags < 0 || ::fcntl(file.fd, F_SETFL, flags & ~O_NONBLOCK) != 0) {
    file.problem = "cannot clear O_NONBLOCK: " + os_reason(errno);
  }
  if (!file.problem.empty()) {
    ::close(file.fd);
    file.fd = -1;
    return file;
  }
  file.size = static_cast<uint64_t>(status.st_size);
  file.stored = static_cast<uint64_t>(status.st_blocks) * 512;  // st_blocks counts 512-byte units
  return file;
}

}  // namespace conveyor::detail
