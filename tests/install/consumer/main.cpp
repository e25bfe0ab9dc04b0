// Built against the installed package: loads a shuffled, batched epoch and
// checks every sample arrives once.
#include <conveyor/conveyor.h>

#include <cstdio>
#include <vector>

int main() {
  std::vector<int> values(100);
  for (int i = 0; i < 100; ++i) values[static_cast<size_t>(i)] = i;
  conveyor::VectorDataset<int> dataset(values);
  conveyor::DataLoader loader(dataset, {.batch_size = 8, .shuffle = true, .seed = 7});
  std::vector<int> seen(100, 0);
  size_t batches = 0;
  for (auto& batch : loader) {
    ++batches;
    for (int v : batch.values()) ++seen[static_cast<size_t>(v)];
  }
  for (int count : seen) {
    if (count != 1) {
      std::fprintf(stderr, "a sample was lost or repeated\n");
      return 1;
    }
  }
  if (batches != loader.size()) return 1;
  // The Python-style iterator, with a worker thread.
  conveyor::DataLoader threaded(dataset, {.batch_size = 8, .shuffle = true, .num_workers = 2, .seed = 7});
  auto epoch = threaded.iter();
  size_t threaded_batches = 0;
  while (auto batch = epoch.next()) threaded_batches += batch->numel() > 0 ? 1 : 0;
  if (threaded_batches != batches) return 1;
  std::printf("consumer: %zu batches from conveyor %s\n", batches, CONVEYOR_VERSION_STRING);
  return 0;
}
