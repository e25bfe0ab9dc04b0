# cmake -P: load_demo rejects a bad flag with exit code 2 and a message
# naming the flag and the text typed (no unknown flag ignored, no value
# wrapped or clamped), and an error of the loader's with "load_demo: ..."
# and exit code 1, not an uncaught exception.
#   -DLOAD_DEMO=path
include(${CMAKE_CURRENT_LIST_DIR}/expect_failure.cmake)

expect_failure(2 "load_demo: unknown flag --bogus" ${LOAD_DEMO} --samples 10 --epochs 1 --bogus 1)
expect_failure(2 "load_demo: --epochs needs a value" ${LOAD_DEMO} --samples 10 --epochs)
expect_failure(2 "--batch-size needs an integer from 1 to 9223372036854775807, got '0'"
               ${LOAD_DEMO} --samples 10 --epochs 1 --batch-size 0)
expect_failure(2 "--batch-size needs an integer from 1 to 9223372036854775807, got '99999999999999999999'"
               ${LOAD_DEMO} --samples 10 --epochs 1 --batch-size 99999999999999999999)
expect_failure(2 "--samples needs an integer from 0 to 9223372036854775807, got '12abc'"
               ${LOAD_DEMO} --samples 12abc --epochs 1)
expect_failure(2 "--samples needs an integer from 0 to 9223372036854775807, got '18446744073709551615'"
               ${LOAD_DEMO} --samples 18446744073709551615 --epochs 1)
expect_failure(2 "--seed needs an integer from 0 to 18446744073709551615, got '-1'"
               ${LOAD_DEMO} --samples 10 --epochs 1 --seed -1)
execute_process(COMMAND ${LOAD_DEMO} --samples 10 --epochs 1 --batch-size ""
                RESULT_VARIABLE result OUTPUT_VARIABLE output ERROR_VARIABLE errors)
check_failure("--batch-size ''" 2 "--batch-size needs an integer from 1 to 9223372036854775807, got ''"
              "${result}" "${errors}")
# The loader's own error (a shuffled empty dataset), caught and printed.
expect_failure(1 "load_demo: num_samples should be a positive integer value, but got num_samples=0"
               ${LOAD_DEMO} --samples 0 --epochs 1)

# The largest seed is a seed, not an error.
execute_process(COMMAND ${LOAD_DEMO} --samples 10 --epochs 1 --seed 18446744073709551615
                RESULT_VARIABLE result OUTPUT_VARIABLE output ERROR_VARIABLE errors)
if(NOT result EQUAL 0)
  message(FATAL_ERROR "--seed 18446744073709551615 failed (${result}):\n${output}\n${errors}")
endif()
