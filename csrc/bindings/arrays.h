// NumPy array helpers shared by the data pipeline's bindings.
#pragma once

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace barqtrain::bindings {

namespace nb = nanobind;

template <typename T>
using Vector = nb::ndarray<const T, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using Rows = nb::ndarray<int64_t, nb::ndim<2>, nb::c_contig, nb::device::cpu>;

// A 1-D numpy array that owns a moved-in std::vector.
template <typename T>
nb::ndarray<nb::numpy, T, nb::ndim<1>> to_numpy(std::vector<T>&& values) {
  auto* owned = new std::vector<T>(std::move(values));
  nb::capsule owner(owned, [](void* p) noexcept { delete static_cast<std::vector<T>*>(p); });
  return nb::ndarray<nb::numpy, T, nb::ndim<1>>(owned->data(), {owned->size()}, owner);
}

// Checks that a [rows, seq_length] buffer has that shape; the error names the argument.
template <typename Error>
void check_rows(const Rows& a, size_t rows, int64_t seq_length, const char* name) {
  if (a.shape(0) != rows || a.shape(1) != static_cast<size_t>(seq_length)) {
    throw Error(std::string(name) + " has shape [" + std::to_string(a.shape(0)) + ", " + std::to_string(a.shape(1)) +
                "], expected [" + std::to_string(rows) + ", " + std::to_string(seq_length) + "]");
  }
}

}  // namespace barqtrain::bindings
