#!/usr/bin/env bash
# Small collectives (8 B to 32 KiB) on CUDA buffers staged through pinned memory against the same ranks on host
# buffers, in one run: where the staged path's fixed cost per collective comes from. The first GPU check measured
# about 0.5 ms staged against 20 us on host buffers below 32 KiB (4 ranks as processes over shm, one H200).
# Five ways, each shardkit-bench's mean time per collective over ITERS runs (bitwise checked by the bench):
#   host 4p    4 ranks as processes over shm, host buffers            (the baseline)
#   staged 4p  the same on CUDA buffers: 4 processes, 4 CUDA contexts sharing the GPU
#   staged 1p  one rank on CUDA buffers: the copies and waits alone, no other context
#   host 4t    4 ranks as threads of one process over loopback, host buffers
#   staged 4t  the same on CUDA buffers: 4 ranks, one CUDA context
# Reading it: staged 1p near host 4p and staged 4t near host 4t, but staged 4p far above, puts the cost between
# CUDA contexts (the GPU time-slicing processes; MPS or ranks as threads avoid it), not in the adapter.
# STAGED_LATENCY_MPS=1 adds "staged 4p MPS" under an MPS daemon of its own (pipe and log folders in a temporary
# directory; only where nvidia-cuda-mps-control is on PATH, and stopped afterwards).
# With SHARDKIT_MODEL_CUDA_DEVICES set (the host twin: shardkit_bench_model) a few iterations only: the wiring.
#   staged_latency.sh BENCH SHARDKIT_RUN
set -uo pipefail
bench=$1 run=$2
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
iters=${STAGED_LATENCY_ITERS:-200} warm=20
[ -n "${SHARDKIT_MODEL_CUDA_DEVICES:-}" ] && iters=3 warm=1
cases=(--collective "all_reduce,all_gather,reduce_scatter" -b 8 -e 32K -f 8 --iters "$iters" --warmup_iters "$warm")
fail() { echo "FAIL: $*"; exit 1; }

# variant NAME COMMAND...: the bench's rows in NAME.txt (collective size time_us), or the step fails.
variants=()
variant() {
  local name=$1
  shift
  "$@" >"$work/$name.log" 2>&1
  local status=$?
  if grep -qE -- '--device cuda: no (usable )?CUDA device' "$work/$name.log"; then
    echo "[cuda] skipped: $(grep -ohE -- '--device cuda: no (usable )?CUDA device.*' "$work/$name.log" | head -1)"
    exit 0
  fi
  [ "$status" = 0 ] || { cat "$work/$name.log"; fail "$name exited $status"; }
  grep -q '# 0 wrong elements' "$work/$name.log" || { cat "$work/$name.log"; fail "$name: wrong elements"; }
  sed 's/^\[rank [0-9]*\] //' "$work/$name.log" | awk '$1 ~ /^[0-9]+$/ && NF >= 6 { print $5, $1, $6 }' >"$work/$name.txt"
  [ -s "$work/$name.txt" ] || { cat "$work/$name.log"; fail "$name printed no rows"; }
  variants+=("$name")
}

variant "host 4p" "$run" -n 4 -- "$bench" --transport shm "${cases[@]}"
variant "staged 4p" "$run" -n 4 -- "$bench" --transport shm --device cuda "${cases[@]}"
variant "staged 1p" "$run" -n 1 -- "$bench" --transport shm --device cuda "${cases[@]}"
variant "host 4t" "$bench" --threads 4 "${cases[@]}"
variant "staged 4t" "$bench" --threads 4 --device cuda "${cases[@]}"
if [ "${STAGED_LATENCY_MPS:-0}" = 1 ]; then
  if command -v nvidia-cuda-mps-control >/dev/null; then
    export CUDA_MPS_PIPE_DIRECTORY="$work/mps-pipe" CUDA_MPS_LOG_DIRECTORY="$work/mps-log"
    mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
    if nvidia-cuda-mps-control -d; then
      variant "staged 4p MPS" "$run" -n 4 -- "$bench" --transport shm --device cuda "${cases[@]}"
      echo quit | nvidia-cuda-mps-control
    else
      echo "   MPS: nvidia-cuda-mps-control -d failed; no MPS row"
    fi
    unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
  else
    echo "   MPS: nvidia-cuda-mps-control not found; no MPS row"
  fi
fi

# One table per collective: bytes down, variants across, mean us per collective.
echo "staged against host buffers, mean us per collective over $iters runs after $warm ($(basename "$bench"))"
for op in all_reduce all_gather reduce_scatter; do
  echo
  header="| $op bytes |" rule="|---:|"
  for v in "${variants[@]}"; do header+=" $v |" rule+="---:|"; done
  echo "$header"
  echo "$rule"
  for size in $(awk -v op="$op" '$1 == op { print $2 }' "$work/host 4p.txt"); do
    line="| $size |"
    for v in "${variants[@]}"; do
      line+=" $(awk -v op="$op" -v s="$size" '$1 == op && $2 == s { print $3 }' "$work/$v.txt") |"
    done
    echo "$line"
  done
done
echo
echo "OK: staged and host latencies measured"
