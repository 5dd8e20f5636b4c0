#!/usr/bin/env bash
# scripts/host-bench's own logic, without root, a lab or node: run on a bundle of stand-ins (a preflight that
# passes, a link step, governor-lab rounds that print a verdict, an fsdp-bench that outlives its time limit):
# 1. the summary has a row per step (ran / timed out), each round's verdict on "<= 2% at the smallest N that keeps
#    up" per governed variant (floor 0: +1.5% met, then kept up at none; floor 5: +3.5% missed), governor-lab asked
#    for both floors, fsdp-bench's step time-boxed, rounds added only while the budget holds one
#    more, the exit status 1 (a step timed out), every step given the bundle's bin/ first on PATH (and not its lib/
#    as LD_LIBRARY_PATH: the bundled binaries' wrappers set it), governor-lab given the bundle's trainer and s3rver;
# 2. --only turn: four plan-validate rounds, the trainer's --early-backward on, off, off, on, with the bundle's
#    trainer and shardkit-plan, their tables printed, and nothing after them (no wait for the budget to run out);
#    without --only turn, none;
# 3. a bundle whose preflight fails runs nothing else and exits 3.
#   host_bench_test.sh SOURCE_DIR
set -euo pipefail
src=$1
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
fail() { echo "FAIL: $*"; exit 1; }

b="$work/stage/host-bench"
mkdir -p "$b/bin" "$b/lib" "$b/scripts/lib" "$b/s3rver/node_modules/s3rver"
cp "$src/scripts/lib/bundle.sh" "$b/scripts/lib/"
echo '{}' >"$b/s3rver/node_modules/s3rver/package.json"
stand_in() { printf '#!/usr/bin/env bash\n%s\n' "$2" >"$b/$1"; chmod +x "$b/$1"; }
# The preflight's tools: ip netns works, node loads s3rver; BROKEN makes ip fail.
stand_in bin/ip '[ -e "$(dirname "$0")/../BROKEN" ] && exit 1; exit 0'
stand_in bin/node 'echo "v0-stand-in"'
stand_in bin/trainer 'exit 0'
stand_in scripts/netlab 'echo "netlab $*: PATH starts ${PATH%%:*}, LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-}."'
# governor-lab: one "round" per call, ~1 s; its verdict from the round's log directory (round 2 misses).
stand_in scripts/governor-lab 'sleep 1; echo "args: $*"; echo "prefix: $NETLAB_PREFIX"
case "$*" in *governor1*) f0="every 10 steps, +1.5% over none" ;; *) f0="none of 5,10" ;; esac
echo "| round | run | step_ms |"; echo "| 1 | none | 260.00 |"
echo "Round 1, the smallest N measured to keep up (no save began before the one before had committed): off: every 5 steps, +4.0% over none; on floor0: $f0; on floor5: every 5 steps, +3.5% over none."'
stand_in scripts/fsdp-bench 'echo "coretype $OPENBLAS_CORETYPE"; sleep 60'
stand_in bin/shardkit-plan 'exit 0'
# plan-validate: its arguments as its table, in its --out file.
stand_in scripts/plan-validate 'args="$*"; while [ $# -gt 0 ]; do [ "$1" = --out ] && out=$2; shift; done
echo "| turn table: $args; $OPENBLAS_CORETYPE $NETLAB_PREFIX |" >"$out"'
echo abc1234 >"$b/COMMIT"
echo Release >"$b/BUILD_TYPE"
tar -C "$work/stage" -cf - host-bench | xz -1 >"$work/bundle.tar.xz"

# 1. A budget of 16 s, steps cut at 3 s: fsdp-bench (60 s) times out, then rounds while one more fits.
status=0
t0=$(date +%s)
HOST_BENCH_STEP_LIMIT_S=3 bash "$src/scripts/host-bench" run --bundle "$work/bundle.tar.xz" --budget 16 \
  --out-dir "$work/out" >"$work/run.txt" 2>&1 || status=$?
