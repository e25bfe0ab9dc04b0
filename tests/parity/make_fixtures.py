#!/usr/bin/python3
"""Writes conveyor's order-parity fixtures from the real PyTorch objects.

Run with Debian's python3-torch (1.13):  /usr/bin/python3 tests/parity/make_fixtures.py
The output files in tests/parity/fixtures/ are committed; tests/parity/parity_test.cpp
replays every case through conveyor's public API.

Line format, one case per line:   name|key=value;key=value|result
  result: values separated by ' ', batches by ',', epochs by '/'.
  Lines starting with '#' are comments.
"""
import math
import os
import re
import sys
import warnings

import torch
from torch.utils.data import (BatchSampler, DataLoader, Dataset, DistributedSampler, IterableDataset,
                              RandomSampler, SequentialSampler, SubsetRandomSampler,
                              WeightedRandomSampler, get_worker_info, random_split)

assert torch.__version__.startswith("1.13"), f"fixtures come from PyTorch 1.13, not {torch.__version__}"
OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures")
warnings.simplefilter("ignore")

SEEDS = [0, 1, 42, 2**32 + 7, 67280421310721, 2**63 - 1]


def flat(values):
    return " ".join(str(int(v)) if not isinstance(v, float) else repr(v) for v in values)


def batches(list_of_lists):
    return ",".join(flat(b) for b in list_of_lists)


def epochs(list_of_epochs, fmt=flat):
    return "/".join(fmt(e) for e in list_of_epochs)


def params(**kw):
    return ";".join(f"{k}={v}" for k, v in kw.items())


class Writer:
    def __init__(self, name):
        self.path = os.path.join(OUT, name)
        self.lines = [f"# written by tests/parity/make_fixtures.py with torch {torch.__version__}"]

    def add(self, case, p, result):
        self.lines.append(f"{case}|{p}|{result}")

    def close(self):
        with open(self.path, "w") as f:
            f.write("\n".join(self.lines) + "\n")
        print(f"{self.path}: {len(self.lines) - 1} cases")


def gen(seed):
    return torch.Generator().manual_seed(seed)


def generator_cases():
    w = Writer("generator.txt")
    for seed in SEEDS:
        g = gen(seed)
        w.add("draw_seed", params(seed=seed), flat(torch.empty(8, dtype=torch.int64).random_(generator=g).tolist()))
        for n in [0, 1, 2, 3, 10, 100, 1000, 5000]:
            w.add("randperm", params(seed=seed, n=n), flat(torch.randperm(n, generator=gen(seed)).tolist()))
        for low, high in [(0, 10), (-5, 7), (0, 2**31), (0, 2**32), (3, 2**40 + 3), (0, 1)]:
            g = gen(seed)
            w.add("randint", params(seed=seed, low=low, high=high, count=40),
                  flat(torch.randint(low, high, (40,), generator=g).tolist()))
        g = gen(seed)
        w.add("uniform_double", params(seed=seed, count=6), flat(torch.rand(6, dtype=torch.float64, generator=g).tolist()))
        g = gen(seed)
        w.add("uniform_float", params(seed=seed, count=6), flat(torch.rand(6, dtype=torch.float32, generator=g).tolist()))
    # A generator that was never seeded starts at 67280421310721.
    w.add("randperm_unseeded", params(n=20), flat(torch.randperm(20, generator=torch.Generator()).tolist()))
    weights_sets = {
        "w5": [0.1, 0.9, 0.4, 0.7, 3.0],
        "w6": [0.9, 0.4, 0.05, 0.2, 0.3, 0.1],
        "ties": [0.0, 0.0, 0.0, 1.0, 0.0, 0.0],
        "flat64": [1.0] * 64,
        "ramp200": [float(i + 1) for i in range(200)],
        "one": [2.5],
    }
    for seed in SEEDS[:4]:
        for name, weights in weights_sets.items():
            wt = torch.as_tensor(weights, dtype=torch.double)
            for replacement in [True, False]:
                for k in [1, 2, 3, 5, 6, 64, 150]:
                    if not replacement and k > len(weights):
                        continue
                    if name == "one" and k > 1 and not replacement:
                        continue
                    g = gen(seed)
                    try:
                        r = torch.multinomial(wt, k, replacement, generator=g).tolist()
                    except RuntimeError:
                        continue
                    w.add("multinomial", params(seed=seed, weights=name, k=k, replacement=int(replacement)),
                          flat(r) + "/" + flat(torch.empty(2, dtype=torch.int64).random_(generator=g).tolist()))
    w.close()
    return weights_sets


