"""Bug hunt, round 3 (issue #14): published checkpoint variants a user loads as they are. Writers
and the reference come from tests/test_quantization.py and tests/test_quant_edge.py."""
from __future__ import annotations

import test_quantization as tq
from test_quant_edge import CT


def test_compressed_tensors_fp8_weight_only_is_refused(tmp_path):
    """A compressed-tensors FP8 group without input_activations is weight-only (W8A16: vLLM runs
    it with 16-bit activations). Running it as W8A8 quantized activations the checkpoint never
    saw (logits 7-15 % off its dequantized reference on the tiny Llama, other tokens) without a
    word; it is refused, naming the scheme."""
    g = {**CT["config_groups"]["group_0"], "input_activations": None}
    tq.assert_config_refused(tmp_path, {**CT, "config_groups": {"group_0": g}},
                             "compressed-tensors FP8 weights without input_activations")
