"""BarqTrain's data pipeline: a C++ tokenizer identical to Hugging Face tokenizers."""

from barqtrain.data.tokenizer import Tokenizer, TokenizerError

__all__ = ["Tokenizer", "TokenizerError"]
