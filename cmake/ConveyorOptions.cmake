# Warnings for conveyor's own targets, and the sanitizer build switch.

function(conveyor_warnings target)
  target_compile_options(${target} PRIVATE -Wall -Wextra -Werror)
endfunction()

if(CONVEYOR_SANITIZE STREQUAL "thread")
  set(_conveyor_sanitize_flags -fsanitize=thread)
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
  add_compile_options(${_conveyor_sanitize_flags} -fno-omit-frame-pointer)
  add_link_options(${_conveyor_sanitize_flags})
endif()
