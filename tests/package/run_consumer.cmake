# Builds and runs the consumer project in MODE find_package (against a fresh install) or add_subdirectory.
# Release (NDEBUG) at -O0: what is checked is that the targets give the consumer what it needs to compile, link
# and run, which -O1 or -O3 checks no better at a higher compile cost (add_subdirectory's libshardkit, CI's
# 2026-11-27 rehearsal: 84 s at -O1, where package_pkg_config's, at -O0, took 53 s).
file(REMOVE_RECURSE ${WORK_DIR})
file(MAKE_DIRECTORY ${WORK_DIR})

function(run)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "command failed (${rc}): ${ARGN}\n${out}\n${err}")
  endif()
  message(STATUS "${out}")
endfunction()

if(MODE STREQUAL "find_package")
  run(${CMAKE_COMMAND} --install ${SHARDKIT_BINARY_DIR} --prefix ${WORK_DIR}/prefix)
  run(${CMAKE_COMMAND} -S ${CONSUMER_DIR} -B ${WORK_DIR}/build -G ${GENERATOR}
      -DCMAKE_PREFIX_PATH=${WORK_DIR}/prefix -DCMAKE_BUILD_TYPE=Release "-DCMAKE_CXX_FLAGS_RELEASE=-O0 -DNDEBUG")
else()
  run(${CMAKE_COMMAND} -S ${CONSUMER_DIR} -B ${WORK_DIR}/build -G ${GENERATOR}
      -DSHARDKIT_SOURCE_DIR=${SHARDKIT_SOURCE_DIR} -DCMAKE_BUILD_TYPE=Release "-DCMAKE_CXX_FLAGS_RELEASE=-O0 -DNDEBUG")
endif()
run(${CMAKE_COMMAND} --build ${WORK_DIR}/build)
run(${WORK_DIR}/build/consumer)
