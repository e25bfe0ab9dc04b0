// Running a reader over a hostile input under a memory cap.
//
// A reader that believes a hostile header (or inflates a bomb) costs
// gigabytes; its test must fail then without costing them. Such a test reads
// in a death-test child (EXPECT_EXIT) whose address space may grow by only
// kHeadroomBytes (RLIMIT_AS): reserving or filling gigabytes fails there at
// once with std::bad_alloc, before any of it is committed, where a ru_maxrss
// check would see the memory only after it had been touched. The fixed
// readers use kilobytes. (Not under ASan: it reserves terabytes of shadow
// memory and aborts rather than throws when an allocation fails.)
#pragma once

#include <conveyor/data_error.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <fstream>
#include <string>
#include <vector>

namespace conveyor::testing {

inline constexpr uint64_t kHeadroomBytes = uint64_t{512} << 20;

inline uint64_t address_space_bytes() {
  std::ifstream statm("/proc/self/statm");
  uint64_t pages = 0;
  statm >> pages;
  return pages * static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
}

// Caps the address space and runs `check`: exits 0 if it returns "", else
// says on stderr what went wrong (EXPECT_EXIT shows it) and exits non-zero,
// as for any exception that escapes (std::bad_alloc when the cap is hit).
template <class Check>
[[noreturn]] void exit_zero_if_under_cap(Check check) {
  rlimit limit{};
  getrlimit(RLIMIT_AS, &limit);
  limit.rlim_cur = std::min<uint64_t>(address_space_bytes() + kHeadroomBytes, limit.rlim_max);
  if (setrlimit(RLIMIT_AS, &limit) != 0) {
    std::perror("setrlimit(RLIMIT_AS)");
    std::_Exit(3);
  }
  try {
    const std::string complaint = check();
    if (complaint.empty()) std::_Exit(0);
    std::fprintf(stderr, "%s\n", complaint.c_str());
    std::_Exit(1);
  } catch (const std::exception& error) {
    std::fprintf(stderr, "exception that is not a DataError: %s\n", error.what());
    std::_Exit(2);
  }
}

// "" when `read` throws a DataError whose message holds every one of
// `parts`, else what it did instead; other exceptions propagate.
template <class Read>
std::string data_error_mismatch(Read read, const std::vector<std::string>& parts) {
  try {
    read();
  } catch (const DataError& error) {
    for (const std::string& part : parts) {
      if (std::string(error.what()).find(part) == std::string::npos) {
        return "DataError '" + std::string(error.what()) + "' does not contain '" + part + "'";
      }
    }
    return "";
  }
  return "no exception";
}

template <class Read>
[[noreturn]] void exit_zero_on_data_error_under_cap(Read read, std::vector<std::string> parts) {
  exit_zero_if_under_cap([&] { return data_error_mismatch(read, parts); });
}

}  // namespace conveyor::testing
