#!/usr/bin/env bash
# The example trainer on the GPU (--device cuda): every step's loss within 1e-4 relative of the CPU run's over 20
# steps; 1, 2 and 4 ranks sharing the GPU (staged over shm) within 1e-5 of each other; a run checkpointed on 4 ranks
# and resumed on 2 within 1e-5 of the uninterrupted run; the "# blas:" line names cuBLAS. Without a usable GPU it
# checks that --device cuda fails at once, in one line (alone and under shardkit-run -n 2), and prints
# "[cuda] skipped: <reason>". Run by ctest (trainer_cuda) and by scripts/gpu-check (step trainer_cuda).
# TRAINER_CUDA_TEST_TWIN=1: TRAINER is the host twin (trainer_cuda_model, ctest trainer_cuda_model, with
# SHARDKIT_MODEL_CUDA_DEVICES=1): 6 steps and a smaller model (a cheap test), its "# blas:" line names the twin,
# and its losses must equal the CPU run's to the last printed digit (OpenBLAS for cuBLAS, the same kernels' code).
# usage: trainer_cuda_test.sh TRAINER SHARDKIT_RUN
set -uo pipefail
trainer=$1 run=$2
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
export OPENBLAS_NUM_THREADS=1
fail() { echo "FAIL: $*"; exit 1; }

# A device given as an ordinal: one line saying how a rank's GPU is chosen and that CUDA_VISIBLE_DEVICES picks them.
for bad in cuda:1 gpu; do
  "$trainer" --device "$bad" --steps 1 >"$work/bad.out" 2>"$work/bad.err" && fail "--device $bad accepted"
  grep -q "cuda:(LOCAL_RANK mod the GPUs it sees), and CUDA_VISIBLE_DEVICES picks" "$work/bad.err" ||
    { cat "$work/bad.err"; fail "--device $bad does not say how a rank's GPU is chosen"; }
done

# No GPU: one line, at once, exit 1; under the launcher too (no rank left waiting for the others).
t0=$(date +%s%N)
"$trainer" --device cuda --steps 1 --batch 2 --context 8 --width 16 --blocks 1 >"$work/probe.out" 2>"$work/probe.err"
status=$?
ms=$((($(date +%s%N) - t0) / 1000000))
if grep -q -- '--device cuda: no usable CUDA device' "$work/probe.err"; then
  [ "$status" = 1 ] || fail "exit status $status without a GPU, not 1"
  [ "$(wc -l <"$work/probe.err")" = 1 ] || { cat "$work/probe.err"; fail "the error is not one line"; }
  [ "$ms" -lt 10000 ] || fail "--device cuda took $ms ms to fail without a GPU"
  timeout 30 "$run" -n 2 -- "$trainer" --device cuda --steps 1 --batch 2 --context 8 --width 16 --blocks 1 >"$work/ranks.out" 2>&1
  status=$?
  [ "$status" != 124 ] || fail "shardkit-run -n 2 -- trainer --device cuda hung without a GPU"
  [ "$status" != 0 ] || fail "shardkit-run -n 2 -- trainer --device cuda succeeded without a GPU"
  grep -q -- '--device cuda: no usable CUDA device' "$work/ranks.out" || { cat "$work/ranks.out"; fail "no error under shardkit-run"; }
  echo "OK: --device cuda fails in $ms ms, in one line: $(cat "$work/probe.err")"
  echo "[cuda] skipped: $(sed 's/^trainer: //' "$work/probe.err")"
  exit 0
fi
# A device: the probe got past the check (and stopped at the launcher variables it lacks); the runs below launch.

twin=${TRAINER_CUDA_TEST_TWIN:-0}
steps=20 half=10 gpu_tolerance=1e-4 blas='cuBLAS [0-9.]+ \(libcublas\.so\.[0-9]+\) on cuda:0'
flags=(--batch 16 --context 32 --width 64 --blocks 2)
if [ "$twin" = 1 ]; then
  steps=6 half=3 gpu_tolerance=0 blas='OpenBLAS for cuBLAS on model device cuda:0'
  flags=(--batch 8 --context 16 --width 32 --blocks 2)
