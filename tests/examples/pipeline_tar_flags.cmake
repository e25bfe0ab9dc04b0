# cmake -P: pipeline_tar rejects a bad flag with exit code 2 and a message
# naming the flag and the text typed (no atoi reading "abc" as 0), and an
# error of the pipeline's with "pipeline_tar: ..." and exit code 1.
#   -DEXAMPLE=path -DWORK_DIR=dir
include(${CMAKE_CURRENT_LIST_DIR}/expect_failure.cmake)
file(REMOVE_RECURSE ${WORK_DIR})
file(MAKE_DIRECTORY ${WORK_DIR})
set(shards --shards ${WORK_DIR})  # flags are checked before the shards are read

expect_failure(2 "--epochs needs an integer from 1 to 2147483647, got 'abc'" ${EXAMPLE} ${shards} --epochs abc)
expect_failure(2 "--epochs needs an integer from 1 to 2147483647, got '4294967297'"
               ${EXAMPLE} ${shards} --epochs 4294967297)
expect_failure(2 "--workers needs an integer from 0 to 1024, got '-1'" ${EXAMPLE} ${shards} --workers -1)
expect_failure(2 "--workers needs an integer from 0 to 1024, got '2000'" ${EXAMPLE} ${shards} --workers 2000)
expect_failure(2 "--world needs an integer from 1 to 2147483647, got '3000000000'"
               ${EXAMPLE} ${shards} --world 3000000000 --rank 5)
expect_failure(2 "--seed needs an integer from 0 to 18446744073709551615, got 'abc'" ${EXAMPLE} ${shards} --seed abc)
expect_failure(2 "--world needs an integer from 1 to 2147483647, got 'two'"
               ${EXAMPLE} ${shards} --rank 0 --world two)
expect_failure(2 "--rank needs an integer from 0 to 2147483646, got '1x'"
               ${EXAMPLE} ${shards} --rank 1x --world 2)
expect_failure(2 "--rank 2 is not below --world 2" ${EXAMPLE} ${shards} --rank 2 --world 2)
expect_failure(2 "pipeline_tar: --epochs needs a value" ${EXAMPLE} ${shards} --epochs)
expect_failure(2 "pipeline_tar: unknown flag --bogus" ${EXAMPLE} ${shards} --bogus 1)
# No shards there: the pipeline's error, caught and printed.
expect_failure(1 "pipeline_tar: ${WORK_DIR}/missing: list_files: not a directory"
               ${EXAMPLE} --shards ${WORK_DIR}/missing)
