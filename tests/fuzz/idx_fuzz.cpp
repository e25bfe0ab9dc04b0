// libFuzzer target for the IDX reader: any bytes either parse or throw
// conveyor::Error; anything else (a crash, an ASan report, another exception,
// a broken invariant) is a bug.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "conveyor/errors.h"
#include "conveyor/idx.h"

namespace {

void check(bool condition) {
  if (!condition) __builtin_trap();
}

// Items of zero bytes (a zero extent, e.g. dims [4000000000, 0]) are valid
// but cost nothing to store; only a bounded number of them is visited, so a
// run stays linear in the input size.
size_t items_to_visit(const conveyor::IdxFile& file) {
  constexpr size_t kMaxEmptyItems = 1024;
  return file.item_bytes() > 0 ? file.size() : std::min(file.size(), kMaxEmptyItems);
}

// Reads every byte of every item and checks the views tile the data.
void touch_every_item(const conveyor::IdxFile& file) {
  volatile uint8_t sink = 0;
  const uint8_t* previous_end = nullptr;
  for (size_t i = 0; i < items_to_visit(file); ++i) {
    std::span<const uint8_t> bytes = file.item(i);
    check(bytes.size() == file.item_bytes());
    check(previous_end == nullptr || bytes.data() == previous_end);
    previous_end = bytes.data() + bytes.size();
    for (uint8_t byte : bytes) sink = sink ^ byte;
    if (file.type_code() == 0x08) {
      conveyor::Array<uint8_t> array = file.item_array(i);
      check(array.data() == bytes.data());
      check(array.shape().size() + 1 == file.dims().size());
      check(array.numel() == bytes.size());
    }
  }
  try {
    (void)file.item(file.size());
    check(false);  // past the end must throw
  } catch (const conveyor::IndexError&) {
  }
}

// Images ([N, H, W] unsigned bytes) also go through the dataset, with labels
// made up to match.
void load_as_images(const conveyor::IdxFile& images) {
  if (images.type_code() != 0x08 || images.dims().size() != 3) return;
  if (images.size() != items_to_visit(images)) return;
  const size_t count = images.size();
  std::vector<uint8_t> label_file = {0, 0, 0x08, 1};  // unsigned bytes, one dimension
  for (int shift = 24; shift >= 0; shift -= 8) label_file.push_back(uint8_t(count >> shift));
  label_file.resize(label_file.size() + count, 7);
  conveyor::IdxImageDataset dataset(images, conveyor::IdxFile::parse(label_file, "labels"));
  check(dataset.size() == count);
  for (size_t i = 0; i < count; ++i) {
    conveyor::LabeledImage sample = dataset.get(i);
    check(sample.label == 7);
    check(sample.image.shape().size() == 3 && sample.image.shape()[0] == 1);
    check(sample.image.numel() == images.item_bytes());
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  conveyor::IdxFile file;
  try {
    file = conveyor::IdxFile::parse(std::span<const uint8_t>(data, size), "fuzz-input");
  } catch (const conveyor::Error&) {
    return 0;  // bad input, reported as it should be
  }
  touch_every_item(file);
  load_as_images(file);
  return 0;
}
