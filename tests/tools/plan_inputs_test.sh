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
#    asks for root or a build); so too --repeat 0, --steps 1, --rows 0, --hosts 1, a --rates that is no tc rate,
#    --rtt-us -5 and a flag without its value, before any lab (they failed in the lab, after its first runs: --repeat
#    0 with a NaN); as root, a second plan-validate on a lab one holds is refused (it took the first's lab away),
#    and a run whose rank fails ends at once beside a stuck rank, its ranks with a 5-min operation timeout (on a
#    stand-in lab); a plan-validate on another lab of the host is refused too (their ranks would share the cores,
#    each slowing the other's measured steps), naming it;
#    pv_other_runs names the labs whose lock another run holds (its pid), not a lock file left behind nor its own;
# 6. with SHARDKIT_PLAN (shardkit-plan's path), plan-validate --from-logs on a made-up cell predicts what
#    shardkit-plan predicts given the inputs worked out here by hand: units scaled to the slowest job's step, the
#    optimizer alike, the collectives' cores from the busy time; with --compute-from rank0 --comm-cpu 0, unscaled;
#    --rtt-us replaces the measured ring step; a cell the logs lack is refused, naming it; a --budgets typo is
#    refused before any run; a truncated or hand-made log directory is refused naming the file (and line), not
#    predicted from what is left (no busy_extra_ms: the collectives' CPU was 0; a host's compute log cut short: the
#    slowest of fewer jobs; a budget's run without a step after the first: "- (0) ... +inf%"); CRLF inputs are read
#    as LF; the runs' own flags (--steps, --repeat, trainer flags) are refused with --from-logs; the trainer's
#    schedule switches reach shardkit-plan as the trainer took them (--keep-last=off; the last of one given twice);
#    as root, --allow-concurrent runs beside another lab's run (on a stand-in lab and trainer), and the footer names
#    it and one that started during the cell.
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

# Other plan-validates on the host: a lab whose lock is held (its pid named), not one whose lock file a finished run
# left, nor this run's own.
if command -v flock >/dev/null; then
  mkdir "$work/locks"
  echo 4242 >"$work/locks/busy.plan-validate.lock"
  : >"$work/locks/left.plan-validate.lock"
  : >"$work/locks/mine.plan-validate.lock"
  exec {busy_fd}>>"$work/locks/busy.plan-validate.lock" {mine_fd}>>"$work/locks/mine.plan-validate.lock"
  flock "$busy_fd"
  flock "$mine_fd"
  expect "other runs" "$(pv_other_runs "$work/locks" mine)" "lab 'busy', pid 4242"
  exec {busy_fd}>&-
  expect "other runs, none left" "$(pv_other_runs "$work/locks" mine)" ""
  exec {mine_fd}>&-
fi

