#!/bin/sh
# package_pkg_config: configures the source (no tests, examples or benchmarks; the tools configured but not built:
# the install docs/packaging.md describes, independent of what the enclosing build has built), builds libshardkit
# (shardkit::compiled) alone, installs it to WORK_DIR/prefix and builds consumers with nothing but pkg-config and the
# compiler, as a Makefile project would:
#   1. test_package/test_package.cpp with `pkg-config --cflags --libs shardkit` (the core alone, header-only);
#   2. tests/package/consumer/main.cpp (TCP transport, fsdp, ckpt, data) with shardkit-compiled shardkit-tcp
#      shardkit-ckpt shardkit-data: separately compiled, its bodies from libshardkit;
#   3. test_package.cpp again with every shardkit-<backend> module the install has: it then includes each
#      backend's header and calls into its system library, so each .pc file's flags are checked.
# All run. Skips (77) with the reason when pkg-config is missing.
#   run_pkgconfig.sh SOURCE_DIR WORK_DIR CXX GENERATOR
set -eu
src=$1 work=$2 cxx=$3 generator=$4
if ! command -v pkg-config >/dev/null 2>&1; then
  echo "SKIP: pkg-config not on PATH (Debian: apt-get install pkg-config)"
  exit 77
fi
rm -rf "$work"
mkdir -p "$work"
# The tools are configured but none is built: the install must install what was built and skip the rest (as after
# scripts/demo, which builds some tools only), not stop at the first tool missing.
cmake -S "$src" -B "$work/build" -G "$generator" -DCMAKE_CXX_COMPILER="$cxx" -DSHARDKIT_BUILD_TESTS=OFF \
  -DSHARDKIT_BUILD_EXAMPLES=OFF -DSHARDKIT_BUILD_BENCH=OFF >/dev/null
cmake --build "$work/build" --target shardkit_compiled >/dev/null
cmake --install "$work/build" --prefix "$work/prefix" >/dev/null
if [ -e "$work/prefix/bin/shardkit-run" ]; then echo "an unbuilt shardkit-run was installed"; exit 1; fi
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
