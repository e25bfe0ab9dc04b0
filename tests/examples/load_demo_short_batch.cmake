# cmake -P: a first batch of fewer than 8 samples prints its labels and its
# own shape, not 8 labels read past its end and the batch size asked for.
#   -DLOAD_DEMO=path
execute_process(COMMAND ${LOAD_DEMO} --samples 5 --epochs 1 --seed 3
                RESULT_VARIABLE result OUTPUT_VARIABLE output ERROR_VARIABLE errors)
if(NOT result EQUAL 0)
  message(FATAL_ERROR "load_demo failed (${result}):\n${output}\n${errors}")
endif()
# Samples 0..4 have labels 0..4: the first (and only) batch holds each once.
string(REGEX MATCH "images \\[5, 3, 32, 32\\], label sum 10, first labels( [0-4])( [0-4])( [0-4])( [0-4])( [0-4]), "
       found "${output}")
if(NOT found)
  message(FATAL_ERROR "want the batch [5, 3, 32, 32] and its 5 labels:\n${output}")
endif()
message(STATUS "${output}")
