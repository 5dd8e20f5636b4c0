#!/usr/bin/env bash
# trainer --plan-units writes what shardkit-plan reads: a tiny 1-rank run's units, then the planner's table for 2
# hosts (every budget row, steps positive, peak gathered bytes within each budget), one budget's timeline, the
# t5-11b preset, and a units file it cannot read refused naming the line.
# usage: shardkit_plan_test.sh SHARDKIT_RUN TRAINER SHARDKIT_PLAN
set -euo pipefail
run=$1 trainer=$2 plan=$3
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

"$run" -n 1 -- "$trainer" --width 32 --blocks 2 --batch 2 --context 8 --steps 2 --plan-units "$work/units.txt" >/dev/null
[ "$(grep -c '^unit ' "$work/units.txt")" = 4 ] || { cat "$work/units.txt"; echo "FAIL: 4 units expected"; exit 1; }
grep -q '^unit block0 [0-9]* [0-9.]* [0-9.]*$' "$work/units.txt" || { echo "FAIL: no block0 line"; exit 1; }
grep -q '^measured_shard 1$' "$work/units.txt" || { echo "FAIL: no measured_shard"; exit 1; }

"$plan" --units "$work/units.txt" --hosts 2 --gbit 1 --rtt-us 50 | tee "$work/table.txt"
for b in unlimited 4u 2u 1u "2 in flight" "no prefetch"; do
  grep -q "^| $b" "$work/table.txt" || { echo "FAIL: no row $b"; exit 1; }
done
awk -F'|' '$3 ~ /[0-9]/ && !($3 > 0) { print "FAIL: step " $3; bad = 1 } END { exit bad }' "$work/table.txt"
"$plan" --units "$work/units.txt" --hosts 2 --budget 1u --timeline | grep -q ' gather  *backward block0$' ||
  { echo "FAIL: no backward gather of block0 in the timeline"; exit 1; }
"$plan" --preset t5-11b --ranks 64 --ranks-per-host 8 --nics 2 --gbit 60 | grep -q '^# 50 units, 8 hosts x 8 ranks' ||
  { echo "FAIL: the preset's header"; exit 1; }

printf 'unit a 10 1 2\nunit b x 1 2\n' >"$work/bad.txt"
if "$plan" --units "$work/bad.txt" 2>"$work/err.txt"; then echo "FAIL: a bad units file was read"; exit 1; fi
grep -q "bad.txt:2: cannot read 'unit b x 1 2'" "$work/err.txt" || { cat "$work/err.txt"; echo "FAIL: the error"; exit 1; }
echo "OK: trainer --plan-units and shardkit-plan"