# refused FLAGS... :: TEXT: plan-validate FLAGS exits 2 at once saying TEXT. Never a lab, also where a refusal is
# missing: no build in --build's place (a flag after it may name binaries), and a lab of the test's own, whose
# --rates 1bit netlab up refuses.
refused() {
  local args=() own=() rc=0 d
  while [[ $1 != :: ]]; do own+=("$1"); shift; done
  # the defaults above, each only where the case gives none of its own (plan-validate refuses a flag given twice)
  for d in --build:"$work/no-build" --hosts:2 --rates:1bit; do
    [[ " ${own[*]} " == *" ${d%%:*} "* ]] || args+=("${d%%:*}" "${d#*:}")
  done
  args+=(${own[@]+"${own[@]}"})
  NETLAB_PREFIX=pvtest NETLAB_STATE_DIR=$work timeout 20 "$src/scripts/plan-validate" "${args[@]}" >"$work/out" 2>&1 || rc=$?
  expect "plan-validate ${own[*]}: exit" "$rc" 2
  grep -qF -- "$2" "$work/out" || fail "plan-validate ${own[*]}: want '$2', got: $(head -n 2 "$work/out")"
}
refused --comm-cpu abc :: "plan-validate: --comm-cpu wants"
refused --compute-from fastest :: "plan-validate: --compute-from wants"
refused --repeat 0 :: "plan-validate: --repeat wants a positive whole number below 10^9, got '0'"
refused --steps 1 :: "plan-validate: --steps wants 2 or more"
refused --rows 0 :: "plan-validate: --rows wants a positive whole number below 10^9, got '0'"
refused --hosts "2 1" :: "plan-validate: --hosts wants host counts from 2 to 250 (the lab's link needs two), got '1'"
refused --rates "2gbit 1gbits" :: "plan-validate: --rates: '1gbits' is not a tc rate"
refused --rtt-us -5 :: "plan-validate: --rtt-us wants a non-negative number of microseconds, got '-5'"
refused --budgets :: "plan-validate: --budgets wants a value"
# A flag given twice: refused, naming both (the last was taken: --rates 2gbit --rates 1gbit measured 1gbit alone).
refused --rates 2gbit --rates 1gbit :: "plan-validate: --rates is given twice ('2gbit', then '1gbit'): give it once"
refused --allow-concurrent --allow-concurrent :: "plan-validate: --allow-concurrent is given twice"
if [[ $(id -u) == 0 ]] && command -v flock >/dev/null && command -v ip >/dev/null; then
  # A lab another plan-validate holds: refused before the lab is touched (without the lock, this run went on to
  # 'netlab down' that lab; here its netlab up then refuses the 1bit rate, a lab of the test's own prefix).
  exec {held}>"$work/pvtest.plan-validate.lock"
  flock "$held"
  rc=0
  NETLAB_PREFIX=pvtest NETLAB_STATE_DIR=$work timeout 20 "$src/scripts/plan-validate" --trainer /bin/true --plan /bin/true \
    --rtt-us 100 --hosts 2 --rates 1bit --budgets unlimited >"$work/out" 2>&1 || rc=$?
  exec {held}>&-
  expect "a second plan-validate on one lab: exit" "$rc" 3
  grep -q "another plan-validate is running on lab 'pvtest'" "$work/out" || fail "a second plan-validate: $(head -n 2 "$work/out")"
  # Another lab's run on this host: refused too, naming it (it went on, both runs' measured steps slowed unnoticed).
  exec {held}>>"$work/pvother.plan-validate.lock"
  flock "$held"
  echo 4343 >"$work/pvother.plan-validate.lock"
  rc=0
  NETLAB_PREFIX=pvtest NETLAB_STATE_DIR=$work timeout 20 "$src/scripts/plan-validate" --trainer /bin/true --plan /bin/true \
    --rtt-us 100 --hosts 2 --rates 1bit --budgets unlimited >"$work/out" 2>&1 || rc=$?
  expect "a plan-validate beside another lab's: exit" "$rc" 3
  grep -q "another plan-validate is running on this host (lab 'pvother', pid 4343)" "$work/out" ||
    fail "a plan-validate beside another lab's: $(head -n 2 "$work/out")"
  exec {held}>&-
  # A run whose rank fails ends at once, though another rank is stuck (it waited for every rank: here 60 s, past
  # the timeout of 20, in the lab up to the operation timeout, 30 min, or for ever): a stand-in lab that runs
  # commands where it stands.
  printf '#!/usr/bin/env bash\ncase $1 in addr) echo 127.0.0.1 ;; iperf) echo "{\\"mbit_per_s\\": 1900.0}" ;; run) shift 2; exec "$@" ;; esac\n' \
    >"$work/netlab"
  printf '#!/usr/bin/env bash\ncase "$*" in *units.r1.h1*) echo $$ >"%s/stuck.pid"; exec sleep 60 ;; esac\necho "trainer: boom, timeout ${SHARDKIT_TIMEOUT_MS:-unset}" >&2; exit 1\n' \
    "$work" >"$work/trainer"
  chmod +x "$work/netlab" "$work/trainer"
  rc=0
  env -u SHARDKIT_TIMEOUT_MS PLAN_VALIDATE_NETLAB="$work/netlab" NETLAB_PREFIX=pvtest NETLAB_STATE_DIR="$work" timeout 20 \
    "$src/scripts/plan-validate" \
    --trainer "$work/trainer" --plan /bin/true --rtt-us 100 --hosts 2 --rates 2gbit --budgets unlimited >"$work/out" 2>&1 || rc=$?
  [[ ! -f $work/stuck.pid ]] || kill "$(cat "$work/stuck.pid")" 2>/dev/null || true
  expect "a failed rank beside a stuck one: exit" "$rc" 1
  grep -q "plan-validate: h2_2gbit.compute.r1 failed" "$work/out" || fail "a failed rank: $(head -n 3 "$work/out")"
  # and the lab's runs have an operation timeout of 5 min, not 30: a stuck rank fails its peers' collectives sooner
  grep -q "trainer: boom, timeout 300000" "$work/out" || fail "the runs' SHARDKIT_TIMEOUT_MS: $(grep boom "$work/out")"
