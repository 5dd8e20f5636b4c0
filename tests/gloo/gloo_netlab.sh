#!/usr/bin/env bash
# The conformance suite over the gloo communicator in the Ethernet lab (scripts/netlab): 3 hosts x 1 link at
# 1gbit, one rank per host, gloo's TCP device on each host's eth0, with the >= 8 MiB cases. Exit 77 (ctest
# SKIP_RETURN_CODE) with a one-line reason when the lab cannot run here.
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../lab/lab_lib.sh"

netlab=${1:?usage: gloo_netlab.sh path/to/scripts/netlab path/to/gloo_test}
binary=${2:?usage: gloo_netlab.sh path/to/scripts/netlab path/to/gloo_test}
lab_up "$netlab" g 3

lab_conformance "gloo conformance" "$binary" gloo_conformance 400 "0 1 2" 100 \
  GLOO_TEST_LAB=1 GLOO_TEST_LARGE=1 SHARDKIT_SOCKET_IFNAME=eth0
