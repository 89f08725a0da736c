"""The policy model: builders, the Megatron CPU shim, the tokenizer and converters to HF."""
