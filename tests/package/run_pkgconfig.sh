#!/bin/sh
# package_pkg_config: the installed .pc files with a bare compiler, no CMake on the consumer side, as a Makefile
# project would. Two installs:
#   0. the source configured afresh (no tests, examples, benchmarks or libshardkit; the tools configured) and
#      installed with nothing built: the install must install what was built and skip the rest (as after
#      scripts/demo, which builds some tools only), not stop at the first tool missing, nor install an unbuilt one;
#   then the install of the enclosing build tree (BUILD_DIR, libshardkit built there, as package_find_package's), to
#   WORK_DIR/prefix, and consumers built with nothing but pkg-config and the compiler:
#   1. test_package/test_package.cpp with `pkg-config --cflags --libs shardkit` (the core alone, header-only);
#   2. tests/package/consumer/main.cpp (TCP transport, fsdp, ckpt, data) with shardkit-compiled shardkit-tcp
#      shardkit-ckpt shardkit-data: separately compiled, its bodies from libshardkit;
#   3. test_package.cpp again with every shardkit-<backend> module the install has: it then includes each
#      backend's header and calls into its system library, so each .pc file's flags are checked.
# All run. Skips (77) with the reason when pkg-config is missing. Until 2026-11-28 the fresh tree built libshardkit
# and 1-3 used its install: 53 s of compile (at -O0) for a library the enclosing build has already built.
#   run_pkgconfig.sh SOURCE_DIR WORK_DIR CXX GENERATOR BUILD_DIR
set -eu
src=$1 work=$2 cxx=$3 generator=$4 build=$5
if ! command -v pkg-config >/dev/null 2>&1; then
  echo "SKIP: pkg-config not on PATH (Debian: apt-get install pkg-config)"
  exit 77
fi
rm -rf "$work"
mkdir -p "$work"
cmake -S "$src" -B "$work/build" -G "$generator" -DCMAKE_CXX_COMPILER="$cxx" -DSHARDKIT_BUILD_TESTS=OFF \
  -DSHARDKIT_BUILD_EXAMPLES=OFF -DSHARDKIT_BUILD_BENCH=OFF -DSHARDKIT_COMPILED=OFF >/dev/null
cmake --install "$work/build" --prefix "$work/unbuilt" >/dev/null
if [ -e "$work/unbuilt/bin/shardkit-run" ]; then echo "an unbuilt shardkit-run was installed"; exit 1; fi
[ -n "$(find "$work/unbuilt" -name shardkit.pc)" ] || { echo "no shardkit.pc under $work/unbuilt"; exit 1; }
cmake --install "$build" --prefix "$work/prefix" >/dev/null
pcdir=$(dirname "$(find "$work/prefix" -name shardkit.pc | head -n1)")
[ -f "$pcdir/shardkit.pc" ] || { echo "no shardkit.pc under $work/prefix"; exit 1; }
export PKG_CONFIG_PATH="$pcdir${PKG_CONFIG_PATH:+:$PKG_CONFIG_PATH}"
set -x
pkg-config --modversion shardkit
pkg-config --cflags --libs shardkit
# shellcheck disable=SC2046  # the flags are words
"$cxx" -o "$work/core_consumer" "$src/test_package/test_package.cpp" $(pkg-config --cflags --libs shardkit)
"$work/core_consumer"
mods="shardkit-compiled shardkit-tcp shardkit-ckpt shardkit-data"
pkg-config --print-errors --exists $mods
# shellcheck disable=SC2046
"$cxx" -o "$work/consumer" "$src/tests/package/consumer/main.cpp" $(pkg-config --cflags --libs $mods)
"$work/consumer"
all=shardkit
for m in tcp codec ckpt data s3 gloo fabric cuda nccl; do
  if pkg-config --exists "shardkit-$m"; then all="$all shardkit-$m"; fi
done
# shellcheck disable=SC2046
"$cxx" -o "$work/all_consumer" "$src/test_package/test_package.cpp" $(pkg-config --cflags --libs $all)
"$work/all_consumer"
