// barqtrain.data._native: pre-tokenized shards (writer, memory-mapped reader with zero-copy
// NumPy views) and the prefetcher. python/barqtrain/data/shards.py and prefetch.py are the
// documented API on top.
#include <Python.h>
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/string.h>

#include <array>
#include <cstring>
#include <map>
#include <memory>
#include <string>

#include "bindings/arrays.h"
#include "data/prefetch.h"
#include "data/shards.h"

namespace nb = nanobind;
using namespace barqtrain::data;
using barqtrain::bindings::check_rows;
using barqtrain::bindings::Rows;
using barqtrain::bindings::to_numpy;
using barqtrain::bindings::Vector;

namespace {

// A view of count values of T at data, kept alive by owner (the ShardSet's Python object).
template <typename T>
nb::object view(const void* data, size_t count, nb::handle owner) {
  return nb::cast(nb::ndarray<nb::numpy, const T, nb::ndim<1>>(static_cast<const T*>(data), {count}, owner));
}

// The prefetcher as Python sees it: it also holds the buffers of every submitted batch, so
// the workers never write into memory Python has freed.
struct PyPrefetcher {
  std::unique_ptr<Prefetcher> prefetcher;
  std::map<size_t, std::array<nb::object, 3>> held;
  int64_t seq_length;
};

}  // namespace

