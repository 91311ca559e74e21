// barqtrain.data._native: the packer and the dataset readers. Work runs without the GIL;
// python/barqtrain/data/packing.py and readers.py are the documented API on top.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "data/packing.h"
#include "data/readers.h"
#include "data/tokenizer/tokenizer.h"

namespace nb = nanobind;
using namespace barqtrain::data;

namespace {

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

nb::dict stats_dict(const PackStats& s) {
  nb::dict d;
  d["sequences"] = s.sequences;
  d["empty_sequences"] = s.empty_sequences;
  d["truncated_sequences"] = s.truncated_sequences;
  d["truncated_tokens"] = s.truncated_tokens;
  d["split_sequences"] = s.split_sequences;
  d["dropped_sequences"] = s.dropped_sequences;
  d["pieces"] = s.pieces;
  d["rows"] = s.rows;
  d["tokens"] = s.tokens;
  d["row_length"] = s.row_length;
  d["fill"] = s.fill();
  return d;
}

void check_rows(const Rows& a, size_t rows, int64_t row_length, const char* name) {
  if (a.shape(0) != rows || a.shape(1) != static_cast<size_t>(row_length)) {
    throw PackingError(std::string(name) + " has shape [" + std::to_string(a.shape(0)) + ", " +
                       std::to_string(a.shape(1)) + "], expected [" + std::to_string(rows) + ", " +
                       std::to_string(row_length) + "]");
  }
}

}  // namespace

