# One INTERFACE target per optional backend, each with a shardkit:: ALIAS so the same names work from the build
# tree, an install and add_subdirectory.
set(SHARDKIT_EXPORTED_TARGETS "" CACHE INTERNAL "")

function(shardkit_add_interface name)
  add_library(${name} INTERFACE)
  add_library(shardkit::${name} ALIAS ${name})
  if(NOT name STREQUAL "shardkit")
    set_target_properties(${name} PROPERTIES EXPORT_NAME ${name})
    target_link_libraries(${name} INTERFACE shardkit)
  endif()
  set(SHARDKIT_EXPORTED_TARGETS ${SHARDKIT_EXPORTED_TARGETS} ${name} CACHE INTERNAL "")
endfunction()

# AUTO: build the target when its dependency is found; ON: fail when it is not; OFF: skip.
function(shardkit_backend_wanted var found dep)
  if(${var} STREQUAL "OFF")
    set(_want OFF)
  elseif(${found})
    set(_want ON)
  elseif(${var} STREQUAL "ON")
    message(FATAL_ERROR "${var}=ON but ${dep} was not found")
  else()
    message(STATUS "shardkit: ${dep} not found, skipping that backend")
    set(_want OFF)
  endif()
  set(${var}_ENABLED ${_want} PARENT_SCOPE)
endfunction()

# shardkit_add_backend(<name> FOUND <var> DEPENDENCY "<what to install>" LIBS <target>...)
# The target shardkit::<name> when SHARDKIT_WITH_<NAME> and the dependency allow (shardkit_backend_wanted): it links
# LIBS and defines SHARDKIT_HAS_<NAME>=1 for its users.
function(shardkit_add_backend name)
  cmake_parse_arguments(B "" "FOUND;DEPENDENCY" "LIBS" ${ARGN})
  string(TOUPPER ${name} _upper)
  shardkit_backend_wanted(SHARDKIT_WITH_${_upper} ${B_FOUND} "${B_DEPENDENCY}")
  if(SHARDKIT_WITH_${_upper}_ENABLED)
    shardkit_add_interface(${name})
    target_link_libraries(${name} INTERFACE ${B_LIBS})
    target_compile_definitions(${name} INTERFACE SHARDKIT_HAS_${_upper}=1)
  endif()
endfunction()

macro(shardkit_find_backends)
  include(ShardkitBackendDeps)
  shardkit_find_backend_deps()

  shardkit_add_backend(tcp FOUND Boost_FOUND DEPENDENCY "Boost headers (libboost-dev)" LIBS Boost::headers)
  shardkit_add_backend(gloo FOUND SHARDKIT_GLOO_FOUND DEPENDENCY "Gloo (libgloo-dev)" LIBS shardkit_deps::gloo)
  shardkit_add_backend(fabric FOUND SHARDKIT_FABRIC_FOUND DEPENDENCY "libfabric (libfabric-dev)"
                       LIBS shardkit_deps::fabric)
  # The CUDA layer (include/shardkit/cuda/ and the fsdp/ckpt CUDA adapters): the CUDA runtime only. NCCL stands on
  # it: no cuda target, no nccl target.
  shardkit_add_backend(cuda FOUND SHARDKIT_CUDA_FOUND DEPENDENCY "CUDA toolkit (CUDA::cudart)" LIBS CUDA::cudart)
  if(NOT TARGET cuda)
    set(SHARDKIT_NCCL_FOUND FALSE)
  endif()
  shardkit_add_backend(nccl FOUND SHARDKIT_NCCL_FOUND DEPENDENCY "CUDA toolkit with NCCL" LIBS cuda shardkit_deps::nccl)

  # The encodings the checkpoint and the data loader share (include/shardkit/codec/): xxHash64 and strict JSON.
  # Neither of those two includes the other; each is its own target over this one.
  if(SHARDKIT_CODEC_FOUND)
    shardkit_add_interface(codec)
    target_link_libraries(codec INTERFACE shardkit_deps::xxhash nlohmann_json::nlohmann_json)
  endif()
  set(_codec_dependency "xxHash (libxxhash-dev) and nlohmann/json (nlohmann-json3-dev)")
  shardkit_add_backend(ckpt FOUND SHARDKIT_CODEC_FOUND DEPENDENCY "${_codec_dependency}" LIBS codec)
  shardkit_add_backend(data FOUND SHARDKIT_CODEC_FOUND DEPENDENCY "${_codec_dependency}" LIBS codec)

  # The S3 sink (include/shardkit/storage/s3_sink.hpp): libcurl, which signs with its own SigV4.
  shardkit_add_backend(s3 FOUND SHARDKIT_S3_FOUND DEPENDENCY "libcurl (libcurl4-openssl-dev)" LIBS CURL::libcurl)
endmacro()
