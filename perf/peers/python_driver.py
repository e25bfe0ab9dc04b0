#!/usr/bin/python3
"""PyTorch's torch.utils.data.DataLoader as a peer in conveyor's performance
suite (perf/run_all). Run with Debian's /usr/bin/python3 (python3-torch 1.13).

  python_driver.py --workload W0..W6 --workers N [--seconds S] [--warmup S]
                   [--samples N] [--w2-iterations K] [--shards a.tar,b.tar]
                   [--objects http://host:port/dir/{00000..09999}.jpg]
  python_driver.py --calibrate [--target-us 50]

The same workloads, protocol and JSON line as the C++ drivers
(perf/peers/workloads.h): sequential order, DataLoader(num_workers=W,
persistent_workers=W > 0, prefetch_factor 2 (the default)); a warm-up
epoch cut after --warmup seconds, then --seconds of timed batches.
"""
import argparse
import ctypes
import io
import json
import os
import sys
import time

import torch
from torch.utils.data import DataLoader, Dataset

BATCH = {"W0": 8, "W1": 256, "W2": 64, "W3": 32, "W4": 32, "W5": 64, "W6": 64}
MASK = (1 << 64) - 1

# ---- the work -------------------------------------------------------------

_slack_pid = None


def tight_timer_slack():
    """1 ns of timer slack for this process's sleeping thread (once), as the
    C++ drivers ask for theirs: 50 us..1 ms sleeps are the workload."""
    global _slack_pid
    if _slack_pid != os.getpid():
        ctypes.CDLL(None, use_errno=True).prctl(29, ctypes.c_ulong(1), 0, 0, 0)  # PR_SET_TIMERSLACK
        _slack_pid = os.getpid()


def spin(seed, iterations):
    """W2: the C++ spin() loop (64-bit LCG + xorshift), in Python integers."""
    x = (seed * 0x9E3779B97F4A7C15 + 1) & MASK
    for _ in range(iterations):
        x = (x * 6364136223846793005 + 1442695040888963407) & MASK
        x ^= x >> 29
    return x >> 1


class Tiny(Dataset):  # W0
    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return i


class InMemoryImages(Dataset):  # W1: TensorDataset-like, a sample is a view; collate copies once
    def __init__(self, n):
        i = torch.arange(n, dtype=torch.int64).view(n, 1)
        j = torch.arange(3072, dtype=torch.int64).view(1, 3072)
        self.images = (((i * 131 + j * 7) % 1024).to(torch.float32) / 1024.0).view(n, 3, 32, 32)
        self.labels = [k % 10 for k in range(n)]
        self.bytes = self.images.numel() * 4 + n * 8

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        return self.images[i], self.labels[i]


class Spin(Dataset):  # W2
    def __init__(self, n, iterations):
        self.n, self.iterations = n, iterations

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return spin(i, self.iterations)


class Sleep(Dataset):  # W3: 1 ms
    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        tight_timer_slack()
        time.sleep(0.001)
        return i


class Stragglers(Dataset):  # W4: 50 us, every 100th 20 ms
    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        tight_timer_slack()
        time.sleep(0.020 if i % 100 == 0 else 0.000050)
        return i


class ShardImages(Dataset):
    """W5: the JPEG tar shards, map-style: tarfile indexes every member's
    offset once; each sample is two os.pread()s, PIL decode (mode L), then
    RandomCrop(28, padding=2) + RandomHorizontalFlip(0.5) + ToTensor-like
    scaling + Normalize(0.2860, 0.3530) in numpy."""

    def __init__(self, shards):
        import tarfile
        self.samples = []  # (path, jpg offset, jpg size, cls offset, cls size)
        for path in shards:
            with tarfile.open(path) as tar:
                groups = {}
                order = []
                for member in tar.getmembers():
                    if not member.isfile():
                        continue
                    base = member.name.rsplit("/", 1)[-1]
                    if "." not in base:
                        continue
                    key = member.name[: len(member.name) - len(base) + base.index(".")]
                    ext = base[base.index(".") + 1:]
                    if key not in groups:
                        groups[key] = {}
                        order.append(key)
                    groups[key][ext] = (member.offset_data, member.size)
            for key in order:
                g = groups[key]
                if "jpg" in g and "cls" in g:
                    self.samples.append((path,) + g["jpg"] + g["cls"])
        self.fds = {}
        self.rng = None
        self.rng_pid = None

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, i):
        import numpy as np
        from PIL import Image
        if self.rng_pid != os.getpid():  # one generator per worker process
            self.rng = np.random.default_rng(torch.initial_seed() % (1 << 63))
            self.rng_pid = os.getpid()
            self.fds = {}
        path, jpg_off, jpg_size, cls_off, cls_size = self.samples[i]
        fd = self.fds.get(path)
        if fd is None:
            fd = self.fds[path] = os.open(path, os.O_RDONLY)
        jpg = os.pread(fd, jpg_size, jpg_off)
        label = int(os.pread(fd, cls_size, cls_off))
        image = np.asarray(Image.open(io.BytesIO(jpg)).convert("L"), dtype=np.uint8)
        h, w = image.shape
        padded = np.zeros((h + 4, w + 4), dtype=np.uint8)
        padded[2:2 + h, 2:2 + w] = image
        top = int(self.rng.integers(0, h + 4 - 28 + 1))
        left = int(self.rng.integers(0, w + 4 - 28 + 1))
        crop = padded[top:top + 28, left:left + 28]
        if self.rng.random() < 0.5:
            crop = crop[:, ::-1]
        out = (crop.astype(np.float32) * np.float32(1 / 255) - np.float32(0.2860)) / np.float32(0.3530)
        return torch.from_numpy(np.ascontiguousarray(out[None])), label


