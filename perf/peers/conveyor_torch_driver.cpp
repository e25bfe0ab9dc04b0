// conveyor's peer with torch tensors as samples (perf/run_all): W0-W4 with
// exactly the tensors LibTorch's peer makes (peers/torch_samples.h), collated
// by conveyor::torch into batch tensors. This is what a LibTorch trainer that
// switches loaders feeds conveyor; conveyor_driver runs the same workloads
// with native C++ samples.
//
//   conveyor_torch_driver --workload W0..W4 --workers N [--scheduling ...] [--in-order 0|1] ...
#include <conveyor/torch.h>

#include <cstdio>
#include <memory>

// Before conveyor_run.h: its template finds batch lengths by ordinary lookup.
namespace perf {
inline size_t batch_length(const at::Tensor& batch) {
  return batch.dim() == 0 ? 0 : static_cast<size_t>(batch.size(0));
}
inline size_t batch_length(const torch::data::Example<>& batch) { return batch_length(batch.data); }
}  // namespace perf

#include "conveyor_run.h"
#include "torch_samples.h"
#include "workloads.h"

namespace {

struct TinyDataset {  // W0
  size_t n;
  size_t size() const { return n; }
  at::Tensor get(size_t index) { return perf::torch_samples::tiny(index); }
};

struct InMemoryImages {  // W1
  perf::torch_samples::InMemoryImages images;
  size_t size() const { return images.size(); }
  torch::data::Example<> get(size_t index) { return images.get(index); }
};

template <int64_t (*Work)(size_t, int64_t)>
struct WorkDataset {  // W2-W4
  size_t n;
  int64_t parameter;
  size_t size() const { return n; }
  at::Tensor get(size_t index) { return perf::torch_samples::work_result(Work(index, parameter)); }
};

int64_t w2_work(size_t index, int64_t iterations) { return perf::spin(index, iterations); }
int64_t w3_work(size_t index, int64_t) { return perf::w3_sample(index); }
int64_t w4_work(size_t index, int64_t) { return perf::w4_sample(index); }

constexpr const char* kPeer = "conveyor-torch";

}  // namespace

int main(int argc, char** argv) {
  const perf::Args args = perf::parse_args(argc, argv);
  try {
    if (args.workload == "W0") {
      TinyDataset dataset{args.samples};
      return perf::run_conveyor(args, dataset, kPeer);
    }
    if (args.workload == "W1") {
      InMemoryImages dataset{perf::torch_samples::InMemoryImages(std::make_shared<perf::W1Data>(args.samples))};
      return perf::run_conveyor(args, dataset, kPeer,
                                ",\"dataset_bytes\":" + std::to_string(dataset.images.data->bytes()));
    }
    if (args.workload == "W2") {
      WorkDataset<w2_work> dataset{args.samples, args.w2_iterations};
      return perf::run_conveyor(args, dataset, kPeer, ",\"w2_iterations\":" + std::to_string(args.w2_iterations));
    }
    if (args.workload == "W3") {
      WorkDataset<w3_work> dataset{args.samples, 0};
      return perf::run_conveyor(args, dataset, kPeer);
    }
    if (args.workload == "W4") {
      WorkDataset<w4_work> dataset{args.samples, 0};
      return perf::run_conveyor(args, dataset, kPeer);
    }
    std::fprintf(stderr, "conveyor_torch_driver: %s has no torch-sample variant (W0-W4 do)\n",
                 args.workload.c_str());
    return 3;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "conveyor_torch_driver: %s\n", e.what());
    return 1;
  }
}
