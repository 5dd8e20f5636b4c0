#!/usr/bin/env bash
# A doc's code blocks are the compiled sources they name, verbatim: for each FILE, the first ```cpp block after a
# line that names FILE must be FILE's text. So a doc example cannot drift from the code the tests build and run.
# usage: doc_blocks_test.sh DOC SOURCE_DIR FILE...
set -euo pipefail
doc=$1 src=$2
shift 2
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
failed=0
for file in "$@"; do
  awk -v name="$file" 'index($0, name) && !inside { named = 1 } named && /^```cpp$/ { inside = 1; next }
       inside && /^```$/ { exit } inside { print }' "$doc" >"$work/block.cpp"
  if [ ! -s "$work/block.cpp" ]; then
    echo "FAIL: $(basename "$doc") has no \`\`\`cpp block after a line naming $file"
    failed=1
  elif ! diff -u "$src/$file" "$work/block.cpp"; then
    echo "FAIL: $(basename "$doc")'s block for $file differs from the file (above)"
    failed=1
  else
    echo "ok: $file"
  fi
done
[ "$failed" = 0 ] && echo "OK: every block of $(basename "$doc") is its source"
exit "$failed"
