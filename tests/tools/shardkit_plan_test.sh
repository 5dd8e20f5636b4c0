#!/usr/bin/env bash
# trainer --plan-units writes what shardkit-plan reads: a tiny 1-rank run's units, then the planner's table for 2
# hosts (every budget row, steps positive, peak gathered bytes within each budget), one budget's timeline, the
# t5-11b preset, and a units file it cannot read refused naming the line; sizes and rates beyond what the simulation
# counts refused; a flag given twice refused naming both values, --flag=V taken; each value outside its range
# refused naming the flag, the value and the range; a units file measured with more than one rank refused, a
# unit named twice, a line of binary refused, CRLF, a byte order mark and a missing last newline read alike.
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
refuse "--ranks-per-host wants a whole number from 1 to 1048576 (ranks on each host), got '0'" --units "$u" --ranks 8 --ranks-per-host 0
refuse "--ranks wants a whole number from 1 to 1048576 (ranks), got '0'" --units "$u" --ranks 0
refuse "--budget 17179869184G is too large" --units "$u" --budget 17179869184G
refuse "--budget 100000000000G is too large" --units "$u" --budget 100000000000G
refuse "is too large" --units "$u" --budget 18446744073709551615
refuse "--budget 99999999999999999999u is too large" --units "$u" --budget 99999999999999999999u
refuse "--budget wants BYTES[K|M|G], Nu (units) or unlimited, got '5XiB'" --units "$u" --budget 5XiB
refuse "is a directory" --units "$work"
refuse "--hosts wants a whole number from 1 to 1048576 (hosts), got '1e30'" --units "$u" --hosts 1e30
refuse "--gbit wants a number from 0.001 to 100000 (Gbit/s a NIC), got '0'" --units "$u" --gbit 0
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
refuse "--gbit wants a number from 0.001 to 100000 (Gbit/s a NIC), got '1e300'" --units "$u" --hosts 2 --gbit 1e300
refuse "--hosts wants a whole number from 1 to 1048576 (hosts), got '2097152'" --units "$u" --hosts 2097152
refuse "--hosts 1048576 x --ranks-per-host 2 = 2097152 ranks: the planner simulates at most 1048576 ranks" --units "$u" \
  --hosts 1048576 --ranks-per-host 2
# A flag given twice: refused, naming both values (the last was taken silently); --flag=V is --flag V.
refuse "--hosts is given twice ('2', then '8'): give it once" --units "$u" --hosts 2 --hosts 8
refuse "--gbit is given twice ('1', then '100'): give it once" --units "$u" --gbit=1 --gbit 100
refuse "--units is given twice ('$u', then '$u'): give it once" --units "$u" --units "$u"
refuse "--timeline is given twice: give it once" --units "$u" --budget 1u --timeline --timeline
refuse "--timeline takes no value, got '--timeline=yes'" --units "$u" --budget 1u --timeline=yes
refuse "unknown flag --hots=2" --units "$u" --hots=2
refuse "unknown flag --hots" --units "$u" --hots
refuse "--units wants a file name, got ''" --units ""
"$plan" --units="$u" --hosts=2 | grep -q '^# 4 units, 2 hosts x 1 ranks' || { echo "FAIL: --hosts=2"; exit 1; }
# Values outside their range: refused, naming the flag, the value and the range (each was planned: --gbit 1e-300 and
# --rtt-us 1e30 as a 30- to 300-digit step, --prefetch 2^64-1 wrapped to no prefetch: "the schedule cannot finish").
refuse "--gbit wants a number from 0.001 to 100000 (Gbit/s a NIC), got '1e-300'" --units "$u" --gbit 1e-300
refuse "--rtt-us wants a number from 0 to 1000000 (microseconds), got '1e30'" --units "$u" --rtt-us 1e30
refuse "--intra-gbit wants 0 (no limit) or a number from 0.001 to 100000 (Gbit/s), got '1e-300'" --units "$u" --intra-gbit 1e-300
refuse "--intra-us wants a number from 0 to 1000000 (microseconds), got '1e30'" --units "$u" --intra-us 1e30
refuse "--nics wants a whole number from 1 to 1024 (NICs on each host), got '1000000'" --units "$u" --nics 1000000
refuse "--cores-per-host wants 0 (one a rank) or a number from 0.001 to 65536 (cores), got '1e-300'" --units "$u" --cores-per-host 1e-300
refuse "--comm-cpu wants a number from 0 to 65536 (cores), got '1e300'" --units "$u" --comm-cpu 1e300
# The smallest shares plan-validate gives (2 cores over 250 lab hosts; collectives that take little CPU) are planned.
"$plan" --units "$u" --hosts 2 --cores-per-host 0.008 --comm-cpu 0.004 | grep -q '^| unlimited |' ||
  { echo "FAIL: --cores-per-host 0.008 --comm-cpu 0.004"; exit 1; }
