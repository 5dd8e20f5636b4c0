#!/usr/bin/env bash
# The fabric transport over the Ethernet lab: 3 hosts x 1 link at 1gbit (scripts/netlab), one rank per host as a
# launcher would start it (RANK, WORLD_SIZE, LOCAL_RANK=0, LOCAL_WORLD_SIZE=1, MASTER_ADDR = host 0's lab
# address), tcp;ofi_rxm on each host's eth0 (SHARDKIT_FABRIC_DOMAIN). Runs the conformance suite with its >= 8 MiB
# cases, then kills rank 2 and expects the others to report errc::peer_lost naming it. Exit 77 (ctest
# SKIP_RETURN_CODE) with a one-line reason when the lab cannot run here.
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../lab/lab_lib.sh"

netlab=${1:?usage: fabric_netlab.sh path/to/scripts/netlab path/to/fabric_test}
binary=${2:?usage: fabric_netlab.sh path/to/scripts/netlab path/to/fabric_test}
command -v fi_info >/dev/null 2>&1 && ! fi_info -p "tcp;ofi_rxm" >/dev/null 2>&1 && skip "libfabric has no tcp;ofi_rxm provider"
lab_up "$netlab" f 3
fabric_env=(FABRIC_TEST_PROVIDER="tcp;ofi_rxm" SHARDKIT_FABRIC_DOMAIN=eth0)

lab_conformance "fabric conformance" "$binary" fabric_conformance 300 "0 1 2" 100 "${fabric_env[@]}" FABRIC_TEST_LARGE=1

start=$(date +%s)
run_ranks "$binary" fabric_kill_one 60 "0 1 2" "${fabric_env[@]}"
for h in 0 1; do
  [[ ${codes[$h]} -eq 0 ]] || { show fabric_kill_one "$h"; fail "rank $h did not see rank 2 lost as expected"; }
  grep -h "peer lost" "$logs/fabric_kill_one.$h.log"
done
[[ ${codes[2]} -eq 137 ]] || { show fabric_kill_one 2; fail "rank 2 exited ${codes[2]}, expected to be killed (137)"; }
echo "fabric netlab test passed (kill scenario $(($(date +%s) - start)) s)"
