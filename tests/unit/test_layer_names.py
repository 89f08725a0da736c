"""A pipeline stage's layers under the whole model's numbers."""

from __future__ import annotations

import pytest

from elastic_rl.layer_names import whole_model_name

pytestmark = pytest.mark.unit


def test_a_stage_numbers_its_layers_from_its_offset_and_leaves_other_names():
    assert whole_model_name("decoder.layers.0.mlp.linear_fc1.weight", 12) == "decoder.layers.12.mlp.linear_fc1.weight"
    assert whole_model_name("decoder.layers.3.self_attention.linear_qkv.weight", 4) == (
        "decoder.layers.7.self_attention.linear_qkv.weight"
    )
    assert whole_model_name("decoder.final_layernorm.weight", 4) == "decoder.final_layernorm.weight"
    assert whole_model_name("output_layer.weight", 4) == "output_layer.weight"
