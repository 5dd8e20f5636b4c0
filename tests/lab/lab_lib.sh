# Sourced by the Ethernet-lab tests (scripts/netlab): skip/fail, a lab of the test's own, and one process per rank
# on a chosen lab host, started the way a launcher would (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
# MASTER_ADDR = host 0's lab address). Exit 77 (ctest SKIP_RETURN_CODE) with a one-line reason when the lab
# cannot run here.

skip() { echo "SKIP: $*"; exit 77; }
fail() { echo "FAIL: $*"; exit 1; }

# lab_up NETLAB PREFIX HOSTS: a 1gbit lab of HOSTS hosts x 1 link under NETLAB_PREFIX=PREFIX<pid>, torn down on
# exit. Sets netlab, master and logs.
lab_up() {
  netlab=$1
  [[ $(id -u) -eq 0 ]] || skip "netlab needs root (network namespaces, veth, tc)"
  ip netns list >/dev/null 2>&1 || skip "'ip netns' is unavailable here"
  # A lab of our own: never touches a lab someone else has up under the default prefix.
  export NETLAB_PREFIX="$2$(($$ % 10000000))"
  logs=$(mktemp -d)
  trap '"$netlab" down >/dev/null 2>&1; rm -rf "$logs"' EXIT
  "$netlab" up --hosts "$3" --links 1 --rate 1gbit
  case $? in
    0) ;;
    3) skip "netlab is unavailable here (see its message above)" ;;
    *) fail "netlab up failed" ;;
  esac
  master=$("$netlab" addr 0) || fail "netlab addr 0 failed"
}

# run_ranks BINARY SCENARIO SECONDS HOSTS [VAR=value...]: HOSTS lists each rank's lab host ("0 1 2", "0 0 1 1");
# starts every rank, waits, and leaves each exit status in codes[rank]. Output goes to $logs/SCENARIO.RANK.log.
run_ranks() {
  local binary=$1 scenario=$2 seconds=$3
  local -a hosts=($4)
  shift 4
  local n=${#hosts[@]} pids=() r local_rank local_size
  for ((r = 0; r < n; r++)); do
    local_rank=0 local_size=0
    for ((q = 0; q < n; q++)); do
      [[ ${hosts[$q]} == "${hosts[$r]}" ]] || continue
      ((q < r)) && local_rank=$((local_rank + 1))
      local_size=$((local_size + 1))
    done
    "$netlab" run "${hosts[$r]}" env RANK="$r" WORLD_SIZE="$n" LOCAL_RANK="$local_rank" LOCAL_WORLD_SIZE="$local_size" \
      MASTER_ADDR="$master" MASTER_PORT=29500 SHARDKIT_TEST_SCENARIO="$scenario" "$@" \
      timeout -s KILL "$seconds" "$binary" >"$logs/$scenario.$r.log" 2>&1 &
    pids+=($!)
  done
  codes=()
  for ((r = 0; r < n; r++)); do
    wait "${pids[$r]}"
    codes[$r]=$?
  done
}

# show SCENARIO RANK: the end of that rank's output, without the expected error log lines.
show() { echo "--- rank $2 ($1), exit ${codes[$2]}:"; grep -v '^\[shardkit ERROR' "$logs/$1.$2.log" | tail -20; }

# tx_mbytes HOST: bytes host HOST has sent on its lab link, in MB.
tx_mbytes() { echo $(($(ip netns exec "$NETLAB_PREFIX-h$1" cat /sys/class/net/eth0/statistics/tx_bytes) / 1000000)); }

# lab_conformance LABEL BINARY SCENARIO SECONDS HOSTS MIN_MB [VAR=value...]: run_ranks, then every rank must
# have exited 0 and lab host 1 must have sent at least MIN_MB on its link (so the ranks really used the lab).
lab_conformance() {
  local label=$1 binary=$2 scenario=$3 seconds=$4 hosts=$5 min_mb=$6 start sent_before sent r
  shift 6
  start=$(date +%s)
  sent_before=$(tx_mbytes 1)
  run_ranks "$binary" "$scenario" "$seconds" "$hosts" "$@"
  sent=$(($(tx_mbytes 1) - sent_before))
  for r in "${!codes[@]}"; do
    [[ ${codes[$r]} -eq 0 ]] || { show "$scenario" "$r"; fail "$label rank $r exited ${codes[$r]}"; }
  done
  echo "$label over the lab: ${#codes[@]} ranks passed in $(($(date +%s) - start)) s; host 1 sent $sent MB on eth0"
  ((sent >= min_mb)) || fail "host 1 sent only $sent MB on eth0: did the ranks talk over the lab links?"
}
