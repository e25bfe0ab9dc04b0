// conveyor::torch: LibTorch's own ops draw what conveyor's generator draws,
// tensor collate stacks into one output, generators interoperate.
#include <gtest/gtest.h>

#include <ATen/CPUGeneratorImpl.h>
#include <conveyor/conveyor.h>
#include <conveyor/torch.h>

#include <cstring>
#include <vector>

namespace {

std::vector<int64_t> as_vector(const at::Tensor& t) {
  const at::Tensor c = t.contiguous().to(at::kLong);
  return {c.data_ptr<int64_t>(), c.data_ptr<int64_t>() + c.numel()};
}

const uint64_t kSeeds[] = {0, 1, 42, (uint64_t{1} << 32) + 7, 67280421310721ULL};

TEST(TorchParity, RandpermMatchesLibTorch) {
  for (uint64_t seed : kSeeds) {
    for (int64_t n : {1, 2, 10, 1000, 20000}) {
      auto torch_gen = at::detail::createCPUGenerator(seed);
      conveyor::Generator ours(seed);
      const auto expected = as_vector(at::randperm(n, torch_gen));
      const auto got = conveyor::randperm(static_cast<size_t>(n), ours);
      EXPECT_EQ(std::vector<int64_t>(got.begin(), got.end()), expected) << "seed " << seed << " n " << n;
    }
  }
}

TEST(TorchParity, RandintAndRandomMatchLibTorch) {
  for (uint64_t seed : kSeeds) {
    for (auto [low, high] : {std::pair<int64_t, int64_t>{0, 10}, {-3, 1000}, {0, int64_t{1} << 33}}) {
      auto torch_gen = at::detail::createCPUGenerator(seed);
      conveyor::Generator ours(seed);
      std::vector<int64_t> got(64);
      conveyor::randint(low, high, got, ours);
      EXPECT_EQ(got, as_vector(at::randint(low, high, {64}, torch_gen, at::kLong)));
    }
    auto torch_gen = at::detail::createCPUGenerator(seed);
    conveyor::Generator ours(seed);
    const auto seeds = as_vector(at::empty({5}, at::kLong).random_(torch_gen));
    for (int64_t s : seeds) EXPECT_EQ(conveyor::draw_seed(ours), s);
  }
}

TEST(TorchParity, MultinomialMatchesLibTorch) {
  std::vector<double> weights;
  for (int i = 0; i < 300; ++i) weights.push_back(1.0 + (i * 37) % 11);
  const at::Tensor w = at::tensor(weights, at::kDouble);
  for (uint64_t seed : kSeeds) {
    for (bool replacement : {true, false}) {
      for (int64_t k : {1, 3, 4, 5, 100, 300}) {
        auto torch_gen = at::detail::createCPUGenerator(seed);
        conveyor::Generator ours(seed);
        EXPECT_EQ(conveyor::multinomial(weights, k, replacement, ours),
                  as_vector(at::multinomial(w, k, replacement, torch_gen)))
            << "seed " << seed << " k " << k << " replacement " << replacement;
        EXPECT_EQ(ours.random(), torch_gen.get<at::CPUGeneratorImpl>()->random());  // same position after
      }
    }
  }
}

TEST(TorchGenerator, FromTorchDrawsFromAndAdvancesTheTorchGenerator) {
  auto torch_gen = at::detail::createCPUGenerator(5);
  auto reference = at::detail::createCPUGenerator(5);
  conveyor::RandomSampler sampler(100, false, std::nullopt, conveyor::from_torch(torch_gen));
  const auto order = conveyor::collect(sampler);
  EXPECT_EQ(std::vector<int64_t>(order.begin(), order.end()), as_vector(at::randperm(100, reference)));
  // One randperm(100) drawn, plus the empty remainder's randperm: both generators moved alike.
  at::randperm(100, reference);
  EXPECT_EQ(torch_gen.get<at::CPUGeneratorImpl>()->random(), reference.get<at::CPUGeneratorImpl>()->random());
}

TEST(TorchGenerator, ToTorchCopiesTheStateMidStream) {
  conveyor::Generator ours(99);
  for (int i = 0; i < 1000; ++i) ours.random();  // past one regeneration of the 624-word state
  at::Generator copy = conveyor::to_torch(ours);
  for (int i = 0; i < 2000; ++i) {
    ASSERT_EQ(copy.get<at::CPUGeneratorImpl>()->random(), ours.random()) << "draw " << i;
  }
  conveyor::Generator fresh(3);
  at::Generator fresh_copy = conveyor::to_torch(fresh);
  EXPECT_EQ(as_vector(at::randperm(50, fresh_copy)), as_vector(at::randperm(50, at::detail::createCPUGenerator(3))));
}

TEST(TensorCollate, StacksIntoOneAlignedOutput) {
  std::vector<at::Tensor> samples;
  for (int i = 0; i < 4; ++i) samples.push_back(at::full({3, 2}, static_cast<float>(i)));
  const at::Tensor batch = conveyor::default_collate(std::move(samples));
  EXPECT_EQ(batch.sizes(), (at::IntArrayRef{4, 3, 2}));
  EXPECT_EQ(batch.scalar_type(), at::kFloat);
  EXPECT_TRUE(batch.is_contiguous());
  EXPECT_EQ(reinterpret_cast<uintptr_t>(batch.data_ptr()) % 64, 0u);
  for (int i = 0; i < 4; ++i) EXPECT_TRUE(at::equal(batch[i], at::full({3, 2}, static_cast<float>(i))));
}

TEST(TensorCollate, EveryKindOfSampleStacksAsTorchStackDoes) {
  // collate copies plain samples itself and leaves the rest to at::stack_out:
  // either way the batch must be torch.stack's.
  auto compare = [](const std::string& what, std::vector<at::Tensor> samples) {
    SCOPED_TRACE(what);
    const at::Tensor expected = at::stack(samples, 0);
    const at::Tensor batch = conveyor::default_collate(std::vector<at::Tensor>(samples));
    EXPECT_EQ(batch.sizes(), expected.sizes());
    EXPECT_EQ(batch.scalar_type(), expected.scalar_type());
    EXPECT_TRUE(at::equal(batch, expected));
    EXPECT_EQ(batch.requires_grad(), expected.requires_grad());
  };
  const at::Tensor grid = at::arange(24, at::kLong).reshape({4, 2, 3});
  compare("0-d scalars", {at::scalar_tensor(7, at::kLong), at::scalar_tensor(-1, at::kLong)});
  compare("contiguous views of one tensor", {grid[0], grid[1], grid[3]});
  compare("transposed (non-contiguous) views", {grid[0].t(), grid[2].t()});
  compare("strided slices", {grid.select(2, 0), grid.select(2, 1)});
  compare("empty samples", {at::zeros({0, 3}), at::zeros({0, 3})});
  compare("bool", {at::ones({5}, at::kBool), at::zeros({5}, at::kBool)});
  compare("requiring grad", {at::ones({2}, at::TensorOptions().requires_grad(true)), at::zeros({2})});
  compare("requiring grad, not first", {at::zeros({2}), at::ones({2}, at::TensorOptions().requires_grad(true))});
  compare("conjugate view", {at::ones({2}, at::kComplexFloat).conj(), at::ones({2}, at::kComplexFloat)});
}

TEST(TensorCollate, UnequalSizesGiveTorchsMessage) {
  std::vector<at::Tensor> samples{at::zeros({3}), at::zeros({4})};
  try {
    conveyor::default_collate(std::move(samples));
    FAIL();
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find(
                  "stack expects each tensor to be equal size, but got [3] at entry 0 and [4] at entry 1"),
              std::string::npos);
  }
}

