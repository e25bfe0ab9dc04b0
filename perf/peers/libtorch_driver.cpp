// LibTorch's C++ DataLoader as a peer in the performance suite
// (perf/run_all): the same workloads as conveyor_driver, as
// torch::data::datasets::Dataset samples (tensors) through
//
//   torch::data::make_data_loader<SequentialSampler>(
//       dataset.map(torch::data::transforms::Stack<>()),
//       DataLoaderOptions().batch_size(B).workers(W).enforce_ordering(true))
//
// timed after a warm-up epoch, one JSON line (the format of workloads.h).
// LibTorch's workers(0) loads in the main thread. One translation unit on
// purpose: LibTorch's headers compile slowly.
//
//   libtorch_driver --workload W0..W6 --workers N [--seconds S] [--warmup S]
//                   [--samples N] [--w2-iterations K] [--shards a.tar,b.tar] [--objects URL-pattern]
#include <torch/torch.h>

#if CONVEYOR_PERF_HAVE_FORMATS
#include <conveyor/detail/worker_scope.h>
#include <conveyor/generator.h>
#include <conveyor/image.h>
#include <conveyor/tar_shards.h>
#include <conveyor/transforms.h>

#include "w6_work.h"
#endif
#if CONVEYOR_PERF_HAVE_CURL
#include <curl/curl.h>
#endif

#include <cstring>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>
#include <thread>

#include "torch_samples.h"
#include "workloads.h"

