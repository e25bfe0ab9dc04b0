// conveyor's main job: a small LibTorch CNN trained on Fashion-MNIST, fed by
// conveyor's loader (shuffled, multi-worker, augmented on the workers).
//
//   train_fashion_mnist [--epochs 2] [--workers 2] [--batch-size 64] [--seed 0]
//                       [--source idx|shards] [--shards DIR|pattern|URL-pattern] [--data DIR]
//                       [--scheduling work_stealing|round_robin] [--threads N]
//                       [--limit N] [--lr 0.002] [--loader-only] [--pin-memory]
//                       [--distributed] [--checkpoint DIR [--checkpoint-every N]
//                       [--auto-resume]] [--resume DIR]
//
// Prints a progress bar per epoch (samples/s, loss, data stall: the share of
// the epoch the trainer spent waiting for the loader), test accuracy after
// each epoch, and a final summary with a fingerprint of the loss curve: the
// same seed gives the same fingerprint, and under work_stealing the same for
// any number of workers.
//
// --distributed: one rank of a data-parallel job launched by torchrun (or
// mpirun): each rank reads its shard of the training set, gradients are
// averaged across ranks after every step, rank 0 prints and evaluates. The
// fingerprint is then of the job's mean loss per step.
//
// --shards http://host/train-{000000..000011}.tar: the shards are streamed
// over HTTP(S) as they are read (conveyor::io), not downloaded first. A
// local pattern (DIR/train-{000000..000011}.tar) names shards already
// written; a plain DIR gets them written on first use.
//
// --checkpoint DIR --checkpoint-every N: every N steps, the model, the
// optimizer and the loader's state (DataLoader::state_dict) are saved into
// DIR, atomically (examples/trainer_checkpoint.h). --resume DIR continues
// from the last one, mid-epoch: a run killed with SIGKILL and resumed ends
// with the same loss-curve fingerprint and accuracy as one never stopped.
// --auto-resume continues from --checkpoint's DIR when it holds one (what a
// job torchrun restarts with --max-restarts wants). Under --distributed each
// rank keeps DIR/rank-R, every rank saves at the same step, and a resumed
// job's ranks agree on the checkpoint they all have.
#include <conveyor/conveyor.h>
#if CONVEYOR_HAVE_CUDA
#include <conveyor/cuda.h>
#endif
#if CONVEYOR_HAVE_DISTRIBUTED
#include <conveyor/distributed.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#endif
#include <conveyor/idx.h>
#include <conveyor/image.h>
#include <conveyor/tar_shards.h>
#if CONVEYOR_HAVE_IO
#include <conveyor/nodes/http.h>
#endif
#include <conveyor/torch.h>
#include <conveyor/transforms.h>
#include <torch/torch.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <map>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "flags.h"
#include "shard_writing.h"
#include "trainer_checkpoint.h"

