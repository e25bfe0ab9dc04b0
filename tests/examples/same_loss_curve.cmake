# cmake -P: the trainer under work_stealing gives the same loss curve (its
# fingerprint) with 0 and with 3 loader workers, and twice in a row.
function(fingerprint workers out)
  execute_process(COMMAND ${TRAINER} --epochs 1 --limit 1280 --batch-size 64 --threads 1
                          --workers ${workers} --scheduling work_stealing --seed 5
                  RESULT_VARIABLE result OUTPUT_VARIABLE output ERROR_VARIABLE errors)
  if(NOT result EQUAL 0)
    message(FATAL_ERROR "trainer failed (${result}) with ${workers} workers:\n${output}\n${errors}")
  endif()
  string(REGEX MATCH "loss-curve fingerprint ([0-9a-f]+)" found "${output}")
  if(NOT found)
    message(FATAL_ERROR "no fingerprint in the trainer's output:\n${output}")
  endif()
  set(${out} ${CMAKE_MATCH_1} PARENT_SCOPE)
endfunction()

fingerprint(0 none)
fingerprint(3 three)
fingerprint(3 again)
message(STATUS "fingerprints: 0 workers ${none}, 3 workers ${three}, again ${again}")
if(NOT none STREQUAL three OR NOT three STREQUAL again)
  message(FATAL_ERROR "loss curves differ: 0 workers ${none}, 3 workers ${three}, again ${again}")
endif()
