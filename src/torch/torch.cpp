// The LibTorch adapters: kept to this one translation unit because LibTorch's
// headers are slow to compile.
#include "conveyor/torch.h"

#include <ATen/CPUGeneratorImpl.h>

#include <algorithm>
#include <cstring>
#include <sstream>
#include <string>
#include <utility>

#include "conveyor/buffer.h"
#include "conveyor/errors.h"

namespace conveyor {

namespace {

// Whether torch.stack(samples) is a copy of each sample's bytes in turn:
// contiguous dense CPU tensors of one dtype and one shape, nothing lazy
// (conjugate or negative views) and nothing for autograd to record. Then
// collate copies them itself: at::stack_out goes through cat, which makes
// an unsqueezed view (a TensorImpl) of every sample and checks each.
bool stack_is_a_copy(const std::vector<at::Tensor>& samples) {
  const at::Tensor& first = samples.front();
  const at::IntArrayRef sizes = first.sizes();
  const at::ScalarType dtype = first.scalar_type();
  for (const at::Tensor& sample : samples) {
    if (!sample.defined() || sample.layout() != at::kStrided || !sample.device().is_cpu() ||
        sample.scalar_type() != dtype || sample.sizes() != sizes || !sample.is_contiguous() ||
        sample.requires_grad() || sample.is_conj() || sample.is_neg() || sample.is_quantized()) {
      return false;
    }
  }
  return true;
}

}  // namespace

at::Tensor collate_traits<at::Tensor>::collate(std::vector<at::Tensor>&& samples) {
  if (samples.empty()) throw ValueError("default_collate: cannot collate an empty batch");
  const at::Tensor& first = samples.front();
  const bool copy = stack_is_a_copy(samples);
  // On a device, or for autograd (out= variants record no graph): torch's.
  if (!copy && (!first.device().is_cpu() ||
                std::any_of(samples.begin(), samples.end(), [](const at::Tensor& t) { return t.requires_grad(); }))) {
    return at::stack(samples, 0);
  }
  std::vector<int64_t> sizes{static_cast<int64_t>(samples.size())};
  for (int64_t extent : first.sizes()) sizes.push_back(extent);
  // Unequal samples: torch's own checks and messages (stack_out below).
  const size_t sample_bytes = copy ? first.nbytes() : 0;
  int64_t numel = 1;
  for (int64_t extent : sizes) numel *= extent;
  const auto bytes = static_cast<size_t>(numel) * first.element_size();
  std::shared_ptr<std::byte> buffer = allocate_batch_buffer(bytes);
  std::byte* data = buffer.get();
  at::Tensor out = detail::tensor_over(std::move(buffer), data, sizes, first.scalar_type());
  if (!copy) {
    at::stack_out(out, samples, 0);
    return out;
  }
  for (const at::Tensor& sample : samples) {
    std::memcpy(data, sample.data_ptr(), sample_bytes);
    data += sample_bytes;
  }
  return out;
}

torch::data::Example<at::Tensor, at::Tensor>
collate_traits<torch::data::Example<at::Tensor, at::Tensor>>::collate(
    std::vector<torch::data::Example<at::Tensor, at::Tensor>>&& samples) {
  std::vector<at::Tensor> data, targets;
  data.reserve(samples.size());
  targets.reserve(samples.size());
  for (auto& sample : samples) {
    data.push_back(std::move(sample.data));
    targets.push_back(std::move(sample.target));
  }
  return {collate_traits<at::Tensor>::collate(std::move(data)),
          collate_traits<at::Tensor>::collate(std::move(targets))};
}

namespace detail {
namespace {
// The DataPtr deleter of tensor_over's tensors: its context is the owner.
void release_owner(void* context) { delete static_cast<std::shared_ptr<void>*>(context); }
}  // namespace

at::Tensor tensor_over(std::shared_ptr<void> owner, void* data, at::IntArrayRef sizes,
                       at::ScalarType dtype) {
  int64_t numel = 1;
  for (int64_t extent : sizes) numel *= extent;
  const size_t bytes = static_cast<size_t>(numel) * c10::elementSize(dtype);
  if (data == nullptr && bytes != 0) {  // no memory must not pass for elements (sizes [] claim one)
    throw ValueError("tensor_over: no memory for " + std::to_string(numel) + " elements");
  }
  auto* context = new std::shared_ptr<void>(std::move(owner));
  c10::DataPtr data_ptr(data, context, &release_owner, at::Device(at::kCPU));
  c10::Storage storage(c10::Storage::use_byte_size_t(), bytes, std::move(data_ptr),
                       /*allocator=*/nullptr, /*resizable=*/false);
  // The TensorImpl directly, as at::empty builds it, without the two
  // dispatched ops (empty, set_) per batch.
  at::Tensor tensor = at::detail::make_tensor<c10::TensorImpl>(
      std::move(storage), c10::DispatchKeySet(c10::DispatchKey::CPU), c10::scalarTypeToTypeMeta(dtype));
  tensor.unsafeGetTensorImpl()->set_sizes_contiguous(sizes);
  return tensor;
}

std::shared_ptr<void> owner_of(const at::Tensor& tensor) {
  if (!tensor.has_storage()) return {};
  const c10::DataPtr& data_ptr = tensor.storage().data_ptr();
  if (data_ptr.get_deleter() != &release_owner) return {};
  return *static_cast<std::shared_ptr<void>*>(data_ptr.get_context());
}
}  // namespace detail

namespace {

constexpr int kStateWords = 624;

// A torch CPU generator as a RandomEngine: draws go to its own engine under
// its own mutex, so torch and conveyor see one stream.
class TorchEngine final : public RandomEngine {
 public:
  explicit TorchEngine(at::Generator generator) : generator_(std::move(generator)) {
    if (!generator_.defined() || generator_.device().type() != at::kCPU) {
      throw ValueError("from_torch: expected a CPU torch::Generator");
    }
  }
  std::mutex& mutex() override { return generator_.mutex(); }
  uint32_t next32() override { return impl()->random(); }
  void seed(uint64_t seed) override { impl()->set_current_seed(seed); }
  uint64_t initial_seed() const override { return generator_.current_seed(); }
  std::vector<uint8_t> get_state() const override {
    const at::Tensor state = generator_.get_state();
    const auto* bytes = state.data_ptr<uint8_t>();
    return {bytes, bytes + state.numel()};
  }
  at::Generator clone() const { return generator_.clone(); }
  void set_state(std::span<const uint8_t> state) override {
    at::Tensor tensor = at::empty({static_cast<int64_t>(state.size())}, at::kByte);
    std::memcpy(tensor.data_ptr<uint8_t>(), state.data(), state.size());
    generator_.set_state(tensor);
  }

