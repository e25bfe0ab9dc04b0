// Small datasets shared by the tests.
#pragma once

#include <conveyor/dataset.h>

#include <atomic>
#include <cstdint>
#include <optional>
#include <set>
#include <stdexcept>
#include <string>
#include <vector>

namespace conveyor::testing {

// Sample i is i.
struct RangeDataset final : Dataset<int64_t> {
  explicit RangeDataset(size_t n) : n(n) {}
  size_t size() const override { return n; }
  int64_t get(size_t i) override { return static_cast<int64_t>(i); }
  size_t n;
};

// Sample i is i, except the indices in `bad`, which throw.
struct ThrowingDataset final : Dataset<int64_t> {
  ThrowingDataset(size_t n, std::set<size_t> bad) : n(n), bad(std::move(bad)) {}
  size_t size() const override { return n; }
  int64_t get(size_t i) override {
    if (bad.count(i)) throw std::runtime_error("bad sample " + std::to_string(i));
    return static_cast<int64_t>(i);
  }
  size_t n;
  std::set<size_t> bad;
};

// An iterable over [0, n); with workers, worker w of W takes w, w+W, ...
struct StridedStream final : IterableDataset<int64_t> {
  explicit StridedStream(int64_t n, std::optional<size_t> reported = std::nullopt)
      : n(n), reported(reported) {}
  std::unique_ptr<SampleIterator<int64_t>> iter(const WorkerInfo* worker) override {
    const int64_t start = worker ? worker->id : 0;
    const int64_t step = worker ? worker->num_workers : 1;
    return make_sample_iterator<int64_t>([next = start, step, n = n]() mutable -> std::optional<int64_t> {
      if (next >= n) return std::nullopt;
      const int64_t value = next;
      next += step;
      return value;
    });
  }
  std::optional<size_t> size() const override { return reported; }
  int64_t n;
  std::optional<size_t> reported;
};

}  // namespace conveyor::testing
