"""The ``data`` section: where prompts come from and how they are shown to the model."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import PositiveInt, field_validator, model_validator

from elastic_rl.spec.base import Component, existing_file


class DataSpec(Component):
    """Where prompts come from, and how they are shown to the model."""

    task: Literal["toy_copy", "arithmetic"] = "toy_copy"
    """A built-in task that makes its prompts in code: toy_copy (repeat toy_digits digits) or
    arithmetic (word problems with small numbers, the answer as the label). Unused when `path` is given."""
    toy_digits: PositiveInt = 1
    """toy_copy only: digits in each prompt, which the answer repeats, so the response needs
    rollout.max_new_tokens of at least this (the toy tokenizer has a token per digit)."""
    path: Path | None = None
    """A JSONL file of prompts (relative paths are taken from the spec's folder); when given it
    replaces `task`."""
    prompt_key: str = "prompt"
    """The JSONL field holding the prompt text."""
    label_key: str = "label"
    """The JSONL field holding the reference answer the reward compares against (for SFT: the response)."""
    messages_key: str = "messages"
    """SFT only: the JSONL field holding a chat, a list of {"role", "content"} messages; a line with
    it is trained on every assistant turn (the loss on the assistant's tokens only, through the chat
    template: needs apply_chat_template) instead of on a prompt and its label."""
    num_prompts: PositiveInt = 256
    """How many prompts a built-in task makes."""
    shuffle: bool = True
    """Shuffle prompts each epoch, with a seed derived from the job seed and the epoch."""
    apply_chat_template: bool = False
    """Render each prompt as a user message through the tokenizer's chat template."""
    system_prompt: str | None = None
    """With apply_chat_template: a system message before each prompt, and before each chat that has
    none of its own (else the template's default)."""

    _path_exists = field_validator("path")(existing_file)

    @model_validator(mode="after")
    def _system_prompt_needs_template(self) -> DataSpec:
        if self.system_prompt is not None and not self.apply_chat_template:
            raise ValueError("system_prompt is used only with apply_chat_template: true")
        return self

    @model_validator(mode="after")
    def _toy_digits_need_the_toy_task(self) -> DataSpec:
        if self.toy_digits != 1 and (self.task != "toy_copy" or self.path is not None):
            raise ValueError("toy_digits is used only by task toy_copy without a path: remove it, or set task toy_copy")
        return self