namespace {

using Clock = std::chrono::steady_clock;

struct Flags {
  int epochs = 2;
  int workers = 2;
  int64_t batch_size = 64;
  uint64_t seed = 0;
  std::string source = "idx";
  std::string data = conveyor::kFashionMnistDirectory;
  std::string shards = "fashion-mnist-shards";
  conveyor::Scheduling scheduling = conveyor::Scheduling::work_stealing;
  int threads = 0;  // 0: LibTorch's default
  int64_t limit = 0;  // 0: the whole training set
  double lr = 2e-3;
  bool loader_only = false;  // time the loader alone: no model, no training
  bool pin_memory = false;   // pinned batches, copied to the device 2 ahead
  bool distributed = false;  // one rank of a torchrun/mpirun job
  std::string checkpoint;      // save checkpoints into this directory
  int64_t checkpoint_every = 0;  // steps between checkpoints (0: with --checkpoint, 100)
  std::string resume;          // continue from the checkpoint in this directory
  bool auto_resume = false;    // continue from --checkpoint's directory if it holds one
};

[[noreturn]] void usage(const std::string& problem) {
  std::fprintf(stderr,
               "train_fashion_mnist: %s\n"
               "usage: train_fashion_mnist [--epochs N] [--workers N] [--batch-size N] [--seed N]\n"
               "       [--source idx|shards] [--data DIR] [--shards DIR|pattern|URL-pattern]\n"
               "       [--scheduling work_stealing|round_robin] [--threads N] [--limit N] [--lr X]\n"
               "       [--loader-only] [--pin-memory] [--distributed]\n"
               "       [--checkpoint DIR [--checkpoint-every N] [--auto-resume]] [--resume DIR]\n",
               problem.c_str());
  std::exit(2);
}

Flags parse(int argc, char** argv) {
  using conveyor::examples::integer_flag;
  Flags flags;
  try {  // integer_flag throws FlagError
    for (int i = 1; i < argc; ++i) {
      const std::string name = argv[i];
      if (name == "--help" || name == "-h") usage("train a CNN on Fashion-MNIST through conveyor");
      if (name == "--loader-only") {
        flags.loader_only = true;
        continue;
      }
      if (name == "--pin-memory") {
        flags.pin_memory = true;
        continue;
      }
      if (name == "--distributed") {
        flags.distributed = true;
        continue;
      }
      if (name == "--auto-resume") {
        flags.auto_resume = true;
        continue;
      }
      if (i + 1 >= argc) usage(name + " needs a value");
      const char* value = argv[++i];
      if (name == "--epochs") {
        flags.epochs = integer_flag<int>(name, value, 1);
      } else if (name == "--workers") {
        flags.workers = integer_flag<int>(name, value, 0, 1024);  // the loader's limit
      } else if (name == "--batch-size") {
        flags.batch_size = integer_flag<int64_t>(name, value, 1);
      } else if (name == "--seed") {
        flags.seed = integer_flag<uint64_t>(name, value, 0);
      } else if (name == "--threads") {
        flags.threads = integer_flag<int>(name, value, 0, 1024);  // 2^31 - 1 ran libgomp out of memory
      } else if (name == "--limit") {
        flags.limit = integer_flag<int64_t>(name, value, 0);
      } else if (name == "--source") {
        flags.source = value;
        if (flags.source != "idx" && flags.source != "shards") usage("--source is idx or shards, not '" + flags.source + "'");
      } else if (name == "--data") {
        flags.data = value;
      } else if (name == "--shards") {
        flags.shards = value;
        if (flags.shards.empty()) usage("--shards needs a directory, a pattern or a URL pattern, got ''");
      } else if (name == "--scheduling") {
        const std::string mode = value;
        if (mode == "work_stealing") {
          flags.scheduling = conveyor::Scheduling::work_stealing;
        } else if (mode == "round_robin") {
          flags.scheduling = conveyor::Scheduling::round_robin;
        } else {
          usage("--scheduling is work_stealing or round_robin, not '" + mode + "'");
        }
      } else if (name == "--checkpoint") {
        flags.checkpoint = value;
      } else if (name == "--checkpoint-every") {
        flags.checkpoint_every = integer_flag<int64_t>(name, value, 1);
      } else if (name == "--resume") {
        flags.resume = value;
      } else if (name == "--lr") {
        char* end = nullptr;
        flags.lr = std::strtod(value, &end);
        if (*value == '\0' || *end != '\0' || !(flags.lr > 0) || !std::isfinite(flags.lr)) {
          usage(std::string("--lr needs a positive number, got '") + value + "'");
        }
      } else {
        usage("unknown flag " + name);
      }
    }
  } catch (const conveyor::examples::FlagError& e) {
    usage(e.what());
  }
  if (flags.checkpoint_every > 0 && flags.checkpoint.empty()) usage("--checkpoint-every needs --checkpoint DIR");
  if (!flags.checkpoint.empty() && flags.checkpoint_every == 0) flags.checkpoint_every = 100;
  if (flags.auto_resume && flags.checkpoint.empty()) usage("--auto-resume needs --checkpoint DIR");
  if (flags.auto_resume && !flags.resume.empty()) usage("--auto-resume resumes from --checkpoint's DIR: drop --resume");
  if (flags.loader_only && (!flags.checkpoint.empty() || !flags.resume.empty())) {
    usage("--loader-only trains nothing to checkpoint");
  }
  return flags;
}

// Two conv blocks and a classifier: ~1.2 M multiply-adds per image.
struct NetImpl : torch::nn::Module {
  NetImpl()
      : conv1(register_module("conv1", torch::nn::Conv2d(torch::nn::Conv2dOptions(1, 16, 3).padding(1)))),
        conv2(register_module("conv2", torch::nn::Conv2d(torch::nn::Conv2dOptions(16, 32, 3).padding(1)))),
        fc1(register_module("fc1", torch::nn::Linear(32 * 7 * 7, 128))),
        fc2(register_module("fc2", torch::nn::Linear(128, 10))) {}

  torch::Tensor forward(torch::Tensor x) {
    x = torch::max_pool2d(torch::relu(conv1->forward(x)), 2);
    x = torch::max_pool2d(torch::relu(conv2->forward(x)), 2);
    x = torch::relu(fc1->forward(x.flatten(1)));
    return fc2->forward(x);
  }

