# Included by the example tests that run a program with bad input.

# check_failure(label code text result errors): the run labelled `label`
# ended with exit code `code`, its stderr (`errors`) holds `text` (literal),
# and no LibTorch stack trace.
function(check_failure label code text result errors)
  string(FIND "${errors}" "${text}" at)
  if(NOT result STREQUAL "${code}" OR at EQUAL -1)
    message(FATAL_ERROR "${label}: want exit code ${code} and \"${text}\" on stderr, "
                        "got exit code ${result} and stderr:\n${errors}")
  endif()
  if(errors MATCHES "Exception raised from|frame #0")
    message(FATAL_ERROR "${label}: a stack trace on stderr:\n${errors}")
  endif()
  message(STATUS "${label}: ${result}, ${text}")
endfunction()

# expect_failure(code text command...): runs the command; check_failure.
# (An empty argument does not survive ARGN: run such a command directly.)
function(expect_failure code text)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE result OUTPUT_VARIABLE output ERROR_VARIABLE errors)
  string(REPLACE ";" " " label "${ARGN}")
  check_failure("${label}" ${code} "${text}" "${result}" "${errors}")
endfunction()
