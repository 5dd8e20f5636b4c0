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

# pv_busy_ms [STAT] [HZ]: the machine's busy time in ms since boot, every core's user, nice, system, irq and softirq
# (idle, iowait and steal are not busy) from STAT (/proc/stat) in ticks of HZ (getconf CLK_TCK).
pv_busy_ms() {
  awk -v hz="${2:-$(getconf CLK_TCK)}" '$1 == "cpu" { printf "%.0f\n", ($2 + $3 + $4 + $7 + $8) * 1000 / hz; exit }' "${1:-/proc/stat}"
}

# pv_irq_ms [STAT] [HZ]: the machine's irq and softirq time in ms since boot (the kernel's network work, which no
# process is charged with), as pv_busy_ms reads it.
pv_irq_ms() {
  awk -v hz="${2:-$(getconf CLK_TCK)}" '$1 == "cpu" { printf "%.0f\n", ($7 + $8) * 1000 / hz; exit }' "${1:-/proc/stat}"
}

# pv_times_children_ms TIMES: the user and system CPU in ms of the waited-for children, from bash's `times`
# builtin's output in the file TIMES (its second line; "1m2.500s 0m0.250s" is 62750). Run `times` in the shell
# that waited for them, not in $(...): a subshell has children of its own.
pv_times_children_ms() {
  awk 'NR == 2 { t = 0; for (i = 1; i <= 2; i++) { split($i, p, "m"); sub(/s$/, "", p[2]); t += p[1] * 60 + p[2] }
                 printf "%.0f\n", t * 1000 }' "$1"
}

# pv_units_step_ms UNITS: a units file's (trainer --plan-units) step: its units' forward and backward ms and other_ms.
pv_units_step_ms() { awk '$1 == "unit" { s += $4 + $5 } $1 == "other_ms" { s += $2 } END { print s + 0 }' "$1"; }
# pv_units_value UNITS KEY: the value of a 'KEY VALUE' line (other_ms, measured_shard).
pv_units_value() { awk -v k="$2" '$1 == k { print $2; exit }' "$1"; }

# pv_comm_cpu BUSY_MS OPTIMIZER_MS LINK_MS: the cores a host's collectives keep busy while they move bytes at the
# link's full rate (shardkit-plan --comm-cpu): BUSY_MS, the CPU per communication-only step per host (the ranks'
# own and the kernel's network work), less OPTIMIZER_MS, the step's own work there, over LINK_MS, the time the
# step's bytes take at the link's full rate. Never below 0 (a step whose busy time the optimizer explains costs
# the collectives nothing).
pv_comm_cpu() {
  awk -v b="$1" -v o="$2" -v l="$3" 'BEGIN { if (l <= 0) { print "pv_comm_cpu: link time " l " ms" > "/dev/stderr"; exit 1 }
                                             c = (b - o) / l; printf "%.3f\n", (c > 0 ? c : 0) }'
}
