# cmake -P script: configure the add_subdirectory consumer, check that
# conveyor's own sources compile without -Werror there, build it, run it.
file(REMOVE_RECURSE ${WORK_DIR})

function(run)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE result OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT result EQUAL 0)
    message(FATAL_ERROR "failed (${result}): ${ARGN}\n${out}\n${err}")
  endif()
endfunction()

run(${CMAKE_COMMAND} -S ${CONSUMER_SOURCE} -B ${WORK_DIR} -G Ninja
    -DCONVEYOR_SOURCE_DIR=${CONVEYOR_SOURCE_DIR} -DCMAKE_CXX_COMPILER=${CXX_COMPILER}
    -DCMAKE_BUILD_TYPE=${BUILD_TYPE})
file(READ ${WORK_DIR}/compile_commands.json commands)
string(JSON count LENGTH "${commands}")
math(EXPR last "${count} - 1")
set(conveyor_sources 0)
foreach(i RANGE ${last})
  string(JSON file GET "${commands}" ${i} file)
  string(JSON command GET "${commands}" ${i} command)
  if(file MATCHES "/(src|runtime)/")
    math(EXPR conveyor_sources "${conveyor_sources} + 1")
    if(command MATCHES "-Werror")
      message(FATAL_ERROR "${file} is compiled with -Werror in a consumer's build:\n${command}")
    endif()
  endif()
endforeach()
if(conveyor_sources EQUAL 0)
  message(FATAL_ERROR "no conveyor sources in ${WORK_DIR}/compile_commands.json")
endif()
run(${CMAKE_COMMAND} --build ${WORK_DIR} --target consumer)
run(${WORK_DIR}/consumer)
message(STATUS "add_subdirectory consumer: ${conveyor_sources} conveyor sources without -Werror, built and ran")
