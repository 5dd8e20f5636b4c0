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

lab_conformance "TCP conformance" "$binary" conformance_tcp 400 "0 1 2" 100 "${common[@]}"
lab_conformance "shm+tcp conformance (2 hosts x 2 ranks)" "$binary" conformance_two_hosts 400 "0 0 1 1" 50 "${common[@]}"
