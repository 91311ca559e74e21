"""BarqTrain's data pipeline: a C++ tokenizer identical to Hugging Face tokenizers, and a
C++ packer into fixed-length rows in the DataCollatorWithFlattening format."""

from barqtrain.data.packing import PackedBatch, PackedLoader, Packing, PackingError, pack
from barqtrain.data.readers import ReaderError, TokenizedDataset, read_dataset
from barqtrain.data.tokenizer import Tokenizer, TokenizerError

__all__ = [
    "PackedBatch",
    "PackedLoader",
    "Packing",
    "PackingError",
    "ReaderError",
    "TokenizedDataset",
    "Tokenizer",
    "TokenizerError",
    "pack",
    "read_dataset",
]