fi
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
refused --trainer /bin/true --plan "$plan" --rtt-us 100 --budgets "1u unlimted" :: \
  "plan-validate: --budgets: --budget wants BYTES[K|M|G], Nu (units) or unlimited, got 'unlimted'"
refused --from-logs "$logs" --plan "$plan" --steps 8 :: "plan-validate: --steps is the measured runs'"
refused --from-logs "$logs" --plan "$plan" -- --width 512 :: "plan-validate: -- trainer flags is the measured runs'"
# broken WHAT SETUP WANT: the cell's logs changed by SETUP (run in a copy) are refused, saying WANT
broken() {
  rm -rf "$work/broken" && cp -r "$logs" "$work/broken"
  (cd "$work/broken" && eval "$2")
  if "$src/scripts/plan-validate" --from-logs "$work/broken" --plan "$plan" --hosts 2 --rates 2gbit --budgets unlimited \
    >"$work/out" 2>&1; then
    fail "--from-logs, $1: predicted: $(grep '^| 2 ' "$work/out")"
  fi
  grep -qF -- "$3" "$work/out" || fail "--from-logs, $1: want '$3', got: $(head -n 2 "$work/out")"
}
broken "no busy_extra_ms" "sed -i /busy_extra_ms/d h2_2gbit.inputs" "broken/h2_2gbit.inputs: no busy_extra_ms line"
broken "no cores" "sed -i /cores/d h2_2gbit.inputs" "broken/h2_2gbit.inputs: no cores line"
broken "a word for a number" "sed -i 's/^repeat 1/repeat one/' h2_2gbit.inputs" \
  "broken/h2_2gbit.inputs:4: repeat wants a positive whole number (got 'repeat one')"
broken "a host's compute log cut short" "sed -i '/^step 2/d' h2_2gbit.compute.r1.h1.out" \
  "broken/h2_2gbit.compute.r1.h1.out: 1 steps after the first, $work/broken/h2_2gbit.compute.r1.h0.out has 2"
broken "a host's compute log missing" "rm h2_2gbit.compute.r1.h1.out" "broken/h2_2gbit.compute.r1.h1.out: missing"
broken "a budget's run without a step" "sed -i '/^step [1-9]/d' h2_2gbit.unlimited.r1.h0.out" \
  "broken/h2_2gbit.unlimited.r1.h0.out: no step after the first"
broken "a units file's bad line" "sed -i 's/^unit block0 526080/unit block0 5x/' h2_2gbit.units.r1.h0" \
  "broken/h2_2gbit.units.r1.h0:2: cannot read 'unit block0 5x 30 50'"
