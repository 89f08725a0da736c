"""The toy tokenizer, made in code: one token per character plus special tokens.

Nothing is loaded from a hub. ``build_tokenizer`` makes an HF ``tokenizers``
tokenizer; ``save_tokenizer`` writes it as ``tokenizer.json`` (plus the small
config files ``transformers`` reads) next to exported weights, so the engines
and the trainer tokenize identically.
"""

from __future__ import annotations

import string
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIAL_TOKENS = (PAD, BOS, EOS, UNK)
CHARACTERS = string.digits + string.ascii_lowercase + " =+-*/()[]{}\\,.:;?!'\"<>_"

# Megatron shards the embedding by vocabulary rows; padding the vocabulary to a
# fixed multiple keeps the model's shape the same at every tensor-parallel size.
VOCAB_MULTIPLE = 64


def build_tokenizer() -> Tokenizer:
    vocab = {token: index for index, token in enumerate(SPECIAL_TOKENS + tuple(CHARACTERS))}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    return tokenizer


def as_transformers(tokenizer: Tokenizer) -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, pad_token=PAD, bos_token=BOS, eos_token=EOS, unk_token=UNK
    )


def load_tokenizer(path: Path | None) -> PreTrainedTokenizerFast:
    """The tokenizer in ``path`` (a tokenizer.json or a folder holding one), else the toy one."""
    if path is None:
        return as_transformers(build_tokenizer())
    file = path / "tokenizer.json" if path.is_dir() else path
    return as_transformers(Tokenizer.from_file(str(file)))


def save_tokenizer(tokenizer: PreTrainedTokenizerFast, directory: Path) -> None:
    tokenizer.save_pretrained(str(directory))


def padded_vocab_size(tokenizer: PreTrainedTokenizerFast) -> int:
    size = len(tokenizer)
    return -(-size // VOCAB_MULTIPLE) * VOCAB_MULTIPLE