void register_shards_and_prefetch(nb::module_& m) {
  nb::exception<ShardError>(m, "ShardError", PyExc_ValueError);
  nb::exception<PrefetchError>(m, "PrefetchError", PyExc_RuntimeError);

  m.def("token_bytes_for", &token_bytes_for, nb::arg("id_bound"));

  nb::class_<ShardDirectoryWriter>(m, "ShardDirectoryWriter")
      .def(nb::init<std::string, size_t, size_t, size_t>(), nb::arg("directory"), nb::arg("id_bound"),
           nb::arg("shard_tokens"), nb::arg("complete_shards") = 0,
           "complete_shards k > 0: continue an interrupted run after its first k shards (see csrc/data/shards.h).")
      .def(
          "add",
          [](ShardDirectoryWriter& w, Vector<int32_t> tokens, Vector<int32_t> labels, Vector<int64_t> offsets) {
            TokenizedData data;
            data.tokens.assign(tokens.data(), tokens.data() + tokens.shape(0));
            data.labels.assign(labels.data(), labels.data() + labels.shape(0));
            data.offsets.assign(offsets.data(), offsets.data() + offsets.shape(0));
            nb::gil_scoped_release release;
            w.add(data);
          },
          nb::arg("tokens"), nb::arg("labels"), nb::arg("offsets"))
      .def(
          "add_from",
          [](ShardDirectoryWriter& w, RecordStream& stream, size_t max_records) {
            nb::gil_scoped_release release;
            TokenizedData data;
            const size_t n = stream.read(max_records, data);
            w.add(data);
            return n;
          },
          nb::arg("stream"), nb::arg("max_records"),
          "Reads up to max_records records of stream into the shards; returns how many (0: the end).")
      .def("finish", &ShardDirectoryWriter::finish, nb::arg("metadata_json"), nb::call_guard<nb::gil_scoped_release>())
      .def_prop_ro("sequences", &ShardDirectoryWriter::sequences)
      .def_prop_ro("tokens", &ShardDirectoryWriter::tokens)
      .def_prop_ro("shards", &ShardDirectoryWriter::shards)
      .def_prop_ro("sequences_in_shards", &ShardDirectoryWriter::sequences_in_shards)
      .def_prop_ro("bytes_written", &ShardDirectoryWriter::bytes_written);

  nb::class_<ShardSet, SequenceSource>(m, "ShardSet")
      .def_static("open", &ShardSet::open, nb::arg("path"), nb::call_guard<nb::gil_scoped_release>())
      .def_prop_ro("num_shards", [](const ShardSet& s) { return s.shards().size(); })
      .def(
          "shard_arrays",
          [](nb::handle self, size_t k) {
            const ShardSet& s = nb::cast<const ShardSet&>(self);
            if (k >= s.shards().size()) throw nb::index_error("shard out of range");
            const Shard& shard = *s.shards()[k];
            nb::dict d;
            d["path"] = shard.path();
            d["offsets"] = view<int64_t>(shard.offsets(), shard.size() + 1, self);
            d["tokens"] = shard.header().token_bytes == 2 ? view<uint16_t>(shard.tokens(), shard.num_tokens(), self)
                                                          : view<uint32_t>(shard.tokens(), shard.num_tokens(), self);
            d["mask"] = shard.mask() ? view<uint8_t>(shard.mask(), shard.num_tokens(), self) : nb::none();
            return d;
          },
          nb::arg("shard"),
          "Zero-copy read-only NumPy views of shard k: offsets (int64), tokens (uint16/uint32), mask (uint8 "
          "or None); they keep the files mapped.");

  nb::class_<PyPrefetcher>(m, "Prefetcher")
      .def(
          "__init__",
          [](PyPrefetcher* self, std::shared_ptr<const Packer> packer, size_t batch_size, size_t num_workers,
             size_t depth) {
            const int64_t seq_length = packer ? packer->options().seq_length : 0;
            new (self) PyPrefetcher{std::make_unique<Prefetcher>(std::move(packer), batch_size, num_workers, depth), {},
                                    seq_length};
          },
          nb::arg("packer"), nb::arg("batch_size"), nb::arg("num_workers"), nb::arg("depth"))
      .def(
          "num_batches", [](const PyPrefetcher& p, bool drop_last) { return p.prefetcher->num_batches(drop_last); },
          nb::arg("drop_last"))
      .def(
          "rows_in", [](const PyPrefetcher& p, size_t batch) { return p.prefetcher->rows_in(batch); }, nb::arg("batch"))
      .def(
          "submit",
          [](PyPrefetcher& p, size_t batch, nb::object input_ids, nb::object labels, nb::object position_ids) {
            const size_t rows = p.prefetcher->rows_in(batch);
            Rows ids = nb::cast<Rows>(input_ids), lab = nb::cast<Rows>(labels), pos = nb::cast<Rows>(position_ids);
            check_rows<PrefetchError>(ids, rows, p.seq_length, "input_ids");
            check_rows<PrefetchError>(lab, rows, p.seq_length, "labels");
            check_rows<PrefetchError>(pos, rows, p.seq_length, "position_ids");
            p.prefetcher->submit(batch, {ids.data(), lab.data(), pos.data()});
            p.held[batch] = {input_ids, labels, position_ids};
          },
          nb::arg("batch"), nb::arg("input_ids"), nb::arg("labels"), nb::arg("position_ids"),
          "Queues batch to be collated into the int64 [rows_in(batch), seq_length] arrays (kept alive until taken).")
      .def(
          "take",
          [](PyPrefetcher& p, size_t batch) {
            bool interrupted = false;
            CollateInfo info;
            try {
              nb::gil_scoped_release release;
              info = p.prefetcher->take(batch, [&interrupted] {
                nb::gil_scoped_acquire acquire;
                interrupted = PyErr_CheckSignals() != 0;  // runs Python's handlers: Ctrl-C raises here
                return interrupted;
              });
            } catch (const PrefetchError&) {
              if (interrupted) throw nb::python_error();  // the KeyboardInterrupt (or a handler's error)
              throw;
            } catch (...) {
              p.held.erase(batch);
              throw;
            }
            p.held.erase(batch);
            return nb::make_tuple(to_numpy(std::move(info.cu_seqlens)), info.max_seqlen, info.sequences);
          },
          nb::arg("batch"),
          "Waits for batch (Ctrl-C still works) and returns (cu_seqlens int32, max_seqlen, sequences); "
          "rethrows a worker's error.")
      .def(
          "close",
          [](PyPrefetcher& p) {
            {
              nb::gil_scoped_release release;
              p.prefetcher->close();
            }
            p.held.clear();
          },
          "Stops the workers after their current batch and joins them.")
      .def_prop_ro("outstanding", [](const PyPrefetcher& p) { return p.prefetcher->outstanding(); });
}
