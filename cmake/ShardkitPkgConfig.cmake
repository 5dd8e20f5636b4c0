# pkg-config files for the install tree: shardkit.pc (the core, like shardkit::shardkit), one
# shardkit-<backend>.pc per optional target this build has (shardkit::tcp -> shardkit-tcp.pc, ...), each
# Requires: shardkit, and shardkit-compiled.pc for shardkit::compiled (its library and the backends it has).
# A Makefile consumer then writes `pkg-config --cflags --libs shardkit shardkit-tcp`.
#
# The files live in ${libdir}/pkgconfig (backends name architecture-specific libraries) and are relocatable:
# prefix is found from ${pcfiledir}, so `cmake --install --prefix` anywhere works without reconfiguring.

# shardkit_pc_file(<name> DESCRIPTION d [REQUIRES ...] [CFLAGS ...] [LIBS ...])
function(shardkit_pc_file name)
  cmake_parse_arguments(PC "" "DESCRIPTION" "REQUIRES;CFLAGS;LIBS" ${ARGN})
  set(SHARDKIT_PC_NAME ${name})
  set(SHARDKIT_PC_DESCRIPTION "${PC_DESCRIPTION}")
  list(JOIN PC_REQUIRES ", " SHARDKIT_PC_REQUIRES)
  list(JOIN PC_CFLAGS " " SHARDKIT_PC_CFLAGS)
  list(JOIN PC_LIBS " " SHARDKIT_PC_LIBS)
  configure_file(${PROJECT_SOURCE_DIR}/cmake/shardkit.pc.in ${PROJECT_BINARY_DIR}/pkgconfig/${name}.pc @ONLY)
  install(FILES ${PROJECT_BINARY_DIR}/pkgconfig/${name}.pc DESTINATION ${CMAKE_INSTALL_LIBDIR}/pkgconfig)
endfunction()

# -I<dir> -L<dir> -l<name> for a header directory and a library file found by find_path/find_library; no -I for
# the compiler's own /usr/include (it would break #include_next in the C++ headers).
function(shardkit_pc_flags out_cflags out_libs include_dir library)
  set(_cflags "")
  if(include_dir AND NOT include_dir STREQUAL "/usr/include")
    set(_cflags "-I${include_dir}")
  endif()
  get_filename_component(_dir ${library} DIRECTORY)
  get_filename_component(_name ${library} NAME_WE)
  string(REGEX REPLACE "^lib" "" _name ${_name})
  set(${out_cflags} ${_cflags} PARENT_SCOPE)
  set(${out_libs} "-L${_dir}" "-l${_name}" PARENT_SCOPE)
endfunction()

