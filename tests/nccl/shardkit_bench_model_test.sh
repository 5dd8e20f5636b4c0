#!/usr/bin/env bash
# shardkit-bench on CUDA buffers, linked against the host-memory model of CUDA and NCCL (two model devices):
# --transport nccl with ranks as threads, --device cuda staged over loopback (--threads) and over shm (processes
# sharing one device), each checked bitwise by the bench itself (a wrong element fails it); the table has
# nccl-tests' columns; options that cannot apply are refused.
#   shardkit_bench_model_test.sh BENCH
set -euo pipefail
bench=$1
source "$(dirname "${BASH_SOURCE[0]}")/../../scripts/lib/free_port.sh"
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
fail() { echo "FAIL: $*"; exit 1; }

"$bench" --transport nccl --threads 2 --collective all -o sum,max -b 8 -e 4K -f 8 -n 2 -w 1 >"$out/nccl.txt" 2>&1 ||
  { cat "$out/nccl.txt"; fail "nccl over 2 model devices"; }
grep -q "transport nccl, .*buffers on the GPU" "$out/nccl.txt" || fail "the header does not say nccl on the GPU"
grep -qE "^# +size\(B\) +count +type +redop +collective +time\(us\) +algbw\(GB/s\) +busbw +wrong" "$out/nccl.txt" ||
  fail "not nccl-tests' columns: $(grep 'size(B)' "$out/nccl.txt")"
grep -q "^# 0 wrong elements" "$out/nccl.txt" || fail "wrong elements over nccl"
[ "$(grep -c 'all_to_all' "$out/nccl.txt")" -ge 1 ] || fail "--collective all did not reach all_to_all"

"$bench" --threads 3 --device cuda --collective all -d bf16 -b 8 -e 64K -f 16 -n 2 -w 1 >"$out/staged.txt" 2>&1 ||
  { cat "$out/staged.txt"; fail "staged loopback, 3 threads"; }
grep -q "transport loopback, staged, .*staged through pinned host memory" "$out/staged.txt" || fail "staged header"
grep -q "^# 0 wrong elements" "$out/staged.txt" || fail "wrong elements, staged loopback"

# Two processes sharing model device 0 (each process has its own model: the bytes cross shm, staged).
port=$(shardkit_free_port)
pids=()
for r in 0 1; do
  MASTER_ADDR=127.0.0.1 MASTER_PORT=$port RANK=$r WORLD_SIZE=2 LOCAL_RANK=$r LOCAL_WORLD_SIZE=2 SHARDKIT_MODEL_CUDA_DEVICES=1 \
    "$bench" --transport shm --device cuda --collective all_reduce,all_gather,reduce_scatter -b 1K -e 256K -f 16 -n 2 -w 1 \
    >"$out/shm$r.txt" 2>&1 &
  pids+=($!)
done
for p in "${pids[@]}"; do wait "$p" || { cat "$out"/shm*.txt; fail "staged shm, 2 processes on one device"; }; done
grep -q "transport shm, staged" "$out/shm0.txt" || fail "staged shm header"
grep -q "^# 0 wrong elements" "$out/shm0.txt" || fail "wrong elements, staged shm"

# Refused where they cannot apply, with one line saying why.
for bad in "--transport nccl --device host" "--device cuda --shared-buffers --threads 2" "--device cuda --transport auto" \
           "--device gpu"; do
  # shellcheck disable=SC2086
  if "$bench" $bad >"$out/bad.txt" 2>&1; then fail "accepted: $bad"; fi
  [ "$(wc -l <"$out/bad.txt")" -eq 1 ] || { cat "$out/bad.txt"; fail "more than one line for: $bad"; }
done
echo "shardkit-bench on the CUDA/NCCL model: nccl, staged loopback and staged shm passed"
