#!/bin/sh
# package_conan: `conan create` of the recipe at the repository root, offline, into a CONAN_HOME of its own
# (the user's cache and profiles are never touched), test_package built under WORK_DIR (the source tree stays
# clean). Conan is in neither Debian nor npm: without `conan` on PATH the test skips (77) and says why.
#   run_conan.sh SOURCE_DIR WORK_DIR
set -eu
src=$1 work=$2
if ! command -v conan >/dev/null 2>&1; then
  echo "SKIP: conan not on PATH (Conan 2 is in neither Debian nor npm; see docs/packaging.md to run it)"
  exit 77
fi
rm -rf "$work"
mkdir -p "$work"
export CONAN_HOME="$work/conan-home"
conan --version
conan profile detect >/dev/null 2>&1
# Offline by construction: no remote to reach (the recipe's dependencies come from the system).
conan remote disable "*" >/dev/null
# `profile detect` writes GCC's default standard (gnu17 for GCC 12); the recipe validates C++20.
# mode=check: system requirements are checked (dpkg), never installed.
conan create "$src" -s compiler.cppstd=20 \
  -c tools.cmake.cmake_layout:test_folder="$work/test_package" \
  -c tools.system.package_manager:mode=check
