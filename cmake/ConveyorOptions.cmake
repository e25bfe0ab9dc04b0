# Warnings for conveyor's own targets, and the sanitizer build switch.

# -Werror only with CONVEYOR_WARNINGS_AS_ERRORS (on when conveyor is the
# top-level project): a newer compiler's new warning must not break the build
# of a project that includes conveyor with add_subdirectory().
function(conveyor_warnings target)
  target_compile_options(${target} PRIVATE -Wall -Wextra)
  if(CONVEYOR_WARNINGS_AS_ERRORS)
    target_compile_options(${target} PRIVATE -Werror)
  endif()
endfunction()

if(CONVEYOR_SANITIZE STREQUAL "thread")
  set(_conveyor_sanitize_flags -fsanitize=thread)
  # TSan does not model atomic_thread_fence. conveyor's fences only order its
  # wake-up handshake (data is published by release/acquire pairs TSan sees);
  # moodycamel's are paired with acquire loads too. GCC's warning says so.
  add_compile_options(-Wno-tsan)
elseif(CONVEYOR_SANITIZE STREQUAL "address")
  # AddressSanitizer with UBSan: one build catches both.
  set(_conveyor_sanitize_flags -fsanitize=address,undefined -fno-sanitize-recover=undefined)
elseif(CONVEYOR_SANITIZE STREQUAL "undefined")
  set(_conveyor_sanitize_flags -fsanitize=undefined -fno-sanitize-recover=undefined)
elseif(NOT CONVEYOR_SANITIZE STREQUAL "")
  message(FATAL_ERROR "CONVEYOR_SANITIZE must be thread, address, undefined or empty, "
                      "not '${CONVEYOR_SANITIZE}'")
endif()
if(_conveyor_sanitize_flags)
  # Sanitizer instrumentation makes GCC 12's -Wmaybe-uninitialized misfire on
  # the standard library (std::regex, std::function); the normal build keeps it.
  add_compile_options(${_conveyor_sanitize_flags} -fno-omit-frame-pointer -Wno-maybe-uninitialized)
  add_link_options(${_conveyor_sanitize_flags})
endif()

# libFuzzer builds: coverage instrumentation and ASan on everything; the
# fuzzer executables add -fsanitize=fuzzer (tests/fuzz).
if(CONVEYOR_BUILD_FUZZERS)
  if(NOT CMAKE_CXX_COMPILER_ID STREQUAL "Clang")
    message(FATAL_ERROR "CONVEYOR_BUILD_FUZZERS needs clang (CXX=clang++), not ${CMAKE_CXX_COMPILER_ID}")
  endif()
  add_compile_options(-fsanitize=fuzzer-no-link,address -fno-omit-frame-pointer)
  add_link_options(-fsanitize=address)
endif()