def sampler_cases(weights_sets):
    w = Writer("samplers.txt")
    for seed in SEEDS[:4]:
        for n in [1, 2, 7, 10, 33, 100]:
            for replacement, num_samples in [(False, None), (False, 3), (False, 25), (False, 250), (True, None),
                                             (True, 31), (True, 32), (True, 65), (True, 100)]:
                g = gen(seed)
                s = RandomSampler(range(n), replacement=replacement, num_samples=num_samples, generator=g)
                eps = [list(s) for _ in range(3)]
                w.add("random", params(seed=seed, n=n, replacement=int(replacement),
                                       num_samples=-1 if num_samples is None else num_samples), epochs(eps))
            # Without a generator: each epoch draws a private seed from the default generator.
            torch.manual_seed(seed)
            s = RandomSampler(range(n))
            eps = [list(s) for _ in range(2)]
            w.add("random_default", params(seed=seed, n=n), epochs(eps))
        for indices in [[5], [3, 9, 4, 1], list(range(10, 40, 3))]:
            g = gen(seed)
            s = SubsetRandomSampler(indices, generator=g)
            eps = [list(s) for _ in range(2)]
            w.add("subset_random", params(seed=seed, indices=flat(indices)), epochs(eps))
            torch.manual_seed(seed)
            s = SubsetRandomSampler(indices)
            w.add("subset_random_default", params(seed=seed, indices=flat(indices)), epochs([list(s), list(s)]))
        for name, weights in weights_sets.items():
            for replacement, k in [(True, 1), (True, 7), (True, 40), (False, 1), (False, 3), (False, len(weights))]:
                if not replacement and k > len(weights):
                    continue
                g = gen(seed)
                s = WeightedRandomSampler(weights, k, replacement=replacement, generator=g)
                eps = [list(s) for _ in range(2)]
                w.add("weighted", params(seed=seed, weights=name, k=k, replacement=int(replacement)), epochs(eps))
        for n in [10, 32, 33]:
            for bs in [1, 3, 8, 32, 50]:
                for drop_last in [False, True]:
                    g = gen(seed)
                    s = BatchSampler(RandomSampler(range(n), generator=g), bs, drop_last)
                    eps = [list(s) for _ in range(2)]
                    w.add("batch", params(seed=seed, n=n, batch_size=bs, drop_last=int(drop_last)),
                          epochs(eps, batches))
    for n in [0, 1, 3, 10, 11, 17]:
        for replicas in [1, 2, 3, 4, 8]:
            for rank in range(replicas):
                for shuffle in [True, False]:
                    for drop_last in [False, True]:
                        for seed in [0, 7]:
                            s = DistributedSampler(range(n), num_replicas=replicas, rank=rank, shuffle=shuffle,
                                                   seed=seed, drop_last=drop_last)
                            eps = []
                            for e in [0, 1, 3]:
                                s.set_epoch(e)
                                eps.append(list(s))
                            w.add("distributed", params(n=n, replicas=replicas, rank=rank, shuffle=int(shuffle),
                                                        seed=seed, drop_last=int(drop_last)), epochs(eps))
    for n, lengths in [(10, [3, 7]), (10, [10]), (10, [0, 10]), (30, [0.3, 0.3, 0.4]), (10, [0.5, 0.5]),
                       (11, [0.5, 0.5]), (7, [0.1, 0.2, 0.7]), (5, [0.1, 0.1, 0.8]), (100, [0.33, 0.33, 0.34]),
                       (1, [1])]:
        for seed in SEEDS[:3]:
            parts = random_split(range(n), lengths, generator=gen(seed))
            w.add("random_split", params(seed=seed, n=n, lengths=" ".join(map(str, lengths))),
                  batches([list(p.indices) for p in parts]))
    w.close()


class Range(Dataset):
    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return i