namespace {

using torch::data::Example;
using torch::data::TensorExample;
namespace datasets = torch::data::datasets;

// W0: the sample is its index, as a 0-dim int64 tensor.
struct TinyDataset : datasets::Dataset<TinyDataset, TensorExample> {
  explicit TinyDataset(size_t n) : n(n) {}
  TensorExample get(size_t index) override { return TensorExample(perf::torch_samples::tiny(index)); }
  torch::optional<size_t> size() const override { return n; }
  size_t n;
};

// W1: as torch::data::datasets::TensorDataset does, a sample is a view of
// the in-memory tensors (images[i]); Stack<> makes the one copy.
struct InMemoryImages : datasets::Dataset<InMemoryImages, Example<>> {
  explicit InMemoryImages(std::shared_ptr<perf::W1Data> data) : images(std::move(data)) {}
  Example<> get(size_t index) override { return images.get(index); }
  torch::optional<size_t> size() const override { return images.size(); }
  perf::torch_samples::InMemoryImages images;
};

// W2-W4: the sample is the work's result, a 0-dim int64 tensor.
template <int64_t (*Work)(size_t, int64_t)>
struct WorkDataset : datasets::Dataset<WorkDataset<Work>, TensorExample> {
  WorkDataset(size_t n, int64_t parameter) : n(n), parameter(parameter) {}
  TensorExample get(size_t index) override {
    return TensorExample(perf::torch_samples::work_result(Work(index, parameter)));
  }
  torch::optional<size_t> size() const override { return n; }
  size_t n;
  int64_t parameter;
};

int64_t w2_work(size_t index, int64_t iterations) { return perf::spin(index, iterations); }
int64_t w3_work(size_t index, int64_t) { return perf::w3_sample(index); }
int64_t w4_work(size_t index, int64_t) { return perf::w4_sample(index); }

#if CONVEYOR_PERF_HAVE_FORMATS
// W5: the conveyor_driver's decode + augment (conveyor::formats), fed
// through LibTorch's loader from a map-style view of the same shards: an
// index of (offset, size) per member built once at start-up, pread per
// sample. Each LibTorch worker thread binds its own conveyor generator (as a
// conveyor worker has one), so the random crops and flips do not contend on
// the process-wide generator's mutex.
const conveyor::Normalize kNormalize{{perf::kW5Mean}, {perf::kW5Std}};

struct ShardImages : datasets::Dataset<ShardImages, Example<>> {
  explicit ShardImages(std::shared_ptr<const std::vector<perf::TarSample>> index) : index(std::move(index)) {}
  Example<> get(size_t i) override {
    thread_local conveyor::Generator generator(
        std::hash<std::thread::id>{}(std::this_thread::get_id()));
    thread_local conveyor::detail::WorkerScope scope(nullptr, &generator);
    static const auto transform =
        conveyor::compose(conveyor::RandomCrop{perf::kW5Crop, perf::kW5Padding},
                          conveyor::RandomHorizontalFlip{0.5}, conveyor::ToFloat{}, kNormalize);
    const perf::TarSample& where = (*index)[i];
    const std::vector<uint8_t> jpg = perf::pread_bytes(where.fd, where.jpg_offset, where.jpg_size);
    const std::vector<uint8_t> cls = perf::pread_bytes(where.fd, where.cls_offset, where.cls_size);
    const std::string text(cls.begin(), cls.end());
    const long label = std::strtol(text.c_str(), nullptr, 10);
    const conveyor::Array<uint8_t> image = conveyor::decode_image(jpg, "sample " + std::to_string(i), 1);
    conveyor::Array<float> out = transform(image);
    std::vector<int64_t> shape(out.shape().begin(), out.shape().end());
    std::shared_ptr<void> owner = out.owner();
    torch::Tensor tensor = torch::from_blob(
        out.data(), shape, [owner](void*) mutable { owner.reset(); }, torch::kFloat);
    return {tensor, torch::scalar_tensor(static_cast<int64_t>(label), torch::kLong)};
  }
  torch::optional<size_t> size() const override { return index->size(); }
  std::shared_ptr<const std::vector<perf::TarSample>> index;
};
#endif

#if CONVEYOR_PERF_HAVE_FORMATS && CONVEYOR_PERF_HAVE_CURL
// W6-http: a thread per request, as LibTorch's loader allows: each worker
// thread GETs its sample with a blocking libcurl transfer on a connection of
// its own (kept alive across samples), then runs the same decode as
// conveyor's peer (w6_work.h).
struct HttpImages : datasets::Dataset<HttpImages, TensorExample> {
  explicit HttpImages(std::shared_ptr<const std::vector<std::string>> urls) : urls(std::move(urls)) {}
  TensorExample get(size_t i) override {
    struct Handle {
      CURL* curl = curl_easy_init();
      ~Handle() { curl_easy_cleanup(curl); }
    };
    thread_local Handle handle;
    const std::string& url = (*urls)[i];
    std::vector<uint8_t> body;
    curl_easy_setopt(handle.curl, CURLOPT_URL, url.c_str());
    curl_easy_setopt(handle.curl, CURLOPT_WRITEDATA, &body);
    curl_easy_setopt(handle.curl, CURLOPT_WRITEFUNCTION, +[](char* data, size_t, size_t n, void* out) {
      auto* bytes = static_cast<std::vector<uint8_t>*>(out);
      bytes->insert(bytes->end(), data, data + n);
      return n;
    });
    const CURLcode code = curl_easy_perform(handle.curl);
    long status = 0;
    curl_easy_getinfo(handle.curl, CURLINFO_RESPONSE_CODE, &status);
    if (code != CURLE_OK || status != 200) {
      throw std::runtime_error(url + ": " + (code != CURLE_OK ? curl_easy_strerror(code)
                                                              : "HTTP " + std::to_string(status)));
    }
    conveyor::Array<float> out = perf::w6_image(body, url);
    std::vector<int64_t> shape(out.shape().begin(), out.shape().end());
    std::shared_ptr<void> owner = out.owner();
    return TensorExample(torch::from_blob(
        out.data(), shape, [owner](void*) mutable { owner.reset(); }, torch::kFloat));
  }
  torch::optional<size_t> size() const override { return urls->size(); }
  std::shared_ptr<const std::vector<std::string>> urls;
};
#endif

template <class Dataset>
int run(perf::Args args, Dataset dataset, const std::string& note = "") {
  using Stack = torch::data::transforms::Stack<typename Dataset::ExampleType>;
  auto loader = torch::data::make_data_loader<torch::data::samplers::SequentialSampler>(
      dataset.map(Stack()), torch::data::DataLoaderOptions()
                                .batch_size(static_cast<size_t>(args.batch_size))
                                .workers(static_cast<size_t>(args.workers))
                                .enforce_ordering(true));
  using Iterator = decltype(loader->begin());
  std::optional<Iterator> it;
  bool first = true;
  perf::Result result = perf::drive(
      args,
      [&] {
        it.reset();
        it.emplace(loader->begin());
        first = true;
      },
      [&](size_t& samples) {
        if (!first) ++*it;
        first = false;
        if (*it == loader->end()) return false;
        samples = static_cast<size_t>((**it).data.size(0));
        return true;
      },
      [] {});
  result.peer = "libtorch";
  result.extra = ",\"torch_threads\":" + std::to_string(torch::get_num_threads()) + note;
  perf::print_result(args, result);
  // A cut epoch still has jobs in flight; the loader's destructor drains
  // them and joins its threads.
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  perf::Args args = perf::parse_args(argc, argv);
  try {
    if (args.workload == "W0") return run(args, TinyDataset(args.samples));
    if (args.workload == "W1") {
      auto data = std::make_shared<perf::W1Data>(args.samples);
      return run(args, InMemoryImages(data), ",\"dataset_bytes\":" + std::to_string(data->bytes()));
    }
    if (args.workload == "W2") {
      return run(args, WorkDataset<w2_work>(args.samples, args.w2_iterations),
                 ",\"w2_iterations\":" + std::to_string(args.w2_iterations));
    }
    if (args.workload == "W3") return run(args, WorkDataset<w3_work>(args.samples, 0));
    if (args.workload == "W4") return run(args, WorkDataset<w4_work>(args.samples, 0));
#if CONVEYOR_PERF_HAVE_FORMATS
    if (args.workload == "W5") {
      auto index = std::make_shared<std::vector<perf::TarSample>>();
      for (const std::string& shard : args.shards) perf::index_tar(shard, *index);
      args.samples = index->size();
      return run(args, ShardImages(index));
    }
#endif
#if CONVEYOR_PERF_HAVE_FORMATS && CONVEYOR_PERF_HAVE_CURL
    if (args.workload == "W6") {
      auto urls = std::make_shared<const std::vector<std::string>>(conveyor::expand_shard_pattern(args.objects));
      args.samples = urls->size();
      curl_global_init(CURL_GLOBAL_DEFAULT);  // before any thread makes a handle
      return run(args, HttpImages(urls));
    }
#endif
    std::fprintf(stderr, "libtorch_driver: %s is not built in (W5 needs conveyor::formats, W6 libcurl too)\n",
                 args.workload.c_str());
    return 3;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "libtorch_driver: %s\n", e.what());
    return 1;
  }
}
