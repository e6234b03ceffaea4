"""Tokenizers small enough for the tiny random models (their checkpoints ship none): a word-level one of 12 words, and
a byte-level BPE the native runtime also reads."""

from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

WORDS = ["<unk>", "</s>", "the", "cat", "sat", "on", "a", "mat", "and", "dog", "ran", "."]


def save_tiny_tokenizer(out_dir: str | Path) -> None:
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="</s>").save_pretrained(str(out_dir))


BYTE_VOCAB_SIZE = 257  # the 256 byte symbols and "</s>"


def save_byte_tokenizer(out_dir: str | Path) -> None:
    """A byte-level BPE without merges (every byte one token, "</s>" the end of sequence): a tokenizer the native
    runtime reads (it reads BPE tokenizers only) for a tiny model of BYTE_VOCAB_SIZE tokens."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE({symbol: i for i, symbol in enumerate(alphabet)}, []))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>").save_pretrained(str(out_dir))
