#!/usr/bin/env bash
# The example trainer checkpoints asynchronously and resumes exactly: a 4-rank run whose rank 1 is killed (SIGKILL)
# mid-run, resumed on 4 ranks, prints the same losses, to the last digit, as an uninterrupted run; resumed again on
# 2 ranks (a rescale, the data loader's state redistributed) it continues training from where it was.
# usage: trainer_resume_test.sh SHARDKIT_RUN TRAINER
set -euo pipefail
run=$1 trainer=$2
source "$(dirname "${BASH_SOURCE[0]}")/../../scripts/lib/free_port.sh"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cd "$work"
export OPENBLAS_NUM_THREADS=1
flags=(--batch 12 --context 16 --width 32 --blocks 4 --data "$work/data" --init-data)
losses() { grep -o 'step [0-9]* loss [^ ]*' || true; }

"$run" -n 4 -- "$trainer" --steps 10 "${flags[@]}" | losses > reference.txt
echo "uninterrupted:"; cat reference.txt
[ "$(wc -l < reference.txt)" = 10 ] || { echo "FAIL: the reference run printed $(wc -l < reference.txt) steps, not 10"; exit 1; }

if "$run" -n 4 -- "$trainer" --steps 10 "${flags[@]}" --ckpt-dir "$work/ckpt" --ckpt-every 2 --die-at-step 7 --die-rank 1 \
    > killed.txt 2>&1; then
  echo "FAIL: the run whose rank 1 was killed succeeded"; cat killed.txt; exit 1
fi
# shardkit-run names the rank killed by a signal as the cause, even where a survivor failing on its loss was reaped
# first.
grep -q "shardkit-run: rank 1 was killed by signal 9" killed.txt || { echo "FAIL: rank 1 was not named as killed"; cat killed.txt; exit 1; }

"$run" -n 4 -- "$trainer" --steps 10 "${flags[@]}" --ckpt-dir "$work/ckpt" --ckpt-every 2 --resume > resumed.txt
grep -o 'resumed from step [0-9]*' resumed.txt || { echo "FAIL: nothing to resume from"; cat resumed.txt; exit 1; }
losses < resumed.txt > resumed_losses.txt
echo "resumed on 4 ranks:"; cat resumed_losses.txt
first=$(head -1 resumed_losses.txt | awk '{print $2}')
[ "$first" -ge 2 ] && [ "$first" -le 7 ] || { echo "FAIL: resumed at step $first, not within [2, 7]"; exit 1; }
# Same steps, same losses, bit for bit (%.9g): parameters, AdamW moments and step count, and the data stream.
diff <(awk -v f="$first" '$2 >= f' reference.txt) resumed_losses.txt || { echo "FAIL: the resumed losses differ"; exit 1; }

"$run" -n 2 -- "$trainer" --steps 14 "${flags[@]}" --ckpt-dir "$work/ckpt" --ckpt-every 2 --ckpt-mode at-call --resume \
  > rescaled.txt
grep -q 'resumed from step 10 of .* (saved by 4 ranks, loaded by 2)' rescaled.txt || { echo "FAIL: no rescaled resume"; cat rescaled.txt; exit 1; }
losses < rescaled.txt > rescaled_losses.txt
echo "resumed on 2 ranks:"; cat rescaled_losses.txt
# It goes on from the trained state: the first rescaled loss is near the last one, far below the initial one.
awk -v last="$(tail -1 reference.txt | awk '{print $4}')" -v initial="$(head -1 reference.txt | awk '{print $4}')" '
  NR == 1 { if ($2 != 10 || $4 > last * 1.1 || $4 > initial * 0.95) { printf "FAIL: step %s loss %s after step 9 loss %s (initial %s)\n", $2, $4, last, initial; exit 1 } }
  END { if (NR != 4) { print "FAIL: expected steps 10..13"; exit 1 } }' rescaled_losses.txt
grep -q 'checkpoints: 2 of 2 committed' rescaled.txt || { echo "FAIL: the rescaled run's checkpoints"; cat rescaled.txt; exit 1; }
echo "OK: exact resume after a kill, and a rescaled resume that goes on training"

