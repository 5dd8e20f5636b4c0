// shardkit::compiled (CMakeLists.txt): the library's separately compiled bodies, built once per build tree and
// installed as libshardkit. Its users compile with SHARDKIT_SEPARATE_COMPILATION (the target defines it for them),
// so their sources declare what this file defines.
#include <shardkit/impl/src.hpp>
