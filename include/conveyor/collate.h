// conveyor/collate.h: default_collate and default_convert for C++ types.
//
// default_collate(std::vector<T>) follows torch.utils.data.default_collate,
// with C++ types in the places of Python's:
//
//   sample T                        batch
//   number (int, float, bool...)    Array<T> of shape [B]
//   Array<T> of shape S             Array<T> of shape [B, S...] (stacked)
//   std::array<number, N>           Array<number> of shape [B, N] (like a numpy array)
//   std::string                     std::vector<std::string>
//   std::pair / std::tuple          the same, each position collated
//   std::array<U, N>, U not number  std::array of collated U
//   std::vector<U>                  std::vector of collated U (equal lengths required)
//   std::map / unordered_map<std::string, U>   the same keys, values collated
//   aggregate struct (<= 16 fields) std::tuple of its fields, collated
//   torch::Tensor (conveyor/torch.h) one stacked tensor
//
// Any other type opts in by specialising conveyor::collate_traits<T>:
//
//   template <> struct conveyor::collate_traits<MySample> {
//     static MyBatch collate(std::vector<MySample>&& samples);
//   };
//
// default_convert (the batch_size=nullopt path) passes a sample through.
#pragma once

#include <array>
#include <cstddef>
#include <cstring>
#include <map>
#include <string>
#include <tuple>
#include <type_traits>
#include <unordered_map>
#include <utility>
#include <vector>

#include "conveyor/array.h"
#include "conveyor/errors.h"

