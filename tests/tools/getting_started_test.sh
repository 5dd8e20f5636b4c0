#!/usr/bin/env bash
# docs/getting-started.md's trainer: the doc's code block is examples/getting_started.cpp, verbatim, and it runs:
# two steps on 1 rank with a checkpoint after each, then a second run resumes from step 2 and trains a third; a
# resume with nothing left to train warns; a second run into a live run's location is refused before step 0.
# usage: getting_started_test.sh SHARDKIT_RUN SHARDKIT_TOKENIZE GETTING_STARTED SOURCE_DIR
set -euo pipefail
run=$1 tokenize=$2 example=$3 src=$4
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# The first ```cpp block after the line that names the file.
awk '/examples\/getting_started\.cpp/ { named = 1 } named && /^```cpp$/ { inside = 1; next } inside && /^```$/ { exit }
     inside { print }' "$src/docs/getting-started.md" >"$work/doc.cpp"
diff -u "$src/examples/getting_started.cpp" "$work/doc.cpp" ||
  { echo "FAIL: docs/getting-started.md's code block differs from examples/getting_started.cpp (above)"; exit 1; }
echo "the doc's code block is examples/getting_started.cpp"

mkdir "$work/data"
"$tokenize" --split paragraph -o "$work/data/text.tokens" "$src/README.md" "$src/docs/fsdp.md" >/dev/null
"$run" -n 1 -- "$example" "$work/data" "$work/ckpt" 2 1 | tee "$work/first.txt"
grep -q '^\[rank 0\] step 1 loss' "$work/first.txt" || { echo "FAIL: no step 1"; exit 1; }
"$run" -n 1 -- "$example" "$work/data" "$work/ckpt" 3 1 | tee "$work/second.txt"
grep -q '^\[rank 0\] resumed from step 2$' "$work/second.txt" || { echo "FAIL: not resumed from step 2"; exit 1; }
[ "$(grep -c ' loss ' "$work/second.txt")" = 1 ] && grep -q '^\[rank 0\] step 2 loss' "$work/second.txt" ||
  { echo "FAIL: the resumed run should train step 2 alone"; exit 1; }
# A zero model predicts uniformly: ln 257 = 5.549; AdamW's steps bring the loss down.
awk '$3 == "step" { loss[$4] = $6 } END { if (!(loss[0] > 5.5 && loss[0] < 5.6 && loss[2] < loss[0])) {
       printf "FAIL: losses %s, %s, %s\n", loss[0], loss[1], loss[2]; exit 1 } }' "$work/first.txt" "$work/second.txt"
ls "$work/ckpt" | grep -q . || { echo "FAIL: no checkpoint written"; exit 1; }
# Resumed with STEPS not past the checkpoint's step: a warning that nothing is trained, exit status 0.
"$run" -n 1 -- "$example" "$work/data" "$work/ckpt" 2 1 >"$work/none.txt" 2>&1 ||
  { echo "FAIL: STEPS 2 on a step-3 checkpoint failed:"; cat "$work/none.txt"; exit 1; }
grep -q "warning: the checkpoint is at step 3, not before STEPS 2: nothing to train" "$work/none.txt" &&
  ! grep -q ' loss ' "$work/none.txt" || { echo "FAIL: STEPS 2 on a step-3 checkpoint: no warning:"; cat "$work/none.txt"; exit 1; }
# A second run into a live run's location is refused before its step 0, naming the holder's pid (it used to train
# until its first save and be refused there).
"$run" -n 1 -- "$example" "$work/data" "$work/ckpt-live" 1000000 1000000 >"$work/live.txt" 2>&1 &
live=$!
for _ in $(seq 100); do [ -f "$work/ckpt-live/lease.json" ] && break; sleep 0.1; done
holder=$(grep -o '"pid": *[0-9]*' "$work/ckpt-live/lease.json" 2>/dev/null | grep -o '[0-9]*$' || echo none)
if "$run" -n 1 -- "$example" "$work/data" "$work/ckpt-live" 3 1 >"$work/second-live.txt" 2>&1; then
  kill "$live"; echo "FAIL: a second run into a live run's location was not refused"; exit 1
fi
kill "$live"; wait "$live" || true
grep -q "is held by run .*pid $holder" "$work/second-live.txt" && ! grep -q ' loss ' "$work/second-live.txt" ||
  { echo "FAIL: the second run trained, or did not name the live run's pid $holder:"; cat "$work/second-live.txt"; exit 1; }
# STEPS and SAVE_EVERY that are not whole numbers from 1 are named, before any rank starts work.
for bad in "abc 1" "3 0" "3x 1"; do
  if "$run" -n 1 -- "$example" "$work/data" "$work/ckpt" $bad >"$work/bad.txt" 2>&1; then
    echo "FAIL: STEPS SAVE_EVERY = $bad was taken"; exit 1
  fi
  grep -qE "(STEPS|SAVE_EVERY) wants a whole number from 1, got '(abc|0|3x)'" "$work/bad.txt" ||
    { echo "FAIL: STEPS SAVE_EVERY = $bad: not named"; cat "$work/bad.txt"; exit 1; }
done
# A checkpoint location's errors name it (they said "the sink's root"): here every index of a copy is damaged.
cp -r "$work/ckpt" "$work/ckpt-bad"
for f in "$work"/ckpt-bad/*/index.json; do echo garbage >"$f"; done
if "$run" -n 1 -- "$example" "$work/data" "$work/ckpt-bad" 3 1 >"$work/bad.txt" 2>&1; then echo "FAIL: damaged indexes loaded"; exit 1; fi
grep -q "no complete checkpoint under '$work/ckpt-bad' loads" "$work/bad.txt" ||
  { echo "FAIL: the damaged location is not named:"; cat "$work/bad.txt"; exit 1; }
# By hand, as torchrun's variables start it (no launcher to stop the others): rank 1 refuses its STEPS, and rank 0,
# waiting for it to join, fails at once naming it and why; it waited its whole SHARDKIT_STORE_TIMEOUT (5 min).
source "$src/scripts/lib/free_port.sh"
port=$(shardkit_free_port)
hand() { env -u SHARDKIT_AUTH_TOKEN -u LOCAL_RANK -u LOCAL_WORLD_SIZE SHARDKIT_STORE_TIMEOUT=30 RANK=$1 WORLD_SIZE=2 \
           MASTER_ADDR=127.0.0.1 MASTER_PORT=$port "$example" "$work/data" "$work/ckpt-hand" "$2" 1; }
t0=$SECONDS
hand 0 3 >"$work/hand0.txt" 2>&1 &
rank0=$!
for _ in $(seq 100); do (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null && break; sleep 0.1; done  # its store is up
if hand 1 3x >"$work/hand1.txt" 2>&1; then echo "FAIL: rank 1 took STEPS 3x"; exit 1; fi
if wait "$rank0"; then echo "FAIL: rank 0 trained without rank 1"; exit 1; fi
grep -q "rank 1 gives up: getting_started: STEPS wants a whole number from 1, got '3x'" "$work/hand0.txt" &&
  ((SECONDS - t0 < 20)) || { echo "FAIL: rank 0 did not name rank 1's refusal at once ($((SECONDS - t0)) s):"; cat "$work/hand0.txt"; exit 1; }
echo "OK: rank 0 named rank 1's refused STEPS in $((SECONDS - t0)) s"
echo "OK: the getting-started trainer runs, checkpoints and resumes"