  torch::nn::Conv2d conv1, conv2;
  torch::nn::Linear fc1, fc2;
};
TORCH_MODULE(Net);

// What the loader hands the trainer: a normalised image and its class.
struct Sample {
  conveyor::Array<float> image;  // [1, 28, 28]
  int64_t label;
};

// Fashion-MNIST's mean and standard deviation.
const conveyor::Normalize kNormalize{{0.2860f}, {0.3530f}};

// Augmentation, on the workers, from the task's generator.
Sample augment(conveyor::LabeledImage&& sample) {
  static const auto transform = conveyor::compose(conveyor::RandomCrop{28, 2},
                                                  conveyor::RandomHorizontalFlip{0.5},
                                                  conveyor::ToFloat{}, kNormalize);
  return {transform(sample.image), sample.label};
}

Sample plain(conveyor::LabeledImage&& sample) {
  return {kNormalize(conveyor::ToFloat{}(sample.image)), sample.label};
}

// A shard sample (jpg + cls) as a one-channel LabeledImage; a bad one is a
// DataError naming the shard and key.
conveyor::LabeledImage decode(conveyor::ShardSample&& sample) {
  return conveyor::decode_class_sample(sample, {.channels = 1, .num_classes = 10});
}

bool is_url(const std::string& shards) { return shards.starts_with("http://") || shards.starts_with("https://"); }
// Fashion-MNIST as JPEG shards, written once into `directory`. Its COMPLETE
// marker lists the shards written (one name a line), and only those are
// read: .tar files of another origin beside them are not. A directory that
// holds .tar files but neither marker (WRITING: a write of ours was cut
// short, and is done again) is refused, never written into.
std::vector<std::string> ensure_shards(const std::string& directory, const std::string& data) {
  namespace fs = std::filesystem;
  const std::string done = directory + "/COMPLETE";
  const auto tar_files = [&] {
    std::vector<std::string> names;
    for (const auto& entry : fs::directory_iterator(directory)) {
      if (entry.path().extension() == ".tar") names.push_back(entry.path().filename().string());
    }
    std::sort(names.begin(), names.end());
    return names;
  };
  const std::string writing = directory + "/WRITING";
  if (!fs::exists(done)) {
    if (fs::is_directory(directory) && !fs::exists(writing) && !tar_files().empty()) {
      throw conveyor::DataError("holds .tar files but no COMPLETE marker, so they are not shards this trainer "
                                "wrote; name them with a pattern (e.g. --shards '" + directory +
                                    "/train-{000000..000011}.tar') or give an empty directory",
                                directory);
    }
    std::printf("writing JPEG tar shards of the training set into %s ...\n", directory.c_str());
    fs::create_directories(directory);
    std::ofstream(writing).flush();
    if (!fs::exists(writing)) throw conveyor::DataError("cannot write the WRITING marker", writing);
    conveyor::IdxImageDataset train = conveyor::IdxImageDataset::from_directory(data, true);
    const std::vector<std::string> written =
        conveyor::examples::write_image_shards(train, directory + "/train-", 5000, 95);
    // Written whole, then renamed into place: a run killed meanwhile leaves no marker.
    const std::string partial = done + ".partial";
    {
      std::ofstream marker(partial, std::ios::trunc);
      for (const std::string& shard : written) marker << fs::path(shard).filename().string() << '\n';
      if (!marker.flush()) throw conveyor::DataError("cannot write the COMPLETE marker", partial);
    }
    fs::rename(partial, done);
    fs::remove(writing);
  }
  std::vector<std::string> names;
  std::ifstream marker(done);
  for (std::string line; std::getline(marker, line);) {
    if (!line.empty()) names.push_back(line);
  }
  if (names.empty()) names = tar_files();  // an empty marker: written before markers listed their shards
  if (names.empty()) throw conveyor::DataError("no .tar shards", directory);
  std::vector<std::string> shards;
  for (const std::string& name : names) shards.push_back(directory + "/" + name);
  return shards;
}

// One line of progress, redrawn in place on a terminal, every 10% otherwise.
class Progress {
 public:
  Progress(int epoch, int epochs, size_t total)
      : epoch_(epoch), epochs_(epochs), total_(total), tty_(isatty(STDOUT_FILENO) != 0) {}

  void update(size_t done, double seconds, double loss, double stall) {
    const int tenth = total_ ? static_cast<int>(10 * done / total_) : 10;
    if (!tty_ && tenth == last_tenth_ && done != total_) return;
    last_tenth_ = tenth;
    char bar[31];
    const size_t filled = total_ ? 30 * done / total_ : 30;
    for (size_t i = 0; i < 30; ++i) bar[i] = i < filled ? '#' : '.';
    bar[30] = '\0';
    std::printf("%sepoch %d/%d [%s] %6zu/%zu  %7.0f samples/s  loss %.4f  data stall %4.1f%%%s",
                tty_ ? "\r" : "", epoch_ + 1, epochs_, bar, done, total_,
                seconds > 0 ? static_cast<double>(done) / seconds : 0.0, loss, 100 * stall,
                tty_ ? "" : "\n");
    std::fflush(stdout);
  }
  void finish() {
    if (tty_) std::printf("\n");
  }

 private:
  int epoch_, epochs_;
  size_t total_;
  bool tty_;
  int last_tenth_ = -1;
};

// FNV-1a over the bits of every step's loss.
struct Fingerprint {
  uint64_t hash = 1469598103934665603ULL;
  void add(float value) {
    uint32_t bits = 0;
    std::memcpy(&bits, &value, sizeof bits);
    for (int i = 0; i < 4; ++i) {
      hash ^= (bits >> (8 * i)) & 0xff;
      hash *= 1099511628211ULL;
    }
  }
};

// This process's place in the job: rank 0 of 1 without --distributed.
struct Job {
  int rank = 0;
  int world = 1;
  uint64_t seed = 0;  // agreed by every rank
#if CONVEYOR_HAVE_DISTRIBUTED
  conveyor::distributed::Group* group = nullptr;
#endif
  // Samples this rank reads in the current epoch (after set_epoch), before
  // --limit, and the batches of `batch_size` they make: an iterable dataset
  // is batched per worker (PyTorch's rule), so shards split across workers
  // make more batches than samples / batch_size. Set under --distributed only.
  std::function<size_t()> local_samples;
  std::function<size_t(size_t batch_size)> local_batches;
  // The tar shards this rank reads in the current epoch (--source shards).
  std::function<std::string()> local_shards;
  // The shard set's file names, in order (--source shards): a checkpoint
  // resumes only over the same set, wherever it is (disk or HTTP).
  std::vector<std::string> shard_names;

