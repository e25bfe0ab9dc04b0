#!/usr/bin/env python3
"""The best any batch-level loader can do on W4, with zero overhead.

W4's samples cost 50 us, and 20 ms for every 100th index; batches of 32 come
from a sequential sampler.  This model runs W workers that never waste a
microsecond: the consumer keeps `prefetch x W` batches submitted and takes
each one the instant it is ready, so its `next()` wait is pure scheduling.
Two ways to hand out batches, as conveyor's two modes do:

  round_robin   batch b goes to worker b % W (PyTorch's rule)
  work_stealing batch b goes to whichever worker is free first

and delivery in sampler order or as batches complete.  Its p99 of the
`next()` wait is the floor for the suite's measured p99 of the same mode;
`results.md` shows how close conveyor comes.

usage: perf/tools/w4_model.py [--batches N] [--prefetch P] [W ...]
"""
import argparse
import heapq

STRAGGLER_EVERY = 100
FAST_US, STRAGGLER_US = 50.0, 20000.0
BATCH = 32


def batch_cost_us(b, overshoot_us=0.0):
    return sum((STRAGGLER_US if (b * BATCH + j) % STRAGGLER_EVERY == 0 else FAST_US) + overshoot_us
               for j in range(BATCH))


def overshoot_from_mean(measured_mean_us):
    """What each sleep overran on average, from the measured mean cost per
    sample over indices 0..999 (the calibration's w4_mean_cost_us): the
    nominal mean is 0.99 x 50 + 0.01 x 20000 = 249.5 us."""
    nominal = (1 - 1 / STRAGGLER_EVERY) * FAST_US + STRAGGLER_US / STRAGGLER_EVERY
    return max(0.0, measured_mean_us - nominal)


def run(workers, mode, in_order, batches, prefetch, overshoot_us=0.0):
    """Returns (p50 wait ms, p99 wait ms, samples/s) over all but the first 5% of batches.
    `overshoot_us` adds to every sample's cost (a machine's sleeps overrun:
    the bound on that machine)."""
    window = prefetch * workers
    worker_free_at = [0.0] * workers
    completion = {}           # batch -> time it completes
    completed = []            # heap of (time, batch) not yet delivered
    now, submitted, waits = 0.0, 0, []
    for delivered in range(batches - window):
        while submitted - delivered < window:
            b = submitted
            submitted += 1
            w = b % workers if mode == "round_robin" else min(range(workers), key=worker_free_at.__getitem__)
            worker_free_at[w] = max(worker_free_at[w], now) + batch_cost_us(b, overshoot_us)
            completion[b] = worker_free_at[w]
            heapq.heappush(completed, (worker_free_at[w], b))
        if in_order:
            ready_at = completion.pop(delivered)
        else:
            ready_at, b = heapq.heappop(completed)
            completion.pop(b)
        waits.append(max(0.0, ready_at - now))
        now = max(now, ready_at)
    waits = waits[len(waits) // 20:]
    samples_per_s = len(waits) * BATCH / (sum(waits) / 1e6)
    waits.sort()
    pick = lambda q: waits[int(q * (len(waits) - 1))] / 1000.0
    return pick(0.50), pick(0.99), samples_per_s


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("workers", nargs="*", type=int, default=[4, 16])
    parser.add_argument("--batches", type=int, default=20000)
    parser.add_argument("--prefetch", type=int, default=2)
    args = parser.parse_args()
    print("| W | mode | next() p50 | next() p99 | samples/s |")
    print("|---|---|---|---|---|")
    for workers in args.workers:
        for mode in ("round_robin", "work_stealing"):
            for in_order in (False, True):
                p50, p99, rate = run(workers, mode, in_order, args.batches, args.prefetch)
                label = f"{mode}, in_order={'on' if in_order else 'off'}"
                print(f"| {workers} | {label} | {p50:.2f} ms | {p99:.2f} ms | {rate:,.0f} |")


if __name__ == "__main__":
    main()