TEST(TensorDataset, LoadsThroughTheLoader) {
  const at::Tensor x = at::arange(20, at::kFloat).reshape({10, 2});
  const at::Tensor y = at::arange(10, at::kLong);
  conveyor::TensorDataset dataset({x, y});
  conveyor::DataLoader loader(dataset, {.batch_size = 4, .shuffle = true, .seed = 1});
  int64_t rows = 0;
  for (auto& batch : loader) {
    ASSERT_EQ(batch.size(), 2u);
    const at::Tensor& xs = batch[0];
    const at::Tensor& ys = batch[1];
    EXPECT_TRUE(at::equal(xs.select(1, 0), ys.to(at::kFloat) * 2));
    rows += ys.size(0);
  }
  EXPECT_EQ(rows, 10);
  EXPECT_THROW(conveyor::TensorDataset({at::zeros({3, 2}), at::zeros({4})}), conveyor::ValueError);
  try {
    conveyor::TensorDataset({at::zeros({3, 2}), at::zeros({4})});
  } catch (const conveyor::ValueError& e) {
    EXPECT_STREQ(e.what(), "Size mismatch between tensors");  // PyTorch's text (an AssertionError there)
  }
}

TEST(ArrayToTensor, SharesMemory) {
  conveyor::Array<int32_t> a({2, 3});
  for (size_t i = 0; i < 6; ++i) a[i] = static_cast<int32_t>(i);
  at::Tensor t = conveyor::to_tensor(a);
  EXPECT_EQ(t.sizes(), (at::IntArrayRef{2, 3}));
  EXPECT_EQ(t.data_ptr(), static_cast<void*>(a.data()));
  a[5] = 42;
  EXPECT_EQ(t[1][2].item<int32_t>(), 42);
}

