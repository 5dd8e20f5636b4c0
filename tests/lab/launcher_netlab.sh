#!/usr/bin/env bash
# shardkit-run across hosts, as torchrun's --nnodes: 2 lab hosts x 2 ranks, one shardkit-run per host with
# --nnodes 2 --node-rank K --nproc-per-node 2 --master-addr (host 0's lab address) --master-port and the token
# from a file both hosts read. The trainer trains 2 steps over shm within a host and TCP across the lab link; both
# launchers must exit 0, every rank must have printed its place, and host 1 must be told RANK 2 and 3 of 4.
# A second run with no token shows the launcher refusing to start a multi-host job without a shared secret.
# Exit 77 (ctest SKIP_RETURN_CODE) with a one-line reason when the lab cannot run here.
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lab_lib.sh"

usage="usage: launcher_netlab.sh path/to/scripts/netlab path/to/shardkit-run path/to/trainer"
netlab=${1:?$usage} run=${2:?$usage} trainer=${3:?$usage}
lab_up "$netlab" l 2
echo "lab-token-$$" >"$logs/token"
start=$(date +%s)
pids=()
for node in 0 1; do
  "$netlab" run "$node" env -u SHARDKIT_AUTH_TOKEN SHARDKIT_SOCKET_IFNAME=eth0 SHARDKIT_TIMEOUT_MS=60000 \
    SHARDKIT_STORE_TIMEOUT=60 timeout -s KILL 120 "$run" --nnodes 2 --node-rank "$node" --nproc-per-node 2 \
    --master-addr "$master" --master-port 29500 --auth-token-file "$logs/token" -- \
    sh -c 'echo "place $RANK/$WORLD_SIZE local $LOCAL_RANK/$LOCAL_WORLD_SIZE"; exec "$0" --steps 2 --width 16 --blocks 1' \
    "$trainer" >"$logs/node.$node.log" 2>&1 &
  pids+=($!)
done
for node in 0 1; do
  wait "${pids[$node]}"
  code=$?
  ((code == 0)) || { tail -30 "$logs/node.$node.log"; fail "shardkit-run on host $node exited $code"; }
done
for want in "0:[rank 0] place 0/4 local 0/2" "0:[rank 1] place 1/4 local 1/2" "1:[rank 2] place 2/4 local 0/2" \
            "1:[rank 3] place 3/4 local 1/2"; do
  grep -qF "${want#*:}" "$logs/node.${want%%:*}.log" || { cat "$logs/node.${want%%:*}.log"; fail "host ${want%%:*} lacks '${want#*:}'"; }
done
grep -q "step 1" "$logs/node.0.log" || { cat "$logs/node.0.log"; fail "the trainer on host 0 did not reach step 1"; }
echo "2 hosts x 2 ranks through shardkit-run --nnodes 2 trained in $(($(date +%s) - start)) s"

"$netlab" run 1 env -u SHARDKIT_AUTH_TOKEN "$run" --nnodes 2 --node-rank 1 -n 2 --master-addr "$master" \
  --master-port 29500 -- true >"$logs/notoken.log" 2>&1
code=$?
((code == 1)) && grep -q "needs the job's shared secret" "$logs/notoken.log" ||
  { cat "$logs/notoken.log"; fail "a multi-host launch without a token exited $code"; }
echo "launcher over the lab: OK"
