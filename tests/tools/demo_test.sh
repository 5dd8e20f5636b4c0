#!/usr/bin/env bash
# scripts/demo, README's first command, stays working: its quick mode on an existing build's binaries trains on 4
# ranks, resumes on 2 from the checkpoint with the loss where it was, and prints the summary table.
# usage: demo_test.sh SOURCE_DIR BUILD_DIR
set -euo pipefail
src=$1 build=$2
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

SHARDKIT_DEMO_BUILD=$build SHARDKIT_DEMO_NO_BUILD=1 SHARDKIT_DEMO_RUNS=$work/demo "$src/scripts/demo" --quick \
  2>&1 | tee "$work/out.txt"
out=$work/out.txt
for line in '== summary' 'tokens/s (4 ranks, median step)' 'all_reduce busbw, best size' 'limiter peak / budget' \
            'checkpoint stall, zero-overhead' 'checkpoint stall, synchronous save' 'latest (shardkit-ckpt ls)' 'loss curve'; do
  grep -qF "$line" "$out" || { echo "FAIL: the summary has no '$line'"; exit 1; }
done
grep -q 'resumed from step 12 of .* (saved by 4 ranks, loaded by 2)' "$out" || { echo "FAIL: no resume on 2 ranks"; exit 1; }
grep -q 'resume on 2 ranks .*step 11 loss .* -> step 12 loss .* (yes)' "$out" || { echo "FAIL: the resume did not continue"; exit 1; }
grep -Eq 'latest \(shardkit-ckpt ls\) +16 complete latest 2 ' "$out" || { echo "FAIL: the latest checkpoint is not step 16 of 2 ranks"; exit 1; }
# The limiter's peak never exceeds its budget.
grep -Eq 'limiter peak / budget .*\(([0-9]|[1-9][0-9]|100)%\)' "$out" || { echo "FAIL: limiter peak over budget"; exit 1; }
if command -v gnuplot >/dev/null; then
  [ -s "$work/demo/loss.png" ] || { echo "FAIL: no loss plot"; exit 1; }
fi
# Nothing left running: no rank of this demo's runs.
if pgrep -f -- "--data $work/demo/data" >/dev/null; then echo "FAIL: a rank is still running"; exit 1; fi
echo "OK: scripts/demo --quick"
