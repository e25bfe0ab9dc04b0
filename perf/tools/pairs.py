#!/usr/bin/env python3
"""Before/after in alternating pairs: one driver binary against another.

    perf/tools/pairs.py BEFORE_DRIVER AFTER_DRIVER [--pairs 8] [--seconds 1]
        [--warmup 0.5] [--config "W0 1" --config "W1 4" ...] [--shards a.tar,b.tar]
        [--driver-arg=--pipeline --driver-arg=nodes ...]

For each configuration (workload and workers; W5 needs --shards), runs
before, after, before, after ... --pairs times, each run alone, and prints
the median samples/s of each side, the median of the per-pair ratios
after / before, and the range of those ratios. On a shared machine whose
threaded runs vary two-fold from one run to the next (W0 and W1 with
workers do on 2 vCPUs), only pairs taken back to back say which side is
faster; a suite run of each side minutes apart does not.
"""
import argparse
import json
import statistics
import subprocess
import sys

DEFAULT_CONFIGS = ["W0 1", "W0 2", "W0 4", "W1 1", "W1 2", "W1 4", "W5 1", "W5 2"]


def run(driver, workload, workers, args):
    command = [driver, "--workload", workload, "--workers", str(workers), "--seconds", str(args.seconds),
               "--warmup", str(args.warmup)]
    if workload == "W5":
        command += ["--shards", args.shards]
    command += args.driver_arg or []
    done = subprocess.run(command, capture_output=True, text=True)
    # A driver prints its line before tearing down: a crash after it is
    # still a failed run, not a measurement.
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed ({done.returncode}): {done.stderr[-500:]}")
    for line in reversed(done.stdout.splitlines()):
        if line.startswith("{"):
            return json.loads(line)["samples_per_s"]
    raise RuntimeError(f"{' '.join(command)} failed ({done.returncode}): {done.stderr[-500:]}")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("before")
    parser.add_argument("after")
    parser.add_argument("--pairs", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=1.0)
    parser.add_argument("--warmup", type=float, default=0.5)
    parser.add_argument("--config", action="append", help='"WORKLOAD WORKERS", e.g. "W0 1" (repeatable)')
    parser.add_argument("--shards", default="", help="W5's tar shards, comma-separated")
    parser.add_argument("--driver-arg", action="append",
                        help="passed on to both drivers (repeatable), e.g. --driver-arg=--pipeline --driver-arg=nodes")
    parser.add_argument("--limit", type=float, default=3.0, help="percent slower that counts as a regression")
    args = parser.parse_args()
    configs = [c.split() for c in (args.config or DEFAULT_CONFIGS)]
    if any(w == "W5" for w, _ in configs) and not args.shards:
        configs = [c for c in configs if c[0] != "W5"]
        print("pairs: W5 skipped (no --shards)", file=sys.stderr)
    print("| workload | W | before samples/s | after samples/s | after / before (median of pairs) | range |")
    print("| --- | --- | --- | --- | --- | --- |")
    slower = 0
    for workload, workers in configs:
        before, after, ratios = [], [], []
        for _ in range(args.pairs):
            b = run(args.before, workload, workers, args)
            a = run(args.after, workload, workers, args)
            before.append(b)
            after.append(a)
            ratios.append(a / b)
        ratio = statistics.median(ratios)
        mark = " **slower**" if ratio < 1 - args.limit / 100 else ""
        slower += bool(mark)
        print(f"| {workload} | {workers} | {statistics.median(before):,.0f} | {statistics.median(after):,.0f} | "
              f"{ratio:.3f}{mark} | {min(ratios):.2f}-{max(ratios):.2f} |", flush=True)
    print(f"\n{len(configs)} configurations, {args.pairs} pairs each, {slower} more than {args.limit:g}% slower")
    return 1 if slower else 0


if __name__ == "__main__":
    sys.exit(main())
