# shellcheck shell=bash
# The step planner's measured inputs as scripts/plan-validate derives them from the lab's runs (sourced; tested by
# tests/tools/plan_inputs_test.sh). Every function reads its arguments or stdin and prints one value or one per line.

# The median of the numbers on stdin ("-" when there are none).
pv_median() { sort -g | awk '{ v[NR] = $1 } END { if (NR == 0) { print "-"; exit } print (NR % 2 ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2) }'; }

# pv_step_ms FILES...: rank 0's step_ms of every step after the first (the trainer's step lines).
pv_step_ms() { cat "$@" | sed 's/^\[rank 0\] //' | awk '$1 == "step" && $2 > 0 { for (i = 3; i < NF; i += 2) if ($i == "step_ms") print $(i + 1) }'; }

# pv_slowest_steps FILES...: one-rank jobs that ran side by side (one file each); step by step after the first, the
# slowest of them: a step of the synchronous job they stand for ends with its slowest rank. As many lines as the
# longest job has steps.
pv_slowest_steps() {
  local f
  for f in "$@"; do pv_step_ms "$f" | paste -sd' '; done |
    awk '{ for (i = 1; i <= NF; i++) if (!(i in m) || $i + 0 > m[i]) m[i] = $i + 0; if (NF > n) n = NF } END { for (i = 1; i <= n; i++) print m[i] }'
}

# pv_stat_ms FIELDS [STAT] [HZ]: the sum of FIELDS (awk field numbers, space-separated) of STAT's (/proc/stat's)
# "cpu" line, every core's time since boot in ticks of HZ (getconf CLK_TCK), in ms: these inputs' one reader of /proc/stat.
pv_stat_ms() {
  awk -v fields="$1" -v hz="${3:-$(getconf CLK_TCK)}" \
    '$1 == "cpu" { n = split(fields, f, " "); for (i = 1; i <= n; i++) t += $f[i]; printf "%.0f\n", t * 1000 / hz; exit }' "${2:-/proc/stat}"
}

# pv_busy_ms [STAT] [HZ]: the machine's busy time in ms since boot: user, nice, system, irq and softirq (idle,
# iowait and steal are not busy).
pv_busy_ms() { pv_stat_ms "2 3 4 7 8" "$@"; }

# pv_irq_ms [STAT] [HZ]: the machine's irq and softirq time in ms since boot (the kernel's network work, which no
# process is charged with).
pv_irq_ms() { pv_stat_ms "7 8" "$@"; }

# pv_times_children_ms TIMES: the user and system CPU in ms of the waited-for children, from bash's `times`
# builtin's output in the file TIMES (its second line; "1m2.500s 0m0.250s" is 62750). Run `times` in the shell
# that waited for them, not in $(...): a subshell has children of its own.
pv_times_children_ms() {
  awk 'NR == 2 { t = 0; for (i = 1; i <= 2; i++) { split($i, p, "m"); sub(/s$/, "", p[2]); t += p[1] * 60 + p[2] }
                 printf "%.0f\n", t * 1000 }' "$1"
}

# pv_units_step_ms UNITS: a units file's (trainer --plan-units) step: its units' forward and backward ms and other_ms.
pv_units_step_ms() { awk '$1 == "unit" { s += $4 + $5 } $1 == "other_ms" { s += $2 } END { print s + 0 }' "$1"; }
# pv_units_value UNITS KEY: the value of a 'KEY VALUE' line (other_ms, measured_shard; CELL.inputs' keys), a CR
# line end dropped (shardkit-plan reads a units file with CRLF line ends alike).
pv_units_value() { awk -v k="$2" '{ sub(/\r$/, "") } $1 == k { print $2; exit }' "$1"; }
# pv_busy_extra INPUTS: CELL.inputs' busy_extra_ms values, one a line.
pv_busy_extra() { awk '{ sub(/\r$/, "") } $1 == "busy_extra_ms" { for (i = 2; i <= NF; i++) print $i }' "$1"; }

# pv_run_steps FILE WHAT: how many steps after the first FILE, WHAT's log, holds; refused when it is missing or
# holds none (the reason on stdout instead, as pv_check_cell's).
pv_run_steps() {
  local n
  [[ -f $1 ]] || { echo "$1: missing ($2)"; return 1; }
  n=$(pv_step_ms "$1" | wc -l)
  ((n > 0)) || { echo "$1: no step after the first ($2 cut short?)"; return 1; }
  echo "$n"
}

