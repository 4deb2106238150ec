"""Bug hunt, round 3 (issue #14): published checkpoint variants a user loads as they are. Writers
and the reference come from tests/test_quantization.py and tests/test_quant_edge.py."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from rankserve import LLM

import test_quantization as tq
from conftest import make_checkpoint
from test_quant_edge import CT, write_checkpoint


def test_compressed_tensors_fp8_weight_only_is_refused(tmp_path):
    """A compressed-tensors FP8 group without input_activations is weight-only (W8A16: vLLM runs
    it with 16-bit activations). Running it as W8A8 quantized activations the checkpoint never
    saw (logits 7-15 % off its dequantized reference on the tiny Llama, other tokens) without a
    word; it is refused, naming the scheme."""
    g = {**CT["config_groups"]["group_0"], "input_activations": None}
    tq.assert_config_refused(tmp_path, {**CT, "config_groups": {"group_0": g}},
                             "compressed-tensors FP8 weights without input_activations")


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("llama"), "LlamaForCausalLM", **tq.SIZES)


def _without_quantization_config(path: Path) -> None:
    cfg = json.loads((path / "config.json").read_text())
    del cfg["quantization_config"]
    (path / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("flag", [None, "fp8"])
def test_fp8_tensors_without_a_quantization_config_say_so(llama, tmp_path, flag):
    """e4m3 weights in a checkpoint whose config.json has no quantization_config (dropped by a
    copy or a conversion script), with or without --quantization fp8 (which quantizes 16-bit
    weights): the error says the config is missing, not that the module "runs unquantized here"
    as if the config had listed it."""
    write_checkpoint(llama, tmp_path / "q", tq.write_fp8_block, tq.FORMATS["fp8-block"][1], reference=False)
    _without_quantization_config(tmp_path / "q")
    with pytest.raises(ValueError, match=r"model\.layers\.0\.\w+\.\w+\.weight: is stored as fp8 but "
                                         r"the checkpoint's config\.json has no quantization_config"):
        LLM(str(tmp_path / "q"), dtype="float32", quantization=flag)


@pytest.mark.parametrize("qc", [{"quant_method": "modelopt", "quant_algo": "NVFP4"},
                                {"quant_method": "modelopt", "quantization": {"quant_algo": "NVFP4"}}])
def test_modelopt_in_config_json_is_named(tmp_path, qc):
    """(ModelOpt FP8 loads since session 13: tests/test_modelopt.py; NVFP4 stays refused.)"""
    tq.assert_config_refused(tmp_path, qc, r"ModelOpt .*quant_algo 'NVFP4' \(from config\.json\)")


def test_compressed_tensors_w4a16_per_channel(llama, tmp_path, caplog):
    """llm-compressor's W4A16 with one scale per output channel (strategy channel: `weight_scale`
    [N, 1]) runs as one group over all of K; the startup log says so."""
    from test_quant_edge import assert_matches
    w = tq.CT_W4A16["config_groups"]["group_0"]["weights"]
    qc = {**tq.CT_W4A16, "config_groups": {"group_0": {**tq.CT_W4A16["config_groups"]["group_0"], "weights": {
        **w, "strategy": "channel", "group_size": None}}}}
    ref, quantized = write_checkpoint(llama, tmp_path / "q", lambda t: tq.write_ct_w4a16(t, group=t.shape[1]), qc)
    with caplog.at_level("INFO", logger="rankserve.runner"):
        llm = LLM(str(tmp_path / "q"), dtype="float32", max_num_seqs=4)
    assert "linear layers: 8 x compressed-tensors 4-bit (per-channel, symmetric)" in caplog.text
    assert_matches(llm, ref, quantized, False)


def _ct_w4(weights=None, **group):
    g = tq.CT_W4A16["config_groups"]["group_0"]
    return {**tq.CT_W4A16, "config_groups": {"group_0": {**g, **group, "weights": {**g["weights"], **(weights or {})}}}}


@pytest.mark.parametrize("qc, words", [
    (_ct_w4({"actorder": "bogus"}), "4-bit weights with actorder 'bogus'"),
    (_ct_w4({"strategy": "tensor"}), "4-bit weight strategy 'tensor'"),
    (_ct_w4(input_activations={"num_bits": 8, "type": "int", "strategy": "token", "dynamic": True}),
     "4-bit weights with input_activations"),
])
def test_compressed_tensors_w4a16_variants_not_run_are_refused(tmp_path, qc, words):
    """Zero points and act-order indices would be dropped, int8 activations not quantized:
    each is refused, naming it."""
    tq.assert_config_refused(tmp_path, qc, words)


@pytest.mark.parametrize("sym, actorder", [(False, False), (True, True), (False, True)])
def test_compressed_tensors_w4a16_zero_points_and_actorder(llama, tmp_path, sym, actorder):
    """W4A16_ASYM (llm-compressor's AWQ recipe: `weight_zero_point` packed along the output dim)
    and GPTQ's actorder group (`weight_g_idx`): greedy tokens and logits of the dequantized
    reference."""
    from test_quant_edge import assert_matches
    qc = _ct_w4({"symmetric": sym, "actorder": "group" if actorder else None})
    ref, quantized = write_checkpoint(llama, tmp_path / "q",
                                      lambda t: tq.write_ct_w4a16(t, sym=sym, actorder=actorder), qc)
    assert_matches(LLM(str(tmp_path / "q"), dtype="float32", max_num_seqs=4), ref, quantized, False)


def test_compressed_tensors_unpacked_zero_points_are_refused_naming_them(llama, tmp_path):
    """Zero points stored as int8 [N, G] (not packed int32 words) would unpack to other values
    of the same shape: refused, naming the tensor."""
    import torch

    def unpacked(t):
        out, d = tq.write_ct_w4a16(t, sym=False)
        n, g = out["weight_scale"].shape
        out["weight_zero_point"] = torch.zeros(n, g, dtype=torch.int8)
        return out, d
    write_checkpoint(llama, tmp_path / "q", unpacked, _ct_w4({"symmetric": False}), reference=False)
    with pytest.raises(ValueError, match=r"model\.layers\.0\.\w+\.\w+\.weight_zero_point: is int8 in the checkpoint"):
        LLM(str(tmp_path / "q"), dtype="float32")
