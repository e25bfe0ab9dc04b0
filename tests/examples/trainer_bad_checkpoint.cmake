# cmake -P: resuming from a checkpoint with a truncated model.pt,
# optimizer.pt or rng.pt fails with a message naming that file and why,
# without LibTorch's stack trace; a `latest` naming "step-2x", "step-abc"
# or a step past uint64 fails naming that text, not resuming step 2 or
# looking for step 0.
#   -DTRAINER=path -DWORK_DIR=dir
include(${CMAKE_CURRENT_LIST_DIR}/expect_failure.cmake)
file(REMOVE_RECURSE ${WORK_DIR})
file(MAKE_DIRECTORY ${WORK_DIR})
set(tiny --epochs 1 --limit 64 --batch-size 32 --workers 0 --threads 1 --seed 5)

# Two steps, checkpointed at step 2, then killed before the (slow) evaluation.
set(good ${WORK_DIR}/good)
set(ENV{CONVEYOR_TRAINER_KILL_AT_STEP} 2)
execute_process(COMMAND ${TRAINER} ${tiny} --checkpoint ${good} --checkpoint-every 2
                RESULT_VARIABLE result OUTPUT_VARIABLE output ERROR_VARIABLE errors)
unset(ENV{CONVEYOR_TRAINER_KILL_AT_STEP})
if(NOT EXISTS ${good}/step-000000002/rng.pt OR NOT EXISTS ${good}/latest)
  message(FATAL_ERROR "no checkpoint of step 2 (${result}):\n${output}\n${errors}")
endif()

foreach(part model optimizer rng)
  set(bad ${WORK_DIR}/truncated-${part})
  file(COPY ${good}/ DESTINATION ${bad})
  # Its first 100 bytes: what a torn write leaves.
  execute_process(COMMAND truncate -s 100 ${bad}/step-000000002/${part}.pt COMMAND_ERROR_IS_FATAL ANY)
  expect_failure(1 "train_fashion_mnist: checkpoint: cannot load ${bad}/step-000000002/${part}.pt: PytorchStreamReader"
                 ${TRAINER} ${tiny} --resume ${bad})
endforeach()

foreach(name step-2x step-abc step-99999999999999999999)
  set(bad ${WORK_DIR}/latest-${name})
  file(COPY ${good}/ DESTINATION ${bad})
  file(WRITE ${bad}/latest "{\"checkpoint\": \"${name}\"}")
  expect_failure(1 "checkpoint: ${bad}/latest names '${name}', not a checkpoint of this trainer"
                 ${TRAINER} ${tiny} --resume ${bad})
endforeach()
