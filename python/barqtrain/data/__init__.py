"""BarqTrain's data pipeline: a C++ tokenizer identical to Hugging Face tokenizers, dataset
readers (JSONL, JSON, text, Parquet) with resumable streams, pre-tokenized memory-mapped
shards, a C++ packer into fixed-length rows in the DataCollatorWithFlattening format, and a
loader whose batches C++ threads collate ahead."""

from barqtrain.data.loader import PackedLoader, SequenceDataset, SubsetDataset
from barqtrain.data.packing import PackedBatch, Packing, PackingError, as_source, pack
from barqtrain.data.prefetch import Prefetch, PrefetchError
from barqtrain.data.readers import DatasetStream, ReaderError, TokenizedDataset, read_dataset
from barqtrain.data.shards import ShardDataset, ShardError, open_shards
from barqtrain.data.tokenizer import Tokenizer, TokenizerError

__all__ = [
    "DatasetStream",
    "PackedBatch",
    "PackedLoader",
    "Packing",
    "PackingError",
    "Prefetch",
    "PrefetchError",
    "ReaderError",
    "SequenceDataset",
    "SubsetDataset",
    "ShardDataset",
    "ShardError",
    "TokenizedDataset",
    "Tokenizer",
    "TokenizerError",
    "as_source",
    "open_shards",
    "pack",
    "read_dataset",
]
