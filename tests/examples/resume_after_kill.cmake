# cmake -P: the trainer killed with SIGKILL (no cleanup, as a preemption
# would) twice in one epoch, then once in the middle of writing a checkpoint,
# and resumed each time from its last checkpoint, ends with the same
# loss-curve fingerprint and test accuracy as a run never stopped.
#   -DTRAINER=path -DSOURCE=idx|shards -DWORK_DIR=dir
#   -DKILL1=N -DKILL2=N replay given steps (else drawn and printed)
set(common --epochs 2 --limit 3000 --batch-size 64 --threads 1 --workers 2 --seed 7 --source ${SOURCE})
if(SOURCE STREQUAL "shards")
  list(APPEND common --shards ${WORK_DIR}/shards)
endif()
set(every 5)
set(steps_per_epoch 47)  # ceil(3000 / 64)

# run_trainer(out_var KILL_VARIABLE value command...): KILL_VARIABLE set in
# the environment for this run only ("-" for none).
function(run_trainer out_var kill_variable kill_value)
  if(NOT kill_variable STREQUAL "-")
    set(ENV{${kill_variable}} ${kill_value})
  endif()
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE result OUTPUT_VARIABLE output ERROR_VARIABLE errors)
  if(NOT kill_variable STREQUAL "-")
    unset(ENV{${kill_variable}})
  endif()
  set(${out_var} "${output}" PARENT_SCOPE)
  set(${out_var}_result "${result}" PARENT_SCOPE)
  set(${out_var}_errors "${errors}" PARENT_SCOPE)
endfunction()

function(final_line output out_fingerprint out_accuracy)
  string(REGEX MATCH "final: [^\n]*test accuracy ([0-9.]+)%[^\n]*loss-curve fingerprint ([0-9a-f]+)" found "${output}")
  if(NOT found)
    message(FATAL_ERROR "no final line in the trainer's output:\n${output}")
  endif()
  set(${out_accuracy} ${CMAKE_MATCH_1} PARENT_SCOPE)
  set(${out_fingerprint} ${CMAKE_MATCH_2} PARENT_SCOPE)
endfunction()

function(expect_killed label result output errors)
  # Killed by a signal, not ended by an error of its own.
  if(result EQUAL 0 OR result MATCHES "^[0-9]+$" OR output MATCHES "final: ")
    message(FATAL_ERROR "${label}: the trainer was to be killed, but ended (${result}):\n${output}\n${errors}")
  endif()
  message(STATUS "${label}: killed as planned (${result})")
endfunction()

# Steps of the first epoch to be killed at: the second after the first
# one's checkpoint, so the resumed run is killed again in the same epoch.
if(NOT DEFINED KILL1)
  string(RANDOM LENGTH 4 ALPHABET 0123456789 r1)
  string(RANDOM LENGTH 4 ALPHABET 0123456789 r2)
  math(EXPR KILL1 "${every} + 1 + (1${r1} % 20)")
  math(EXPR KILL2 "${KILL1} + 1 + (1${r2} % (${steps_per_epoch} - ${KILL1} - 1))")
endif()
# A checkpoint of the second epoch, killed while it is written.
math(EXPR KILL_IN_SAVE "(${steps_per_epoch} / ${every} + 2) * ${every}")
message(STATUS "${SOURCE}: killed at steps ${KILL1} and ${KILL2} (replay: -DKILL1=${KILL1} -DKILL2=${KILL2}), "
               "and in the save of step ${KILL_IN_SAVE}")

set(checkpoints ${WORK_DIR}/checkpoints-${SOURCE})
file(REMOVE_RECURSE ${checkpoints})

run_trainer(whole - - ${TRAINER} ${common})
if(NOT whole_result EQUAL 0)
  message(FATAL_ERROR "the uninterrupted run failed (${whole_result}):\n${whole}\n${whole_errors}")
endif()
final_line("${whole}" want_fingerprint want_accuracy)

run_trainer(first CONVEYOR_TRAINER_KILL_AT_STEP ${KILL1}
            ${TRAINER} ${common} --checkpoint ${checkpoints} --checkpoint-every ${every})
expect_killed("step ${KILL1}" "${first_result}" "${first}" "${first_errors}")
run_trainer(second CONVEYOR_TRAINER_KILL_AT_STEP ${KILL2}
            ${TRAINER} ${common} --checkpoint ${checkpoints} --checkpoint-every ${every} --resume ${checkpoints})
expect_killed("step ${KILL2}" "${second_result}" "${second}" "${second_errors}")
if(NOT second MATCHES "resumed from [^\n]*epoch 1,")
  message(FATAL_ERROR "the second run did not resume in the first epoch:\n${second}")
endif()
run_trainer(third CONVEYOR_TRAINER_KILL_IN_SAVE ${KILL_IN_SAVE}
            ${TRAINER} ${common} --checkpoint ${checkpoints} --checkpoint-every ${every} --resume ${checkpoints})
expect_killed("the save of step ${KILL_IN_SAVE}" "${third_result}" "${third}" "${third_errors}")
# The interrupted save left its staging directory; `latest` names the one before.
file(READ ${checkpoints}/latest latest)
math(EXPR previous "${KILL_IN_SAVE} - ${every}")
if(NOT latest MATCHES "step-0*${previous}\"")
  message(FATAL_ERROR "after a save killed midway, latest is ${latest}, not step ${previous}")
endif()
run_trainer(last - - ${TRAINER} ${common} --checkpoint ${checkpoints} --checkpoint-every ${every}
            --resume ${checkpoints})
if(NOT last_result EQUAL 0)
  message(FATAL_ERROR "the last resumed run failed (${last_result}):\n${last}\n${last_errors}")
endif()
final_line("${last}" got_fingerprint got_accuracy)
message(STATUS "${SOURCE}: uninterrupted ${want_fingerprint} ${want_accuracy}%, "
               "killed three times and resumed ${got_fingerprint} ${got_accuracy}%")
if(NOT got_fingerprint STREQUAL want_fingerprint OR NOT got_accuracy STREQUAL want_accuracy)
  message(FATAL_ERROR "the resumed run differs: fingerprint ${got_fingerprint} (want ${want_fingerprint}), "
                      "accuracy ${got_accuracy}% (want ${want_accuracy}%)")
endif()
