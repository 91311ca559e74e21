// encode_batch, encode_batch_flat, encode_batch_with_offsets and offset conversion for
// barqtrain.data._native
// (included by data_module.cpp).
//
// Under the GIL they only take the UTF-8 buffers Python already holds for the str objects
// (no copies) and, at the end, build the result objects; all the encoding runs without it.
#pragma once

#include <Python.h>
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <string_view>
#include <utility>
#include <vector>

#include "data/tokenizer/tokenizer.h"

namespace barqtrain::bindings {

namespace nb = nanobind;

// Views of the UTF-8 of each str in texts. The returned tuple holds a reference to each str,
// so the views stay valid while the GIL is released even if the caller's list changes.
inline nb::object utf8_views(nb::handle texts, std::vector<std::string_view>& views) {
  nb::object items = nb::steal(PySequence_Tuple(texts.ptr()));
  if (!items.is_valid()) throw nb::python_error();
  const Py_ssize_t count = PyTuple_GET_SIZE(items.ptr());
  views.resize(static_cast<size_t>(count));
  for (Py_ssize_t i = 0; i < count; ++i) {
    PyObject* text = PyTuple_GET_ITEM(items.ptr(), i);
    if (!PyUnicode_Check(text)) {
      PyErr_Format(PyExc_TypeError, "texts[%zd] is %.100s, not str", i, Py_TYPE(text)->tp_name);
      throw nb::python_error();
    }
    Py_ssize_t size = 0;
    const char* data = PyUnicode_AsUTF8AndSize(text, &size);  // cached in the str object
    if (!data) throw nb::python_error();
    views[i] = std::string_view(data, static_cast<size_t>(size));
  }
  return items;
}

inline tokenizer::Tokenizer::FlatIds encode_flat(const tokenizer::Tokenizer& self, nb::handle texts,
                                                 const tokenizer::EncodeOptions& options, size_t num_threads) {
  std::vector<std::string_view> views;
  const nb::object keep_alive = utf8_views(texts, views);
  nb::gil_scoped_release release;
  return self.encode_batch_flat(views, options, num_threads);
}

// list[list[int]]. The cyclic garbage collector is paused while the lists are built: it
// would otherwise scan every list built so far after each few hundred new ones.
inline nb::object encode_batch_lists(const tokenizer::Tokenizer& self, nb::handle texts,
                                     const tokenizer::EncodeOptions& options, size_t num_threads) {
  const tokenizer::Tokenizer::FlatIds flat = encode_flat(self, texts, options, num_threads);
  const size_t count = flat.offsets.size() - 1;
  // A large batch shares one int object per distinct id instead of allocating one per id.
  std::vector<PyObject*> int_of;
  if (flat.ids.size() >= self.id_bound() / 4) int_of.assign(self.id_bound(), nullptr);
  auto int_object = [&](tokenizer::TokenId id) -> PyObject* {
    if (id >= int_of.size()) return PyLong_FromUnsignedLong(id);
    PyObject*& cached = int_of[id];
    if (!cached) cached = PyLong_FromUnsignedLong(id);
    Py_XINCREF(cached);
    return cached;
  };
  const int gc_was_enabled = PyGC_Disable();
  PyObject* lists = PyList_New(static_cast<Py_ssize_t>(count));
  for (size_t i = 0; lists && i < count; ++i) {
    const int64_t first = flat.offsets[i], last = flat.offsets[i + 1];
    PyObject* ids = PyList_New(last - first);
    bool failed = !ids;
    for (int64_t j = first; !failed && j < last; ++j) {
      PyObject* id = int_object(flat.ids[j]);
      failed = !id;
      PyList_SET_ITEM(ids, j - first, id);  // a NULL item is fine in a list being freed
    }
    if (failed) {
      Py_XDECREF(ids);
      Py_CLEAR(lists);
      break;
    }
    PyList_SET_ITEM(lists, i, ids);
  }
  for (PyObject* object : int_of) Py_XDECREF(object);
  if (gc_was_enabled) PyGC_Enable();
  if (!lists) throw nb::python_error();
  return nb::steal(lists);
}

// (ids, offsets) as NumPy arrays (uint32, int64) that own the C++ buffers: no copy.
inline nb::tuple encode_batch_flat(const tokenizer::Tokenizer& self, nb::handle texts,
                                   const tokenizer::EncodeOptions& options, size_t num_threads) {
  auto* ids = new std::vector<tokenizer::TokenId>;
  auto* offsets = new std::vector<int64_t>;
  {
    tokenizer::Tokenizer::FlatIds flat;
    try {
      flat = encode_flat(self, texts, options, num_threads);
    } catch (...) {
      delete ids;
      delete offsets;
      throw;
    }
    *ids = std::move(flat.ids);
    *offsets = std::move(flat.offsets);
  }
  nb::capsule ids_owner(ids, [](void* p) noexcept { delete static_cast<std::vector<tokenizer::TokenId>*>(p); });
  nb::capsule offsets_owner(offsets, [](void* p) noexcept { delete static_cast<std::vector<int64_t>*>(p); });
  auto ids_array = nb::ndarray<nb::numpy, tokenizer::TokenId, nb::ndim<1>>(ids->data(), {ids->size()}, ids_owner);
  auto offsets_array = nb::ndarray<nb::numpy, int64_t, nb::ndim<1>>(offsets->data(), {offsets->size()}, offsets_owner);
  return nb::make_tuple(ids_array, offsets_array);
}

// Byte offsets into text (UTF-8) as offsets into the Python str, counted in code points.
// Offsets are on character boundaries or at the end of the text.
inline std::vector<std::pair<size_t, size_t>> character_offsets(std::string_view text,
                                                                 const std::vector<tokenizer::Span>& offsets) {
  std::vector<uint32_t> character_at(text.size() + 1);  // the character index of each byte
  uint32_t characters = 0;
  for (size_t pos = 0; pos < text.size(); ++pos) {
    if ((static_cast<unsigned char>(text[pos]) & 0xC0) != 0x80 && pos > 0) ++characters;
    character_at[pos] = characters;
  }
  character_at[text.size()] = text.empty() ? 0 : characters + 1;
  std::vector<std::pair<size_t, size_t>> out;
  out.reserve(offsets.size());
  for (const tokenizer::Span& span : offsets) out.emplace_back(character_at[span.start], character_at[span.end]);
  return out;
}

using IdsAndOffsets = std::pair<std::vector<tokenizer::TokenId>, std::vector<std::pair<size_t, size_t>>>;

// (ids, character offsets) of each text; the encoding and the offset conversion run without the GIL.
inline std::vector<IdsAndOffsets> encode_batch_with_offsets(const tokenizer::Tokenizer& self, nb::handle texts,
                                                            const tokenizer::EncodeOptions& options,
                                                            size_t num_threads) {
  std::vector<std::string_view> views;
  const nb::object keep_alive = utf8_views(texts, views);
  nb::gil_scoped_release release;
  std::vector<tokenizer::Tokenizer::Encoding> encodings = self.encode_batch_with_offsets(views, options, num_threads);
  std::vector<IdsAndOffsets> results(encodings.size());
  for (size_t i = 0; i < encodings.size(); ++i) {
    results[i] = {std::move(encodings[i].ids), character_offsets(views[i], encodings[i].offsets)};
  }
  return results;
}

}  // namespace barqtrain::bindings
