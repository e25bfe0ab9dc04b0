// conveyor/array.h: a contiguous n-dimensional array, what default_collate
// makes of numbers when LibTorch is not in the build.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "conveyor/buffer.h"
#include "conveyor/errors.h"

namespace conveyor {

// "[3, 32, 32]", as torch prints sizes.
inline std::string shape_string(const std::vector<int64_t>& shape) {
  std::string text = "[";
  for (size_t i = 0; i < shape.size(); ++i) {
    if (i > 0) text += ", ";
    text += std::to_string(shape[i]);
  }
  return text + "]";
}

// Row-major, contiguous, owning (through a shared buffer: copies share
// elements, like tensors). conveyor/torch.h turns one into a torch::Tensor
// without copying.
template <class T>
class Array {
  static_assert(std::is_arithmetic_v<T>, "Array holds numbers");

 public:
  using value_type = T;

  // No elements and no memory (numel() == 0).
  Array() = default;
  // Uninitialised elements, from allocate_batch_buffer(). A shape of {} is a
  // scalar: one element. Throws ValueError for a negative extent or a size
  // beyond memory.
  explicit Array(std::vector<int64_t> shape) : shape_(std::move(shape)) {
    size_t count = 1;
    for (int64_t extent : shape_) {
      if (extent < 0) throw ValueError("Array: negative extent in shape " + shape_string(shape_));
      // At most PTRDIFF_MAX bytes: no allocation is larger.
      if (extent != 0 && count > static_cast<size_t>(PTRDIFF_MAX) / sizeof(T) / static_cast<size_t>(extent)) {
        throw ValueError("Array: shape " + shape_string(shape_) + " holds more bytes than memory can");
      }
      count *= static_cast<size_t>(extent);
    }
    std::shared_ptr<std::byte> buffer = allocate_batch_buffer(count * sizeof(T));
    data_ = reinterpret_cast<T*>(buffer.get());
    owner_ = std::move(buffer);
  }
  // Views memory kept alive by `owner`.
  Array(std::vector<int64_t> shape, T* data, std::shared_ptr<void> owner)
      : shape_(std::move(shape)), data_(data), owner_(std::move(owner)) {}

  const std::vector<int64_t>& shape() const noexcept { return shape_; }
  int64_t dim() const noexcept { return static_cast<int64_t>(shape_.size()); }
  // Elements: the product of the shape (1 for a scalar), 0 when default
  // constructed.
  size_t numel() const noexcept {
    size_t count = 1;
    for (int64_t extent : shape_) count *= static_cast<size_t>(extent);
    return shape_.empty() && data_ == nullptr ? 0 : count;
  }

  T* data() noexcept { return data_; }
  const T* data() const noexcept { return data_; }
  std::span<T> values() noexcept { return {data_, numel()}; }
  std::span<const T> values() const noexcept { return {data_, numel()}; }
  T& operator[](size_t flat_index) noexcept { return data_[flat_index]; }
  const T& operator[](size_t flat_index) const noexcept { return data_[flat_index]; }

  // What keeps the elements alive.
  const std::shared_ptr<void>& owner() const noexcept { return owner_; }

 private:
  std::vector<int64_t> shape_;
  T* data_ = nullptr;
  std::shared_ptr<void> owner_;
};

}  // namespace conveyor
