# Finds moodycamel's ConcurrentQueue (header-only) and defines
# moodycamel::concurrentqueue, whose include directory holds concurrentqueue.h,
# blockingconcurrentqueue.h and lightweightsemaphore.h.
#
# Looks where the known packagings put it: Debian's libconcurrentqueue-dev
# (<include>/concurrentqueue/), upstream's CMake install
# (<include>/concurrentqueue/moodycamel/) and a plain copy (<include>/).
# Set CONCURRENTQUEUE_INCLUDE_DIR to point at another checkout.
find_path(CONCURRENTQUEUE_INCLUDE_DIR
  NAMES concurrentqueue.h
  PATH_SUFFIXES concurrentqueue concurrentqueue/moodycamel moodycamel
  DOC "Directory holding moodycamel's concurrentqueue.h")

if(CONCURRENTQUEUE_INCLUDE_DIR AND NOT EXISTS "${CONCURRENTQUEUE_INCLUDE_DIR}/lightweightsemaphore.h")
  set(_concurrentqueue_reason
    "${CONCURRENTQUEUE_INCLUDE_DIR} has concurrentqueue.h but not lightweightsemaphore.h (a release before 1.0.1?)")
endif()

include(FindPackageHandleStandardArgs)
find_package_handle_standard_args(concurrentqueue
  REQUIRED_VARS CONCURRENTQUEUE_INCLUDE_DIR
  REASON_FAILURE_MESSAGE
    "${_concurrentqueue_reason} conveyor's engine needs moodycamel's ConcurrentQueue: install Debian's libconcurrentqueue-dev (scripts/setup does), or set CONCURRENTQUEUE_INCLUDE_DIR to the directory holding concurrentqueue.h.")

if(concurrentqueue_FOUND AND NOT TARGET moodycamel::concurrentqueue)
  add_library(moodycamel::concurrentqueue INTERFACE IMPORTED)
  set_target_properties(moodycamel::concurrentqueue PROPERTIES
    INTERFACE_INCLUDE_DIRECTORIES "${CONCURRENTQUEUE_INCLUDE_DIR}")
endif()
mark_as_advanced(CONCURRENTQUEUE_INCLUDE_DIR)
