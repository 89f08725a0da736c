"""The job's tokenizer: the pretrained checkpoint's own, or the toy one made in code.

With ``model.hf_checkpoint`` the tokenizer, its special tokens and its chat
template come from the checkpoint (``AutoTokenizer``). The toy tokenizer is
one token per character plus special tokens; ``save_tokenizer`` writes it as
``tokenizer.json`` (plus the small config files ``transformers`` reads) next
to exported weights, so the engines and the trainer tokenize identically.
Nothing is loaded from a hub.
"""

from __future__ import annotations

import string
from pathlib import Path
from typing import TYPE_CHECKING

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

if TYPE_CHECKING:
    from elastic_rl.spec.model import ModelSpec

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


def load_tokenizer(spec: ModelSpec) -> PreTrainedTokenizerBase:
    """The checkpoint's tokenizer; for the toy model the spec's tokenizer.json, else the toy one."""
    if spec.hf_checkpoint is not None:
        return AutoTokenizer.from_pretrained(str(spec.hf_checkpoint))
    if spec.tokenizer is None:
        return as_transformers(build_tokenizer())
    return as_transformers(Tokenizer.from_file(str(spec.tokenizer)))


def pad_token_id(tokenizer: PreTrainedTokenizerBase) -> int:
    """The id that right-pads a batch; padding is masked, so end-of-sequence serves where there is no pad."""
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


def save_tokenizer(tokenizer: PreTrainedTokenizerBase, directory: Path) -> None:
    tokenizer.save_pretrained(str(directory))


def padded_vocab_size(tokenizer: PreTrainedTokenizerBase) -> int:
    """The toy model's vocabulary: the tokenizer's, padded to a multiple of VOCAB_MULTIPLE."""
    size = len(tokenizer)
    return -(-size // VOCAB_MULTIPLE) * VOCAB_MULTIPLE