 private:
  at::CPUGeneratorImpl* impl() const { return generator_.get<at::CPUGeneratorImpl>(); }
  at::Generator generator_;
};

}  // namespace

Generator from_torch(at::Generator generator) {
  return Generator(std::make_shared<TorchEngine>(std::move(generator)));
}

at::Generator to_torch(const Generator& generator) {
  if (auto* torch_engine = dynamic_cast<TorchEngine*>(generator.engine().get())) {
    std::lock_guard lock(torch_engine->mutex());
    return torch_engine->clone();
  }
  // The built-in engine's state: "seed w0 ... w623 position" (std::mt19937's
  // text form after the seed). at::mt19937 keeps the same words; its
  // position is `next_`, with left_ = 1 meaning "regenerate on next draw".
  const std::vector<uint8_t> raw = generator.get_state();
  std::istringstream in(std::string(raw.begin(), raw.end()));
  at::mt19937_data_pod pod{};
  size_t position = 0;
  in >> pod.seed_;
  for (int i = 0; i < kStateWords; ++i) in >> pod.state_[static_cast<size_t>(i)];
  in >> position;
  if (!in) throw ValueError("to_torch: this Generator's engine state cannot be converted");
  pod.seeded_ = true;
  pod.next_ = static_cast<uint32_t>(position);
  pod.left_ = static_cast<int>(kStateWords + 1 - position);
  at::mt19937 engine;
  engine.set_data(pod);
  at::Generator out = at::detail::createCPUGenerator(pod.seed_);
  out.get<at::CPUGeneratorImpl>()->set_engine(engine);
  return out;
}

TensorDataset::TensorDataset(std::vector<at::Tensor> tensors) : tensors_(std::move(tensors)) {
  if (tensors_.empty()) throw ValueError("TensorDataset needs at least one tensor");
  for (const at::Tensor& tensor : tensors_) {
    if (tensor.dim() == 0 || tensor.size(0) != tensors_.front().size(0)) {
      throw ValueError("Size mismatch between tensors");
    }
  }
}

size_t TensorDataset::size() const { return static_cast<size_t>(tensors_.front().size(0)); }

std::vector<at::Tensor> TensorDataset::get(size_t index) {
  if (index >= size()) {
    throw IndexError("index " + std::to_string(index) + " is out of range for a TensorDataset of size " +
                     std::to_string(size()));
  }
  std::vector<at::Tensor> sample;
  sample.reserve(tensors_.size());
  for (const at::Tensor& tensor : tensors_) sample.push_back(tensor[static_cast<int64_t>(index)]);
  return sample;
}

}  // namespace conveyor