void register_pipeline(nb::module_& m) {
  nb::exception<PackingError>(m, "PackingError", PyExc_ValueError);

  nb::class_<Packer>(m, "Packer")
      .def(
          "__init__",
          [](Packer* self, Vector<int32_t> tokens, Vector<int64_t> offsets, std::optional<Vector<int32_t>> labels,
             int64_t row_length, const std::string& overflow, size_t shuffle_window, bool shuffle, uint64_t seed,
             uint64_t epoch, int64_t rank, int64_t world_size, int64_t pad_id, int64_t separator_id,
             int64_t ignore_index) {
            if (offsets.shape(0) < 1) throw PackingError("offsets needs at least one value (0)");
            const size_t count = offsets.shape(0) - 1;
            const int64_t total = offsets.data()[count];
            if (total < 0 || static_cast<size_t>(total) > tokens.shape(0)) {
              throw PackingError("offsets end at " + std::to_string(total) + " but there are " +
                                 std::to_string(tokens.shape(0)) + " tokens");
            }
            if (labels && labels->shape(0) != tokens.shape(0)) {
              throw PackingError("labels has " + std::to_string(labels->shape(0)) + " values, tokens " +
                                 std::to_string(tokens.shape(0)));
            }
            PackOptions options;
            options.row_length = row_length;
            options.overflow = parse_overflow(overflow);
            options.shuffle_window = shuffle_window;
            options.shuffle = shuffle;
            options.seed = seed;
            options.epoch = epoch;
            options.rank = rank;
            options.world_size = world_size;
            options.pad_id = pad_id;
            options.separator_id = separator_id;
            options.ignore_index = ignore_index;
            nb::gil_scoped_release release;
            new (self) Packer(tokens.data(), labels ? labels->data() : nullptr, offsets.data(), count, options);
          },
          nb::arg("tokens"), nb::arg("offsets"), nb::arg("labels").none(), nb::arg("row_length"),
          nb::arg("overflow") = "split", nb::arg("shuffle_window") = 16384, nb::arg("shuffle") = true,
          nb::arg("seed") = 0, nb::arg("epoch") = 0, nb::arg("rank") = 0, nb::arg("world_size") = 1,
          nb::arg("pad_id") = 0, nb::arg("separator_id") = -100, nb::arg("ignore_index") = -100)
      .def_prop_ro("num_rows", &Packer::num_rows)
      .def_prop_ro("row_length", [](const Packer& p) { return p.options().row_length; })
      .def_prop_ro("stats", [](const Packer& p) { return stats_dict(p.stats()); })
      .def(
          "row_pieces",
          [](const Packer& p, size_t r) {
            if (r >= p.num_rows()) throw nb::index_error("row out of range");
            std::vector<std::tuple<uint64_t, uint32_t, uint32_t>> out;
            for (const Piece* q = p.row_begin(r); q != p.row_end(r); ++q) out.emplace_back(q->sequence, q->start, q->length);
            return out;
          },
          nb::arg("row"), "(sequence, start, length) of each segment of row `row`")
      .def(
          "collate",
          [](const Packer& p, size_t first_row, size_t last_row, Rows input_ids, Rows labels, Rows position_ids) {
            const size_t rows = last_row >= first_row ? last_row - first_row : 0;
            check_rows(input_ids, rows, p.options().row_length, "input_ids");
            check_rows(labels, rows, p.options().row_length, "labels");
            check_rows(position_ids, rows, p.options().row_length, "position_ids");
            CollateInfo info;
            {
              nb::gil_scoped_release release;
              info = p.collate(first_row, last_row, {input_ids.data(), labels.data(), position_ids.data()});
            }
            return nb::make_tuple(to_numpy(std::move(info.cu_seqlens)), info.max_seqlen, info.sequences);
          },
          nb::arg("first_row"), nb::arg("last_row"), nb::arg("input_ids"), nb::arg("labels"),
          nb::arg("position_ids"),
          "Writes rows [first_row, last_row) into the int64 [rows, row_length] arrays; returns "
          "(cu_seqlens int32, max_seqlen, sequences).");

  nb::exception<ReaderError>(m, "ReaderError", PyExc_ValueError);

  m.def(
      "read_dataset",
      [](const std::string& path, const barqtrain::tokenizer::Tokenizer& tokenizer, const std::string& format,
         const std::string& kind, const std::string& on_error, const std::string& text_unit,
         const std::string& text_field, const std::string& chat_template, int64_t eos_id, bool add_special_tokens,
         size_t max_reported_errors, size_t num_threads) {
        ReadOptions o;
        o.format = parse_record_format(format);
        o.kind = parse_file_kind(kind);
        o.on_error = parse_on_error(on_error);
        if (text_unit == "line") {
          o.text_unit = TextUnit::kLine;
        } else if (text_unit == "document") {
          o.text_unit = TextUnit::kDocument;
        } else {
          throw ReaderError("unknown text_unit '" + text_unit + "': expected line or document");
        }
        o.text_field = text_field;
        o.chat_template = chat_template;
        o.eos_id = eos_id;
        o.add_special_tokens = add_special_tokens;
        o.max_reported_errors = max_reported_errors;
        o.num_threads = num_threads;
        TokenizedData data;
        ReadReport report;
        {
          nb::gil_scoped_release release;
          report = read_dataset(path, o, tokenizer, data);
        }
        nb::dict r;
        r["path"] = report.path;
        r["records"] = report.records;
        r["skipped"] = report.skipped;
        r["errors"] = report.errors;
        return nb::make_tuple(to_numpy(std::move(data.tokens)), to_numpy(std::move(data.labels)),
                              to_numpy(std::move(data.offsets)), r);
      },
      nb::arg("path"), nb::arg("tokenizer"), nb::arg("format") = "text", nb::arg("kind") = "auto",
      nb::arg("on_error") = "raise", nb::arg("text_unit") = "line", nb::arg("text_field") = "text",
      nb::arg("chat_template") = "chatml", nb::arg("eos_id") = -1, nb::arg("add_special_tokens") = true,
      nb::arg("max_reported_errors") = 20, nb::arg("num_threads") = 0,
      "(tokens int32, labels int32, offsets int64, report dict) of every record of a dataset file.");

  m.def(
      "shard_indices",
      [](size_t count, bool shuffle, uint64_t seed, uint64_t epoch, int64_t rank, int64_t world_size) {
        PackOptions o;
        o.shuffle = shuffle;
        o.seed = seed;
        o.epoch = epoch;
        o.rank = rank;
        o.world_size = world_size;
        return to_numpy(shard_indices(count, o));
      },
      nb::arg("count"), nb::arg("shuffle") = true, nb::arg("seed") = 0, nb::arg("epoch") = 0, nb::arg("rank") = 0,
      nb::arg("world_size") = 1);
}
