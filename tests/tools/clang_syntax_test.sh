#!/usr/bin/env bash
# clang 14 parses every public header this build has (one translation unit that includes them all, header-only, so
# their detail/ parts and impl/ bodies come too): the library stays within what clang accepts, which keeps clang's
# -ftime-trace usable for compile-time work (docs/benchmarks.md). Skips (77) with one line where clang++-14 (or
# clang++) is missing.
# usage: clang_syntax_test.sh FLAGS_FILE TRANSLATION_UNIT
set -euo pipefail
flags=$1 tu=$2
clang=$(command -v clang++-14 || command -v clang++ || true)
if [ -z "$clang" ]; then
  echo "SKIP: no clang++-14 or clang++ on PATH"
  exit 77
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# The doc examples' flags, less what is theirs: separate compilation (this TU is header-only) and -Werror (a
# warning clang adds is not what this check is for).
grep -v -e '^-DSHARDKIT_SEPARATE_COMPILATION$' -e '^-Werror$' "$flags" >"$work/flags.txt"
"$clang" @"$work/flags.txt" -fsyntax-only "$tu"
echo "OK: $("$clang" --version | head -1) parses $(grep -c '^#include' "$tu") public headers"
