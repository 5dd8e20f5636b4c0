#!/usr/bin/env bash
# Smoke test of scripts/netlab: up 2 hosts x 1 link at 200mbit, reach host 1 from host 0, measure both directions
# with iperf3 (expect 180-205 Mbit/s: TCP goodput is ~95% of the shaped L2 rate), down, and check nothing is left.
# Exit 77 (ctest SKIP_RETURN_CODE) with a one-line reason when the lab cannot run here.
set -uo pipefail

netlab=${1:?usage: netlab_smoke.sh path/to/scripts/netlab}
skip() { echo "SKIP: $*"; exit 77; }
fail() { echo "FAIL: $*"; exit 1; }

[[ $(id -u) -eq 0 ]] || skip "netlab needs root (network namespaces, veth, tc)"
ip netns list >/dev/null 2>&1 || skip "'ip netns' is unavailable here"
command -v iperf3 >/dev/null 2>&1 || skip "iperf3 is not installed"

# A lab of our own: never touches a lab someone else has up under the default prefix.
export NETLAB_PREFIX="t$(($$ % 10000000))"
trap '"$netlab" down >/dev/null 2>&1' EXIT

"$netlab" up --hosts 2 --links 1 --rate 200mbit || fail "netlab up failed"
"$netlab" status || fail "netlab status says the lab is not up"

peer=$("$netlab" addr 1) || fail "netlab addr 1 failed"
[[ $peer == 10.77.0.2 ]] || fail "host 1 has address '$peer', expected 10.77.0.2"
if command -v ping >/dev/null 2>&1; then
  "$netlab" run 0 ping -c 3 -i 0.2 -W 2 "$peer" || fail "host 0 cannot ping host 1 at $peer"
else
  # No ping here: a TCP connect through the lab proves the same path (ARP, bridge, both shapers).
  "$netlab" run 1 iperf3 -s -1 -B "$peer" -p 5299 >/dev/null 2>&1 &
  server=$!
  sleep 0.5
  "$netlab" run 0 timeout 5 bash -c "exec 3<>/dev/tcp/$peer/5299" || fail "host 0 cannot reach host 1 at $peer"
  kill "$server" 2>/dev/null
  wait "$server" 2>/dev/null
  echo "reachability: TCP connect from host 0 to $peer ok (ping is not installed)"
fi
"$netlab" run 0 ip -br addr show eth0 | grep -q "10.77.0.1/24" || fail "host 0's eth0 lacks 10.77.0.1/24"

report=$("$netlab" iperf --json --time 3) || fail "netlab iperf failed: $report"
echo "$report"
rates=$(grep -o '"mbit_per_s": [0-9.]*' <<<"$report" | awk '{print $2}')
[[ $(wc -l <<<"$rates") -eq 2 ]] || fail "expected 2 measurements, got: $rates"
for r in $rates; do
  awk -v r="$r" 'BEGIN { exit !(r >= 180 && r <= 205) }' || fail "measured $r Mbit/s on a 200mbit link (expected 180-205)"
done

"$netlab" down || fail "netlab down failed"
"$netlab" down >/dev/null || fail "a second netlab down failed (must be idempotent)"
left=$(ip netns list | awk '{print $1}' | grep -E "^${NETLAB_PREFIX}-" || true)
[[ -z $left ]] || fail "namespaces left after down: $left"
echo "netlab smoke test passed: $(tr '\n' ' ' <<<"$rates")Mbit/s"
