// The trainer's checkpoints: model, optimizer, LibTorch's generator, the
// loader's state and the trainer's own counters, saved together so that a
// crash at any moment leaves the last complete checkpoint readable.
//
//   DIR/step-000120/   model.pt optimizer.pt rng.pt trainer.json (the loader's
//                      state inside); written as DIR/.step-000120.tmp, each
//                      file fsynced, then renamed
//   DIR/latest         {"checkpoint": "step-000120"}: replaced atomically
//                      (conveyor::save_state_file) once the directory is whole
//
// A crash before `latest` is replaced leaves it naming the previous
// checkpoint; the one before that is deleted only after. A job of many ranks
// keeps one DIR per rank (DIR/rank-R), writes, waits for every rank at a
// barrier, then publishes. CONVEYOR_TRAINER_KILL_IN_SAVE=N
// (tests) kills the process with SIGKILL in the middle of step N's save.
#pragma once

#include <ATen/CPUGeneratorImpl.h>
#include <conveyor/state.h>
#include <fcntl.h>
#include <torch/torch.h>
#include <unistd.h>

#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <limits>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "flags.h"

namespace conveyor::examples {

namespace checkpoint_detail {
inline void fsync_path(const std::string& path, bool directory) {
  const int fd = ::open(path.c_str(), (directory ? O_RDONLY | O_DIRECTORY : O_RDONLY) | O_CLOEXEC);
  if (fd < 0) throw conveyor::RuntimeError("checkpoint: cannot open " + path + ": " + std::strerror(errno));
  const int synced = ::fsync(fd);
  const int error = errno;
  ::close(fd);
  if (synced != 0) throw conveyor::RuntimeError("checkpoint: cannot fsync " + path + ": " + std::strerror(error));
}

inline uint64_t env_step(const char* name) {
  const char* text = std::getenv(name);
  return text ? std::strtoull(text, nullptr, 10) : 0;
}

// Runs load(path of `file`); LibTorch's errors (a truncated or corrupt .pt,
// a generator state of the wrong size) come back as a StateError naming the
// file, without LibTorch's stack trace.
template <class Load>
void load_part(const std::filesystem::path& file, Load&& load) {
  try {
    load(file.string());
  } catch (const c10::Error& e) {
    throw conveyor::StateError("checkpoint: cannot load " + file.string() + ": " + e.what_without_backtrace());
  } catch (const std::exception& e) {
    throw conveyor::StateError("checkpoint: cannot load " + file.string() + ": " + e.what());
  }
}
}  // namespace checkpoint_detail

// Writes checkpoint `step` into `dir` (its directory whole, but not yet
// the one `latest` names: publish_checkpoint does that). `trainer` holds the
// counters and the loader's state. Returns the checkpoint's name.
template <class Net, class Optimizer>
std::string write_checkpoint(const std::string& dir, uint64_t step, Net& net, Optimizer& optimizer,
                             const conveyor::State& trainer) {
  namespace fs = std::filesystem;
  using checkpoint_detail::fsync_path;
  char name[32];
  std::snprintf(name, sizeof name, "step-%09llu", static_cast<unsigned long long>(step));
  const fs::path root(dir);
  const fs::path staging = root / (std::string(".") + name + ".tmp");
  const fs::path final_dir = root / name;
  fs::create_directories(root);
  fs::remove_all(staging);
  fs::create_directories(staging);
  torch::save(net, (staging / "model.pt").string());
  torch::save(optimizer, (staging / "optimizer.pt").string());
  torch::save(at::detail::getDefaultCPUGenerator().get_state(), (staging / "rng.pt").string());
  if (checkpoint_detail::env_step("CONVEYOR_TRAINER_KILL_IN_SAVE") == step) std::raise(SIGKILL);
  conveyor::save_state_file((staging / "trainer.json").string(), trainer);
  for (const char* file : {"model.pt", "optimizer.pt", "rng.pt"}) fsync_path((staging / file).string(), false);
  fsync_path(staging.string(), true);
  fs::remove_all(final_dir);
  fs::rename(staging, final_dir);
  fsync_path(root.string(), true);
  return name;
}

// Makes checkpoint `name` the one `dir`/latest names (atomically), then
// deletes all but it and the one before it: the ranks of a job may be one
// checkpoint apart after a crash, and agree on the older (agreed_step).
inline void publish_checkpoint(const std::string& dir, const std::string& name) {
  namespace fs = std::filesystem;
  std::string previous;
  if (fs::exists(fs::path(dir) / "latest")) {
    previous = conveyor::load_state_file((fs::path(dir) / "latest").string()).string_at("checkpoint");
  }
  conveyor::State latest = conveyor::State::object();
  latest.set("checkpoint", name);
  conveyor::save_state_file((fs::path(dir) / "latest").string(), latest);  // the switch
  for (const auto& entry : fs::directory_iterator(dir)) {
    const std::string other = entry.path().filename().string();
    if (entry.is_directory() && other.starts_with("step-") && other != name && other != previous) {
      fs::remove_all(entry.path());
    }
  }
}

// The step of the checkpoint `dir`/latest names; nullopt when there is none.
inline std::optional<uint64_t> latest_checkpoint_step(const std::string& dir) {
  namespace fs = std::filesystem;
  if (!fs::exists(fs::path(dir) / "latest")) return std::nullopt;
  const std::string name = conveyor::load_state_file((fs::path(dir) / "latest").string()).string_at("checkpoint");
  // "step-" and digits alone, that fit a uint64_t: "step-2x" is not step 2.
  std::optional<uint64_t> step;
  if (name.starts_with("step-")) {
    step = parse_integer<uint64_t>(name.c_str() + 5, 0, std::numeric_limits<uint64_t>::max());
  }
  if (!step) {
    throw conveyor::StateError("checkpoint: " + dir + "/latest names '" + name + "', not a checkpoint of this trainer");
  }
  return step;
}

// Loads checkpoint `step` of `dir` into `net`, `optimizer` and LibTorch's
// generator; returns its trainer.json. A missing, truncated or corrupt file
// of it is a StateError naming that file.
template <class Net, class Optimizer>
conveyor::State load_checkpoint(const std::string& dir, uint64_t step, Net& net, Optimizer& optimizer) {
  namespace fs = std::filesystem;
  char name[32];
  std::snprintf(name, sizeof name, "step-%09llu", static_cast<unsigned long long>(step));
  const fs::path checkpoint = fs::path(dir) / name;
  if (!fs::is_directory(checkpoint)) {
    throw conveyor::StateError("checkpoint: " + checkpoint.string() + " is missing");
  }
  using checkpoint_detail::load_part;
  // torch::load takes each saved tensor whatever its shape: a model of
  // another architecture under the same names loaded, and failed at the
  // first optimizer step with a bare LibTorch error.
  const auto shapes = [&net] {
    std::vector<std::pair<std::string, std::vector<int64_t>>> out;
    for (const auto& item : net->named_parameters()) out.emplace_back(item.key(), item.value().sizes().vec());
    for (const auto& item : net->named_buffers()) out.emplace_back(item.key(), item.value().sizes().vec());
    return out;
  };
  const auto shape_text = [](const std::vector<int64_t>& sizes) {
    std::string text = "[";
    for (size_t i = 0; i < sizes.size(); ++i) text += (i ? ", " : "") + std::to_string(sizes[i]);
    return text + "]";
  };
  const auto expected = shapes();
  load_part(checkpoint / "model.pt", [&](const std::string& path) { torch::load(net, path); });
  const auto loaded = shapes();
  for (size_t i = 0; i < expected.size(); ++i) {
    if (i >= loaded.size() || loaded[i] != expected[i]) {
      throw conveyor::StateError("checkpoint: " + (checkpoint / "model.pt").string() + ": " + expected[i].first +
                                 " is " + (i < loaded.size() ? shape_text(loaded[i].second) : std::string("missing")) +
                                 ", this net's is " + shape_text(expected[i].second));
    }
  }
  load_part(checkpoint / "optimizer.pt", [&](const std::string& path) { torch::load(optimizer, path); });
  load_part(checkpoint / "rng.pt", [](const std::string& path) {
    torch::Tensor rng;
    torch::load(rng, path);
    at::Generator generator = at::detail::getDefaultCPUGenerator();  // a handle: shares the default
    generator.set_state(rng);
  });
  return conveyor::load_state_file((checkpoint / "trainer.json").string());
}

// Tests: CONVEYOR_TRAINER_KILL_AT_STEP=N kills the process with SIGKILL
// right after step N (no cleanup, as a preemption would); with
// CONVEYOR_TRAINER_KILL_RANK=R only rank R, and never in a job torchrun has
// restarted (TORCHELASTIC_RESTART_COUNT > 0).
inline void maybe_killed_at(uint64_t step, int rank) {
  if (checkpoint_detail::env_step("CONVEYOR_TRAINER_KILL_AT_STEP") != step) return;
  if (const char* only = std::getenv("CONVEYOR_TRAINER_KILL_RANK"); only && std::atoi(only) != rank) return;
  if (checkpoint_detail::env_step("TORCHELASTIC_RESTART_COUNT") > 0) return;
  std::raise(SIGKILL);
}

}  // namespace conveyor::examples