secs=$(($(date +%s) - t0))
[ "$status" -eq 1 ] || { cat "$work/run.txt"; fail "run exited $status, not 1 (fsdp timed out)"; }
[ "$secs" -le 26 ] || fail "run took $secs s on a budget of 16"
row() { grep "^| $1 |" "$work/out/summary.md" || { cat "$work/run.txt"; fail "no row for $1"; }; }
row preflight | grep -q "| ran |" || fail "preflight: $(row preflight)"
row link | grep -q "| ran |" || fail "link: $(row link)"
row governor1 | grep -q "| ran |" || fail "governor1: $(row governor1)"
row fsdp | grep -q "| \*\*timed out\*\* after 3 s |" || fail "fsdp: $(row fsdp)"
row governor2 | grep -q "| ran |" || fail "governor2: $(row governor2)"
grep -q "governor1: on floor0: every 10 steps, +1.5% over none: \*\*met\*\*" "$work/out/summary.md" || fail "round 1's floor-0 verdict"
grep -q "governor1: on floor5: every 5 steps, +3.5% over none: \*\*missed\*\*" "$work/out/summary.md" || fail "round 1's floor-5 verdict"
grep -q "governor2: on floor0: none of 5,10: kept up at none" "$work/out/summary.md" || fail "round 2's floor-0 verdict"
grep -q "governor2: on floor5: every 5 steps, +3.5% over none: \*\*missed\*\*" "$work/out/summary.md" || fail "round 2's floor-5 verdict"
grep -q -- "--every 5,10 --floor 0,5" "$work/out/governor1.log" || fail "governor-lab was not asked for floors 0 and 5: $(head -1 "$work/out/governor1.log")"
grep -q "coretype SkylakeX" "$work/out/fsdp.log" || fail "fsdp-bench ran without OPENBLAS_CORETYPE=SkylakeX"
grep -q -- "--trainer .*/host-bench/bin/trainer --s3rver .*/host-bench/s3rver/node_modules/s3rver" "$work/out/governor1.log" ||
  fail "governor-lab was not given the bundle's trainer and s3rver: $(head -1 "$work/out/governor1.log")"
grep -q "prefix: hbgov" "$work/out/governor1.log" || fail "governor-lab ran on the default lab prefix"
grep -q "PATH starts .*/host-bench/bin, LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-}\.$" "$work/out/link.log" ||
  fail "the steps do not see the bundle first: $(cat "$work/out/link.log")"
grep -q "^| round | run | step_ms |" "$work/run.txt" || fail "the governor's table is not printed"
! grep -q "^| turn" "$work/out/summary.md" || fail "a turn step ran without --only turn"

# 2. --only turn: the four rounds, and then the end. The stand-ins return at once, so the run takes a few seconds;
# the whole budget means it went on asking for governor rounds that --only leaves out (as it once did).
t0=$(date +%s)
bash "$src/scripts/host-bench" run --bundle "$work/bundle.tar.xz" --only turn --budget 60 --out-dir "$work/turn" \
  >"$work/turn.txt" 2>&1 || { cat "$work/turn.txt"; fail "--only turn failed"; }
secs=$(($(date +%s) - t0))
[ "$secs" -le 30 ] || fail "--only turn took $secs s of its 60 s budget for four stand-in rounds"
t=0
for k in on off off on; do
  t=$((t + 1))
  grep -q "^| turn$t | ran |" "$work/turn/summary.md" || { cat "$work/turn.txt"; fail "no turn$t row"; }
  grep -q -- "--trainer .*/host-bench/bin/trainer --plan .*/host-bench/bin/shardkit-plan --hosts 4 --rates 2gbit .*--early-backward $k; SkylakeX hbturn |" \
    "$work/turn/turn$t-$k.md" || fail "turn$t: $(cat "$work/turn/turn$t-$k.md")"
done
grep -q "^| turn table: .*--early-backward off" "$work/turn.txt" || fail "the turn tables are not printed"

# 3. No network namespaces: the preflight says so and nothing else runs.
touch "$b/BROKEN"
tar -C "$work/stage" -cf - host-bench | xz -1 >"$work/broken.tar.xz"
status=0
bash "$src/scripts/host-bench" run --bundle "$work/broken.tar.xz" --budget 20 --out-dir "$work/broken" \
  >"$work/broken.txt" 2>&1 || status=$?
[ "$status" -eq 3 ] || { cat "$work/broken.txt"; fail "a failed preflight exited $status, not 3"; }
grep -q "network namespaces: no" "$work/broken.txt" || fail "the preflight did not say why"
[ ! -e "$work/broken/governor1.log" ] || fail "governor-lab ran after a failed preflight"
echo "host-bench: stand-in bundle: steps time-boxed, rounds within the budget, verdicts, preflight gate"