# CRLF line ends in the inputs file: read as LF (the same prediction)
want=$("$src/scripts/plan-validate" --from-logs "$logs" --plan "$plan" --hosts 2 --rates 2gbit --budgets unlimited | grep '^| 2 ')
sed -i 's/$/\r/' "$logs/h2_2gbit.inputs"
expect "--from-logs, CRLF inputs" "$("$src/scripts/plan-validate" --from-logs "$logs" --plan "$plan" --hosts 2 --rates 2gbit \
  --budgets unlimited | grep '^| 2 ')" "$want"
# The trainer's schedule switches as the trainer took them: --keep-last=off (passed over: the default schedule was
# planned) and --keep-before given twice, the last counting (both were passed on, and shardkit-plan refuses that).
want=$("$plan" "${cell[@]}" --optimizer-ms 10 --comm-cpu 0 --keep-last off --keep-before off | first_row)
[[ $want != "$("$plan" "${cell[@]}" --optimizer-ms 10 --comm-cpu 0 | first_row)" ]] || fail "the switches change nothing here"
echo "--width 256 --keep-last=off --keep-before on --keep-before off" >"$logs/trainer.flags"
row=$("$src/scripts/plan-validate" --from-logs "$logs" --plan "$plan" --hosts 2 --rates 2gbit --budgets unlimited \
  --compute-from rank0 --comm-cpu 0 2>&1 | grep '^| 2 ') || fail "--from-logs with the trainer's switches: no row"
expect "--from-logs, the trainer's switches: predicted step" "$(awk -F'|' '{ gsub(/ /, "", $8); print $8 }' <<<"$row")" "$want"
rm "$logs/trainer.flags"
if [[ $(id -u) == 0 ]] && command -v flock >/dev/null && command -v ip >/dev/null; then
  # --allow-concurrent beside another lab's run (held here), on the stand-in lab above and a trainer that writes a
  # units file and step lines; its compute-only job on host 0 starts a third run (a lock held 3 s) during the cell.
  # The footer names both, with the cell and when each was seen.
  cat >"$work/ok-trainer" <<EOS
#!/usr/bin/env bash
steps=2 units=
while ((\$#)); do case \$1 in --steps) steps=\$2; shift ;; --plan-units) units=\$2; shift ;; esac; shift; done
if [[ -n \$units ]]; then
  printf 'unit embed 81920 0 0\nunit block0 526080 30 50\nunit head 65792 0 0\nother_ms 20\nmeasured_shard 1\n' >"\$units"
  [[ \$units != *.h0 ]] || flock "$work/pvlate.plan-validate.lock" sleep 3 >/dev/null 2>&1 &
fi
for ((s = 0; s < steps; s++)); do echo "step \$s loss 2.5 tokens/s 100 step_ms 100 compute_ms 1.00 gather_wait_ms 0.00"; done
EOS
  chmod +x "$work/ok-trainer"
  exec {held}>>"$work/pvother.plan-validate.lock"
  flock "$held"
  rc=0
  PLAN_VALIDATE_NETLAB="$work/netlab" NETLAB_PREFIX=pvtest NETLAB_STATE_DIR="$work" timeout 30 "$src/scripts/plan-validate" \
    --trainer "$work/ok-trainer" --plan "$plan" --rtt-us 100 --hosts 2 --rates 2gbit --budgets unlimited --steps 2 \
    --repeat 1 --allow-concurrent >"$work/out" 2>&1 || rc=$?
  exec {held}>&-
  rm -rf "$(sed -n 's/.*; logs in //p' "$work/out")"
  expect "--allow-concurrent: exit" "$rc" 0
  grep -q '^| 2 | 2gbit |' "$work/out" || fail "--allow-concurrent: no row: $(cat "$work/out")"
  grep -q "^WARNING: another plan-validate ran on this host.*h2_2gbit (start): lab 'pvother', pid 4343; h2_2gbit (end): lab 'pvlate' and lab 'pvother', pid 4343\. Measure again" \
    "$work/out" || fail "--allow-concurrent: the footer: $(grep -v '^|' "$work/out")"
fi
echo "plan_inputs_test: all passed"