namespace conveyor {

// Specialise with `static Batch collate(std::vector<T>&&)` to give T a rule.
template <class T>
struct collate_traits;

namespace detail {

template <class T>
concept HasCollateTraits = requires(std::vector<T>&& samples) {
  collate_traits<T>::collate(std::move(samples));
};

template <class T>
struct is_std_array : std::false_type {};
template <class U, size_t N>
struct is_std_array<std::array<U, N>> : std::true_type {};

template <class T>
struct is_conveyor_array : std::false_type {};
template <class U>
struct is_conveyor_array<Array<U>> : std::true_type {};

template <class T>
struct is_pair : std::false_type {};
template <class A, class B>
struct is_pair<std::pair<A, B>> : std::true_type {};

template <class T>
struct is_tuple : std::false_type {};
template <class... Ts>
struct is_tuple<std::tuple<Ts...>> : std::true_type {};

template <class T>
struct is_vector : std::false_type {};
template <class U, class A>
struct is_vector<std::vector<U, A>> : std::true_type {};

template <class T>
struct is_string_map : std::false_type {};
template <class U, class C, class A>
struct is_string_map<std::map<std::string, U, C, A>> : std::true_type {};
template <class U, class H, class E, class A>
struct is_string_map<std::unordered_map<std::string, U, H, E, A>> : std::true_type {};

template <class Map, class Value>
struct rebind_map;
template <class U, class C, class A, class Value>
struct rebind_map<std::map<std::string, U, C, A>, Value> {
  using type = std::map<std::string, Value>;
};
template <class U, class H, class E, class A, class Value>
struct rebind_map<std::unordered_map<std::string, U, H, E, A>, Value> {
  using type = std::unordered_map<std::string, Value>;
};

template <class>
inline constexpr bool always_false = false;

// ---- aggregates: count the fields, then bind them -------------------------

struct AnyField {
  template <class U>
  operator U() const;  // never defined: only used in unevaluated contexts
};

template <class T, size_t... I>
constexpr bool brace_constructible(std::index_sequence<I...>) {
  return requires { T{((void)I, AnyField{})...}; };
}

template <class T, size_t N = 16>
constexpr size_t field_count() {
  if constexpr (N == 0) {
    return 0;
  } else if constexpr (brace_constructible<T>(std::make_index_sequence<N>{})) {
    return N;
  } else {
    return field_count<T, N - 1>();
  }
}

template <class T>
concept CollatableAggregate = std::is_aggregate_v<T> && std::is_class_v<T> &&
                              !is_std_array<T>::value && field_count<T>() > 0;

// Moves an aggregate's fields into a tuple.
template <class T>
auto fields_as_tuple(T&& value) {
  using Plain = std::remove_cvref_t<T>;
  constexpr size_t kFields = field_count<Plain>();
  static_assert(kFields <= 16, "aggregates of more than 16 fields need collate_traits");
  // clang-format off
  if constexpr (kFields == 1) { auto&& [a] = value; return std::make_tuple(std::move(a)); }
  else if constexpr (kFields == 2) { auto&& [a, b] = value; return std::make_tuple(std::move(a), std::move(b)); }
  else if constexpr (kFields == 3) { auto&& [a, b, c] = value; return std::make_tuple(std::move(a), std::move(b), std::move(c)); }
  else if constexpr (kFields == 4) { auto&& [a, b, c, d] = value; return std::make_tuple(std::move(a), std::move(b), std::move(c), std::move(d)); }
  else if constexpr (kFields == 5) { auto&& [a, b, c, d, e] = value; return std::make_tuple(std::move(a), std::move(b), std::move(c), std::move(d), std::move(e)); }
  else if constexpr (kFields == 6) { auto&& [a, b, c, d, e, f] = value; return std::make_tuple(std::move(a), std::move(b), std::move(c), std::move(d), std::move(e), std::move(f)); }
  else if constexpr (kFields == 7) { auto&& [a, b, c, d, e, f, g] = value; return std::make_tuple(std::move(a), std::move(b), std::move(c), std::move(d), std::move(e), std::move(f), std::move(g)); }
  else if constexpr (kFields == 8) { auto&& [a, b, c, d, e, f, g, h] = value; return std::make_tuple(std::move(a), std::move(b), std::move(c), std::move(d), std::move(e), std::move(f), std::move(g), std::move(h)); }
  else if constexpr (kFields == 9) { auto&& [a, b, c, d, e, f, g, h, i] = value; return std::make_tuple(std::move(a), std::move(b), std::move(c), std::move(d), std::move(e), std::move(f), std::move(g), std::move(h), std::move(i)); }
  else if constexpr (kFields == 10) { auto&& [a, b, c, d, e, f, g, h, i, j] = value; return std::make_tuple(std::move(a), std::move(b), std::move(c), std::move(d), std::move(e), std::move(f), std::move(g), std::move(h), std::move(i), std::move(j)); }
  else if constexpr (kFields == 11) { auto&& [a, b, c, d, e, f, g, h, i, j, k] = value; return std::make_tuple(std::move(a), std::move(b), std::move(c), std::move(d), std::move(e), std::move(f), std::move(g), std::move(h), std::move(i), std::move(j), std::move(k)); }
  else if constexpr (kFields == 12) { auto&& [a, b, c, d, e, f, g, h, i, j, k, l] = value; return std::make_tuple(std::move(a), std::move(b), std::move(c), std::move(d), std::move(e), std::move(f), std::move(g), std::move(h), std::move(i), std::move(j), std::move(k), std::move(l)); }
  else if constexpr (kFields == 13) { auto&& [a, b, c, d, e, f, g, h, i, j, k, l, m] = value; return std::make_tuple(std::move(a), std::move(b), std::move(c), std::move(d), std::move(e), std::move(f), std::move(g), std::move(h), std::move(i), std::move(j), std::move(k), std::move(l), std::move(m)); }
  else if constexpr (kFields == 14) { auto&& [a, b, c, d, e, f, g, h, i, j, k, l, m, n] = value; return std::make_tuple(std::move(a), std::move(b), std::move(c), std::move(d), std::move(e), std::move(f), std::move(g), std::move(h), std::move(i), std::move(j), std::move(k), std::move(l), std::move(m), std::move(n)); }
  else if constexpr (kFields == 15) { auto&& [a, b, c, d, e, f, g, h, i, j, k, l, m, n, o] = value; return std::make_tuple(std::move(a), std::move(b), std::move(c), std::move(d), std::move(e), std::move(f), std::move(g), std::move(h), std::move(i), std::move(j), std::move(k), std::move(l), std::move(m), std::move(n), std::move(o)); }
  else { auto&& [a, b, c, d, e, f, g, h, i, j, k, l, m, n, o, p] = value; return std::make_tuple(std::move(a), std::move(b), std::move(c), std::move(d), std::move(e), std::move(f), std::move(g), std::move(h), std::move(i), std::move(j), std::move(k), std::move(l), std::move(m), std::move(n), std::move(o), std::move(p)); }
  // clang-format on
}

inline void require_nonempty(size_t size) {
  if (size == 0) throw ValueError("default_collate: cannot collate an empty batch");
}

}  // namespace detail

template <class T>
auto default_collate(std::vector<T>&& batch);

namespace detail {

template <class T>
Array<T> collate_numbers(std::vector<T>&& batch) {
  Array<T> out({static_cast<int64_t>(batch.size())});
  if constexpr (std::is_same_v<T, bool>) {  // std::vector<bool> has no data()
    for (size_t i = 0; i < batch.size(); ++i) out[i] = batch[i];
  } else if (!batch.empty()) {
    std::memcpy(out.data(), batch.data(), batch.size() * sizeof(T));
  }
  return out;
}

// torch.stack into one preallocated output.
template <class T>
Array<T> stack_arrays(std::vector<Array<T>>&& batch) {
  require_nonempty(batch.size());
  // A default Array() has shape [] like a scalar but no element: the shape
  // alone does not give the bytes to copy, so numel must match too.
  const auto describe = [](const Array<T>& a) {
    return a.dim() == 0 && a.numel() == 0 ? std::string("[] (an empty Array())")
                                          : shape_string(a.shape());
  };
  const std::vector<int64_t>& shape = batch.front().shape();
  const size_t per_sample = batch.front().numel();
  for (size_t i = 1; i < batch.size(); ++i) {
    if (batch[i].shape() != shape || batch[i].numel() != per_sample) {
      throw RuntimeError("stack expects each tensor to be equal size, but got " +
                         describe(batch.front()) + " at entry 0 and " + describe(batch[i]) +
                         " at entry " + std::to_string(i));
    }
  }
  if (shape.empty() && per_sample == 0) {  // all empty: stacking would invent an element each
    const std::string where =
        batch.size() == 1 ? "entry 0" : "entries 0 to " + std::to_string(batch.size() - 1);
    throw ValueError("default_collate: cannot stack empty Array()s (default constructed: shape [] "
                     "but no element), at " + where);
  }
  std::vector<int64_t> stacked{static_cast<int64_t>(batch.size())};
  stacked.insert(stacked.end(), shape.begin(), shape.end());
  Array<T> out(std::move(stacked));
  for (size_t i = 0; i < batch.size(); ++i) {
    std::memcpy(out.data() + i * per_sample, batch[i].data(), per_sample * sizeof(T));
  }
  return out;
}

template <class U, size_t N>
Array<U> stack_std_arrays(std::vector<std::array<U, N>>&& batch) {
  Array<U> out({static_cast<int64_t>(batch.size()), static_cast<int64_t>(N)});
  for (size_t i = 0; i < batch.size(); ++i) {
    std::memcpy(out.data() + i * N, batch[i].data(), N * sizeof(U));
  }
  return out;
}

// Collates position I of every sample: a column of a "transposed" batch.
template <size_t I, class Sample>
auto collate_position(std::vector<Sample>& batch) {
  using Element = std::remove_cvref_t<decltype(std::get<I>(batch.front()))>;
  std::vector<Element> column;
  column.reserve(batch.size());
  for (Sample& sample : batch) column.push_back(std::move(std::get<I>(sample)));
  return default_collate(std::move(column));
}

template <class Tuple, size_t... I>
auto collate_tuple(std::vector<Tuple>&& batch, std::index_sequence<I...>) {
  return std::make_tuple(collate_position<I>(batch)...);
}

template <class U, size_t N, size_t... I>
auto collate_std_array(std::vector<std::array<U, N>>&& batch, std::index_sequence<I...>) {
  using Collated = decltype(default_collate(std::vector<U>{}));
  return std::array<Collated, N>{collate_position<I>(batch)...};
}

template <class U, class A>
auto collate_vectors(std::vector<std::vector<U, A>>&& batch) {
  require_nonempty(batch.size());
  const size_t length = batch.front().size();
  for (const auto& sample : batch) {
    if (sample.size() != length) {
      throw RuntimeError("each element in list of batch should be of equal size");
    }
  }
  using Collated = decltype(default_collate(std::vector<U>{}));
  std::vector<Collated> out;
  out.reserve(length);
  for (size_t position = 0; position < length; ++position) {
    std::vector<U> column;
    column.reserve(batch.size());
    for (auto& sample : batch) column.push_back(std::move(sample[position]));
    out.push_back(default_collate(std::move(column)));
  }
  return out;
}

template <class Map>
auto collate_maps(std::vector<Map>&& batch) {
  require_nonempty(batch.size());
  using Value = typename Map::mapped_type;
  using Collated = decltype(default_collate(std::vector<Value>{}));
  typename rebind_map<Map, Collated>::type out;
  for (const auto& [key, unused] : batch.front()) {
    std::vector<Value> column;
    column.reserve(batch.size());
    for (auto& sample : batch) {
      auto found = sample.find(key);
      if (found == sample.end()) throw KeyError("'" + key + "'");
      column.push_back(std::move(found->second));
    }
    out.emplace(key, default_collate(std::move(column)));
  }
  return out;
}

}  // namespace detail

// torch.utils.data.default_collate for one batch of samples.
template <class T>
auto default_collate(std::vector<T>&& batch) {
  // An empty batch is refused whatever the sample type, as torch's
  // default_collate refuses it (batch[0]); a type with collate_traits
  // decides for itself.
  if constexpr (!detail::HasCollateTraits<T>) detail::require_nonempty(batch.size());
  if constexpr (detail::HasCollateTraits<T>) {
    return collate_traits<T>::collate(std::move(batch));
  } else if constexpr (std::is_arithmetic_v<T>) {
    return detail::collate_numbers(std::move(batch));
  } else if constexpr (detail::is_conveyor_array<T>::value) {
    return detail::stack_arrays(std::move(batch));
  } else if constexpr (std::is_same_v<T, std::string>) {
    return std::move(batch);
  } else if constexpr (detail::is_std_array<T>::value) {
    using U = typename T::value_type;
    if constexpr (std::is_arithmetic_v<U>) {
      return detail::stack_std_arrays(std::move(batch));
    } else {
      return detail::collate_std_array(std::move(batch),
                                       std::make_index_sequence<std::tuple_size_v<T>>{});
    }
  } else if constexpr (detail::is_pair<T>::value) {
    return std::make_pair(detail::collate_position<0>(batch), detail::collate_position<1>(batch));
  } else if constexpr (detail::is_tuple<T>::value) {
    return detail::collate_tuple(std::move(batch),
                                 std::make_index_sequence<std::tuple_size_v<T>>{});
  } else if constexpr (detail::is_vector<T>::value) {
    return detail::collate_vectors(std::move(batch));
  } else if constexpr (detail::is_string_map<T>::value) {
    return detail::collate_maps(std::move(batch));
  } else if constexpr (detail::CollatableAggregate<T>) {
    using Fields = decltype(detail::fields_as_tuple(std::declval<T>()));
    std::vector<Fields> as_tuples;
    as_tuples.reserve(batch.size());
    for (T& sample : batch) as_tuples.push_back(detail::fields_as_tuple(std::move(sample)));
    return default_collate(std::move(as_tuples));
  } else {
    static_assert(detail::always_false<T>,
                  "default_collate has no rule for this sample type: specialise "
                  "conveyor::collate_traits<T> or pass a collate function to the loader");
  }
}

// The batch type default_collate makes of samples of type T.
template <class T>
using collated_t = decltype(default_collate(std::declval<std::vector<T>&&>()));

// default_collate as a function object: the loader's default collate_fn.
struct DefaultCollate {
  template <class T>
  auto operator()(std::vector<T>&& batch) const {
    return default_collate(std::move(batch));
  }
};

// default_collate into a batch type of your own, so that a batch of
// aggregate samples keeps its field names (default_collate alone makes a
// std::tuple of them). Batch is an aggregate with one field per sample
// field, in order, each taking what default_collate makes of that field:
//
//   struct Sample { Array<float> image; int64_t label; };
//   struct Batch  { Array<float> image; Array<int64_t> label; };
//   conveyor::DataLoader loader(dataset, options, conveyor::CollateInto<Batch>{});
//   for (Batch& batch : loader) step(batch.image, batch.label);  // [B, ...], [B]
//
// Also for std::tuple and std::pair samples.
template <class Batch>
struct CollateInto {
  template <class T>
  Batch operator()(std::vector<T>&& batch) const {
    auto fields = default_collate(std::move(batch));
    return std::apply(
        []<class... Fields>(Fields&&... collated) {
          static_assert(requires { Batch{std::declval<Fields>()...}; },
                        "CollateInto<Batch>: Batch must be an aggregate whose fields, in order, "
                        "take what default_collate makes of each sample field");
          return Batch{std::forward<Fields>(collated)...};
        },
        std::move(fields));
  }
};

// default_convert: with batch_size = nullopt (no auto-batching) each sample
// is handed to the consumer as it is. C++ samples are already in their final
// types, so this is the identity.
template <class T>
T default_convert(T&& sample) {
  return std::forward<T>(sample);
}

struct DefaultConvert {
  static constexpr bool takes_one_sample = true;  // never a batch collate
  template <class T>
  std::remove_cvref_t<T> operator()(T&& sample) const {
    return std::forward<T>(sample);
  }
};

}  // namespace conveyor
