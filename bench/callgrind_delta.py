#!/usr/bin/env python3
"""Instructions per call from callgrind runs of bench/call_check_ab (docs/benchmarks.md, "the call check's 8-byte
path in instructions"), per function, with the check off (A) and on (B).

    callgrind_delta.py PREFIX_A PREFIX_B [ROWS]

reads PREFIX-200.out and PREFIX-400.out of each (runs that differ only in --per-block 200 / 400: 2 x 1200 more
calls), and prints per call per rank: the whole program, the program without the allocator, and the calls' own code
(without the allocator and without the thread hand-off: condition variables, futexes, the waits' polling), then the
ROWS functions whose instructions differ most. Why two of those leave parts out: glibc's malloc and free take other
paths from run to run of one binary (which chunk a free finds, whether a thread's cache refills), and so do the
hand-off's waits (whether a waiter finds its message or sleeps): up to +-150 instructions per call between two runs
of one binary, in both worlds alike. What is left, the calls' own code, repeats to within 2 instructions per call.
"""
import collections
import re
import subprocess
import sys

CALLS = 2 * 6 * 200  # 2 ranks; 2 warm-up blocks and 4 blocks, each 200 calls more in the 400 run
ALLOCATOR = {"_int_malloc", "_int_free", "unlink_chunk.constprop.0", "malloc_consolidate", "alloc_perturb", "malloc",
             "free", "operator new(unsigned long)", "operator delete(void*, unsigned long)"}
HANDOFF = re.compile(r"^(pthread_cond_|__futex_|__lll_lock_|__pthread_mutex_cond_lock|__condvar_|"
                     r"__pthread_(enable|disable)_asynccancel|_pthread_cleanup_|clock_gettime|syscall|"
                     r"std::chrono::_V2::steady_clock::now|shardkit::basic_completion<unsigned long>::wait_until|"
                     r"bool shardkit::spin_until|shardkit::comm::algorithms::p2p_op<[^>]*>::wait_watching|"
                     r"shardkit::comm::detail::progress_engine::run)")

# The functions the check's instructions are in (the op's start, its first sends and recvs, their verification):
# the same count in every run, where the own code also holds the slow path of waits that outlast a slice (the
# checked world polls every 10 ms, the other every 100 ms: under load, more of its waits time out and re-lock).
CHECK = re.compile(r"^shardkit::comm::(algorithms::p2p_op<[^>]*>::(p2p_op|send|recv|wait_recv|wait_recv_view|"
                   r"send_apart|posted_frame)\(|p2p_communicator<[^>]*>::(all_reduce|begin)\(|algorithms::call_checker)")


def self_costs(path):
    out = subprocess.run(["callgrind_annotate", "--threshold=100", "--inclusive=no", path],
                         capture_output=True, text=True, check=True).stdout
    costs = collections.Counter()
    for line in out.splitlines():
        m = re.match(r"^\s*([\d,]+)\s+\(\s*[\d.]+%\)\s+(.*)$", line)
        if not m or "PROGRAM TOTALS" in line:
            continue
        name = re.sub(r"\s*\[[^\]]*\]\s*$", "", m.group(2))
        if name.startswith("./") or name.startswith("???"):
            name = re.sub(r"^\S*?:(?=[^:])", "", name, count=1)
        costs[name] += int(m.group(1).replace(",", ""))
    return costs


def per_call(prefix):
    a, b = self_costs(prefix + "-200.out"), self_costs(prefix + "-400.out")
    return {k: (b[k] - a[k]) / CALLS for k in set(a) | set(b)}


def main():
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    x, y = per_call(sys.argv[1]), per_call(sys.argv[2])
    rows = int(sys.argv[3]) if len(sys.argv) > 3 else 20
    total = lambda d: sum(d.values())
    no_alloc = lambda d: sum(v for k, v in d.items() if k not in ALLOCATOR)
    own = lambda d: sum(v for k, v in d.items() if k not in ALLOCATOR and not HANDOFF.match(k))
    for label, f in (("whole program", total), ("without the allocator", no_alloc), ("own code", own)):
        print(f"{label:22} A {f(x):8.0f}  B {f(y):8.0f}  B-A {f(y) - f(x):6.0f}")
    check = lambda d: sum(v for k, v in d.items() if CHECK.match(k))
    label = "the check's functions"
    print(f"{label:22} A {check(x):8.0f}  B {check(y):8.0f}  B-A {check(y) - check(x):6.0f}")
    keys = sorted(set(x) | set(y), key=lambda k: -abs(y.get(k, 0) - x.get(k, 0)))
    for k in keys[:rows]:
        print(f"{y.get(k, 0) - x.get(k, 0):8.1f}  {x.get(k, 0):8.1f} {y.get(k, 0):8.1f}  {k[:150]}")


if __name__ == "__main__":
    main()
