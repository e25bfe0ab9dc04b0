// conveyor/sample_fields.h: a tar-shard sample's fields (extension -> bytes),
// a small map kept as one sorted array.
//
// A WebDataset sample has two to five fields. std::map spent a heap node on
// each, and its lookups compared strings down a tree; the shard reader makes
// one sample per member pair, on the consumer's thread, at hundreds of
// thousands a second, and frees them on the same thread a batch later. Here
// the fields of a sample share one allocation, kept in name order, so
// iteration, equality and printing read as std::map's did.
#pragma once

#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <stdexcept>
#include <string>
#include <string_view>
#include <tuple>
#include <utility>
#include <vector>

namespace conveyor {

class SampleFields {
 public:
  using key_type = std::string;
  using mapped_type = std::vector<uint8_t>;
  using value_type = std::pair<std::string, std::vector<uint8_t>>;
  using iterator = std::vector<value_type>::iterator;
  using const_iterator = std::vector<value_type>::const_iterator;
  using size_type = size_t;

  SampleFields() = default;
  // As std::map's: in any order; of a name given twice the first is kept.
  SampleFields(std::initializer_list<value_type> fields) {
    for (const value_type& field : fields) try_emplace(field.first, field.second);
  }

  // In name order. A name must not be changed through an iterator: use
  // extract-and-insert (erase, then try_emplace) as with a map's key.
  iterator begin() noexcept { return fields_.begin(); }
  iterator end() noexcept { return fields_.end(); }
  const_iterator begin() const noexcept { return fields_.begin(); }
  const_iterator end() const noexcept { return fields_.end(); }
  size_t size() const noexcept { return fields_.size(); }
  bool empty() const noexcept { return fields_.empty(); }
  void clear() noexcept { fields_.clear(); }
  // Room for `count` fields without another allocation.
  void reserve(size_t count) { fields_.reserve(count); }

  iterator find(std::string_view name) noexcept {
    const auto at = lower_bound(name);
    return at != fields_.end() && at->first == name ? at : fields_.end();
  }
  const_iterator find(std::string_view name) const noexcept {
    return const_cast<SampleFields*>(this)->find(name);
  }
  bool contains(std::string_view name) const noexcept { return find(name) != end(); }
  size_t count(std::string_view name) const noexcept { return contains(name) ? 1 : 0; }

  // Throws std::out_of_range naming the field, where std::map's says only "map::at".
  std::vector<uint8_t>& at(std::string_view name) {
    const auto field = find(name);
    if (field == end()) throw std::out_of_range("sample has no field '" + std::string(name) + "'");
    return field->second;
  }
  const std::vector<uint8_t>& at(std::string_view name) const {
    return const_cast<SampleFields*>(this)->at(name);
  }
  // Unlike std::map's, inserting a field moves the others (one sorted
  // array): a reference to another field taken before it goes stale, so
  // `s["input"] = s.at("jpg")` (whose right side is evaluated first) is
  // wrong. Copy from another field with insert_or_assign or try_emplace,
  // which make the bytes before they insert.
  std::vector<uint8_t>& operator[](std::string_view name) { return try_emplace(name).first->second; }

  // Inserts `name` with bytes made from `args` unless it is there; returns
  // the field and whether it was inserted. The bytes are made before the
  // insertion moves the other fields: `args` may be one of them.
  template <class... Args>
  std::pair<iterator, bool> try_emplace(std::string_view name, Args&&... args) {
    const auto at = lower_bound(name);
    if (at != fields_.end() && at->first == name) return {at, false};
    mapped_type bytes(std::forward<Args>(args)...);
    return {fields_.emplace(at, std::piecewise_construct, std::forward_as_tuple(name),
                            std::forward_as_tuple(std::move(bytes))),
            true};
  }
  // As std::map's: a name already there keeps its bytes.
  template <class... Args>
  std::pair<iterator, bool> emplace(std::string_view name, Args&&... args) {
    return try_emplace(name, std::forward<Args>(args)...);
  }
  std::pair<iterator, bool> insert(const value_type& field) { return try_emplace(field.first, field.second); }
  std::pair<iterator, bool> insert(value_type&& field) { return try_emplace(field.first, std::move(field.second)); }
  // `bytes` may be another field's (see try_emplace).
  template <class Bytes>
  std::pair<iterator, bool> insert_or_assign(std::string_view name, Bytes&& bytes) {
    if (const auto field = find(name); field != end()) {
      field->second = std::forward<Bytes>(bytes);
      return {field, false};
    }
    return try_emplace(name, std::forward<Bytes>(bytes));
  }
  size_t erase(std::string_view name) {
    const auto field = find(name);
    if (field == end()) return 0;
    fields_.erase(field);
    return 1;
  }

  friend bool operator==(const SampleFields&, const SampleFields&) = default;

 private:
  iterator lower_bound(std::string_view name) noexcept {
    return std::lower_bound(fields_.begin(), fields_.end(), name,
                            [](const value_type& field, std::string_view wanted) { return field.first < wanted; });
  }

  std::vector<value_type> fields_;
};

}  // namespace conveyor
