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


# What a run's work depends on beyond its key: rows whose work differs
# between the suites are not compared (W2's iterations are calibrated per
# suite, so two suites can give W2 different work).
WORK = ("w2_iterations", "batch_size", "batches_per_epoch")


def medians(path):
    """(median samples/s by configuration, failed runs by configuration,
    the work each configuration did)."""
    with open(path) as f:
        runs = json.load(f)["runs"]
    rates, failures, work = {}, {}, {}
    for run in runs:
        key = (run["workload"], run["peer"], run["workers"], run.get("mode", ""))
        result = run.get("result") or {}
        if run.get("rc") != 0 or "samples_per_s" not in result:
            failures[key] = failures.get(key, 0) + 1
            continue
        rates.setdefault(key, []).append(result["samples_per_s"])
        work.setdefault(key, {}).update({name: result[name] for name in WORK if name in result})
    return {key: statistics.median(values) for key, values in rates.items()}, failures, work


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("before")
    parser.add_argument("after")
    parser.add_argument("--limit", type=float, default=3.0, help="percent slower that counts as a regression")
    args = parser.parse_args()
    (before, _, before_work), (after, after_failures, after_work) = medians(args.before), medians(args.after)
    # A configuration that ran before and failed after is the worst
    # regression, not a row left out.
    failed = sorted(key for key in after_failures if key in before)
    different = sorted(key for key in set(before) & set(after)
                       if before_work.get(key, {}) != after_work.get(key, {}))
    common = sorted(set(before) & set(after) - set(failed) - set(different), key=lambda k: (k[0], k[1], k[2], k[3]))
    if not common and not failed:
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
    for key in failed:
        workload, peer, workers, mode = key
        print(f"| {workload} | {peer} | {workers} | {mode} | {before[key]:,.0f} | "
              f"FAILED {after_failures[key]} run(s) | **failed** |")
    only = sorted((set(before) ^ set(after)) - set(failed))
    if only:
        print(f"\n{len(only)} configurations ran in one suite only: {only}")
    for key in different:
        print(f"\nnot compared, the work differs: {key}: before {before_work.get(key)}, after {after_work.get(key)}")
    print(f"\n{len(common)} configurations, {slower} more than {args.limit:g}% slower, {len(failed)} failed after")
    return 1 if slower or failed else 0


if __name__ == "__main__":
    sys.exit(main())