  bool distributed() const {
#if CONVEYOR_HAVE_DISTRIBUTED
    return group != nullptr;
#else
    return false;
#endif
  }
  bool lead() const { return rank == 0; }
};

#if CONVEYOR_HAVE_DISTRIBUTED
// Every rank starts from rank 0's weights: one broadcast per tensor, once.
void broadcast_weights(conveyor::distributed::Group& group, Net& net) {
  torch::NoGradGuard no_grad;
  group.run("broadcast of rank 0's weights", [&](c10d::ProcessGroup& pg) {
    for (const torch::Tensor& t : net->parameters()) {
      std::vector<at::Tensor> one{t.detach()};
      pg.broadcast(one)->wait();
    }
    for (const torch::Tensor& t : net->buffers()) {
      std::vector<at::Tensor> one{t.detach()};
      pg.broadcast(one)->wait();
    }
  });
}

// After backward: every gradient, this rank's loss and batch size in one
// flat tensor and one allreduce (SUM), instead of one per parameter: one
// round trip per step, not eight. Gradients and loss come back averaged.
// Returns {the job's mean loss, the job's samples this step}.
std::pair<float, size_t> average_gradients(conveyor::distributed::Group& group, Net& net,
                                           const torch::Tensor& loss, int64_t batch) {
  torch::NoGradGuard no_grad;
  std::vector<torch::Tensor> parts;
  const auto parameters = net->parameters();
  for (const torch::Tensor& p : parameters) parts.push_back(p.grad().reshape(-1));
  parts.push_back(loss.detach().reshape(1).to(torch::kFloat));
  parts.push_back(torch::full({1}, static_cast<float>(batch)));
  std::vector<at::Tensor> flat{torch::cat(parts)};
  group.run("gradient allreduce", [&](c10d::ProcessGroup& pg) { pg.allreduce(flat)->wait(); });
  const float world = static_cast<float>(group.world_size());
  int64_t offset = 0;
  for (const torch::Tensor& p : parameters) {
    torch::Tensor grad = p.grad();
    const int64_t n = grad.numel();
    grad.copy_(flat[0].slice(0, offset, offset + n).view_as(grad)).div_(world);
    offset += n;
  }
  const float loss_sum = flat[0][offset].item<float>();
  const float samples = flat[0][offset + 1].item<float>();
  return {loss_sum / world, static_cast<size_t>(samples)};
}
#endif

template <class Loader>
double evaluate(Net& net, Loader& loader) {
  torch::NoGradGuard no_grad;
  net->eval();
  int64_t correct = 0, seen = 0;
  for (auto& [images, labels] : loader) {
    const torch::Tensor x = conveyor::to_tensor(images);
    const torch::Tensor y = conveyor::to_tensor(labels);
    correct += net->forward(x).argmax(1).eq(y).sum().template item<int64_t>();
    seen += y.size(0);
  }
  net->train();
  return seen ? static_cast<double>(correct) / static_cast<double>(seen) : 0.0;
}

// The loader alone, at full speed: what the pipeline (read, decode, augment,
// collate) delivers when nothing downstream waits.
template <class Loader>
int time_loader(const Flags& flags, Loader& loader, size_t samples_per_epoch) {
  for (int epoch = 0; epoch < flags.epochs; ++epoch) {
    loader.set_epoch(static_cast<uint64_t>(epoch));
    Progress progress(epoch, flags.epochs, samples_per_epoch);
    const auto start = Clock::now();
    size_t done = 0;
    for (auto& [images, labels] : loader) {
      done += labels.numel();
      const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
      progress.update(done, seconds, 0, 1);
      if (flags.limit > 0 && done >= static_cast<size_t>(flags.limit)) break;
    }
    progress.finish();
    const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
    std::printf("loader only, epoch %d/%d: %zu samples in %.2f s, %.0f samples/s (source %s, %d workers)\n",
                epoch + 1, flags.epochs, done, seconds, static_cast<double>(done) / seconds,
                flags.source.c_str(), flags.workers);
  }
  return 0;
}

template <class TrainDataset, class TestLoader>
int train(const Flags& flags, const Job& job, std::shared_ptr<TrainDataset> dataset, TestLoader& test_loader,
          size_t samples_per_epoch) {
  torch::manual_seed(flags.seed);
  Net net;
#if CONVEYOR_HAVE_DISTRIBUTED
  if (job.distributed()) broadcast_weights(*job.group, net);
#endif
  torch::optim::Adam optimizer(net->parameters(), torch::optim::AdamOptions(flags.lr));

  conveyor::LoaderOptions options{.batch_size = flags.batch_size,
                                  .num_workers = flags.workers,
                                  .persistent_workers = flags.workers > 0,
                                  .drop_last = false,
                                  .seed = flags.seed,
                                  .scheduling = flags.scheduling};
  if constexpr (conveyor::MapStyleDataset<TrainDataset>) {
    if (job.distributed()) {
      // This rank's share, reshuffled each epoch from the agreed seed.
      options.sampler = std::make_shared<conveyor::DistributedSampler>(dataset->size(), job.world, job.rank,
                                                                        /*shuffle=*/true, job.seed);
    } else {
      options.shuffle = true;
    }
  }
  // Ranks augment their samples from different streams.
  if (job.distributed()) options.seed = job.seed + static_cast<uint64_t>(job.rank);
  if (flags.pin_memory) {
#if CONVEYOR_HAVE_CUDA
    // CUDA when there is a GPU, else the host stand-in (with a warning).
    options.transfer_device = conveyor::cuda::select_transfer_device(0, /*standin_fallback=*/true);
#else
    options.transfer_device = conveyor::make_host_standin_device();
#endif
    options.pin_memory = true;
    options.prefetch_to_device = 2;
    if (job.lead()) std::printf("pin_memory: batches collated into pinned memory of %s, copied 2 batches ahead\n",
                options.transfer_device->name().c_str());
  }
  conveyor::DataLoader loader(dataset, options);

  if (flags.loader_only) return time_loader(flags, loader, samples_per_epoch);

  Fingerprint fingerprint;
  double accuracy = 0, total_seconds = 0, total_wait = 0;
  size_t total_samples = 0;
  // What must match between the run that saved a checkpoint and the one
  // resuming it (the loader checks its own: batch size, schedule, ...).
  conveyor::State run = conveyor::State::object();
  run.set("seed", flags.seed);
  run.set("source", flags.source);
  run.set("lr", flags.lr);
  run.set("limit", flags.limit);
  run.set("epochs", static_cast<int64_t>(flags.epochs));
  run.set("world", static_cast<int64_t>(job.world));
  if (!job.shard_names.empty()) {
    conveyor::State names = conveyor::State::array();
    for (const std::string& name : job.shard_names) names.push_back(name);
    run.set("shards", std::move(names));
  }
  // Each rank of a job keeps checkpoints of its own.
  auto rank_dir = [&job](const std::string& dir) {
    return job.distributed() ? dir + "/rank-" + std::to_string(job.rank) : dir;
  };
  // A resumed run: where it starts, and the counters it carries on.
  int first_epoch = 0;
  uint64_t global_step = 0;
  std::optional<conveyor::State> resumed;
  const std::string resume_from = flags.auto_resume ? flags.checkpoint : flags.resume;
  if (!resume_from.empty()) {
    std::optional<uint64_t> step = conveyor::examples::latest_checkpoint_step(rank_dir(resume_from));
#if CONVEYOR_HAVE_DISTRIBUTED
    if (job.distributed()) {
      // A crash between two ranks' saves leaves them one checkpoint apart:
      // all take the older, which each keeps. None anywhere: none at all.
      int64_t agreed = step ? static_cast<int64_t>(*step) : -1;
      job.group->run("agreement on the checkpoint to resume", [&](c10d::ProcessGroup& pg) {
        std::vector<at::Tensor> value{torch::full({1}, agreed, torch::kInt64)};
        c10d::AllreduceOptions options;
        options.reduceOp = c10d::ReduceOp::MIN;
        pg.allreduce(value, options)->wait();
        agreed = value[0].item<int64_t>();
      });
      step = agreed < 0 ? std::nullopt : std::optional<uint64_t>(static_cast<uint64_t>(agreed));
    }
#endif
    if (!step && !flags.auto_resume) {
      throw conveyor::StateError("--resume " + resume_from + ": no checkpoint there (no " + rank_dir(resume_from) +
                                 "/latest)");
    }
    if (step) resumed = conveyor::examples::load_checkpoint(rank_dir(resume_from), *step, net, optimizer);
    if (!step && job.lead()) std::printf("no checkpoint in %s yet: starting afresh\n", resume_from.c_str());
  }
  if (resumed) {
    if (!(resumed->at("run") == run)) {
      throw conveyor::StateError("resuming from " + resume_from + ": the checkpoint was saved by a run with " +
                                 resumed->at("run").to_json() + ", this one has " + run.to_json());
    }
    first_epoch = static_cast<int>(resumed->int_at("epoch"));
    // A checkpoint taken while padding (the loader's next pass over this
    // epoch's share) resumes that pass, which set_epoch() below is skipped
    // for: the dataset's epoch, which picks the epoch's shards and is not in
    // the loader's state, is set here, before the state sets the loader's.
    if (resumed->bool_at("padding")) loader.set_epoch(static_cast<uint64_t>(first_epoch));
    loader.load_state_dict(resumed->at("loader"));
    global_step = resumed->uint_at("global_step");
    fingerprint.hash = resumed->uint_at("fingerprint");
    accuracy = resumed->at("accuracy").as_double();
    total_seconds = resumed->at("total_seconds").as_double();
    total_wait = resumed->at("total_wait").as_double();
    total_samples = resumed->uint_at("total_samples");
    if (job.lead()) {
      std::printf("resumed from %s: epoch %d, step %llu of the run, %llu steps into the epoch\n",
                  resume_from.c_str(), first_epoch + 1, static_cast<unsigned long long>(global_step),
                  static_cast<unsigned long long>(resumed->uint_at("steps")));
    }
  }
  for (int epoch = first_epoch; epoch < flags.epochs; ++epoch) {
    Progress progress(epoch, flags.epochs, samples_per_epoch);
    const auto start = Clock::now();
    double waited = 0, running_loss = 0;
    size_t done = 0, steps = 0;
    // --distributed: padding the epoch with a second pass, which the
    // loader's state resumes (it is the loader's next epoch, not this one).
    bool resumed_padding = false;
    size_t resumed_read = 0, resumed_padded = 0;
    if (resumed && epoch == first_epoch) {
      steps = resumed->uint_at("steps");
      done = resumed->uint_at("done");
      running_loss = resumed->at("running_loss").as_double();
      resumed_padding = resumed->bool_at("padding");
      resumed_read = resumed->uint_at("read");
      resumed_padded = resumed->uint_at("padded");
      resumed.reset();
    }
    if (!resumed_padding) loader.set_epoch(static_cast<uint64_t>(epoch));
    // --distributed: every rank runs the same number of steps, or the one
    // with more would wait forever in its last allreduce. A rank with fewer
    // batches pads by starting its share again, as DistributedSampler pads.
    size_t agreed_steps = std::numeric_limits<size_t>::max();
    size_t local = 0, local_batches = 0, fewest = 0, padded = resumed_padded, read = resumed_read;
    bool padding = resumed_padding;  // on a second pass over this rank's share
#if CONVEYOR_HAVE_DISTRIBUTED
    if (job.distributed()) {
      local = job.local_samples();
      const size_t batch = static_cast<size_t>(flags.batch_size);
      local_batches = job.local_batches(batch);
      if (flags.limit > 0) {
        const size_t world = static_cast<size_t>(job.world);
        local = std::min(local, (static_cast<size_t>(flags.limit) + world - 1) / world);
        local_batches = std::min(local_batches, (local + batch - 1) / batch);
      }
      const conveyor::distributed::BatchCounts counts = job.group->agree_batch_count(local_batches);
      agreed_steps = counts.agreed;
      fewest = counts.fewest;
    }
#endif
    auto pass = loader.iter();
    while (steps < agreed_steps) {
      // Checked before asking for a batch, so a run resumed right at the
      // limit asks for none. Under --distributed the agreed step count is
      // the limit.
      if (!job.distributed() && flags.limit > 0 && done >= static_cast<size_t>(flags.limit)) break;
      const auto asked = Clock::now();
      auto batch = pass.next();
      if (!batch && job.distributed() && steps > 0) {
        // End the finished pass first: a persistent loader runs one at a time.
        { auto finished = std::move(pass); }
        pass = loader.iter();
        batch = pass.next();
        padding = true;
      }
      waited += std::chrono::duration<double>(Clock::now() - asked).count();
      if (!batch) {
        if (job.distributed()) throw conveyor::RuntimeError("rank " + std::to_string(job.rank) + " has no batches to pad with");
        break;
      }
      auto& [images, labels] = *batch;
      // LibTorch here is CPU-only: the model reads the (pinned) host batch;
      // a CUDA build would wait on pass.device().ready on its stream instead.
      const torch::Tensor x = conveyor::to_tensor(images);
      const torch::Tensor y = conveyor::to_tensor(labels);
      optimizer.zero_grad();
      torch::Tensor loss = torch::nn::functional::cross_entropy(net->forward(x), y);
      loss.backward();
      float value = 0;
      size_t samples = static_cast<size_t>(y.size(0));
#if CONVEYOR_HAVE_DISTRIBUTED
      if (job.distributed()) std::tie(value, samples) = average_gradients(*job.group, net, loss, y.size(0));
#endif
      optimizer.step();
      if (!job.distributed()) value = loss.item<float>();
      fingerprint.add(value);
      running_loss = steps == 0 ? value : 0.98 * running_loss + 0.02 * value;
      ++steps;
      if (padding) {
        ++padded;
      } else {
        read += static_cast<size_t>(y.size(0));  // of this rank's share, first time round
      }
      done += samples;
      ++global_step;
      if (!flags.checkpoint.empty() && global_step % static_cast<uint64_t>(flags.checkpoint_every) == 0) {
        conveyor::State trainer = conveyor::State::object();
        trainer.set("run", run);
        trainer.set("epoch", static_cast<int64_t>(epoch));
        trainer.set("steps", static_cast<uint64_t>(steps));
        trainer.set("done", static_cast<uint64_t>(done));
        trainer.set("running_loss", running_loss);
        trainer.set("global_step", global_step);
        trainer.set("fingerprint", fingerprint.hash);
        trainer.set("accuracy", accuracy);
        trainer.set("total_seconds", total_seconds);
        trainer.set("total_wait", total_wait);
        trainer.set("total_samples", static_cast<uint64_t>(total_samples));
        trainer.set("padding", padding);
        trainer.set("read", static_cast<uint64_t>(read));
        trainer.set("padded", static_cast<uint64_t>(padded));
        trainer.set("loader", loader.state_dict());
        const std::string mine = rank_dir(flags.checkpoint);
        const std::string name =
            conveyor::examples::write_checkpoint(mine, global_step, net, optimizer, trainer);
#if CONVEYOR_HAVE_DISTRIBUTED
        // Every rank has written this step before any names it latest.
        if (job.distributed()) job.group->barrier();
#endif
        conveyor::examples::publish_checkpoint(mine, name);
      }
      conveyor::examples::maybe_killed_at(global_step, job.rank);
      const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
      if (job.lead()) progress.update(done, seconds, running_loss, seconds > 0 ? waited / seconds : 0);
    }
    if (job.distributed()) {
      // Every rank, one line: what it read and how many steps it ran (the
      // same on every rank, or the job would hang), for the tests and logs.
      std::printf("rank %d: epoch %d: samples=%zu read=%zu batches=%zu steps=%zu fewest=%zu most=%zu padded=%zu%s%s\n",
                  job.rank, epoch + 1, local, read, local_batches, steps, fewest, agreed_steps, padded,
                  job.local_shards ? " shards=" : "", job.local_shards ? job.local_shards().c_str() : "");
      std::fflush(stdout);
    }
    if (!job.lead()) continue;  // rank 0 alone reports and evaluates
    progress.finish();
    std::printf("loader: %s\n", pass.metrics().summary().c_str());
    const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
    total_seconds += seconds;
    total_wait += waited;
    total_samples += done;
    accuracy = evaluate(net, test_loader);
    std::printf("epoch %d/%d: test accuracy %.2f%%, %.0f samples/s, data stall %.1f%%\n", epoch + 1,
                flags.epochs, 100 * accuracy, static_cast<double>(done) / seconds, 100 * waited / seconds);
  }
  if (!job.lead()) return 0;
  uint64_t skipped = 0;
  if constexpr (requires { dataset->skipped(); }) skipped = dataset->skipped();
  std::printf(
      "final: %d epochs, test accuracy %.2f%%, %.0f samples/s, data stall %.1f%%, skipped samples %llu, "
      "loss-curve fingerprint %016llx (source %s, %d workers, %s, seed %llu)\n",
      flags.epochs, 100 * accuracy, static_cast<double>(total_samples) / total_seconds,
      100 * total_wait / total_seconds, static_cast<unsigned long long>(skipped),
      static_cast<unsigned long long>(fingerprint.hash), flags.source.c_str(), flags.workers,
      flags.scheduling == conveyor::Scheduling::work_stealing ? "work_stealing" : "round_robin",
      static_cast<unsigned long long>(flags.seed));
  return 0;
}

// Samples in each shard, read once: a rank's count for an epoch is the sum
// over the shards it reads then, which it must know before the epoch to
// agree on the step count.
std::map<std::string, size_t> count_shard_samples(const conveyor::TarShardOptions& options) {
  std::map<std::string, size_t> counts;
  for (const std::string& shard : options.shards) {
    conveyor::TarShardOptions one = options;
    one.shards = {shard};
    one.shuffle_shards = false;
    one.shuffle_buffer = 0;
    one.num_replicas = 1;
    one.rank = 0;
    conveyor::TarShardDataset dataset(one);
    auto samples = dataset.iter(nullptr);
    size_t n = 0;
    while (samples->next()) ++n;
    counts[shard] = n;
  }
  return counts;
}

}  // namespace

