// barqtrain.data._native: sequence sources, the packer, the dataset readers and their
// resumable streams. Work runs without the GIL; python/barqtrain/data/ is the documented API.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <cmath>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "bindings/arrays.h"
#include "data/packing.h"
#include "data/readers.h"
#include "data/tokenizer/tokenizer.h"

namespace nb = nanobind;
using namespace barqtrain::data;
using barqtrain::bindings::check_rows;
using barqtrain::bindings::Rows;
using barqtrain::bindings::to_numpy;
using barqtrain::bindings::Vector;
using barqtrain::tokenizer::Tokenizer;

void register_shards_and_prefetch(nb::module_& m);  // csrc/bindings/shards_prefetch.cpp

namespace {

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
  d["repeated_rows"] = s.repeated_rows;
  d["dropped_rows"] = s.dropped_rows;
  d["seq_length"] = s.seq_length;
  d["fill"] = s.fill();
  return d;
}

// A JSON value as the Python object json.loads gives (a whole number as an int).
nb::object to_python(const barqtrain::json::Value& v) {
  if (v.is_null()) return nb::none();
  if (v.is_bool()) return nb::bool_(v.as_bool());
  if (v.is_number()) {
    const double d = v.as_number();
    if (std::floor(d) == d && std::fabs(d) < 9.007199254740992e15) return nb::int_(static_cast<int64_t>(d));
    return nb::float_(d);
  }
  if (v.is_string()) return nb::str(v.as_string().data(), v.as_string().size());
  if (v.is_array()) {
    nb::list list;
    for (const auto& item : v.as_array()) list.append(to_python(item));
    return std::move(list);
  }
  nb::dict dict;
  for (const auto& [key, item] : v.as_object()) dict[nb::str(key.data(), key.size())] = to_python(item);
  return std::move(dict);
}

// A Python callable as the reader's ChatRenderer: called with a list of records (dicts), it
// returns for each either (text, [(begin, end), ...] in characters) or an error message.
// The reader calls it without the GIL, from the thread that reads, so it takes the GIL.
ChatRenderer python_chat_renderer(nb::object callable) {
  if (callable.is_none()) return {};
  // Copies of the ChatRenderer share one reference, dropped under the GIL.
  std::shared_ptr<nb::object> held(new nb::object(std::move(callable)), [](nb::object* p) {
    nb::gil_scoped_acquire gil;
    delete p;
  });
  return [held](const std::vector<const barqtrain::json::Value*>& records) {
    nb::gil_scoped_acquire gil;
    nb::list batch;
    for (const auto* record : records) batch.append(to_python(*record));
    const nb::object results = (*held)(batch);
    std::vector<RenderedChat> out;
    out.reserve(records.size());
    for (nb::handle item : results) {
      RenderedChat chat;
      if (nb::isinstance<nb::str>(item)) {
        chat.error = nb::cast<std::string>(item);
      } else {
        auto [text, trained] = nb::cast<std::pair<std::string, std::vector<std::pair<size_t, size_t>>>>(item);
        chat.text = std::move(text);
        chat.trained = std::move(trained);
      }
      out.push_back(std::move(chat));
    }
    return out;
  };
}

ReadOptions read_options(const std::string& format, const std::string& kind, const std::string& on_error,
                         const std::string& text_unit, const std::string& text_field, const std::string& chat_template,
                         nb::object chat_renderer, int64_t eos_id, bool add_special_tokens, size_t max_reported_errors,
                         size_t num_threads) {
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
  o.chat_renderer = python_chat_renderer(std::move(chat_renderer));
  o.eos_id = eos_id;
  o.add_special_tokens = add_special_tokens;
  o.max_reported_errors = max_reported_errors;
  o.num_threads = num_threads;
  return o;
}

nb::dict report_dict(const ReadReport& report) {
  nb::dict r;
  r["path"] = report.path;
  r["records"] = report.records;
  r["skipped"] = report.skipped;
  r["errors"] = report.errors;
  return r;
}

nb::tuple data_arrays(TokenizedData&& data) {
  return nb::make_tuple(to_numpy(std::move(data.tokens)), to_numpy(std::move(data.labels)),
                        to_numpy(std::move(data.offsets)));
}

// The reader options as keyword arguments, the same for every function that reads.
#define BARQTRAIN_READ_OPTION_ARGS                                                                          \
  nb::arg("format") = "text", nb::arg("kind") = "auto", nb::arg("on_error") = "raise",                      \
  nb::arg("text_unit") = "line", nb::arg("text_field") = "text", nb::arg("chat_template") = "chatml",       \
  nb::arg("chat_renderer").none() = nb::none(), nb::arg("eos_id") = -1,                                     \
  nb::arg("add_special_tokens") = true, nb::arg("max_reported_errors") = 20,                                 \
  nb::arg("num_threads") = 0

}  // namespace