# A resume that would leave part of the checkpoint unloaded is refused, naming what: a model with fewer --blocks,
# a run without the --data whose loader state the checkpoint holds.
partial() {  # partial MESSAGE FLAGS...: the resume exits 1 and says MESSAGE
  local message=$1 status=0; shift
  "$run" -n 2 -- "$trainer" --steps 16 --batch 12 --context 16 --width 32 --ckpt-dir "$work/ckpt" --resume "$@" \
    > partial.txt 2>&1 || status=$?
  [ "$status" = 1 ] && grep -qF -- "$message" partial.txt || { echo "FAIL: resume with $* (status $status):"; cat partial.txt; exit 1; }
}
partial "a strict load of the checkpoint of step 14 refuses it: it holds 18 entries that no rank's state asks for (block3." --blocks 3 --data "$work/data"
partial "--data: the checkpoint in $work/ckpt was saved with a data loader (its run had --data): resume it with that --data" --blocks 4
echo "OK: a resume that would load part of the checkpoint is refused"

# A resume with another compute dtype (--dtype bf16 after an f32 run, no saves) loads the f32 master weights and
# AdamW state as saved and says so in one line; an f32 resume says nothing.
"$run" -n 2 -- "$trainer" --steps 15 "${flags[@]}" --ckpt-dir "$work/ckpt" --resume --dtype bf16 > bf16.txt 2>&1 ||
  { echo "FAIL: the bf16 resume failed"; cat bf16.txt; exit 1; }
grep -q '# --dtype bf16 resumes a checkpoint saved with --dtype f32: its [0-9]* tensors on rank 0 load as saved, in f32 (master weights and AdamW state: nothing converted); the parameters are gathered in bf16 from here (f32 -> bf16' bf16.txt &&
  grep -q 'step 14 loss' bf16.txt && ! grep -q -- '--reduce-dtype' bf16.txt ||
  { echo "FAIL: the bf16 resume did not say what it converts"; cat bf16.txt; exit 1; }
! grep -q -- '--dtype' rescaled.txt || { echo "FAIL: an f32 resume spoke of dtypes"; cat rescaled.txt; exit 1; }
echo "OK: a resume with another --dtype says that it converts nothing at load and computes in the new dtype"

# Every index cut short (a disk that filled up): the resume refuses to start over at step 0, which would overwrite
# the intact rank files with its own saves, and leaves every file as it was.
cp -r "$work/ckpt" "$work/bad"
for index in "$work"/bad/step-*/index.json; do truncate -s 100 "$index"; done
(cd "$work/bad" && find . -type f -exec md5sum {} + | sort) > bad_before.txt
status=0
"$run" -n 2 -- "$trainer" --steps 16 "${flags[@]}" --ckpt-dir "$work/bad" --ckpt-every 2 --resume > bad.txt 2>&1 || status=$?
[ "$status" = 1 ] && grep -q "no complete checkpoint under '$work/bad' loads: step 14: its index does not parse" bad.txt && ! grep -q 'loss' bad.txt ||
  { echo "FAIL: resume from checkpoints whose indexes are all cut short (status $status):"; cat bad.txt; exit 1; }
diff bad_before.txt <(cd "$work/bad" && find . -type f -exec md5sum {} + | sort) || { echo "FAIL: the refused resume changed files"; exit 1; }
echo "OK: a resume whose checkpoints all fail to load stops, and touches none of them"

# Checkpoint flags that cannot do what they say are refused before anything runs (status 2, the reason named).
refused() {  # refused MESSAGE FLAGS...: the trainer exits 2 and says MESSAGE
  local message=$1 status=0; shift
  "$trainer" "$@" > refused.txt 2>&1 || status=$?
  [ "$status" = 2 ] && grep -qF -- "$message" refused.txt || { echo "FAIL: $* (status $status):"; cat refused.txt; exit 1; }
}
refused "--ckpt-every wants the steps between saves, from 1 to 2147483647, got '0'" --ckpt-dir "$work/x" --ckpt-every 0
refused "--ckpt-every wants an integer from 0 to 2147483647, got '-1'" --ckpt-dir "$work/x" --ckpt-every -1
refused "--ckpt-every wants an integer from 0 to 2147483647, got 'abc'" --ckpt-dir "$work/x" --ckpt-every abc
refused "--ckpt-every wants an integer from 0 to 2147483647, got '4294967297'" --ckpt-dir "$work/x" --ckpt-every 4294967297
refused "--ckpt-every needs --ckpt-dir" --ckpt-every 2
refused "--ckpt-dir needs --ckpt-every N" --ckpt-dir "$work/x"
[ ! -e "$work/x" ] || { echo "FAIL: a refused run created its --ckpt-dir"; exit 1; }
echo "OK: checkpoint flags that cannot work are refused"