def expand_pattern(pattern):
    """One {first..last} range, zero-padded to first's width, as
    conveyor::expand_shard_pattern reads it."""
    import re
    found = re.search(r"\{(\d+)\.\.(\d+)\}", pattern)
    if not found:
        return [pattern]
    first, last = found.group(1), found.group(2)
    return [pattern[:found.start()] + str(i).zfill(len(first)) + pattern[found.end():]
            for i in range(int(first), int(last) + 1)]


class HttpImages(Dataset):
    """W6-http: one GET per sample on the worker process's own kept-alive
    connection (http.client), PIL decode (mode L), scaling and Normalize(0.2860,
    0.3530) in numpy: the C++ peers' work (w6_work.h)."""

    def __init__(self, urls):
        from urllib.parse import urlsplit
        self.urls = urls
        first = urlsplit(urls[0])
        self.host, self.port = first.hostname, first.port or 80
        self.paths = [urlsplit(u).path for u in urls]
        self.connection = None
        self.connection_pid = None

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, i):
        import http.client
        import numpy as np
        from PIL import Image
        if self.connection_pid != os.getpid():  # one connection per worker process
            self.connection = http.client.HTTPConnection(self.host, self.port, timeout=30)
            self.connection_pid = os.getpid()
        self.connection.request("GET", self.paths[i])
        response = self.connection.getresponse()
        body = response.read()
        if response.status != 200:
            raise RuntimeError(f"{self.urls[i]}: HTTP {response.status}")
        image = np.asarray(Image.open(io.BytesIO(body)).convert("L"), dtype=np.uint8)
        out = (image.astype(np.float32) * np.float32(1 / 255) - np.float32(0.2860)) / np.float32(0.3530)
        return torch.from_numpy(np.ascontiguousarray(out[None]))


# ---- calibration ----------------------------------------------------------

def mean_cost_us(iterations, samples, seed):
    start = time.perf_counter()
    for i in range(samples):
        spin(seed + i, iterations)
    return (time.perf_counter() - start) * 1e6 / samples


def calibrate(target_us):
    iterations = 16
    cost = mean_cost_us(iterations, 100, 1)
    while cost * 100 < 20000:
        iterations *= 2
        cost = mean_cost_us(iterations, 100, 1)
    for _ in range(3):
        iterations = max(1, round(iterations * target_us / cost))
        trials = sorted(mean_cost_us(iterations, 100, 7 + t) for t in range(5))
        cost = trials[2]
    trials = [mean_cost_us(iterations, 200, 100 + t) for t in range(7)]
    print(json.dumps({"language": "python", "w2_target_us": target_us, "w2_iterations": iterations,
                      "w2_cost_us": sorted(trials)[3], "w2_cost_trials_us": trials,
                      "cores": os.cpu_count()}), flush=True)


# ---- the timed loop -------------------------------------------------------

def percentile(values, q):
    if not values:
        return 0.0
    values = sorted(values)
    rank = q * (len(values) - 1)
    low = int(rank)
    high = min(len(values) - 1, low + 1)
    return values[low] + (values[high] - values[low]) * (rank - low)