fi
losses() { grep -o 'step [0-9]* loss [^ ]*' || true; }
# same FILE_A FILE_B TOLERANCE WHAT: the same steps, losses within TOLERANCE relative
same() {
  [ -s "$1" ] && [ "$(wc -l <"$1")" = "$(wc -l <"$2")" ] || fail "$4: $(wc -l <"$1") steps against $(wc -l <"$2")"
  paste "$1" "$2" | awk -v tol="$3" -v what="$4" '
    { a = $4; b = $8; d = a - b; if (d < 0) d = -d; if (a < 0) a = -a; if (d > worst * a) worst = d / a
      if ($2 != $6 || d > tol * a) { printf "FAIL: %s: step %s loss %s against %s\n", what, $2, $4, $8; bad = 1 } }
    END { if (!bad) printf "OK: %s: %d steps within %s relative (largest %.2e)\n", what, NR, tol, worst; exit bad }' ||
    exit 1
}
trainer_run() {  # trainer_run NAME RANKS FLAGS...: the log in NAME.log, the losses in NAME.txt (--steps $steps unless given)
  local name=$1 n=$2 default_steps=(--steps "$steps")
  shift 2
  [[ " $* " == *" --steps "* ]] && default_steps=()  # the trainer refuses a flag given twice
  "$run" -n "$n" -- "$trainer" "${flags[@]}" "${default_steps[@]}" "$@" >"$work/$name.log" 2>&1 || { cat "$work/$name.log"; fail "$name"; }
  losses <"$work/$name.log" >"$work/$name.txt"
}

trainer_run cpu 1
trainer_run gpu1 1 --device cuda
grep -E "^\[rank 0\] # blas: $blas" "$work/gpu1.log" || { grep -n '#' "$work/gpu1.log"; fail "no '# blas: $blas' line"; }
grep -E '^\[rank 0\] # blas: OpenBLAS' "$work/cpu.log" || fail "the CPU run's '# blas:' line"
[ "$(wc -l <"$work/cpu.txt")" = "$steps" ] || fail "the CPU run printed $(wc -l <"$work/cpu.txt") steps, not $steps"
paste "$work/cpu.txt" "$work/gpu1.txt" | awk '{ print "step " $2 ": cpu " $4 " gpu " $8 }'
same "$work/gpu1.txt" "$work/cpu.txt" "$gpu_tolerance" "GPU against CPU, 1 rank"
trainer_run gpu2 2 --device cuda
trainer_run gpu4 4 --device cuda
same "$work/gpu2.txt" "$work/gpu1.txt" 1e-5 "2 ranks on one GPU against 1"
same "$work/gpu4.txt" "$work/gpu1.txt" 1e-5 "4 ranks on one GPU against 1"

# Checkpointed on 4 ranks at step 10 (pinned staging), resumed on 2 to step 20.
trainer_run saved 4 --device cuda --steps "$half" --ckpt-dir "$work/ckpt" --ckpt-every "$half"
grep -q 'checkpoints: 1 of 1 committed' "$work/saved.log" || { cat "$work/saved.log"; fail "no checkpoint committed"; }
trainer_run resumed 2 --device cuda --ckpt-dir "$work/ckpt" --ckpt-every "$half" --resume
grep -q "resumed from step $half .*(saved by 4 ranks, loaded by 2)" "$work/resumed.log" || { cat "$work/resumed.log"; fail "no resume from step $half"; }
awk -v h="$half" '$2 >= h' "$work/gpu4.txt" >"$work/gpu4_tail.txt"
same "$work/resumed.txt" "$work/gpu4_tail.txt" 1e-5 "resumed on 2 ranks against the uninterrupted 4-rank run"
grep -h "step $((steps - 1)) " "$work/cpu.log" "$work/gpu1.log" | sed 's/^/   /'
echo "OK: the trainer on the GPU"
