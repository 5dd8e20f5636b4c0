#!/usr/bin/env bash
# shardkit-bench on CUDA buffers, linked against the host-memory model of CUDA and NCCL (two model devices):
# --transport nccl with ranks as threads, --device cuda staged over loopback (--threads) and over shm (processes
# sharing one device), each checked bitwise by the bench itself (a wrong element fails it); the table has
# nccl-tests' columns; options that cannot apply are refused; NCCL ranks without a GPU of their own fail at once.
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

# NCCL takes one rank per GPU: two ranks on the one model device, as threads and as processes (LOCAL_RANK 1 of a
# one-device host), fail every rank at once, each saying which rank and GPU and what to do (the model's NCCL
# used to accept the threads, and rank 0 of the processes waited for init_timeout, 5 minutes).
advice="NCCL takes one rank per GPU.*--transport shm --device cuda"
if SHARDKIT_MODEL_CUDA_DEVICES=1 timeout 60 "$bench" --transport nccl --threads 2 -b 8 -e 8 >"$out/dup.txt" 2>&1; then
  fail "two nccl ranks on one model device passed"
fi
for r in 0 1; do
  grep -E "\[rank $r\] .*ranks 0 and 1 both use the GPU at PCI bus .*$advice" "$out/dup.txt" >/dev/null ||
    { cat "$out/dup.txt"; fail "rank $r of two threads on one device does not say so"; }
done
nccl_procs() {  # nccl_procs DEVICES: two processes of --transport nccl, their output in nccl_proc<r>.txt
  port=$(shardkit_free_port)
  pids=()
  for r in 0 1; do
    MASTER_ADDR=127.0.0.1 MASTER_PORT=$port RANK=$r WORLD_SIZE=2 LOCAL_RANK=$r LOCAL_WORLD_SIZE=2 SHARDKIT_MODEL_CUDA_DEVICES=$1 \
      timeout 60 "$bench" --transport nccl -b 8 -e 8 >"$out/nccl_proc$r.txt" 2>&1 &
    pids+=($!)
  done
}
nccl_procs 1
for r in 0 1; do
  wait "${pids[$r]}" && fail "rank $r of two nccl processes on one model device passed"
  [ $? != 124 ] || fail "rank $r of two nccl processes on one model device waited 60 s"
done
grep -E "\[rank 1\] .*cuda:1 is not a CUDA device of this process: it sees 1 device \(cuda:0\), LOCAL_RANK='1'; $advice" \
  "$out/nccl_proc1.txt" >/dev/null || { cat "$out"/nccl_proc*.txt; fail "rank 1 without a device does not say so"; }
grep -E "\[rank 0\] .*rank 1 has no GPU for NCCL: cuda:1 is not a CUDA device" "$out/nccl_proc0.txt" >/dev/null ||
  { cat "$out"/nccl_proc*.txt; fail "rank 0 does not say that rank 1 has no device"; }
# The model's NCCL spans the threads of one process: ranks as processes fail at once (rank 1, which rank 0's unique
# id reaches; rank 0, waiting in NCCL's init, is stopped as shardkit-run stops the others) rather than hang.
nccl_procs 2
wait "${pids[1]}" && fail "nccl processes on the model passed"
grep -q "the model's NCCL spans threads of one process" "$out/nccl_proc1.txt" ||
  { cat "$out/nccl_proc1.txt"; fail "ranks as processes on the model's NCCL: no clear error"; }
kill "${pids[0]}" 2>/dev/null || true
wait "${pids[0]}" || true

# Refused where they cannot apply, with one line saying why.
for bad in "--transport nccl --device host" "--device cuda --shared-buffers --threads 2" "--device cuda --transport auto" \
           "--device gpu"; do
  # shellcheck disable=SC2086
  if "$bench" $bad >"$out/bad.txt" 2>&1; then fail "accepted: $bad"; fi
  [ "$(wc -l <"$out/bad.txt")" -eq 1 ] || { cat "$out/bad.txt"; fail "more than one line for: $bad"; }
done
echo "shardkit-bench on the CUDA/NCCL model: nccl, staged loopback and staged shm passed"
