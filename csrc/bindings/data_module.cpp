// barqtrain.data._native: the Python face of the C++ data pipeline. Calls that take time
// release the GIL; python/barqtrain/data/ adds the documented Python API on top.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string_view.h>
#include <nanobind/stl/vector.h>

#include "bindings/tokenizer_batch.h"
#include "data/tokenizer/tokenizer.h"

namespace nb = nanobind;
using barqtrain::tokenizer::EncodeOptions;
using barqtrain::tokenizer::TokenId;
using barqtrain::tokenizer::Tokenizer;
using barqtrain::tokenizer::TokenizerError;

void register_pipeline(nb::module_& m);  // csrc/bindings/pipeline.cpp: packing, readers

NB_MODULE(_native, m) {
  register_pipeline(m);
  nb::exception<TokenizerError>(m, "TokenizerError", PyExc_ValueError);

  nb::class_<Tokenizer>(m, "Tokenizer")
      .def_static("from_file", &Tokenizer::from_file, nb::arg("path"), nb::call_guard<nb::gil_scoped_release>())
      .def(
          "encode",
          [](const Tokenizer& self, std::string_view text, bool add_special_tokens, bool split_special_tokens) {
            return self.encode(text, EncodeOptions{add_special_tokens, split_special_tokens});
          },
          nb::arg("text"), nb::arg("add_special_tokens") = true, nb::arg("split_special_tokens") = false,
          nb::call_guard<nb::gil_scoped_release>())
      .def(
          "encode_with_offsets",
          [](const Tokenizer& self, std::string_view text, bool add_special_tokens, bool split_special_tokens) {
            Tokenizer::Encoding encoding = self.encode_with_offsets(text, EncodeOptions{add_special_tokens, split_special_tokens});
            return std::make_pair(std::move(encoding.ids), barqtrain::bindings::character_offsets(text, encoding.offsets));
          },
          nb::arg("text"), nb::arg("add_special_tokens") = true, nb::arg("split_special_tokens") = false,
          nb::call_guard<nb::gil_scoped_release>())
      .def(
          "encode_batch",
          [](const Tokenizer& self, nb::handle texts, bool add_special_tokens, bool split_special_tokens,
             size_t num_threads) {
            return barqtrain::bindings::encode_batch_lists(
                self, texts, EncodeOptions{add_special_tokens, split_special_tokens}, num_threads);
          },
          nb::arg("texts"), nb::arg("add_special_tokens") = true, nb::arg("split_special_tokens") = false,
          nb::arg("num_threads") = 0)
      .def(
          "encode_batch_with_offsets",
          [](const Tokenizer& self, nb::handle texts, bool add_special_tokens, bool split_special_tokens,
             size_t num_threads) {
            return barqtrain::bindings::encode_batch_with_offsets(
                self, texts, EncodeOptions{add_special_tokens, split_special_tokens}, num_threads);
          },
          nb::arg("texts"), nb::arg("add_special_tokens") = true, nb::arg("split_special_tokens") = false,
          nb::arg("num_threads") = 0)
      .def(
          "encode_batch_flat",
          [](const Tokenizer& self, nb::handle texts, bool add_special_tokens, bool split_special_tokens,
             size_t num_threads) {
            return barqtrain::bindings::encode_batch_flat(
                self, texts, EncodeOptions{add_special_tokens, split_special_tokens}, num_threads);
          },
          nb::arg("texts"), nb::arg("add_special_tokens") = true, nb::arg("split_special_tokens") = false,
          nb::arg("num_threads") = 0)
      .def("decode", &Tokenizer::decode, nb::arg("ids"), nb::arg("skip_special_tokens") = false,
           nb::call_guard<nb::gil_scoped_release>())
      .def_prop_ro("id_bound", &Tokenizer::id_bound);
}
