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

With --probe build-perf/perf/conveyor_perf_limits, the cache-line round
trip between the first two CPUs is taken before each run. A VM's host
places its vCPUs near (50-120 ns on the 2-vCPU machines) or apart
(330-400 ns) and moves them within minutes; a pair whose two runs met
round trips more than 2x apart compares placements, not builds. Such pairs
are counted and left out of the ratio (the medians of each side keep them).
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


def round_trip(probe):
    if not probe:
        return None
    done = subprocess.run([probe, "--core-round-trip"], capture_output=True, text=True)
    for line in reversed(done.stdout.splitlines()):
        if line.startswith("{"):
            return json.loads(line).get("core_round_trip_ns")
    return None


def same_placement(trip_a, trip_b):
    if not trip_a or not trip_b:
        return True  # no probe (or one CPU): nothing to tell them apart
    return max(trip_a, trip_b) <= 2 * min(trip_a, trip_b)


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
    parser.add_argument("--probe", default="",
                        help="conveyor_perf_limits: take the core round trip before each run (see above)")
    args = parser.parse_args()
    configs = [c.split() for c in (args.config or DEFAULT_CONFIGS)]
    if any(w == "W5" for w, _ in configs) and not args.shards:
        configs = [c for c in configs if c[0] != "W5"]
        print("pairs: W5 skipped (no --shards)", file=sys.stderr)
    print("| workload | W | before samples/s | after samples/s | after / before (median of pairs) | range "
          "| pairs across a placement change |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    slower = 0
    for workload, workers in configs:
        before, after, ratios, mixed = [], [], [], 0
        for _ in range(args.pairs):
            trip_b = round_trip(args.probe)
            b = run(args.before, workload, workers, args)
            trip_a = round_trip(args.probe)
            a = run(args.after, workload, workers, args)
            before.append(b)
            after.append(a)
            if same_placement(trip_b, trip_a):
                ratios.append(a / b)
            else:
                mixed += 1
        if not ratios:
            print(f"| {workload} | {workers} | {statistics.median(before):,.0f} | {statistics.median(after):,.0f} | "
                  f"- | - | {mixed} (all) |", flush=True)
            continue
        ratio = statistics.median(ratios)
        mark = " **slower**" if ratio < 1 - args.limit / 100 else ""
        slower += bool(mark)
        print(f"| {workload} | {workers} | {statistics.median(before):,.0f} | {statistics.median(after):,.0f} | "
              f"{ratio:.3f}{mark} | {min(ratios):.2f}-{max(ratios):.2f} | {mixed} |", flush=True)
    print(f"\n{len(configs)} configurations, {args.pairs} pairs each, {slower} more than {args.limit:g}% slower")
    return 1 if slower else 0


if __name__ == "__main__":
    sys.exit(main())