void register_pipeline(nb::module_& m) {
  nb::exception<PackingError>(m, "PackingError", PyExc_ValueError);
  nb::exception<ReaderError>(m, "ReaderError", PyExc_ValueError);

  nb::class_<SequenceSource>(m, "SequenceSource")
      .def("__len__", &SequenceSource::size)
      .def_prop_ro("num_tokens", &SequenceSource::num_tokens)
      .def(
          "sequence",
          [](const SequenceSource& s, size_t i) {
            if (i >= s.size()) throw nb::index_error(("sequence " + std::to_string(i) + " of " + std::to_string(s.size())).c_str());
            const size_t n = s.length(i);
            std::vector<int64_t> ids(n), labels(n);
            s.read(i, 0, n, ids.data(), labels.data());
            return nb::make_tuple(to_numpy(std::move(ids)), to_numpy(std::move(labels)));
          },
          nb::arg("index"), "(input_ids, labels) of one sequence as int64 arrays");

  nb::class_<InMemorySequences, SequenceSource>(m, "InMemorySequences")
      .def(
          "__init__",
          [](InMemorySequences* self, Vector<int32_t> tokens, Vector<int64_t> offsets,
             std::optional<Vector<int32_t>> labels) {
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
            nb::gil_scoped_release release;
            new (self) InMemorySequences(tokens.data(), labels ? labels->data() : nullptr, offsets.data(), count);
          },
          nb::arg("tokens"), nb::arg("offsets"), nb::arg("labels").none(),
          "A copy of int32 tokens (and labels, None: the tokens) with int64 offsets.");

  nb::class_<SubsetSequences, SequenceSource>(m, "SubsetSequences")
      .def(
          "__init__",
          [](SubsetSequences* self, std::shared_ptr<const SequenceSource> source, Vector<int64_t> indices) {
            std::vector<uint64_t> chosen(indices.shape(0));
            for (size_t i = 0; i < chosen.size(); ++i) {
              if (indices.data()[i] < 0) throw PackingError("subset index " + std::to_string(indices.data()[i]) + " is negative");
              chosen[i] = static_cast<uint64_t>(indices.data()[i]);
            }
            nb::gil_scoped_release release;
            new (self) SubsetSequences(std::move(source), std::move(chosen));
          },
          nb::arg("source"), nb::arg("indices"),
          "The sequences indices (int64) of source, in that order, without copying their tokens.");

  nb::class_<Packer>(m, "Packer")
      .def(
          "__init__",
          [](Packer* self, std::shared_ptr<const SequenceSource> source, int64_t seq_length, const std::string& overflow,
             size_t shuffle_window, bool shuffle, uint64_t seed, uint64_t epoch, int64_t rank, int64_t world_size,
             int64_t pad_id, int64_t separator_id, int64_t ignore_index, const std::string& balance) {
            PackOptions options;
            options.seq_length = seq_length;
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
            options.balance = parse_balance(balance);
            nb::gil_scoped_release release;
            new (self) Packer(std::move(source), options);
          },
          nb::arg("source"), nb::arg("seq_length"), nb::arg("overflow") = "split", nb::arg("shuffle_window") = 16384,
          nb::arg("shuffle") = true, nb::arg("seed") = 0, nb::arg("epoch") = 0, nb::arg("rank") = 0,
          nb::arg("world_size") = 1, nb::arg("pad_id") = 0, nb::arg("separator_id") = -100,
          nb::arg("ignore_index") = -100, nb::arg("balance") = "repeat")
      .def_prop_ro("num_rows", &Packer::num_rows)
      .def_prop_ro("seq_length", [](const Packer& p) { return p.options().seq_length; })
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
            check_rows<PackingError>(input_ids, rows, p.options().seq_length, "input_ids");
            check_rows<PackingError>(labels, rows, p.options().seq_length, "labels");
            check_rows<PackingError>(position_ids, rows, p.options().seq_length, "position_ids");
            CollateInfo info;
            {
              nb::gil_scoped_release release;
              info = p.collate(first_row, last_row, {input_ids.data(), labels.data(), position_ids.data()});
            }
            return nb::make_tuple(to_numpy(std::move(info.cu_seqlens)), info.max_seqlen, info.sequences);
          },
          nb::arg("first_row"), nb::arg("last_row"), nb::arg("input_ids"), nb::arg("labels"),
          nb::arg("position_ids"),
          "Writes rows [first_row, last_row) into the int64 [rows, seq_length] arrays; returns "
          "(cu_seqlens int32, max_seqlen, sequences).");

  m.def(
      "read_dataset",
      [](const std::string& path, const Tokenizer& tokenizer, const std::string& format, const std::string& kind,
         const std::string& on_error, const std::string& text_unit, const std::string& text_field,
         const std::string& chat_template, nb::object chat_renderer, int64_t eos_id, bool add_special_tokens,
         size_t max_reported_errors,
         size_t num_threads) {
        const ReadOptions o = read_options(format, kind, on_error, text_unit, text_field, chat_template,
                                           std::move(chat_renderer), eos_id, add_special_tokens, max_reported_errors,
                                           num_threads);
        TokenizedData data;
        ReadReport report;
        {
          nb::gil_scoped_release release;
          report = read_dataset(path, o, tokenizer, data);
        }
        nb::tuple arrays = data_arrays(std::move(data));
        return nb::make_tuple(arrays[0], arrays[1], arrays[2], report_dict(report));
      },
      nb::arg("path"), nb::arg("tokenizer"), BARQTRAIN_READ_OPTION_ARGS,
      "(tokens int32, labels int32, offsets int64, report dict) of every record of a dataset file.");

  nb::class_<RecordStream>(m, "RecordStream")
      .def(
          "__init__",
          [](RecordStream* self, const std::string& path, const Tokenizer& tokenizer, const std::string& format,
             const std::string& kind, const std::string& on_error, const std::string& text_unit,
             const std::string& text_field, const std::string& chat_template, nb::object chat_renderer, int64_t eos_id,
             bool add_special_tokens,
             size_t max_reported_errors, size_t num_threads) {
            const ReadOptions o = read_options(format, kind, on_error, text_unit, text_field, chat_template,
                                               std::move(chat_renderer), eos_id, add_special_tokens,
                                               max_reported_errors, num_threads);
            nb::gil_scoped_release release;
            new (self) RecordStream(path, o, tokenizer);
          },
          nb::arg("path"), nb::arg("tokenizer"), BARQTRAIN_READ_OPTION_ARGS, nb::keep_alive<1, 3>())
      .def_static(
          "jsonl_rows",
          [](std::string name, nb::bytes records, uint64_t first_row, const Tokenizer& tokenizer,
             const std::string& format, const std::string& on_error, const std::string& text_field,
             const std::string& chat_template, nb::object chat_renderer, int64_t eos_id, bool add_special_tokens,
         size_t max_reported_errors,
             size_t num_threads) {
            const ReadOptions o = read_options(format, "jsonl", on_error, "line", text_field, chat_template,
                                               std::move(chat_renderer), eos_id, add_special_tokens,
                                               max_reported_errors, num_threads);
            return RecordStream::jsonl_rows(std::move(name), std::string(records.c_str(), records.size()), first_row, o,
                                            tokenizer);
          },
          nb::arg("name"), nb::arg("records"), nb::arg("first_row"), nb::arg("tokenizer"), nb::arg("format") = "text",
          nb::arg("on_error") = "raise", nb::arg("text_field") = "text", nb::arg("chat_template") = "chatml",
          nb::arg("chat_renderer").none() = nb::none(), nb::arg("eos_id") = -1,
          nb::arg("add_special_tokens") = true, nb::arg("max_reported_errors") = 20, nb::arg("num_threads") = 0,
          nb::keep_alive<0, 4>(), "A stream over JSONL records in memory; errors name 'name: row N'.")
      .def(
          "read",
          [](RecordStream& s, size_t max_records) {
            TokenizedData data;
            {
              nb::gil_scoped_release release;
              s.read(max_records, data);
            }
            return data_arrays(std::move(data));
          },
          nb::arg("max_records"), "(tokens int32, labels int32, offsets int64) of up to max_records more records")
      .def_prop_ro("at_end", &RecordStream::at_end)
      .def_prop_ro("size_bytes", &RecordStream::size_bytes)
      .def_prop_ro("report", [](const RecordStream& s) { return report_dict(s.report()); })
      .def_prop_ro("position",
                   [](const RecordStream& s) {
                     const StreamPosition& p = s.position();
                     return nb::make_tuple(p.offset, p.line, p.records, p.skipped);
                   })
      .def(
          "seek",
          [](RecordStream& s, uint64_t offset, uint64_t line, uint64_t records, uint64_t skipped) {
            s.seek(StreamPosition{offset, line, records, skipped});
          },
          nb::arg("offset"), nb::arg("line"), nb::arg("records"), nb::arg("skipped"));

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

  register_shards_and_prefetch(m);
}
