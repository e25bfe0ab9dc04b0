// conveyor/torch.h: LibTorch adapters (target conveyor::torch).
//
// - default_collate stacks torch::Tensor samples into one output tensor,
//   allocated through allocate_batch_buffer() (pinned memory when the loader
//   has a transfer stage) and written once.
// - TensorDataset, as torch.utils.data.TensorDataset.
// - Generator interop: from_torch() lets conveyor's samplers draw from (and
//   advance) a torch::Generator; to_torch() copies a conveyor::Generator.
// - to_tensor(): an Array as a tensor, without copying.
#pragma once

#include <ATen/ATen.h>

#include <cstddef>
#include <vector>

#include "conveyor/array.h"
#include "conveyor/collate.h"
#include "conveyor/dataset.h"
#include "conveyor/generator.h"

namespace conveyor {

template <>
struct collate_traits<at::Tensor> {
  // torch.stack(samples, 0, out=preallocated). Throws c10::Error for tensors
  // of unequal sizes, with torch's message.
  static at::Tensor collate(std::vector<at::Tensor>&& samples);
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

// The Array's elements as a tensor sharing its memory.
template <class T>
at::Tensor to_tensor(const Array<T>& array) {
  std::shared_ptr<void> owner = array.owner();
  return at::from_blob(const_cast<T*>(array.data()), array.shape(),
                       [owner](void*) mutable { owner.reset(); },
                       at::TensorOptions().dtype(scalar_type_of<T>()));
}

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

}  // namespace conveyor
