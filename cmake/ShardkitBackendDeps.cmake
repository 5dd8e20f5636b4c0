# Finds the third-party pieces behind the optional backends. Used by the build and installed beside the package
# config, so a consumer's find_package(shardkit) recreates the same imported targets.

# shardkit_found_if(<var> <condition>...): <var> is TRUE when the condition holds, else FALSE.
macro(shardkit_found_if var)
  if(${ARGN})
    set(${var} TRUE)
  else()
    set(${var} FALSE)
  endif()
endmacro()

macro(shardkit_find_backend_deps)
  find_package(Threads REQUIRED)
  find_package(Boost 1.74 QUIET)

  if(NOT TARGET shardkit_deps::gloo)
    find_path(SHARDKIT_GLOO_INCLUDE gloo/context.h)
    find_library(SHARDKIT_GLOO_LIBRARY gloo)
    if(SHARDKIT_GLOO_INCLUDE AND SHARDKIT_GLOO_LIBRARY)
      add_library(shardkit_deps::gloo UNKNOWN IMPORTED)
      set_target_properties(shardkit_deps::gloo PROPERTIES IMPORTED_LOCATION ${SHARDKIT_GLOO_LIBRARY}
        INTERFACE_INCLUDE_DIRECTORIES ${SHARDKIT_GLOO_INCLUDE})
    endif()
  endif()
  shardkit_found_if(SHARDKIT_GLOO_FOUND TARGET shardkit_deps::gloo)

  if(NOT TARGET shardkit_deps::fabric)
    find_package(PkgConfig QUIET)
    if(PKG_CONFIG_FOUND)
      pkg_check_modules(SHARDKIT_LIBFABRIC QUIET IMPORTED_TARGET GLOBAL libfabric)
      if(SHARDKIT_LIBFABRIC_FOUND)
        add_library(shardkit_deps::fabric ALIAS PkgConfig::SHARDKIT_LIBFABRIC)
      endif()
    endif()
  endif()
  shardkit_found_if(SHARDKIT_FABRIC_FOUND TARGET shardkit_deps::fabric)

  if(NOT TARGET CUDA::cudart)
    if(NOT CUDAToolkit_ROOT AND EXISTS /usr/local/cuda)
      set(CUDAToolkit_ROOT /usr/local/cuda)
    endif()
    find_package(CUDAToolkit QUIET)
  endif()
  if(TARGET CUDA::cudart)
    set(SHARDKIT_CUDA_FOUND TRUE)
  else()
    set(SHARDKIT_CUDA_FOUND FALSE)
  endif()

  if(NOT TARGET shardkit_deps::nccl)
    if(CUDAToolkit_FOUND)
      find_path(SHARDKIT_NCCL_INCLUDE nccl.h HINTS ${CUDAToolkit_INCLUDE_DIRS})
      find_library(SHARDKIT_NCCL_LIBRARY nccl HINTS ${CUDAToolkit_LIBRARY_DIR} ${CUDAToolkit_LIBRARY_ROOT}/lib64)
      if(SHARDKIT_NCCL_INCLUDE AND SHARDKIT_NCCL_LIBRARY)
        add_library(shardkit_deps::nccl UNKNOWN IMPORTED)
        set_target_properties(shardkit_deps::nccl PROPERTIES IMPORTED_LOCATION ${SHARDKIT_NCCL_LIBRARY}
          INTERFACE_INCLUDE_DIRECTORIES ${SHARDKIT_NCCL_INCLUDE})
      endif()
    endif()
  endif()
  shardkit_found_if(SHARDKIT_NCCL_FOUND TARGET shardkit_deps::nccl)

  # shardkit::codec (under shardkit::ckpt and shardkit::data): xxHash (libxxhash-dev, through pkg-config) and
  # nlohmann/json (nlohmann-json3-dev).
  if(NOT TARGET shardkit_deps::xxhash)
    find_package(PkgConfig QUIET)
    if(PKG_CONFIG_FOUND)
      pkg_check_modules(SHARDKIT_LIBXXHASH QUIET IMPORTED_TARGET GLOBAL libxxhash)
      if(SHARDKIT_LIBXXHASH_FOUND)
        add_library(shardkit_deps::xxhash ALIAS PkgConfig::SHARDKIT_LIBXXHASH)
      endif()
    endif()
  endif()
  find_package(nlohmann_json 3.9 QUIET)
  shardkit_found_if(SHARDKIT_CODEC_FOUND TARGET shardkit_deps::xxhash AND TARGET nlohmann_json::nlohmann_json)

  # shardkit::s3: libcurl 7.75 or newer (CURLOPT_AWS_SIGV4; 7.88 on Debian 12).
  if(NOT TARGET CURL::libcurl)
    find_package(CURL 7.75 QUIET)
  endif()
  shardkit_found_if(SHARDKIT_S3_FOUND TARGET CURL::libcurl)
endmacro()
