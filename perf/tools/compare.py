#!/usr/bin/env python3
"""Before/after: two results.json files from perf/run_all, one table.

    perf/tools/compare.py BEFORE/results.json AFTER/results.json [--limit 3]

For each (workload, peer, workers, mode) both runs measured, the median
samples/s of each and after / before. Rows more than --limit percent slower
are marked; the exit status is 1 when any is. Run the two suites back to
back on the same machine (better: interleaved), and read the ratios, not
the absolute figures.
"""
import argparse
import json
import statistics
import sys


def medians(path):
    with open(path) as f:
        runs = json.load(f)["runs"]
    rates = {}
    for run in runs:
        result = run.get("result") or {}
        if run.get("rc") != 0 or "samples_per_s" not in result:
            continue
        key = (run["workload"], run["peer"], run["workers"], run.get("mode", ""))
        rates.setdefault(key, []).append(result["samples_per_s"])
    return {key: statistics.median(values) for key, values in rates.items()}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("before")
    parser.add_argument("after")
    parser.add_argument("--limit", type=float, default=3.0, help="percent slower that counts as a regression")
    args = parser.parse_args()
    before, after = medians(args.before), medians(args.after)
    common = sorted(set(before) & set(after), key=lambda k: (k[0], k[1], k[2], k[3]))
    if not common:
        print("compare: the two runs share no configuration", file=sys.stderr)
        return 2
    print("| workload | peer | W | mode | before samples/s | after samples/s | after / before |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    slower = 0
    for key in common:
        ratio = after[key] / before[key]
        mark = ""
        if ratio < 1 - args.limit / 100:
            mark = " **slower**"
            slower += 1
        workload, peer, workers, mode = key
        print(f"| {workload} | {peer} | {workers} | {mode} | {before[key]:,.0f} | {after[key]:,.0f} | {ratio:.3f}{mark} |")
    only = sorted(set(before) ^ set(after))
    if only:
        print(f"\n{len(only)} configurations ran in one suite only: {only}")
    print(f"\n{len(common)} configurations, {slower} more than {args.limit:g}% slower")
    return 1 if slower else 0


if __name__ == "__main__":
    sys.exit(main())