int main(int argc, char** argv) {
  const Flags flags = parse(argc, argv);
  if (flags.threads > 0) torch::set_num_threads(flags.threads);
#if !CONVEYOR_HAVE_DISTRIBUTED
  if (flags.distributed) {
    std::fprintf(stderr,
                 "train_fashion_mnist: --distributed needs conveyor::distributed, which this build lacks "
                 "(it needs LibTorch's c10d and gloo's headers; Debian: libgloo-dev, then reconfigure)\n");
    return 2;
  }
#endif
  try {
    Job job;
    job.seed = flags.seed;
#if CONVEYOR_HAVE_DISTRIBUTED
    std::optional<conveyor::distributed::Group> group;
    if (flags.distributed) {
      // A lost rank fails the job within minutes, not PyTorch's default 30.
      conveyor::distributed::GroupOptions options;
      options.timeout = std::chrono::minutes(5);
      group.emplace(conveyor::distributed::Group::init(options));
      job.group = &*group;
      job.rank = group->rank();
      job.world = group->world_size();
      // Ranks started with different --seed values are an error, not two jobs.
      job.seed = group->agree_seed(flags.seed);
    }
#endif
    auto test = std::make_shared<conveyor::IdxImageDataset>(
        conveyor::IdxImageDataset::from_directory(flags.data, false));
    auto test_set = conveyor::map(test, plain);
    conveyor::DataLoader test_loader(test_set, {.batch_size = 1000, .num_workers = flags.workers});
    if (job.lead()) {
      std::printf("conveyor %s, LibTorch %d threads: Fashion-MNIST from %s, %d workers, batch %lld\n",
                  CONVEYOR_VERSION_STRING, torch::get_num_threads(),
                  flags.source == "idx" ? flags.data.c_str() : flags.shards.c_str(), flags.workers,
                  static_cast<long long>(flags.batch_size));
    }
    if (job.distributed()) {
      std::printf("distributed: rank %d of %d, seed %llu, batch %lld per rank; gradients averaged by one "
                  "flattened allreduce per step\n",
                  job.rank, job.world, static_cast<unsigned long long>(job.seed),
                  static_cast<long long>(flags.batch_size));
    }
    if (flags.source == "idx") {
      auto train_set = std::make_shared<conveyor::IdxImageDataset>(
          conveyor::IdxImageDataset::from_directory(flags.data, true));
      const size_t samples = flags.limit > 0 ? std::min<size_t>(train_set->size(), static_cast<size_t>(flags.limit))
                                             : train_set->size();
      if (job.distributed()) {
        const size_t share = conveyor::DistributedSampler(train_set->size(), job.world, job.rank).size();
        job.local_samples = [share] { return share; };
        job.local_batches = [share](size_t batch) { return (share + batch - 1) / batch; };
      }
      return train(flags, job, conveyor::map(train_set, augment), test_loader, samples);
    }
    conveyor::TarShardOptions shard_options;
    // Rank 0 writes the shards once; the others wait for it at the barrier.
    std::vector<std::string> shard_paths;
    if (is_url(flags.shards)) {
      // Streamed over HTTP as they are read, never downloaded first.
#if CONVEYOR_HAVE_IO
      shard_paths = conveyor::expand_shard_patterns({flags.shards});
      shard_options.open = conveyor::nodes::http_opener();
#else
      usage("--shards " + flags.shards + ": URLs need conveyor::io (libcurl), which this build lacks");
#endif
    } else if (conveyor::is_shard_pattern(flags.shards)) {
      // A brace range names the shards themselves, never a directory to write into.
      shard_paths = conveyor::expand_shard_patterns({flags.shards});  // a missing one is a DataError naming it
    } else {
      if (job.lead()) shard_paths = ensure_shards(flags.shards, flags.data);
#if CONVEYOR_HAVE_DISTRIBUTED
      if (job.distributed()) group->barrier();
#endif
      if (!job.lead()) shard_paths = ensure_shards(flags.shards, flags.data);
    }
    shard_options.shards = shard_paths;
    for (const std::string& path : shard_paths) {
      job.shard_names.push_back(path.substr(path.find_last_of('/') + 1));
    }
    shard_options.shuffle_shards = true;
    shard_options.seed = job.seed;
    shard_options.shuffle_buffer = 2000;
    shard_options.required_fields = {"jpg", "cls"};
    // Rank r reads shards r, r + R, ... of each epoch's (shared) shard order.
    shard_options.num_replicas = job.world;
    shard_options.rank = job.rank;
    auto shards = std::make_shared<conveyor::TarShardDataset>(shard_options);
    if (job.distributed()) {
      auto counts = std::make_shared<const std::map<std::string, size_t>>(count_shard_samples(shard_options));
      auto samples_of = [shards, counts](const conveyor::WorkerInfo* worker) {
        size_t n = 0;
        for (const std::string& shard : shards->shards_for(worker)) n += counts->at(shard);
        return n;
      };
      job.local_samples = [samples_of] { return samples_of(nullptr); };
      job.local_batches = [samples_of, workers = flags.workers](size_t batch) {
        if (workers == 0) return (samples_of(nullptr) + batch - 1) / batch;
        size_t batches = 0;
        for (int id = 0; id < workers; ++id) {
          conveyor::WorkerInfo worker;
          worker.id = id;
          worker.num_workers = workers;
          batches += (samples_of(&worker) + batch - 1) / batch;
        }
        return batches;
      };
      job.local_shards = [shards] {
        std::string names;
        for (const std::string& shard : shards->shards_for(nullptr)) {
          if (!names.empty()) names += ',';
          names += std::filesystem::path(shard).filename().string();
        }
        return names;
      };
    }
    auto decoded = conveyor::map(shards, [](conveyor::ShardSample&& s) { return augment(decode(std::move(s))); },
                                 conveyor::OnError::skip);
    const size_t samples = flags.limit > 0 ? static_cast<size_t>(flags.limit) : 60000;
    return train(flags, job, decoded, test_loader, samples);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "train_fashion_mnist: %s\n", e.what());
    return 1;
  }
}