refuse "--scale-compute wants a number from 0 to 1000000 (a factor), got '1e300'" --units "$u" --scale-compute 1e300
refuse "--optimizer-ms wants a number from 0 to 10000000 (ms), got '1e300'" --units "$u" --optimizer-ms 1e300
refuse "--rtt-us wants a number from 0 to 1000000 (microseconds), got '0x10'" --units "$u" --rtt-us 0x10
refuse "--prefetch wants a whole number from 0 to 1048576 (units ahead; the units' count or more: all), got '18446744073709551615'" \
  --units "$u" --prefetch 18446744073709551615
refuse "--mfu wants a number from 0.001 to 1 (of the A100's peak), got '1e-300'" --preset t5-11b --ranks 64 --ranks-per-host 8 --mfu 1e-300
refuse "--seqs-per-gpu wants a number from 0.001 to 1000000 (sequences), got '1e300'" --preset t5-11b --ranks 64 --ranks-per-host 8 \
  --seqs-per-gpu 1e300
# Ranks x units past 2^22: the simulation ran a minute a table (65536 x 50 in a Debug build), 2^20 x 50 for longer.
refuse "--ranks 131072 of 50 units: the simulation's time grows with ranks x units" --preset t5-11b --ranks 131072 --ranks-per-host 8
grep -qF "at most 83886 ranks of 50 units" "$work/err.txt" || { cat "$work/err.txt"; echo "FAIL: the ranks x units bound"; exit 1; }
# The preset plans bf16 unless --dtype says otherwise (the flags were overridden): f32 moves twice the bytes.
mb() { "$plan" --preset t5-11b --ranks 64 --ranks-per-host 8 "$@" | sed -n 's/^# compute only.*(\([0-9.]*\) MB each way.*/\1/p'; }
awk -v b="$(mb)" -v f="$(mb --dtype f32 --reduce-dtype f32)" 'BEGIN { exit !(f > 1.9 * b) }' ||
  { echo "FAIL: the preset with --dtype f32: $(mb --dtype f32 --reduce-dtype f32) MB, bf16 $(mb) MB"; exit 1; }
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
bad_file 'unit a 10 -1 2\n' 1 "FORWARD_MS a number of ms from 0 to 10000000, got '-1'"
bad_file 'unit a 10 0x10 2\n' 1 "FORWARD_MS a number of ms from 0 to 10000000, got '0x10'"
bad_file 'unit a 10 1 2\nother_ms 0x1p3\n' 2 "other_ms a number of ms from 0 to 10000000, got '0x1p3'"
bad_file 'unit a 10 nan 2\n' 1 "FORWARD_MS a number of ms from 0 to 10000000, got 'nan'"
bad_file 'unit a 10 1 1e300\n' 1 "BACKWARD_MS a number of ms from 0 to 10000000, got '1e300'"
bad_file 'unit a 0 1 2\n' 1 "NUMEL a positive integer, got '0'"
bad_file 'unit a 10 1 2\nwarmup_ms 3\n' 2 "expected a line 'unit ...', 'other_ms X' or 'measured_shard N'"
# A unit named twice: two files, or two runs' output, in one (it was planned as a model of both).
bad_file 'unit a 10 1 2\nunit b 10 1 2\nunit a 10 1 2\n' 3 "each unit once, and unit 'a' is on line 1 too"
# CRLF line ends: the line named without its CR.
bad_file 'unit a 10 1 2\r\nunit b x 1 2\r\n' 2 "cannot read 'unit b x 1 2': expected NUMEL"
: >"$work/f.txt"
refuse "f.txt lists no unit" --units "$work/f.txt"
# A line no units file has (binary; --units /dev/zero grew one line until memory ran out).
head -c 100000 /dev/zero >"$work/f.txt"
refuse "f.txt:1: a line longer than 4096 characters: not a units file" --units "$work/f.txt"
# Read alike: CRLF, a UTF-8 byte order mark (an editor's), no newline after the last line.
lf=$("$plan" --units "$u" --hosts 2)
for form in crlf bom no-newline; do
  case $form in
    crlf) sed 's/$/\r/' "$u" ;;
    bom) printf '\xef\xbb\xbf'; cat "$u" ;;
    no-newline) printf '%s' "$(cat "$u")" ;;
  esac >"$work/f.txt"
  [[ $("$plan" --units "$work/f.txt" --hosts 2) == "$lf" ]] || { echo "FAIL: a units file with $form read otherwise"; exit 1; }
done
# Measured with more than one rank: refused, naming the file, line and ranks (it was planned as one rank's compute).
sed '1s/1 rank(s)$/4 rank(s)/' "$u" >"$work/f.txt"
grep -q '^# shardkit-plan units: .*, 4 rank(s)$' "$work/f.txt" || { head -n 1 "$u"; echo "FAIL: the trainer's header"; exit 1; }
refuse "f.txt:1: measured in a run of 4 ranks" --units "$work/f.txt"
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
