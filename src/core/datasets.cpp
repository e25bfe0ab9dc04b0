#include "conveyor/datasets.h"

#include <cmath>
#include <string>

#include "conveyor/warnings.h"

namespace conveyor::detail {

namespace {
// Python's math.isclose(a, b) with its default rel_tol=1e-9, abs_tol=0.
bool isclose(double a, double b) {
  return std::fabs(a - b) <= 1e-9 * std::max(std::fabs(a), std::fabs(b));
}
}  // namespace

std::vector<size_t> resolve_split_lengths(size_t dataset_size, std::span<const double> lengths) {
  double sum = 0;
  for (double length : lengths) sum += length;  // left to right, as Python's sum()

  std::vector<size_t> counts;
  if (isclose(sum, 1) && sum <= 1) {
    size_t assigned = 0;
    for (size_t i = 0; i < lengths.size(); ++i) {
      const double fraction = lengths[i];
      if (fraction < 0 || fraction > 1) {
        throw ValueError("Fraction at index " + std::to_string(i) + " is not between 0 and 1");
      }
      counts.push_back(static_cast<size_t>(std::floor(static_cast<double>(dataset_size) * fraction)));
      assigned += counts.back();
    }
    // Spread what floor() left over, one each, round-robin from index 0.
    for (size_t i = 0; assigned + i < dataset_size; ++i) counts[i % counts.size()] += 1;
    for (size_t i = 0; i < counts.size(); ++i) {
      if (counts[i] == 0) {
        warn("Length of split at index " + std::to_string(i) +
             " is 0. This might result in an empty dataset.");
      }
    }
  } else {
    // PyTorch compares the sum first; what it would fail on later (negative or
    // fractional counts) gets a message of its own here.
    if (sum != static_cast<double>(dataset_size)) {
      throw ValueError("Sum of input lengths does not equal the length of the input dataset!");
    }
    for (size_t i = 0; i < lengths.size(); ++i) {
      const double length = lengths[i];
      if (length < 0 || std::floor(length) != length) {
        throw ValueError("random_split: length at index " + std::to_string(i) + " is " +
                         std::to_string(length) +
                         "; lengths are non-negative counts or fractions summing to 1");
      }
      counts.push_back(static_cast<size_t>(length));
    }
  }
  size_t total = 0;
  for (size_t count : counts) total += count;
  if (total != dataset_size) {
    throw ValueError("Sum of input lengths does not equal the length of the input dataset!");
  }
  return counts;
}

}  // namespace conveyor::detail
