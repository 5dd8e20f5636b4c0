#!/usr/bin/env bash
# trainer --plan-units writes what shardkit-plan reads: a tiny 1-rank run's units, then the planner's table for 2
# hosts (every budget row, steps positive, peak gathered bytes within each budget), one budget's timeline, the
# t5-11b preset, and a units file it cannot read refused naming the line; sizes and rates beyond what the simulation
# counts refused.
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
# The ratio is to a lower bound (compute, the link's bytes at its full rate): never below 1, latency or not.
"$plan" --preset t5-11b --ranks 256 --ranks-per-host 8 --nics 2 --gbit 60 --rtt-us 30 >"$work/t5.txt"
awk -F'|' '$4 ~ /[0-9]x/ && $4 + 0 < 1 { print "FAIL: ratio " $4 " below 1"; bad = 1 } END { exit bad }' "$work/t5.txt"
"$plan" --units "$work/units.txt" --hosts 2 --budget 1u --timeline | grep -q ' gather  *backward block0$' ||
  { echo "FAIL: no backward gather of block0 in the timeline"; exit 1; }
"$plan" --preset t5-11b --ranks 64 --ranks-per-host 8 --nics 2 --gbit 60 | grep -q '^# 50 units, 8 hosts x 8 ranks' ||
  { echo "FAIL: the preset's header"; exit 1; }

printf 'unit a 10 1 2\nunit b x 1 2\n' >"$work/bad.txt"
if "$plan" --units "$work/bad.txt" 2>"$work/err.txt"; then echo "FAIL: a bad units file was read"; exit 1; fi
grep -q "bad.txt:2: cannot read 'unit b x 1 2'" "$work/err.txt" || { cat "$work/err.txt"; echo "FAIL: the error"; exit 1; }

# Refusals: exit 2, the message naming what is wrong, nothing on stdout (no table header before an error).
refuse() {
  local want=$1
  shift
  local rc=0
  "$plan" "$@" >"$work/out.txt" 2>"$work/err.txt" || rc=$?
  if [ "$rc" != 2 ] || ! grep -qF -- "$want" "$work/err.txt" || [ -s "$work/out.txt" ]; then
    echo "FAIL: shardkit-plan $* (rc $rc, want 2 and '$want'):"; cat "$work/out.txt" "$work/err.txt"; exit 1
  fi
}
u=$work/units.txt
refuse "--ranks-per-host must be positive" --units "$u" --ranks 8 --ranks-per-host 0
refuse "--ranks must be positive" --units "$u" --ranks 0
refuse "--budget 17179869184G is too large" --units "$u" --budget 17179869184G
refuse "--budget 100000000000G is too large" --units "$u" --budget 100000000000G
refuse "is too large" --units "$u" --budget 18446744073709551615
refuse "--budget 99999999999999999999u is too large" --units "$u" --budget 99999999999999999999u
refuse "--budget wants BYTES[K|M|G], Nu (units) or unlimited, got '5XiB'" --units "$u" --budget 5XiB
refuse "is a directory" --units "$work"
refuse "--hosts wants a whole number (an integer), got '1e30'" --units "$u" --hosts 1e30
refuse "--gbit must be positive" --units "$u" --gbit 0
refuse "not both" --units "$u" --preset t5-11b
refuse "--mfu and --seqs-per-gpu" --units "$u" --mfu 0.5
refuse "--mfu and --seqs-per-gpu" --units "$u" --seqs-per-gpu 4
refuse "--hybrid-size is for --strategy hybrid_shard" --units "$u" --hybrid-size 2
refuse "give --budget too" --units "$u" --timeline
refuse "--early-gathers wants on or off, got 'maybe'" --units "$u" --early-gathers maybe
refuse "--keep-last wants on or off, got 'never'" --units "$u" --keep-last never
refuse "--early-backward wants on or off, got 'soon'" --units "$u" --early-backward soon
refuse "--keep-before wants on or off, got 'x'" --units "$u" --keep-before x
refuse "give two of the three" --units "$u" --hosts 2 --ranks 8 --ranks-per-host 2
refuse "below the" --units "$u" --hosts 2 --budget 1000
# Beyond what the simulation counts: refused, not printed as a step (the 2^62-parameter unit wrapped to a smaller
# model's bytes, --gbit 1e300 printed "-nan MB each way", --hosts 2^21 ran for minutes and 99999999999 until killed).
printf 'unit a 10 1 2\nunit huge 4611686018427387904 1 2\n' >"$work/huge.txt"
refuse "unit 'huge' has 4611686018427387904 parameters, past 2^50" --units "$work/huge.txt" --hosts 2
refuse "plan_cluster::link_bytes_per_second must be finite" --units "$u" --hosts 2 --gbit 1e300
refuse "must be at most 1048576 ranks, got 2097152 x 1" --units "$u" --hosts 2097152
refuse "must be at most 1048576 ranks, got 99999999999 x 8" --units "$u" --hosts 99999999999 --ranks-per-host 8
"$plan" --units "$u" --strategy hybrid_shard --ranks 8 --ranks-per-host 4 | grep -q '^# 4 units, 2 hosts x 4 ranks, shard 4 x 2 replicas' ||
  { echo "FAIL: hybrid_shard without --hybrid-size: a shard group per host"; exit 1; }
