#!/usr/bin/env bash
# The fabric transport over the Ethernet lab: 3 hosts x 1 link at 1gbit (scripts/netlab), one rank per host as a
# launcher would start it (RANK, WORLD_SIZE, LOCAL_RANK=0, LOCAL_WORLD_SIZE=1, MASTER_ADDR = host 0's lab
# address), tcp;ofi_rxm on each host's eth0 (SHARDKIT_FABRIC_DOMAIN). Runs the conformance suite with its >= 8 MiB
# cases, then kills rank 2 and expects the others to report errc::peer_lost naming it. Exit 77 (ctest
# SKIP_RETURN_CODE) with a one-line reason when the lab cannot run here.
set -uo pipefail

netlab=${1:?usage: fabric_netlab.sh path/to/scripts/netlab path/to/fabric_test}
binary=${2:?usage: fabric_netlab.sh path/to/scripts/netlab path/to/fabric_test}
skip() { echo "SKIP: $*"; exit 77; }
fail() { echo "FAIL: $*"; exit 1; }

[[ $(id -u) -eq 0 ]] || skip "netlab needs root (network namespaces, veth, tc)"
ip netns list >/dev/null 2>&1 || skip "'ip netns' is unavailable here"
command -v fi_info >/dev/null 2>&1 && ! fi_info -p "tcp;ofi_rxm" >/dev/null 2>&1 && skip "libfabric has no tcp;ofi_rxm provider"

# A lab of our own: never touches a lab someone else has up under the default prefix.
export NETLAB_PREFIX="f$(($$ % 10000000))"
logs=$(mktemp -d)
trap '"$netlab" down >/dev/null 2>&1; rm -rf "$logs"' EXIT

"$netlab" up --hosts 3 --links 1 --rate 1gbit
case $? in
  0) ;;
  3) skip "netlab is unavailable here (see its message above)" ;;
  *) fail "netlab up failed" ;;
esac
master=$("$netlab" addr 0) || fail "netlab addr 0 failed"

# run_ranks SCENARIO SECONDS [VAR=value...]: starts rank h on host h, waits, leaves each exit status in codes[h].
run_ranks() {
  local scenario=$1 seconds=$2
  shift 2
  local pids=() h
  for h in 0 1 2; do
    "$netlab" run "$h" env RANK="$h" WORLD_SIZE=3 LOCAL_RANK=0 LOCAL_WORLD_SIZE=1 MASTER_ADDR="$master" MASTER_PORT=29500 \
      SHARDKIT_TEST_SCENARIO="$scenario" FABRIC_TEST_PROVIDER="tcp;ofi_rxm" SHARDKIT_FABRIC_DOMAIN=eth0 "$@" \
      timeout -s KILL "$seconds" "$binary" >"$logs/$scenario.$h.log" 2>&1 &
    pids+=($!)
  done
  codes=()
  for h in 0 1 2; do
    wait "${pids[$h]}"
    codes[$h]=$?
  done
}
show() { echo "--- rank $2 ($1), exit ${codes[$2]}:"; grep -v '^\[shardkit ERROR' "$logs/$1.$2.log" | tail -20; }

start=$(date +%s)
sent_before=$(ip netns exec "$NETLAB_PREFIX-h1" cat /sys/class/net/eth0/statistics/tx_bytes)
run_ranks fabric_conformance 300 FABRIC_TEST_LARGE=1
sent=$(( ($(ip netns exec "$NETLAB_PREFIX-h1" cat /sys/class/net/eth0/statistics/tx_bytes) - sent_before) / 1000000 ))
for h in 0 1 2; do
  [[ ${codes[$h]} -eq 0 ]] || { show fabric_conformance "$h"; fail "conformance rank $h exited ${codes[$h]}"; }
done
echo "conformance over the lab: 3 ranks passed in $(($(date +%s) - start)) s; host 1 sent $sent MB on eth0"
((sent > 100)) || fail "host 1 sent only $sent MB on eth0: did the ranks talk over the lab links?"

start=$(date +%s)
run_ranks fabric_kill_one 60
for h in 0 1; do
  [[ ${codes[$h]} -eq 0 ]] || { show fabric_kill_one "$h"; fail "rank $h did not see rank 2 lost as expected"; }
  grep -h "peer lost" "$logs/fabric_kill_one.$h.log"
done
[[ ${codes[2]} -eq 137 ]] || { show fabric_kill_one 2; fail "rank 2 exited ${codes[2]}, expected to be killed (137)"; }
echo "fabric netlab test passed (kill scenario $(($(date +%s) - start)) s)"
