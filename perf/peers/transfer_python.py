#!/usr/bin/env python3
"""PyTorch's DataLoader on conveyor_bench_transfer's BM_StageCopy work.

The same samples (64 per batch, float32, each sample's bytes set to its
index & 0xff with one fill), default collate, `num_workers` persistent
workers, pin_memory=True, and each batch copied to the GPU with
.to("cuda", non_blocking=True) and waited for, as BM_StageCopy waits on each
batch's ready event. Prints one JSON line: bytes/s and batches/s.

Needs a PyTorch with CUDA and a GPU (the device machine has both); run it
beside conveyor_bench_transfer in the same call and compare ratios.

  python3 perf/peers/transfer_python.py --batch-bytes 12582912 --workers 12
"""
import argparse
import json
import time

import torch
from torch.utils.data import DataLoader, Dataset

BATCH = 64


class Floats(Dataset):
    def __init__(self, floats):
        self.floats = floats

    def __len__(self):
        return 1 << 20

    def __getitem__(self, i):
        sample = torch.empty(self.floats, dtype=torch.float32)
        sample.view(torch.uint8).fill_(i & 0xFF)
        return sample


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch-bytes", type=int, required=True)
    parser.add_argument("--workers", type=int, required=True)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--warmup", type=float, default=1.0)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("transfer_python: no CUDA device for PyTorch here")

    dataset = Floats(args.batch_bytes // 4 // BATCH)
    loader = DataLoader(dataset, batch_size=BATCH, num_workers=args.workers, pin_memory=True,
                        persistent_workers=args.workers > 0)
    stream = torch.cuda.current_stream()
    batches = iter(loader)

    def step():
        on_device = next(batches).to("cuda", non_blocking=True)
        stream.synchronize()
        return on_device

    deadline = time.perf_counter() + args.warmup
    while time.perf_counter() < deadline:
        step()
    count = 0
    start = time.perf_counter()
    while time.perf_counter() - start < args.seconds:
        step()
        count += 1
    elapsed = time.perf_counter() - start
    print(json.dumps({"peer": "pytorch", "torch": torch.__version__, "batch_bytes": args.batch_bytes,
                      "workers": args.workers, "batches": count, "seconds": round(elapsed, 3),
                      "bytes_per_second": count * args.batch_bytes / elapsed,
                      "batches_per_second": count / elapsed}), flush=True)


if __name__ == "__main__":
    main()
