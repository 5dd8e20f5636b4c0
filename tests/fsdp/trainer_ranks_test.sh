#!/usr/bin/env bash
# The example trainer on N ranks (processes, shardkit-run, shm) trains the same model on the same data as on 1 rank:
# every step's loss agrees within 1e-5 relative. Extra arguments (strategy, micro-batches, budget) go to the N-rank
# run only: on 1 rank every strategy computes the same thing. The N-rank run's CPU by thread names the library's
# threads (sk-shm-0, sk-fsdp-gather, sk-fsdp-reduce).
# usage: trainer_ranks_test.sh SHARDKIT_RUN TRAINER N [trainer flags...]
set -euo pipefail
run=$1 trainer=$2 n=$3
shift 3
flags=(--steps 6 --batch 12 --context 16 --width 32 --blocks 6)
export OPENBLAS_NUM_THREADS=1
full=$("$run" -n 1 -- "$trainer" "${flags[@]}")
one=$(grep -o 'step [0-9]* loss [^ ]*' <<<"$full")
# The trainer says which BLAS kernels it runs (a VM's generic CPU gets OpenBLAS's slow ones).
grep -qE '^\[rank 0\] # blas: OpenBLAS, [A-Za-z0-9]+ kernels \((detected|OPENBLAS_CORETYPE=.*)\), 1 thread\(s\)$' <<<"$full" ||
  { echo "no '# blas:' line naming OpenBLAS's kernels:"; grep -n blas <<<"$full"; exit 1; }
trace=$(mktemp -d)
trap 'rm -rf "$trace"' EXIT
many_full=$("$run" -n "$n" -- "$trainer" "${flags[@]}" --trace "$trace/t" "$@")
many=$(grep -o 'step [0-9]* loss [^ ]*' <<<"$many_full")
# The run's CPU by thread names the library's threads by what they do (core/thread_options.hpp), beside the
# trainer's own: the shm transport's progress thread (rank 0's), the model's gather and reduce threads.
cpu=$(grep '# CPU on rank 0 by thread' <<<"$many_full") || { echo "FAIL: no '# CPU on rank 0 by thread' line"; exit 1; }
for name in trainer sk-shm-0 sk-fsdp-gather sk-fsdp-reduce; do
  grep -qE "[:,] $name [0-9]+" <<<"$cpu" || { echo "FAIL: thread $name not in: $cpu"; exit 1; }
done
echo "1 rank:"; echo "$one"
echo "$n ranks:"; echo "$many"
[ "$(echo "$one" | wc -l)" = 6 ] || { echo "FAIL: expected 6 steps from the 1-rank run"; exit 1; }
paste <(echo "$one") <(echo "$many") | awk '
  { a = $4; b = $8; d = a - b; if (d < 0) d = -d; if (a < 0) a = -a
    if ($2 != $6 || d > 1e-5 * a) { printf "FAIL: step %s loss %s on 1 rank, %s on many\n", $2, $4, $8; bad = 1 } }
  END { if (NR != 6) { print "FAIL: the runs printed different numbers of steps"; bad = 1 }; exit bad }'
echo "OK: losses agree within 1e-5"
# --trace: one Chrome trace per rank, with every step and the units' gathers and uses on it.
for ((r = 0; r < n; r++)); do
  f=$trace/t.rank$r.json
  [ -f "$f" ] || { echo "FAIL: --trace wrote no $f"; exit 1; }
  steps=$(grep -c '"cat":"step"' "$f"); uses=$(grep -c '"cat":"use"' "$f")
  # 8 units, used in forward and in backward, every micro-batch of every step
  [ "$steps" = 6 ] && ((uses > 0 && uses % (6 * 2 * 8) == 0)) ||
    { echo "FAIL: $f has $steps steps and $uses unit uses (want 6, and 96 per micro-batch)"; exit 1; }
  if command -v python3 >/dev/null; then python3 -c 'import json, sys; json.load(open(sys.argv[1]))' "$f" || { echo "FAIL: $f is not JSON"; exit 1; }; fi
done
echo "OK: --trace wrote $n timelines"
