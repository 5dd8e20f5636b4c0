#!/usr/bin/env bash
# Chaos in the Ethernet lab (scripts/netlab, 3 hosts x 1 rank, TCP over 1gbit links), ranks started as a launcher
# would (tests/lab/lab_lib.sh):
#  1. kill -9 of one rank at a random point of the collective loop: every other rank fails within its timeout + 1 s
#     with an error naming the killed rank (the chaos_kill_in_collective scenario checks itself and exits 0);
#  2. a lab link set down (ip link set eth0 down in a host's namespace) mid-collective: every rank, on both sides
#     of it, fails with an error within its timeout + 1 s of the link going down, and by the failed collective's
#     own deadline (+ 400 ms of scheduling slack; nothing dies, so nothing closes a connection: timeouts).
# CHAOS_TRIALS (default 2) trials of each. Exit 77 (ctest SKIP_RETURN_CODE) with a one-line reason without root.
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../lab/lab_lib.sh"

netlab=${1:?usage: chaos_netlab.sh path/to/scripts/netlab path/to/chaos_test}
binary=${2:?usage: chaos_netlab.sh path/to/scripts/netlab path/to/chaos_test}
trials=${CHAOS_TRIALS:-2}
timeout_ms=3000
lab_up "$netlab" k 3
common=(SHARDKIT_SOCKET_IFNAME=eth0 SHARDKIT_TIMEOUT_MS=$timeout_ms CHAOS_TRANSPORT=tcp)
monotonic_ns() { python3 -c 'import time; print(time.monotonic_ns())'; }
times=() op_times=()

# collect SCENARIO: appends each survivor's time to error (ms) to times[], and the time from the failed
# collective's call to the error (its deadline is that call + the timeout) to op_times[].
collect() {
  local r line
  for r in "${!codes[@]}"; do
    line=$(grep -m1 '^CHAOS rank' "$logs/$1.$r.log") || continue
    times+=("$(sed -E 's/.* failed ([0-9.]+) ms after the kill.*/\1/' <<<"$line")")
    op_times+=("$(sed -E 's/.* ([0-9.]+) ms after the collective was called.*/\1/' <<<"$line")")
  done
}

# spread LABEL VALUES...: "LABEL min A median B max C".
spread() {
  local label=$1 sorted n
  shift
  sorted=($(printf '%s\n' "$@" | sort -g))
  n=${#sorted[@]}
  ((n > 0)) || sorted=("?")
  echo "$label min ${sorted[0]:-?} median ${sorted[$((n / 2))]:-?} max ${sorted[$((n - 1))]:-?} over $n ranks"
}

summary() {
  local label=$1 passed=$2
  echo "CHAOS lab $label: $passed/$trials trials passed; $(spread "time to error (ms)" "${times[@]}"); $(spread "from the failed collective's call (ms)" "${op_times[@]}") (timeout $timeout_ms ms)"
  times=() op_times=()
}

passed=0
for ((t = 0; t < trials; t++)); do
  victim=$((RANDOM % 3)) after=$((200 + RANDOM % 1500))
  dir=$(mktemp -d)
  run_ranks "$binary" chaos_kill_in_collective 60 "0 1 2" "${common[@]}" CHAOS_VICTIM=$victim CHAOS_KILL_AFTER_MS=$after CHAOS_DIR="$dir"
  ok=1
  for r in 0 1 2; do
    if ((r == victim)); then
      [[ ${codes[$r]} -eq 137 ]] || { show chaos_kill_in_collective "$r"; echo "trial $t: rank $r (victim) exited ${codes[$r]}, not killed"; ok=0; }
    else
      [[ ${codes[$r]} -eq 0 ]] || { show chaos_kill_in_collective "$r"; echo "trial $t: rank $r exited ${codes[$r]}"; ok=0; }
    fi
  done
  collect chaos_kill_in_collective
  passed=$((passed + ok))
  rm -rf "$dir"
done
summary "kill -9 of one rank mid-collective" "$passed"
kill_passed=$passed

passed=0
for ((t = 0; t < trials; t++)); do
  host=$((RANDOM % 3)) after_ms=$((200 + RANDOM % 1500))
  dir=$(mktemp -d)
  (
    for ((i = 0; i < 3000; i++)); do [[ -e $dir/ready ]] && break; sleep 0.01; done
    sleep "$(awk -v ms="$after_ms" 'BEGIN { printf "%.3f", ms / 1000 }')"
    monotonic_ns >"$dir/killed.tmp" && mv "$dir/killed.tmp" "$dir/killed"
    ip -n "$NETLAB_PREFIX-h$host" link set eth0 down
  ) &
  downer=$!
  # The deadline of the collective itself, without the fault reports' grace (SHARDKIT_FAULT_GRACE_MS) after it.
  run_ranks "$binary" chaos_kill_in_collective 60 "0 1 2" "${common[@]}" CHAOS_VICTIM=-1 CHAOS_DIR="$dir" SHARDKIT_FAULT_GRACE_MS=0
  wait "$downer"
  ip -n "$NETLAB_PREFIX-h$host" link set eth0 up
  ok=1
  for r in 0 1 2; do
    [[ ${codes[$r]} -eq 0 ]] || { show chaos_kill_in_collective "$r"; echo "trial $t (host $host down): rank $r exited ${codes[$r]}"; ok=0; }
  done
  collect chaos_kill_in_collective
  passed=$((passed + ok))
  rm -rf "$dir"
  sleep 1  # the link's neighbour entries and routes come back before the next trial's rendezvous
done
summary "lab link set down mid-collective" "$passed"
((kill_passed == trials && passed == trials)) || fail "some chaos trials failed (above)"
echo "OK: chaos in the lab, $trials trials of each"
