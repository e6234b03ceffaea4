"""A word-level tokenizer small enough for the tiny random models (their checkpoints ship none)."""

from pathlib import Path

from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

WORDS = ["<unk>", "</s>", "the", "cat", "sat", "on", "a", "mat", "and", "dog", "ran", "."]


def save_tiny_tokenizer(out_dir: str | Path) -> None:
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="</s>").save_pretrained(str(out_dir))
