// conveyor/torch.h: LibTorch adapters (target conveyor::torch).
//
// - default_collate stacks torch::Tensor samples into one output tensor,
//   allocated through allocate_batch_buffer() (pinned memory when the loader
//   has a transfer stage) and written once.
// - TensorDataset, as torch.utils.data.TensorDataset.
// - Generator interop: from_torch() lets conveyor's samplers draw from (and
//   advance) a torch::Generator; to_torch() copies a conveyor::Generator.
// - to_tensor(): an Array as a tensor, without copying.
// - FromTorchDataset: an existing torch::data dataset (LibTorch's MNIST
//   reader, say) through conveyor's loader; torch::data::Example collates.
#pragma once

#include <ATen/ATen.h>
#include <torch/data/datasets/base.h>
#include <torch/data/example.h>

#include <cstddef>
#include <span>
#include <vector>

#include "conveyor/array.h"
#include "conveyor/collate.h"
#include "conveyor/dataset.h"
#include "conveyor/errors.h"
#include "conveyor/generator.h"
#include "conveyor/transfer.h"

namespace conveyor {

template <>
struct collate_traits<at::Tensor> {
  // torch.stack(samples, 0, out=preallocated). Throws c10::Error for tensors
  // of unequal sizes, with torch's message.
  static at::Tensor collate(std::vector<at::Tensor>&& samples);
};

template <>
struct collate_traits<torch::data::Example<at::Tensor, at::Tensor>> {
  // Stacks data and targets, each into one output (as torch::data's Stack<>).
  static torch::data::Example<at::Tensor, at::Tensor> collate(
      std::vector<torch::data::Example<at::Tensor, at::Tensor>>&& samples);
};

// A Generator drawing from `generator`'s engine (a CPU generator), under its
// mutex: draws through either advance both.
Generator from_torch(at::Generator generator);

// A new CPU torch generator in the same state as `generator` (a copy).
at::Generator to_torch(const Generator& generator);

// The torch dtype of an arithmetic type (int64_t -> kLong, float -> kFloat...).
template <class T>
constexpr at::ScalarType scalar_type_of() {
  return c10::CppTypeToScalarType<T>::value;
}

namespace detail {
// A CPU tensor over `data`, kept alive by `owner`, which the transfer stage
// can find again (owner_of) to copy pinned memory into its device twin.
at::Tensor tensor_over(std::shared_ptr<void> owner, void* data, at::IntArrayRef sizes,
                       at::ScalarType dtype);
// The owner given to tensor_over, or empty for any other tensor.
std::shared_ptr<void> owner_of(const at::Tensor& tensor);
}  // namespace detail

// The Array's elements as a tensor sharing its memory. Throws ValueError for
// a default Array(): a tensor of its shape, [], holds one element, and one of
// shape [0] would add a dimension the Array does not have.
template <class T>
at::Tensor to_tensor(const Array<T>& array) {
  if (array.dim() == 0 && array.numel() == 0) {
    throw ValueError(
        "to_tensor: an empty Array() (default constructed: shape [] but no element) has no tensor");
  }
  return detail::tensor_over(array.owner(), const_cast<T*>(array.data()), array.shape(),
                             scalar_type_of<T>());
}

// Tensors in a batch go to the device (contiguous CPU tensors only).
template <>
struct transfer_traits<at::Tensor> {
  template <class F>
  static void for_each_buffer(at::Tensor& tensor, F&& f) {
    if (!tensor.defined() || !tensor.device().is_cpu() || !tensor.is_contiguous() || tensor.numel() == 0) {
      return;
    }
    f(tensor.data_ptr(), tensor.nbytes(), detail::owner_of(tensor));
  }
};

// torch.utils.data.TensorDataset: sample i is {t[i] for each tensor t}.
class TensorDataset final : public Dataset<std::vector<at::Tensor>> {
 public:
  // Throws ValueError unless every tensor has the same first dimension.
  explicit TensorDataset(std::vector<at::Tensor> tensors);
  size_t size() const override;
  std::vector<at::Tensor> get(size_t index) override;

 private:
  std::vector<at::Tensor> tensors_;
};

// A torch::data map-style dataset (anything deriving from
// torch::data::datasets::Dataset<Self, Example>) as a conveyor dataset.
// get() is called from several workers at once: the wrapped dataset's get()
// must be thread-safe, as LibTorch's own readers are (they index tensors).
template <class TorchDataset>
class FromTorchDataset final : public Dataset<typename TorchDataset::ExampleType> {
 public:
  using sample_type = typename TorchDataset::ExampleType;

  // Throws TypeError if the dataset does not know its size.
  explicit FromTorchDataset(TorchDataset dataset) : dataset_(std::move(dataset)) {
    if (!dataset_.size()) throw TypeError("FromTorchDataset: the torch dataset reports no size()");
  }
  size_t size() const override { return *dataset_.size(); }
  sample_type get(size_t index) override { return dataset_.get(index); }
  std::vector<sample_type> get_batch(std::span<const size_t> indices) override {
    return dataset_.get_batch(c10::ArrayRef<size_t>(indices.data(), indices.size()));
  }
  TorchDataset& inner() noexcept { return dataset_; }

 private:
  TorchDataset dataset_;
};

}  // namespace conveyor
