#!/usr/bin/env bash
# scripts/lib/plan_inputs.sh, the step planner's measured inputs as scripts/plan-validate derives them, on made-up
# logs (no root, lab or trainer needed):
# 1. the median (odd, even, none); the step lines after the first, with and without the "[rank 0] " prefix;
# 2. the synchronous job's compute: step by step the slowest of one-rank jobs that ran side by side, the longest
#    job's steps kept;
# 3. the machine's busy time: user, nice, system, irq and softirq only, in ms at the given tick rate; irq and
#    softirq alone; the waited children's CPU from bash's `times`, parsed and real (a child's busy second);
# 4. a units file's step and values; the collectives' cores, never below 0, a link time of 0 refused;
# 5. plan-validate refuses a --comm-cpu or --compute-from it cannot use, naming the flag, with exit 2 (before it
#    asks for root or a build);
# 6. with SHARDKIT_PLAN (shardkit-plan's path), plan-validate --from-logs on a made-up cell predicts what
#    shardkit-plan predicts given the inputs worked out here by hand: units scaled to the slowest job's step, the
#    optimizer alike, the collectives' cores from the busy time; with --compute-from rank0 --comm-cpu 0, unscaled;
#    --rtt-us replaces the measured ring step; a cell the logs lack is refused, naming it.
#   plan_inputs_test.sh SOURCE_DIR [SHARDKIT_PLAN]
set -euo pipefail
src=$1
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
fail() { echo "FAIL: $*"; exit 1; }
expect() { [[ "$2" == "$3" ]] || fail "$1: got '$2', want '$3'"; }
# shellcheck source=../../scripts/lib/plan_inputs.sh
source "$src/scripts/lib/plan_inputs.sh"

expect "median, odd" "$(printf '3\n1\n2\n' | pv_median)" 2
expect "median, even" "$(printf '4\n1\n3\n2\n' | pv_median)" 2.5
expect "median, none" "$(printf '' | pv_median)" -
line() { echo "${3:-}step $1 loss 2.5 tokens/s 100 step_ms $2 compute_ms 1.00 gather_wait_ms 0.00"; }
{ line 0 999; line 1 200; line 2 300; line 3 210; echo "# plan units: wrote x"; } >"$work/a.out"
{ line 0 999 "[rank 0] "; line 1 320 "[rank 0] "; line 2 205 "[rank 0] "; line 3 330 "[rank 0] "; line 4 230 "[rank 0] "; } >"$work/b.out"
expect "step lines" "$(pv_step_ms "$work/a.out" | paste -sd' ')" "200 300 210"
expect "step lines, prefixed" "$(pv_step_ms "$work/b.out" | paste -sd' ')" "320 205 330 230"
expect "slowest step by step" "$(pv_slowest_steps "$work/a.out" "$work/b.out" | paste -sd' ')" "320 300 330 230"
expect "slowest of one job" "$(pv_slowest_steps "$work/a.out" | paste -sd' ')" "200 300 210"

printf 'cpu  100 10 50 1000 20 5 7 3 0 0\ncpu0 50 5 25 500 10 2 3 1 0 0\n' >"$work/stat"
expect "busy ms" "$(pv_busy_ms "$work/stat" 100)" 1720
expect "busy ms, 250 Hz" "$(pv_busy_ms "$work/stat" 250)" 688

expect "irq ms" "$(pv_irq_ms "$work/stat" 100)" 120
printf '0m0.010s 0m0.020s\n1m2.500s 0m0.250s\n' >"$work/times"
expect "children's CPU" "$(pv_times_children_ms "$work/times")" 62750
# bash's own: the CPU of a grandchild (awk summing 2e7 numbers, a tenth of a second or more), waited for, shows
times >"$work/times"
before=$(pv_times_children_ms "$work/times")
( awk 'BEGIN { for (i = 0; i < 2e7; i++) s += i; exit s < 0 }' ) &
wait $!
times >"$work/times"
(($(pv_times_children_ms "$work/times") - before >= 50)) || fail "a waited grandchild's CPU: $before ms, then $(cat "$work/times")"

printf '# shardkit-plan units\nunit embed 81920 0.5 0.25\nunit block0 526080 10 19\nother_ms 20.25\nmeasured_shard 1\n' >"$work/units"
expect "units step" "$(pv_units_step_ms "$work/units")" 50
expect "other_ms" "$(pv_units_value "$work/units" other_ms)" 20.25
expect "measured_shard" "$(pv_units_value "$work/units" measured_shard)" 1
expect "comm cores" "$(pv_comm_cpu 43 10 78)" 0.423
expect "comm cores, none" "$(pv_comm_cpu 5 10 78)" 0.000
if pv_comm_cpu 43 10 0 2>"$work/err"; then fail "a link time of 0 was accepted"; fi
grep -q "link time 0 ms" "$work/err" || fail "a link time of 0: $(cat "$work/err")"

for bad in "--comm-cpu abc" "--compute-from fastest"; do
  rc=0
  # shellcheck disable=SC2086
  "$src/scripts/plan-validate" $bad >"$work/out" 2>&1 || rc=$?
  expect "plan-validate $bad: exit" "$rc" 2
  grep -q -- "plan-validate: ${bad%% *} wants" "$work/out" || fail "plan-validate $bad: $(head -n 2 "$work/out")"
