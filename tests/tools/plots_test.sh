#!/usr/bin/env bash
# scripts/plots in its quick mode on this build's binaries, into a temporary directory: every figure of
# docs/benchmarks.md is drawn as a PNG from JSON results that hold rows (and no wrong element).
# usage: plots_test.sh SOURCE_DIR BUILD_DIR fsdp|no-fsdp     (exit 77: skipped, gnuplot unavailable)
set -euo pipefail
src=$1 build=$2 fsdp=$3
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

args=(--quick --build "$build" --out "$work/png" --data "$work/data")
pngs=(busbw-transports.png busbw-backends.png ckpt-stall.png)
if [[ $fsdp == fsdp ]]; then pngs+=(fsdp-budget-curve.png); else args+=(--no-fsdp); fi
rc=0
bash "$src/scripts/plots" "${args[@]}" >"$work/plots.out" 2>&1 || rc=$?
cat "$work/plots.out"
if ((rc == 3)); then
  echo "SKIP: gnuplot is not installed and apt-get could not install gnuplot-nox"
  exit 77
fi
((rc == 0)) || { echo "FAIL: scripts/plots exited $rc"; exit 1; }

for p in "${pngs[@]}"; do
  f="$work/png/$p"
  [[ -s $f && $(head -c 4 "$f" | tail -c 3) == PNG ]] || { echo "FAIL: $p is not a PNG"; ls -l "$work/png"; exit 1; }
  echo "ok: $p ($(stat -c %s "$f") bytes)"
done
for t in loopback shm tcp; do
  f="$work/data/transport-$t.jsonl"
  rows=$(grep -c '"collective":"all_reduce"' "$f" || true)
  ((rows >= 2)) || { echo "FAIL: $f has $rows all_reduce rows"; exit 1; }
  ! grep -q '"wrong":[1-9]' "$f" || { echo "FAIL: $f has rows with wrong elements"; exit 1; }
done
[[ $(wc -l <"$work/data/ckpt-sweep.jsonl") == 2 ]] || { echo "FAIL: ckpt_bench sweep gave no row per size"; exit 1; }
grep -q 'sync [ 0-9.]* *zero-overhead' "$work/plots.out" || { echo "FAIL: no stall table"; exit 1; }
echo "OK: scripts/plots drew ${#pngs[@]} figures from JSON results"