def proc_cpu_seconds(pid):
    """user + system CPU seconds of one process (all its threads)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except OSError:
        return 0.0


def cpu_seconds(loader):
    """This process and, with workers, its worker processes."""
    t = os.times()
    total = t.user + t.system
    iterator = getattr(loader, "_iterator", None)
    for worker in getattr(iterator, "_workers", []) or []:
        total += proc_cpu_seconds(worker.pid)
    return total


def batch_length(batch):
    if isinstance(batch, (list, tuple)):
        return len(batch[-1])
    return len(batch)


def drive(args, loader):
    r = {"warmup_batches": 0, "warmup_samples": 0, "warmup_full_epoch": False}
    warm_start = time.perf_counter()
    it = iter(loader)
    epoch_open = True
    while True:
        try:
            batch = next(it)
        except StopIteration:
            epoch_open = False
            r["warmup_full_epoch"] = True
            break
        r["warmup_batches"] += 1
        r["warmup_samples"] += batch_length(batch)
        del batch
        if time.perf_counter() - warm_start >= args.warmup:
            break
    r["warmup_seconds"] = time.perf_counter() - warm_start
    waits = []
    samples = batches = epochs = 0
    cpu_start = cpu_seconds(loader)
    start = time.perf_counter()
    last = start
    while True:
        if not epoch_open:
            it = iter(loader)
            epoch_open = True
            epochs += 1
        asked = time.perf_counter()
        try:
            batch = next(it)
            got = True
        except StopIteration:
            got = False
        last = time.perf_counter()
        if not got:
            epoch_open = False
            if last - start >= args.seconds:
                break
            continue
        waits.append((last - asked) * 1e6)
        batches += 1
        samples += batch_length(batch)
        del batch
        if last - start >= args.seconds:
            break
    seconds = last - start
    cpu = cpu_seconds(loader) - cpu_start
    r.update({"samples": samples, "batches": batches, "seconds": seconds,
              "samples_per_s": samples / seconds if seconds > 0 else 0.0,
              "batches_per_s": batches / seconds if seconds > 0 else 0.0,
              "wait_p50_us": percentile(waits, 0.5), "wait_p99_us": percentile(waits, 0.99),
              "wait_max_us": max(waits) if waits else 0.0, "epochs_started": epochs,
              "cpu_seconds_timed": cpu})
    return r, it


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", default="W0", choices=sorted(BATCH))
    parser.add_argument("--workers", type=int, default=0)
    parser.add_argument("--seconds", type=float, default=2.0)
    parser.add_argument("--warmup", type=float, default=1.0)
    parser.add_argument("--samples", type=int, default=0)
    parser.add_argument("--batch-size", type=int, default=0)
    parser.add_argument("--w2-iterations", type=int, default=0)
    parser.add_argument("--shards", default="")
    parser.add_argument("--objects", default="")
    parser.add_argument("--calibrate", action="store_true")
    parser.add_argument("--target-us", type=float, default=50.0)
    args = parser.parse_args()
    if args.calibrate:
        calibrate(args.target_us)
        return 0
    w = args.workload
    batch_size = args.batch_size or BATCH[w]
    samples = args.samples or (10000 if w == "W1" else 1 << 20)
    extra = {}
    if w == "W0":
        dataset = Tiny(samples)
    elif w == "W1":
        dataset = InMemoryImages(samples)
        extra["dataset_bytes"] = dataset.bytes
    elif w == "W2":
        if args.w2_iterations <= 0:
            parser.error("W2 needs --w2-iterations (run_all calibrates it)")
        dataset = Spin(samples, args.w2_iterations)
        extra["w2_iterations"] = args.w2_iterations
    elif w == "W3":
        dataset = Sleep(samples)
    elif w == "W4":
        dataset = Stragglers(samples)
    elif w == "W6":
        if not args.objects:
            parser.error("W6 needs --objects (a URL pattern)")
        dataset = HttpImages(expand_pattern(args.objects))
        samples = len(dataset)
    else:
        shards = [s for s in args.shards.split(",") if s]
        if not shards:
            parser.error("W5 needs --shards")
        dataset = ShardImages(shards)
        samples = len(dataset)
    loader = DataLoader(dataset, batch_size=batch_size, shuffle=False, num_workers=args.workers,
                        persistent_workers=args.workers > 0)
    r, it = drive(args, loader)
    line = {"peer": "python", "workload": w, "workers": args.workers, "scheduling": "",
            "in_order": 1, "batch_size": batch_size, "dataset_samples": samples}
    line.update(r)
    line["torch_threads"] = torch.get_num_threads()
    line.update(extra)
    print(json.dumps(line), flush=True)
    del it
    return 0


if __name__ == "__main__":
    sys.exit(main())
