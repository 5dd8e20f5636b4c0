#!/usr/bin/env bash
# The conformance suite over the Ethernet lab (scripts/netlab, 1gbit links), ranks started as a launcher would:
#  1. TCP, 3 hosts x 1 rank, with the >= 8 MiB cases;
#  2. auto over 2 hosts x 2 ranks: shared memory within a host, TCP across the lab link, large all-reduces
#     hierarchical (the conformance_two_hosts scenario names each rank's host).
# Exit 77 (ctest SKIP_RETURN_CODE) with a one-line reason when the lab cannot run here.
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../lab/lab_lib.sh"

netlab=${1:?usage: comm_netlab.sh path/to/scripts/netlab path/to/comm_process_test}
binary=${2:?usage: comm_netlab.sh path/to/scripts/netlab path/to/comm_process_test}
lab_up "$netlab" c 3
common=(SHARDKIT_SOCKET_IFNAME=eth0 SHARDKIT_TIMEOUT_MS=60000 SHARDKIT_TEST_LARGE=1)

start=$(date +%s)
sent_before=$(tx_mbytes 1)
run_ranks "$binary" conformance_tcp 400 "0 1 2" "${common[@]}"
sent=$(($(tx_mbytes 1) - sent_before))
for r in 0 1 2; do
  [[ ${codes[$r]} -eq 0 ]] || { show conformance_tcp "$r"; fail "TCP conformance rank $r exited ${codes[$r]}"; }
done
echo "TCP conformance over the lab: 3 ranks passed in $(($(date +%s) - start)) s; host 1 sent $sent MB on eth0"
((sent > 100)) || fail "host 1 sent only $sent MB on eth0: did the ranks talk over the lab links?"

start=$(date +%s)
sent_before=$(tx_mbytes 1)
run_ranks "$binary" conformance_two_hosts 400 "0 0 1 1" "${common[@]}"
sent=$(($(tx_mbytes 1) - sent_before))
for r in 0 1 2 3; do
  [[ ${codes[$r]} -eq 0 ]] || { show conformance_two_hosts "$r"; fail "shm+tcp conformance rank $r exited ${codes[$r]}"; }
done
echo "shm+tcp conformance over the lab (2 hosts x 2 ranks): passed in $(($(date +%s) - start)) s; host 1 sent $sent MB on eth0"
((sent > 50)) || fail "host 1 sent only $sent MB on eth0: did the hosts talk over the lab link?"