# A signal to shardkit-run (SIGTERM here; SIGINT and SIGHUP alike) is forwarded to the ranks, which stop after the
# same step, let the save in flight end and release the location's lease: nothing is left but checkpoints (no
# lease.json, no temporaries), the exit status is 128 + 15, and the next run resumes without taking a lease over.
for sig in TERM INT; do
  # The files of the previous signal's runs go first: a poll must not read their lines as this run's.
  rm -rf "$work/sig" signalled.txt after_signal.txt
  "$run" -n 2 -- "$trainer" --steps 100000 --batch 12 --context 16 --width 32 --blocks 1 --ckpt-dir "$work/sig" \
    --ckpt-every 1 > signalled.txt 2>&1 &
  launcher=$!
  # Until step 3 (the ranks' handlers are installed by then), at most 60 s: under load a Debug start is slow, and a
  # signal before the handlers would kill the ranks outright.
  for _ in $(seq 3000); do grep -qs '^\[rank 0\] step 3 ' signalled.txt && break; sleep 0.02; done
  grep -qs '^\[rank 0\] step 3 ' signalled.txt ||
    { echo "FAIL: the run for SIG$sig did not reach step 3 in 60 s"; cat signalled.txt; kill -KILL "$launcher"; exit 1; }
  kill -"$sig" "$launcher"
  status=0; wait "$launcher" || status=$?
  want=$((128 + $(kill -l "$sig")))
  [ "$status" = "$want" ] && grep -q "trainer: SIG$sig: stopping after step" signalled.txt ||
    { echo "FAIL: SIG$sig to shardkit-run: status $status (want $want)"; cat signalled.txt; exit 1; }
  left=$(cd "$work/sig" && find . -name lease.json -o -name '.shardkit-tmp*')
  [ -z "$left" ] || { echo "FAIL: SIG$sig left $left"; ls -laR "$work/sig"; cat signalled.txt; exit 1; }
  "$run" -n 2 -- "$trainer" --steps 200000 --batch 12 --context 16 --width 32 --blocks 1 --ckpt-dir "$work/sig" \
    --ckpt-every 1 --resume > after_signal.txt 2>&1 &
  launcher=$!
  for _ in $(seq 3000); do grep -qs '^\[rank 0\] step ' after_signal.txt && break; sleep 0.02; done
  kill -TERM "$launcher"; wait "$launcher" || true
  grep -q 'resumed from step' after_signal.txt && ! grep -q 'taking over the stale lease' after_signal.txt ||
    { echo "FAIL: the run after SIG$sig:"; cat after_signal.txt; exit 1; }
done
echo "OK: a signal to shardkit-run stops the ranks after a step, leaving no lease and no temporaries"

# Ranks started by hand (no launcher to forward it), SIGINT to rank 0 alone: both stop after the same step with
# 130, and rank 1, which got nothing, says why it stops.
port=$(shardkit_free_port)
for r in 0 1; do
  env -u LOCAL_RANK -u LOCAL_WORLD_SIZE RANK=$r WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=$port \
    "$trainer" --steps 100000 --batch 12 --context 16 --width 32 --blocks 1 > "by_hand.$r.txt" 2>&1 &
  eval "pid$r=\$!"
done
for _ in $(seq 3000); do grep -qs '^step 3 ' by_hand.0.txt && break; sleep 0.02; done
kill -INT "$pid0"
status0=0; wait "$pid0" || status0=$?
status1=0; wait "$pid1" || status1=$?
[ "$status0" = 130 ] && [ "$status1" = 130 ] && grep -q "trainer: SIGINT: stopping after step" by_hand.0.txt &&
  grep -q "trainer: rank 1: another rank got SIGINT: stopping with it after step" by_hand.1.txt ||
  { echo "FAIL: SIGINT to rank 0 of 2 started by hand: status $status0/$status1"; tail -3 by_hand.0.txt by_hand.1.txt; exit 1; }
echo "OK: ranks started by hand: a signal to one stops both, and the other says why"