done
plan=${2:-}
if [[ -z $plan ]]; then echo "plan_inputs_test: part 6 skipped: no shardkit-plan given"; echo "plan_inputs_test: all passed"; exit 0; fi
logs="$work/logs"
mkdir -p "$logs"
# One cell, 2 hosts at 2 Gbit/s, one run: host 0's job steps at 100 ms, host 1's at 150 then 130; the units file's
# step is 80 + 20 = 100 ms, so the synchronous job's compute (median of 150, 130 = 140) scales it by 1.4.
printf 'unit embed 81920 0 0\nunit block0 526080 30 50\nunit head 65792 0 0\nother_ms 20\nmeasured_shard 1\n' >"$logs/h2_2gbit.units.r1.h0"
{ line 0 1; line 1 100; line 2 100; } >"$logs/h2_2gbit.compute.r1.h0.out"
{ line 0 1; line 1 150; line 2 130; } >"$logs/h2_2gbit.compute.r1.h1.out"
{ line 0 1; line 1 60; } >"$logs/h2_2gbit.comm.r1.h0.out"
{ line 0 1; line 1 62; } >"$logs/h2_2gbit.commlong.r1.h0.out"
{ line 0 1; line 1 170; line 2 190; } >"$logs/h2_2gbit.unlimited.r1.h0.out"
# busy: 900 ms over 10 extra steps of 2 hosts = 45 ms a step a host; the optimizer there is 20 x 1 / 2 = 10 ms
printf 'goodput_mbit 1900\nrtt_us 100\ncores 2\nrepeat 1\nextra_steps 10\nbusy_extra_ms 900\n' >"$logs/h2_2gbit.inputs"
cell=(--units "$logs/h2_2gbit.units.r1.h0" --hosts 2 --gbit 1.9 --rtt-us 100 --cores-per-host 1 --budget unlimited)
link_ms=$("$plan" "${cell[@]}" | awk '/^# compute only/ { for (i = 1; i < NF; i++) if ($(i + 1) == "ms" && $(i + 2) == "at") print $i }')
cores=$(pv_comm_cpu 45 10 "$link_ms")
first_row() { awk -F'|' '$2 ~ /unlimited/ { gsub(/ /, "", $3); print $3; exit }'; }
want=$("$plan" "${cell[@]}" --scale-compute 1.4 --optimizer-ms 14 --comm-cpu "$cores" | first_row)
row=$("$src/scripts/plan-validate" --from-logs "$logs" --plan "$plan" --hosts 2 --rates 2gbit --budgets unlimited | grep '^| 2 ')
got=$(awk -F'|' '{ gsub(/ /, "", $8); print $8 }' <<<"$row")
expect "--from-logs: predicted step" "$got" "$want"
grep -q "| 180 (180) |" <<<"$row" || fail "--from-logs: measured 180 ms (one run): $row"
grep -q "| 140 / " <<<"$row" || fail "--from-logs: the slowest job's compute 140 ms: $row"
grep -q "| 45.0 / $cores |" <<<"$row" || fail "--from-logs: 45 ms a step a host, $cores cores: $row"
want=$("$plan" "${cell[@]}" --optimizer-ms 10 --comm-cpu 0 | first_row)
row=$("$src/scripts/plan-validate" --from-logs "$logs" --plan "$plan" --hosts 2 --rates 2gbit --budgets unlimited \
  --compute-from rank0 --comm-cpu 0 | grep '^| 2 ')
expect "--from-logs, rank0, no comm CPU: predicted step" "$(awk -F'|' '{ gsub(/ /, "", $8); print $8 }' <<<"$row")" "$want"
# --rtt-us given replaces the cell's measured ring step (what-if against the same runs)
cell_500=(--units "$logs/h2_2gbit.units.r1.h0" --hosts 2 --gbit 1.9 --rtt-us 500 --cores-per-host 1 --budget unlimited)
want=$("$plan" "${cell_500[@]}" --optimizer-ms 10 --comm-cpu 0 | first_row)
row=$("$src/scripts/plan-validate" --from-logs "$logs" --plan "$plan" --hosts 2 --rates 2gbit --budgets unlimited \
  --compute-from rank0 --comm-cpu 0 --rtt-us 500 | grep '^| 2 ')
expect "--from-logs --rtt-us 500: predicted step" "$(awk -F'|' '{ gsub(/ /, "", $8); print $8 }' <<<"$row")" "$want"
grep -q "| 500 | unlimited |" <<<"$row" || fail "--from-logs --rtt-us 500: the row names 500 us: $row"
if "$src/scripts/plan-validate" --from-logs "$logs" --plan "$plan" --hosts 4 --rates 2gbit >"$work/out" 2>&1; then
  fail "--from-logs with a cell it did not measure succeeded"
fi
grep -q "holds no h4_2gbit.inputs" "$work/out" || fail "--from-logs, a missing cell: $(cat "$work/out")"
echo "plan_inputs_test: all passed"