// A default Array() has shape [] but no element, and a tensor of shape []
// holds one: no tensor stands for it.
TEST(ArrayToTensor, AnEmptyArrayHasNoTensor) {
  try {
    at::Tensor t = conveyor::to_tensor(conveyor::Array<float>());
    FAIL() << "a tensor of sizes " << t.sizes() << " and " << t.numel() << " elements";
  } catch (const conveyor::ValueError& e) {
    EXPECT_STREQ(e.what(),
                 "to_tensor: an empty Array() (default constructed: shape [] but no element) "
                 "has no tensor");
  }
  conveyor::Array<float> scalar(std::vector<int64_t>{});  // a scalar is one element: still fine
  scalar[0] = 2.5f;
  EXPECT_EQ(conveyor::to_tensor(scalar).item<float>(), 2.5f);
}

}  // namespace

// LibTorch's own MNIST reader, run through conveyor's loader, must agree with
// conveyor's IDX reader on the same (decompressed) Fashion-MNIST test set.
#include <conveyor/idx.h>
#include <torch/data/datasets/mnist.h>
#include <zlib.h>

#include <cstdio>
#include <filesystem>
#include <unistd.h>

namespace {

void gunzip(const std::string& from, const std::string& to) {
  gzFile in = gzopen(from.c_str(), "rb");
  ASSERT_NE(in, nullptr) << from;
  std::FILE* out = std::fopen(to.c_str(), "wb");
  ASSERT_NE(out, nullptr) << to;
  char buffer[1 << 16];
  int n = 0;
  while ((n = gzread(in, buffer, sizeof buffer)) > 0) std::fwrite(buffer, 1, static_cast<size_t>(n), out);
  std::fclose(out);
  gzclose(in);
}

TEST(FromTorchDataset, LibTorchsMnistReaderAgreesWithConveyorsThroughTheLoader) {
  const std::string source = conveyor::kFashionMnistDirectory;
  const std::string dir = "/tmp/conveyor-torch-mnist-" + std::to_string(getpid());
  std::filesystem::create_directories(dir);
  gunzip(source + "/t10k-images-idx3-ubyte.gz", dir + "/t10k-images-idx3-ubyte");
  gunzip(source + "/t10k-labels-idx1-ubyte.gz", dir + "/t10k-labels-idx1-ubyte");

  conveyor::FromTorchDataset<torch::data::datasets::MNIST> theirs(
      torch::data::datasets::MNIST(dir, torch::data::datasets::MNIST::Mode::kTest));
  auto ours = conveyor::IdxImageDataset::from_directory(source, false);
  ASSERT_EQ(theirs.size(), ours.size());

  conveyor::DataLoader loader(theirs, {.batch_size = 500, .num_workers = 2});
  size_t index = 0;
  for (auto& batch : loader) {
    ASSERT_EQ(batch.data.sizes(), (at::IntArrayRef{batch.data.size(0), 1, 28, 28}));
    for (int64_t row = 0; row < batch.data.size(0); ++row, ++index) {
      const conveyor::LabeledImage mine = ours.get(index);
      const at::Tensor expected =
          conveyor::to_tensor(mine.image).to(at::kFloat).div(255);  // MNIST scales to [0, 1]
      ASSERT_TRUE(at::allclose(batch.data[row], expected)) << "image " << index;
      ASSERT_EQ(batch.target[row].item<int64_t>(), mine.label) << "label " << index;
    }
  }
  EXPECT_EQ(index, ours.size());
  std::filesystem::remove_all(dir);
}

}  // namespace

namespace {

TEST(TensorTransfer, StackedTensorsReachTheDeviceThroughTheirPinnedTwins) {
  const at::Tensor x = at::arange(64 * 6, at::kFloat).reshape({64, 6});
  conveyor::TensorDataset dataset({x});
  auto device = conveyor::make_host_standin_device();
  conveyor::DataLoader loader(dataset, {.batch_size = 16, .num_workers = 2, .pin_memory = true,
                                        .transfer_device = device, .prefetch_to_device = 2});
  auto epoch = loader.iter();
  int batches = 0;
  while (auto batch = epoch.next()) {
    const at::Tensor& xs = (*batch)[0];
    EXPECT_TRUE(conveyor::detail::owner_of(xs) != nullptr);  // collated into the pinned pool
    const conveyor::DeviceBatch& copy = epoch.device();
    ASSERT_EQ(copy.buffers.size(), 1u);
    const void* on_device = copy.find(xs.data_ptr());
    ASSERT_NE(on_device, nullptr);
    copy.ready.synchronize();
    EXPECT_EQ(std::memcmp(on_device, xs.data_ptr(), xs.nbytes()), 0);
    ++batches;
  }
  EXPECT_EQ(batches, 4);
}

}  // namespace