def loader_cases():
    w = Writer("loader.txt")
    for seed in SEEDS[:4]:
        for n, bs, shuffle, drop_last in [(10, 3, True, False), (10, 3, True, True), (64, 8, True, False),
                                          (7, 1, False, False), (100, 16, True, True), (5, 10, True, False),
                                          (20, 4, False, True)]:
            loader = DataLoader(Range(n), batch_size=bs, shuffle=shuffle, drop_last=drop_last,
                                generator=gen(seed))
            eps, base_seeds = [], []
            for _ in range(3):
                it = iter(loader)
                base_seeds.append(it._base_seed)
                eps.append([b.tolist() for b in it])
            w.add("loader", params(seed=seed, n=n, batch_size=bs, shuffle=int(shuffle), drop_last=int(drop_last)),
                  epochs(eps, batches) + "|" + flat(base_seeds))
        # No generator: the base seed and the sampler's private seed both come
        # from the default generator, base seed first.
        torch.manual_seed(seed)
        loader = DataLoader(Range(12), batch_size=5, shuffle=True)
        eps, base_seeds = [], []
        for _ in range(2):
            it = iter(loader)
            base_seeds.append(it._base_seed)
            eps.append([b.tolist() for b in it])
        w.add("loader_default", params(seed=seed, n=12, batch_size=5), epochs(eps, batches) + "|" + flat(base_seeds))
    w.close()


class Draws(Dataset):
    """Sample i: (i, a draw from the worker's default generator, worker id)."""

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        info = get_worker_info()
        return (i, int(torch.randint(0, 1000000, (1,)).item()), -1 if info is None else info.id)


class WorkerStreams(IterableDataset):
    """Worker w yields lengths[w] samples (w*1000 + k, a draw, w)."""

    def __init__(self, lengths):
        self.lengths = lengths

    def __iter__(self):
        info = get_worker_info()
        w = 0 if info is None else info.id
        for k in range(self.lengths[w]):
            yield (w * 1000 + k, int(torch.randint(0, 1000000, (1,)).item()), w)


def triples(batch):
    ids, draws, workers = batch
    return " ".join(f"{a}:{b}:{c}" for a, b, c in zip(ids.tolist(), draws.tolist(), workers.tolist()))


def worker_cases():
    """The threaded engine in round_robin mode must reproduce PyTorch's
    workers: batch order, and values drawn inside the dataset."""
    w = Writer("workers.txt")
    for seed in [0, 5, 2**32 + 3]:
        for workers, n, bs, shuffle, drop_last, persistent in [
                (1, 10, 3, True, False, False), (2, 17, 4, True, False, False), (3, 20, 3, True, True, False),
                (2, 9, 2, False, False, False), (3, 30, 4, True, False, True), (2, 12, 5, True, False, True)]:
            loader = DataLoader(Draws(n), batch_size=bs, shuffle=shuffle, drop_last=drop_last, num_workers=workers,
                                generator=gen(seed), persistent_workers=persistent)
            eps = []
            for _ in range(3):
                eps.append(",".join(triples(b) for b in loader))
            w.add("map", params(seed=seed, workers=workers, n=n, batch_size=bs, shuffle=int(shuffle),
                                drop_last=int(drop_last), persistent=int(persistent)), "/".join(eps))
        for workers, lengths, bs, drop_last in [(2, [5, 3], 2, False), (3, [5, 1, 8], 2, False),
                                                (3, [5, 1, 8], 2, True), (2, [0, 4], 3, False), (4, [3, 3, 3, 3], 2, True)]:
            loader = DataLoader(WorkerStreams(lengths), batch_size=bs, drop_last=drop_last, num_workers=workers,
                                generator=gen(seed))
            eps = [",".join(triples(b) for b in loader) for _ in range(2)]
            w.add("iterable", params(seed=seed, workers=workers, lengths=flat(lengths), batch_size=bs,
                                     drop_last=int(drop_last)), "/".join(eps))
    w.close()


class Stream(IterableDataset):
    def __iter__(self):
        return iter(range(4))