"$plan" --units "$u" --max-gathered 3 | grep -q '^| unlimited, at most 3 gathered |' || { echo "FAIL: --max-gathered's label"; exit 1; }
"$plan" --units "$u" --hosts 2 --budget 1M | grep -q "^# the groups' scratch: [1-9][0-9]* of the budget's 1048576 bytes" ||
  { echo "FAIL: no scratch line"; exit 1; }
# The units file, read strictly: each bad line named with what was expected.
bad_file() {
  printf "$1" >"$work/f.txt"
  refuse "f.txt:$2: cannot read" --units "$work/f.txt"
  grep -qF -- "$3" "$work/err.txt" || { cat "$work/err.txt"; echo "FAIL: want '$3'"; exit 1; }
}
bad_file 'unit a 10.5 1 2\n' 1 "NUMEL a positive integer, got '10.5'"
bad_file 'unit a -10 1 2\n' 1 "NUMEL a positive integer, got '-10'"
bad_file 'unit a 10 1 2\nmeasured_shard -3\n' 2 "measured_shard a positive integer"
bad_file 'unit a 10 1 2\nmeasured_shard 2.5\n' 2 "measured_shard a positive integer"
bad_file 'unit a 10 1 2 junk\n' 1 "(5 fields), got 6"
bad_file 'unit a 10 1 2\nother_ms 1\nother_ms 2\n' 3 "other_ms once"
bad_file 'unit a 10 -1 2\n' 1 "FORWARD_MS a non-negative number"
bad_file 'unit a 10 0x10 2\n' 1 "FORWARD_MS a non-negative number of ms, got '0x10'"
bad_file 'unit a 10 1 2\nother_ms 0x1p3\n' 2 "other_ms a non-negative number of ms, got '0x1p3'"
printf 'unit a 10 0 0\nunit b 10 0 0\n' >"$work/f.txt"
refuse "has no measured compute" --units "$work/f.txt"

# The trainer refuses --plan-units where its times would plan nothing, before any step.
tiny=(--width 32 --blocks 2 --batch 2 --context 8)
trainer_refuses() {
  local want=$1
  shift
  if "$run" -n 1 -- "$trainer" "${tiny[@]}" "$@" >"$work/out.txt" 2>"$work/err.txt"; then
    echo "FAIL: trainer $* ran"; exit 1
  fi
  grep -qF -- "$want" "$work/err.txt" || { cat "$work/err.txt"; echo "FAIL: trainer $*: want '$want'"; exit 1; }
  if grep -q '^\[rank 0\] step 0 ' "$work/out.txt"; then echo "FAIL: trainer $* ran a step before refusing"; exit 1; fi
}
trainer_refuses "--plan-units wants a file name" --plan-units ""
trainer_refuses "cannot be given with --skip-compute" --skip-compute --plan-units "$work/p.txt"
trainer_refuses "--steps 2 or more" --steps 1 --plan-units "$work/p.txt"
trainer_refuses "asynchronous" --device cuda --plan-units "$work/p.txt"
trainer_refuses "cannot write $work/no/such/dir/p.txt: No such file or directory" --steps 2 --plan-units "$work/no/such/dir/p.txt"
"$run" -n 1 -- "$trainer" "${tiny[@]}" --steps 2 --ckpt-dir "$work/ck" --ckpt-every 2 >/dev/null
if "$run" -n 1 -- "$trainer" "${tiny[@]}" --steps 2 --ckpt-dir "$work/ck" --resume --plan-units "$work/r.txt" \
  >/dev/null 2>"$work/err.txt"; then
  echo "FAIL: a resume with no step to run wrote units"; exit 1
fi
grep -q "no step ran after the warm-up" "$work/err.txt" || { cat "$work/err.txt"; echo "FAIL: the resume's error"; exit 1; }
[ ! -e "$work/r.txt" ] || { echo "FAIL: an empty units file was left"; exit 1; }
echo "OK: trainer --plan-units and shardkit-plan"