function(shardkit_install_pkgconfig)
  if(IS_ABSOLUTE "${CMAKE_INSTALL_LIBDIR}" OR IS_ABSOLUTE "${CMAKE_INSTALL_INCLUDEDIR}")
    message(WARNING "shardkit: absolute CMAKE_INSTALL_LIBDIR/INCLUDEDIR; the .pc files are not relocatable")
  endif()
  # ${pcfiledir} is <prefix>/<libdir>/pkgconfig: as many ".." as that path has components.
  file(RELATIVE_PATH SHARDKIT_PC_PREFIX_FROM_PCDIR "/p/${CMAKE_INSTALL_LIBDIR}/pkgconfig" "/p")
  string(REGEX REPLACE "/$" "" SHARDKIT_PC_PREFIX_FROM_PCDIR "${SHARDKIT_PC_PREFIX_FROM_PCDIR}")

  shardkit_pc_file(shardkit DESCRIPTION "${PROJECT_DESCRIPTION} (core: loopback, shm, posix)"
                   CFLAGS "-I\${includedir}" -std=c++20 -pthread LIBS -pthread)
  if(TARGET tcp)  # Boost.Asio is header-only and Boost ships no .pc file: the system include path has it
    shardkit_pc_file(shardkit-tcp DESCRIPTION "shardkit TCP transport (Boost.Asio)" REQUIRES shardkit
                     CFLAGS -DSHARDKIT_HAS_TCP=1)
  endif()
  if(TARGET gloo)  # Debian's libgloo-dev ships no .pc file
    shardkit_pc_flags(_cflags _libs "${SHARDKIT_GLOO_INCLUDE}" "${SHARDKIT_GLOO_LIBRARY}")
    shardkit_pc_file(shardkit-gloo DESCRIPTION "shardkit Gloo backend" REQUIRES shardkit
                     CFLAGS -DSHARDKIT_HAS_GLOO=1 ${_cflags} LIBS ${_libs})
  endif()
  if(TARGET fabric)
    shardkit_pc_file(shardkit-fabric DESCRIPTION "shardkit libfabric transport" REQUIRES shardkit libfabric
                     CFLAGS -DSHARDKIT_HAS_FABRIC=1)
  endif()
  if(TARGET cuda)  # CUDA ships no .pc files: the directories this build found
    set(_cflags "")
    foreach(_dir IN LISTS CUDAToolkit_INCLUDE_DIRS)
      if(NOT _dir STREQUAL "/usr/include")
        list(APPEND _cflags "-I${_dir}")
      endif()
    endforeach()
    shardkit_pc_file(shardkit-cuda DESCRIPTION "shardkit CUDA layer (CUDA runtime)" REQUIRES shardkit
                     CFLAGS -DSHARDKIT_HAS_CUDA=1 ${_cflags} LIBS "-L${CUDAToolkit_LIBRARY_DIR}" -lcudart)
  endif()
  if(TARGET nccl)  # NCCL ships no .pc file either
    shardkit_pc_flags(_cflags _libs "${SHARDKIT_NCCL_INCLUDE}" "${SHARDKIT_NCCL_LIBRARY}")
    if(_cflags IN_LIST CUDAToolkit_INCLUDE_DIRS OR "${_cflags}" STREQUAL "-I${CUDAToolkit_INCLUDE_DIRS}")
      set(_cflags "")  # shardkit-cuda has that directory already
    endif()
    shardkit_pc_file(shardkit-nccl DESCRIPTION "shardkit NCCL backend (NCCL, on shardkit-cuda)" REQUIRES shardkit-cuda
                     CFLAGS -DSHARDKIT_HAS_NCCL=1 ${_cflags} LIBS ${_libs})
  endif()
  if(TARGET codec)
    shardkit_pc_file(shardkit-codec DESCRIPTION "shardkit codecs: xxHash64 and strict JSON"
                     REQUIRES shardkit libxxhash nlohmann_json)
  endif()
  if(TARGET ckpt)
    shardkit_pc_file(shardkit-ckpt DESCRIPTION "shardkit checkpoints" REQUIRES shardkit-codec CFLAGS -DSHARDKIT_HAS_CKPT=1)
  endif()
  if(TARGET data)
    shardkit_pc_file(shardkit-data DESCRIPTION "shardkit data loader" REQUIRES shardkit-codec CFLAGS -DSHARDKIT_HAS_DATA=1)
  endif()
  if(TARGET s3)
    shardkit_pc_file(shardkit-s3 DESCRIPTION "shardkit S3 storage sink (libcurl)" REQUIRES shardkit libcurl
                     CFLAGS -DSHARDKIT_HAS_S3=1)
  endif()
  if(TARGET shardkit_compiled)  # shardkit::compiled: libshardkit, with the backends it was compiled with
    set(_requires shardkit)
    foreach(_backend tcp s3 ckpt data)
      if(TARGET ${_backend})
        list(APPEND _requires shardkit-${_backend})
      endif()
    endforeach()
    shardkit_pc_file(shardkit-compiled DESCRIPTION "shardkit's separately compiled bodies (libshardkit)"
                     REQUIRES ${_requires} CFLAGS -DSHARDKIT_SEPARATE_COMPILATION
                     LIBS "-L\${prefix}/${CMAKE_INSTALL_LIBDIR}" -lshardkit)
  endif()
endfunction()
