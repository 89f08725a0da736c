"""Megatron <-> Hugging Face checkpoints for the Llama, Qwen2 and Qwen3 families.

``layout`` names where each weight lives on both sides; ``hf_import`` loads an
HF checkpoint into a megatron model at any tensor-parallel size, each rank
reading only its slices; ``hf_export`` writes megatron's canonical state back
in the same family's HF layout, beside the source checkpoint's config and
tokenizer. Import then export is bitwise the identity (tested at TP=1 and 2).
"""
