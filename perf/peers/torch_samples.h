// The torch-tensor samples of W0-W4, shared by the LibTorch peer and
// conveyor's torch-sample variant so that both make exactly the same
// tensors per sample (what a LibTorch trainer feeds a loader).
#pragma once

#include <torch/torch.h>

#include <memory>

#include "workloads.h"

namespace perf::torch_samples {

// W0: the index as a 0-dim int64 tensor.
inline torch::Tensor tiny(size_t index) {
  return torch::scalar_tensor(static_cast<int64_t>(index), torch::kLong);
}

// W1: views of the in-memory tensors (images[i], labels[i]), as
// torch::data::datasets::TensorDataset returns them; collate makes the copy.
struct InMemoryImages {
  explicit InMemoryImages(std::shared_ptr<W1Data> data_in)
      : data(std::move(data_in)),
        images(torch::from_blob(data->images.data(),
                                {static_cast<int64_t>(data->size()), kW1Channels, kW1Height, kW1Width},
                                torch::kFloat)),
        labels(torch::from_blob(data->labels.data(), {static_cast<int64_t>(data->size())}, torch::kLong)) {}
  torch::data::Example<> get(size_t index) const {
    const auto i = static_cast<int64_t>(index);
    return {images[i], labels[i]};
  }
  size_t size() const { return data->size(); }
  std::shared_ptr<W1Data> data;  // owns what the tensors view
  torch::Tensor images, labels;
};

// W2-W4: the work's result as a 0-dim int64 tensor.
inline torch::Tensor work_result(int64_t value) { return torch::scalar_tensor(value, torch::kLong); }

}  // namespace perf::torch_samples
