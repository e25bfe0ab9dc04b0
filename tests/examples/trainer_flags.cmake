# cmake -P: the trainer rejects an integer flag that does not fit its type
# (no 4294967296 epochs wrapped to 0, no seed clamped) with exit code 2 and
# a message naming the flag and the text typed; the largest uint64 seed is
# a seed, and is the one the run records.
#   -DTRAINER=path -DWORK_DIR=dir
include(${CMAKE_CURRENT_LIST_DIR}/expect_failure.cmake)
file(REMOVE_RECURSE ${WORK_DIR})
file(MAKE_DIRECTORY ${WORK_DIR})
set(tiny --epochs 1 --limit 32 --batch-size 32 --workers 0 --threads 1)

expect_failure(2 "--epochs needs an integer from 1 to 2147483647, got '4294967296'"
               ${TRAINER} ${tiny} --epochs 4294967296)
expect_failure(2 "--workers needs an integer from 0 to 1024, got '4294967295'"
               ${TRAINER} ${tiny} --workers 4294967295)
expect_failure(2 "--workers needs an integer from 0 to 1024, got '5000'" ${TRAINER} ${tiny} --workers 5000)
expect_failure(2 "--threads needs an integer from 0 to 1024, got '2147483647'"
               ${TRAINER} ${tiny} --threads 2147483647)
expect_failure(2 "--seed needs an integer from 0 to 18446744073709551615, got '99999999999999999999'"
               ${TRAINER} ${tiny} --seed 99999999999999999999)
expect_failure(2 "--seed needs an integer from 0 to 18446744073709551615, got '-1'" ${TRAINER} ${tiny} --seed -1)
expect_failure(2 "--batch-size needs an integer from 1 to 9223372036854775807, got '2x'"
               ${TRAINER} ${tiny} --batch-size 2x)
expect_failure(2 "--limit needs an integer from 0 to 9223372036854775807, got '99999999999999999999'"
               ${TRAINER} ${tiny} --limit 99999999999999999999)

# One step with the largest seed, checkpointed, then killed before the
# (slow) evaluation: the checkpoint records the seed the run used.
set(ENV{CONVEYOR_TRAINER_KILL_AT_STEP} 1)
execute_process(COMMAND ${TRAINER} ${tiny} --seed 18446744073709551615
                        --checkpoint ${WORK_DIR}/checkpoints --checkpoint-every 1
                RESULT_VARIABLE result OUTPUT_VARIABLE output ERROR_VARIABLE errors)
unset(ENV{CONVEYOR_TRAINER_KILL_AT_STEP})
set(saved ${WORK_DIR}/checkpoints/step-000000001/trainer.json)
if(NOT EXISTS ${saved})
  message(FATAL_ERROR "--seed 18446744073709551615: no checkpoint (${result}):\n${output}\n${errors}")
endif()
file(READ ${saved} trainer)
if(NOT trainer MATCHES "\"seed\":18446744073709551615[,}]")
  message(FATAL_ERROR "--seed 18446744073709551615: the run recorded another seed:\n${trainer}")
endif()

# --shards: an empty value is a bad flag; a directory of .tar files the
# trainer did not write is refused, not written into or read (they are
# left as they were); a brace range that is no decimal range is refused.
execute_process(COMMAND ${TRAINER} ${tiny} --source shards --shards ""
                RESULT_VARIABLE result OUTPUT_VARIABLE output ERROR_VARIABLE errors)
check_failure("--shards ''" 2 "--shards needs a directory, a pattern or a URL pattern, got ''" "${result}" "${errors}")
file(MAKE_DIRECTORY ${WORK_DIR}/foreign)
file(WRITE ${WORK_DIR}/foreign/train-000000.tar "not the trainer's")
expect_failure(1 "holds .tar files but no COMPLETE marker" ${TRAINER} ${tiny} --source shards --shards ${WORK_DIR}/foreign)
file(READ ${WORK_DIR}/foreign/train-000000.tar kept)
file(GLOB foreign_files ${WORK_DIR}/foreign/*)
list(LENGTH foreign_files foreign_count)
if(NOT kept STREQUAL "not the trainer's" OR NOT foreign_count EQUAL 1)
  message(FATAL_ERROR "the trainer wrote into a directory of foreign shards: ${foreign_files}")
endif()
expect_failure(1 "malformed range '{a..c}'" ${TRAINER} ${tiny} --source shards --shards ${WORK_DIR}/s-{a..c}.tar)
