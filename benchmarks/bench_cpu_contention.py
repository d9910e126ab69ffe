"""The CPU's two user-facing workloads, quiet and beside busy processes: the demo and examples/few_shot_eval.py.

Each run is a fresh process running the script as a user would (``python -m hf_cascade demo``,
``python examples/few_shot_eval.py``); the times are the ones the script prints (the whole cascade generate() calls
against sdpa's, in the same process). ``busy3``: three ``while True: pass`` processes are started a second before the
script and killed after it (the issue-35 setting); the 1-minute load average is sampled every second meanwhile.
Before every run the machine must be quiet (at least 90% idle over 3 s), so that another job's load does not enter
a "quiet" figure or add to the three busy processes.

    python benchmarks/bench_cpu_contention.py --runs 2                      # both workloads, quiet and busy3
    python benchmarks/bench_cpu_contention.py --workloads demo --conditions busy3 --runs 3
    python benchmarks/bench_cpu_contention.py --tree /tmp/base --sha 7b610ce  # another checkout's code

One JSON object per peer and run in ``results/cpu_contention.jsonl``: workload, condition, peer (cascade / sdpa),
seconds, speedup (sdpa's seconds over cascade's, on both records), load (the mean of the 1-minute load average
sampled during the run: it lags, a quiet run after a busy one starts high) and runnable (the mean count of runnable
threads sampled during the run, the script's own included), foreign_share (the share of the machine's CPU time other
jobs used during the run: a run beside another job's work is not the setting it names).
"""

from __future__ import annotations

import argparse
import os
import re
import resource
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import ResultWriter  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
WORKLOADS = {
    "demo": ["-m", "hf_cascade", "demo"],
    "few_shot_eval": ["examples/few_shot_eval.py"],
}
CONDITIONS = {"quiet": 0, "busy3": 3}


def idle_fraction(seconds: float = 3.0) -> float:
    """The machine's idle share over ``seconds`` (/proc/stat, all CPUs)."""

    def read():
        fields = [int(x) for x in open("/proc/stat").readline().split()[1:9]]
        return sum(fields), fields[3]

    total0, idle0 = read()
    time.sleep(seconds)
    total1, idle1 = read()
    return (idle1 - idle0) / max(1, total1 - total0)


def wait_quiet(limit_s: float = 3600.0) -> None:
    start = time.monotonic()
    while idle_fraction() < 0.9:
        if time.monotonic() - start > limit_s:
            raise SystemExit("the machine never became quiet (another job is running); try again later")
        print("  waiting for a quiet machine...", flush=True)


def parse(workload: str, text: str) -> tuple[float, float, bool]:
    """(cascade seconds, sdpa seconds, identical output) from the script's printout."""
    if workload == "demo":
        m = re.search(r"time \(whole generate\(\)\)\s+([\d.]+) s\s+([\d.]+) s", text)
        same = "identical text: yes" in text
        return float(m.group(1)), float(m.group(2)), same
    cascade = re.search(r"^cascade\s+[\d.]+%\s+([\d.]+) s", text, re.M)
    sdpa = re.search(r"^sdpa\s+[\d.]+%\s+([\d.]+) s", text, re.M)
    rows = re.search(r"completions identical to sdpa: (\d+)/(\d+) rows", text)
    return float(cascade.group(1)), float(sdpa.group(1)), rows is not None and rows.group(1) == rows.group(2)


def busy_cpu_s() -> float:
    """CPU seconds the machine has spent busy since boot, all CPUs (/proc/stat: all but idle and iowait)."""
    fields = [int(x) for x in open("/proc/stat").readline().split()[1:9]]
    return (sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


def own_cpu_s() -> float:
    """CPU seconds of this process and its waited-for children (the script, the busy processes)."""
    me, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + children.ru_utime + children.ru_stime


def run_once(workload: str, busy: int, tree: Path) -> dict:
    machine0, own0, wall0 = busy_cpu_s(), own_cpu_s(), time.perf_counter()
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(busy)]
    loads, runnable, done = [], [], threading.Event()

    def sample():
        while not done.wait(1.0):
            fields = open("/proc/loadavg").read().split()
            loads.append(float(fields[0]))
            runnable.append(int(fields[3].split("/")[0]) - 1)  # runnable threads now, less this sampler

    try:
        if hogs:
            time.sleep(1.0)
        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        env = {**os.environ, "PYTHONPATH": str(tree)}
        start = time.perf_counter()
        proc = subprocess.run([sys.executable, *WORKLOADS[workload]], cwd=tree, env=env, capture_output=True,
                              text=True, timeout=3600)
        wall = time.perf_counter() - start
    finally:
        done.set()
        for hog in hogs:
            hog.kill()
            hog.wait()
    # Other jobs' share of the machine meanwhile (0 on a machine running nothing else).
    foreign = (busy_cpu_s() - machine0) - (own_cpu_s() - own0)
    foreign_share = max(0.0, foreign) / ((time.perf_counter() - wall0) * (os.cpu_count() or 1))
    if proc.returncode != 0:
        raise SystemExit(f"{workload} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    cascade_s, sdpa_s, same = parse(workload, proc.stdout)
    return dict(cascade_s=cascade_s, sdpa_s=sdpa_s, identical=same, process_s=round(wall, 2),
                load=round(sum(loads) / len(loads), 2) if loads else None, load_max=max(loads, default=None),
                runnable=round(sum(runnable) / len(runnable), 2) if runnable else None,
                foreign_share=round(foreign_share, 3))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    parser.add_argument("--conditions", nargs="+", default=list(CONDITIONS), choices=list(CONDITIONS))
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--tree", default=str(ROOT), help="the checkout whose code runs (default: this one)")
    parser.add_argument("--sha", default=None, help="the git sha to record for --tree (default: this checkout's)")
    parser.add_argument("--note", default=None, help="a note stored with every record")
    parser.add_argument("--output", default=None)
    args = parser.parse_args(argv)
    if args.sha:
        os.environ["HF_CASCADE_GIT_SHA"] = args.sha
    writer = ResultWriter("cpu_contention.jsonl", args.output)
    tree = Path(args.tree).resolve()
    for run in range(args.runs):
        for workload in args.workloads:
            for condition in args.conditions:
                wait_quiet()
                r = run_once(workload, CONDITIONS[condition], tree)
                speedup = round(r["sdpa_s"] / r["cascade_s"], 2)
                print(f"{workload:14s} {condition:6s} cascade {r['cascade_s']:7.2f} s  sdpa {r['sdpa_s']:7.2f} s  "
                      f"{speedup:5.1f}x  load {r['load']}  runnable {r['runnable']}  other jobs {r['foreign_share']:.0%}  "
                      f"identical {r['identical']}", flush=True)
                common = dict(bench="cpu_contention", machine="2-core CPU", cpu_count=os.cpu_count(),
                              workload=workload, condition=condition, busy_processes=CONDITIONS[condition],
                              run=run, speedup=speedup, load=r["load"], load_max=r["load_max"], runnable=r["runnable"],
                              foreign_share=r["foreign_share"],
                              identical=r["identical"], process_s=r["process_s"], note=args.note)
                writer.write({**common, "peer": "cascade", "seconds": r["cascade_s"]})
                writer.write({**common, "peer": "sdpa", "seconds": r["sdpa_s"]})


if __name__ == "__main__":
    main()
