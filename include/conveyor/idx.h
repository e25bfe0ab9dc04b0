// conveyor/idx.h: the IDX format of MNIST and Fashion-MNIST, gzip'd or raw
// (target conveyor::formats).
//
// An IdxFile is read and decompressed once into one buffer; items are views
// into it (no copy per sample), kept alive by the buffer's shared owner.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "conveyor/array.h"
#include "conveyor/dataset.h"

namespace conveyor {

class IdxFile {
 public:
  // Reads `path`; gzip is recognised by its magic bytes. Throws DataError
  // naming the file for a missing or unreadable file, one that is not a
  // regular file (a device, a FIFO, a directory), a truncated or garbled
  // gzip stream, a wrong IDX magic, an unsupported element type, or a size
  // that does not match the dimensions. A gzip stream is inflated no further
  // than the size its IDX header declares (plus one byte, to see that it
  // goes on), so memory follows the header and what really decompresses,
  // not the compression ratio. A raw file's size is checked against its
  // header before its data is read. A file too big for the memory left is a
  // DataError naming it as well.
  static IdxFile open(const std::string& path);
  // The same from bytes in memory (raw or gzip'd); `name` is used in errors.
  static IdxFile parse(std::span<const uint8_t> bytes, const std::string& name);

  // IDX element type code: 0x08 unsigned byte (the only one MNIST uses),
  // 0x09 signed byte, 0x0B int16, 0x0C int32, 0x0D float32, 0x0E float64.
  uint8_t type_code() const noexcept { return type_code_; }
  // All dimensions; dims()[0] is the number of items.
  const std::vector<int64_t>& dims() const noexcept { return dims_; }
  size_t size() const noexcept { return dims_.empty() ? 0 : static_cast<size_t>(dims_[0]); }
  // Bytes of one item (the product of dims()[1:] times the element size).
  size_t item_bytes() const noexcept { return item_bytes_; }

  // Item i's bytes, a view into the file's buffer (big-endian for multi-byte
  // types, as stored). Throws IndexError past the end.
  std::span<const uint8_t> item(size_t index) const;
  // Item i of an unsigned-byte file as an Array of shape dims()[1:] sharing
  // the file's buffer (no copy). Throws TypeError for other element types.
  Array<uint8_t> item_array(size_t index) const;

  const std::string& name() const noexcept { return name_; }

 private:
  // Validates the IDX header of a whole (decompressed) file and takes the
  // buffer over; open() and parse() share it.
  static IdxFile from_buffer(std::shared_ptr<std::vector<uint8_t>> buffer, const std::string& name);

  std::string name_;
  uint8_t type_code_ = 0;
  std::vector<int64_t> dims_;
  size_t item_bytes_ = 0;
  std::shared_ptr<std::vector<uint8_t>> buffer_;  // the whole decompressed file
  size_t data_offset_ = 0;                        // where item 0 starts in buffer_
};

// An image and its class.
struct LabeledImage {
  Array<uint8_t> image;  // [C, H, W]; MNIST: [1, 28, 28], a view into the file
  int64_t label = 0;
};

// Images from one IDX file with labels from another (MNIST layout: images
// [N, H, W] unsigned bytes, labels [N] unsigned bytes). get(i) copies nothing.
class IdxImageDataset final : public Dataset<LabeledImage> {
 public:
  // Throws DataError if either file is bad, or if their item counts differ
  // (naming both files).
  IdxImageDataset(const std::string& images_path, const std::string& labels_path);
  IdxImageDataset(IdxFile images, IdxFile labels);

  // The Fashion-MNIST (or MNIST) files in `directory`, Debian's names:
  // train-images-idx3-ubyte.gz / t10k-images-idx3-ubyte.gz and the labels.
  static IdxImageDataset from_directory(const std::string& directory, bool train);

  size_t size() const override { return images_.size(); }
  LabeledImage get(size_t index) override;  // IndexError past the end

  const IdxFile& images() const noexcept { return images_; }
  const IdxFile& labels() const noexcept { return labels_; }

 private:
  IdxFile images_;
  IdxFile labels_;
};

// Where Debian's dataset-fashion-mnist puts the files.
inline constexpr const char* kFashionMnistDirectory = "/usr/share/datasets/fashion-mnist";

}  // namespace conveyor
