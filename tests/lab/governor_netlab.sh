#!/usr/bin/env bash
# An S3 checkpoint through a shaped link, with the link governor on: scripts/governor-lab's smallest run (a tiny
# trainer on 4 lab hosts at 1gbit, checkpoints every 2 steps to s3rver on a 5th host, the governor pacing them on
# eth0), beside the same run without checkpoints. Passes when both runs finish, every save commits and the trainer
# reports the interval that keeps up. Exit 77 (ctest SKIP_RETURN_CODE) with a one-line reason when the lab or
# s3rver cannot run here.
set -uo pipefail
lab=${1:?usage: governor_netlab.sh path/to/scripts/governor-lab path/to/trainer build-dir}
trainer=${2:?} build=${3:?}
skip() { echo "SKIP: $*"; exit 77; }
fail() { echo "FAIL: $*"; exit 1; }
[[ $(id -u) -eq 0 ]] || skip "the lab needs root (network namespaces, veth, tc)"
command -v node >/dev/null 2>&1 || skip "node is not installed (the S3 server, s3rver, runs on it)"
export NETLAB_PREFIX="g$(($$ % 10000000))"  # a lab of our own
logs=$(mktemp -d)
trap 'rm -rf "$logs"' EXIT
"$lab" --build "$build" --trainer "$trainer" --runs none,on --every 2 --steps 5 --warm 1 --logs "$logs" \
  -- --width 32 --blocks 1 --batch 4 --context 16 >"$logs/table.md" 2>"$logs/err"
case $? in
  0) ;;
  3) skip "$(tail -n 1 "$logs/err")" ;;
  *) cat "$logs/err"; fail "scripts/governor-lab failed" ;;
esac
cat "$logs/table.md"
grep -q "^# checkpoints: 2 of 2 committed in s3://" "$logs/r1.on2.out" || fail "the saves did not all commit: $(grep '^#' "$logs/r1.on2.out")"
grep -q "^# checkpoint every [0-9]* steps keeps up at this link" "$logs/r1.on2.out" || fail "no sustainable interval reported"
echo "governor lab: S3 checkpoints over a governed 1gbit link committed"