def error_cases():
    """The exception and message PyTorch gives for each mistake. 'prefix' cases
    end in a Python object repr that C++ cannot reproduce; only the text before
    it is compared."""
    from torch.utils.data._utils.collate import default_collate
    w = Writer("errors.txt")
    ds = Range(10)

    def case(name, fn, mode="exact"):
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - recording whatever PyTorch raises
            message = re.sub(r" object at 0x[0-9a-f]+", " object", str(e))  # stable across runs
            w.add(name, params(mode=mode), f"{type(e).__name__}: {message}")
            return
        raise AssertionError(f"{name}: PyTorch raised nothing")

    case("num_workers_negative", lambda: DataLoader(ds, num_workers=-1))
    case("timeout_negative", lambda: DataLoader(ds, timeout=-1))
    case("prefetch_without_workers", lambda: DataLoader(ds, prefetch_factor=3))
    case("persistent_without_workers", lambda: DataLoader(ds, persistent_workers=True))
    case("iterable_shuffle", lambda: DataLoader(Stream(), shuffle=True))
    case("iterable_sampler", lambda: DataLoader(Stream(), sampler=SequentialSampler(ds)), "prefix")
    case("iterable_batch_sampler",
         lambda: DataLoader(Stream(), batch_sampler=BatchSampler(SequentialSampler(ds), 2, False)), "prefix")
    case("sampler_and_shuffle", lambda: DataLoader(ds, sampler=SequentialSampler(ds), shuffle=True))
    bs = BatchSampler(SequentialSampler(ds), 2, False)
    case("batch_sampler_and_batch_size", lambda: DataLoader(ds, batch_sampler=bs, batch_size=2))
    case("batch_sampler_and_shuffle", lambda: DataLoader(ds, batch_sampler=bs, shuffle=True))
    case("batch_sampler_and_sampler", lambda: DataLoader(ds, batch_sampler=bs, sampler=SequentialSampler(ds)))
    case("batch_sampler_and_drop_last", lambda: DataLoader(ds, batch_sampler=bs, drop_last=True))
    case("no_batching_drop_last", lambda: DataLoader(ds, batch_size=None, drop_last=True))
    case("batch_size_zero", lambda: DataLoader(ds, batch_size=0))
    case("batch_size_negative", lambda: DataLoader(ds, batch_size=-3))
    case("random_sampler_num_samples_zero", lambda: RandomSampler(ds, num_samples=0))
    case("random_sampler_empty_dataset", lambda: RandomSampler(Range(0)))
    case("weighted_num_samples_zero", lambda: WeightedRandomSampler([1.0, 2.0], 0))
    case("distributed_rank_too_big", lambda: DistributedSampler(ds, num_replicas=2, rank=2))
    case("distributed_rank_negative", lambda: DistributedSampler(ds, num_replicas=3, rank=-1))
    case("random_split_bad_sum", lambda: random_split(ds, [3, 3]))
    case("random_split_fractions_over_one", lambda: random_split(ds, [0.5, 0.6]))
    case("random_split_bad_fraction", lambda: random_split(ds, [1.5, -0.5]))
    case("concat_empty", lambda: torch.utils.data.ConcatDataset([]))
    d = lambda v: torch.tensor(v, dtype=torch.double)  # noqa: E731
    case("multinomial_negative", lambda: torch.multinomial(d([-1.0, 0.0, 1.0]), 2, True))
    case("multinomial_nan", lambda: torch.multinomial(d([float("nan"), 0.0, 1.0]), 1, True))
    case("multinomial_inf", lambda: torch.multinomial(d([float("inf"), 0.0, 1.0]), 2, True))
    case("multinomial_zero_sum", lambda: torch.multinomial(d([0.0, 0.0]), 2, True))
    case("multinomial_too_many", lambda: torch.multinomial(d([1.0, 0.0, 1.0]), 4, False))
    case("multinomial_negative_no_replacement", lambda: torch.multinomial(d([-1.0, 2.0, 1.0]), 2, False))
    case("multinomial_nan_no_replacement", lambda: torch.multinomial(d([float("nan"), 2.0, 1.0]), 2, False))
    case("multinomial_zero_sum_no_replacement", lambda: torch.multinomial(d([0.0, 0.0, 0.0]), 2, False))
    case("randint_empty_range", lambda: torch.randint(0, 0, (3,)))
    case("stack_unequal", lambda: torch.stack([torch.zeros(3), torch.zeros(4)]))
    case("collate_unequal_lists", lambda: default_collate([[1, 2], [1]]))
    case("collate_missing_key", lambda: default_collate([{"a": 1}, {"b": 2}]))
    case("len_unsized_iterable", lambda: len(DataLoader(Stream())), "prefix")
    case("tensor_dataset_mismatch",
         lambda: torch.utils.data.TensorDataset(torch.zeros(3, 2), torch.zeros(4)))
    w.close()


def main():
    os.makedirs(OUT, exist_ok=True)
    weights_sets = generator_cases()
    sampler_cases(weights_sets)
    loader_cases()
    worker_cases()
    error_cases()


if __name__ == "__main__":
    sys.exit(main())