# pv_check_cell LOGS CELL HOSTS "BUDGETS": whether LOGS holds every input and run the cell's prediction and row use,
# so that a truncated or hand-made log directory (plan-validate --from-logs) is refused, naming the file (and line),
# rather than predicted from what is left: CELL.inputs with each key once and a number (busy_extra_ms one whole
# number a repeat), and for each repeat r the units file of the last, every host's compute-only job, the
# communication-only runs and each budget's run, each with a step after the first, the side-by-side compute-only
# jobs with as many steps each (the slowest of them, step by step, is the synchronous job's compute).
# The reason for a refusal is its output (exit status 1).
pv_check_cell() {
  local logs=$1 cell=$2 hosts=$3 budgets=$4 r h b f n want first=""
  local inputs="$logs/$cell.inputs"
  [[ -f $inputs ]] || { echo "$logs holds no $cell.inputs (a cell of --hosts and --rates that run did not measure)"; return 1; }
  awk -v f="$inputs" '
    function bad(why) { printf "%s:%d: %s (got '\''%s'\'')\n", f, FNR, why, $0; failed = 1; exit 1 }
    { sub(/\r$/, "") }
    NF == 0 || $1 ~ /^#/ { next }
    $1 in seen { bad($1 " is given twice") }
    { seen[$1] = 1 }
    $1 == "goodput_mbit" && !(NF == 2 && $2 ~ /^[0-9]+([.][0-9]+)?$/ && $2 + 0 > 0) { bad("goodput_mbit wants a positive number") }
    $1 == "rtt_us" && !(NF == 2 && $2 ~ /^[0-9]+([.][0-9]+)?$/) { bad("rtt_us wants a non-negative number") }
    ($1 == "cores" || $1 == "repeat" || $1 == "extra_steps") && !(NF == 2 && $2 ~ /^0*[1-9][0-9]*$/) { bad($1 " wants a positive whole number") }
    $1 == "repeat" { repeat = $2 + 0 }
    $1 == "busy_extra_ms" { busy = NF - 1; for (i = 2; i <= NF; i++) if ($i !~ /^-?[0-9]+$/) bad("busy_extra_ms wants whole numbers of ms") }
    END {
      if (failed) exit 1
      n = split("goodput_mbit rtt_us cores repeat extra_steps busy_extra_ms", keys, " ")
      for (i = 1; i <= n; i++) if (!(keys[i] in seen)) { printf "%s: no %s line (a truncated or hand-made inputs file?)\n", f, keys[i]; exit 1 }
      if (busy != repeat) { printf "%s: busy_extra_ms has %d values, one a repeat wants %d\n", f, busy, repeat; exit 1 }
    }' "$inputs" || return 1
  local repeat
  repeat=$(pv_units_value "$inputs" repeat)
  [[ -s $logs/$cell.units.r$repeat.h0 ]] || { echo "$logs/$cell.units.r$repeat.h0: missing or empty (host 0's units file of the last repeat)"; return 1; }
  for ((r = 1; r <= repeat; r++)); do
    for ((h = 0; h < hosts; h++)); do
      f="$logs/$cell.compute.r$r.h$h.out"
      n=$(pv_run_steps "$f" "host $h's compute-only job of repeat $r") || { echo "$n"; return 1; }
      if [[ -z $first ]]; then first=$f want=$n; fi
      ((n == want)) || { echo "$f: $n steps after the first, $first has $want: the side-by-side compute-only jobs ran alike, so one was cut short"; return 1; }
    done
    for b in comm commlong $budgets; do
      f=$(pv_run_steps "$logs/$cell.$b.r$r.h0.out" "the $b run of repeat $r") || { echo "$f"; return 1; }
    done
  done
}

# pv_comm_cpu BUSY_MS OPTIMIZER_MS LINK_MS: the cores a host's collectives keep busy while they move bytes at the
# link's full rate (shardkit-plan --comm-cpu): BUSY_MS, the CPU per communication-only step per host (the ranks'
# own and the kernel's network work), less OPTIMIZER_MS, the step's own work there, over LINK_MS, the time the
# step's bytes take at the link's full rate. Never below 0 (a step whose busy time the optimizer explains costs
# the collectives nothing).
pv_comm_cpu() {
  awk -v b="$1" -v o="$2" -v l="$3" 'BEGIN { if (l <= 0) { print "pv_comm_cpu: link time " l " ms" > "/dev/stderr"; exit 1 }
                                             c = (b - o) / l; printf "%.3f\n", (c > 0 ? c : 0) }'
}

# pv_other_runs LOCK_DIR OWN_PREFIX: the other plan-validates running on this host now, one a line ("lab 'PREFIX', pid
# N"): each holds its lab's LOCK_DIR/PREFIX.plan-validate.lock for its whole run, with its pid in it; a file left by
# a run that ended is held by none. Probed by taking a shared lock and dropping it at once: a run starting on that
# lab in the same instant may find it held and refuse (exit 3), never the reverse. Needs flock (util-linux).
pv_other_runs() {
  local f prefix pid rc
  for f in "$1"/*.plan-validate.lock; do
    [[ -f $f ]] || continue
    prefix=${f##*/} prefix=${prefix%.plan-validate.lock}
    [[ $prefix != "$2" ]] || continue
    rc=0
    flock -n -s -E 75 "$f" true 2>/dev/null || rc=$?
    ((rc == 75)) || continue
    pid=$(head -c 32 "$f" | tr -cd '0-9')
    echo "lab '$prefix'${pid:+, pid $pid}"
  done
  return 0
}
