"""Quantized checkpoints, fifth hunt (issue #14): config fields of published exports that the
earlier hunts (test_quant_hunt*.py, test_quant_edge.py) refused or did not write. Writers and
references come from tests/test_quantization.py and tests/test_quant_edge.py (they never call
rankserve's code)."""
from __future__ import annotations

import re

import pytest

from rankserve import LLM

import test_quantization as tq
from conftest import make_checkpoint
from test_quant_edge import CT, assert_matches, linears, write_checkpoint


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("llama"), "LlamaForCausalLM", **tq.SIZES)


def _targets(qc: dict, targets: list[str]) -> dict:
    (name, group), = qc["config_groups"].items()
    return {**qc, "config_groups": {name: {**group, "targets": targets}}}


MLP = r"re:.*mlp\.(gate|up|down)_proj$"
ATTN = ["re:.*self_attn\\.[qkvo]_proj$"]


@pytest.mark.parametrize("kind, targets, quantized", [
    ("w4a16", [MLP], "mlp"),  # llm-compressor recipes that quantize the MLP only
    ("fp8", ATTN, "self_attn"),
    # a module named exactly (a target without "re:" is a module name, or the class Linear)
    ("w4a16", [f"model.layers.{i}.mlp.{p}_proj" for i in (0, 1) for p in ("gate", "up", "down")], "mlp"),
])
def test_compressed_tensors_targets_by_pattern(llama, tmp_path, kind, targets, quantized):
    """compressed-tensors `targets` other than ["Linear"] (regexes or module names, as
    llm-compressor writes them) quantize the modules they match; the others stay 16-bit (they
    were refused: 'targets ... are not supported (only Linear)')."""
    writer, qc = ((tq.write_ct_w4a16, tq.CT_W4A16) if kind == "w4a16"
                  else (tq.write_fp8_channel, {**CT, "ignore": ["lm_head"]}))
    ref, names = write_checkpoint(llama, tmp_path / "q", writer, _targets(qc, targets),
                                  dense=lambda n: f".{quantized}." not in n)
    llm = LLM(str(tmp_path / "q"), dtype="float32", max_num_seqs=4)
    kinds = {n: mod.quant.describe() for n, mod in linears(llm).items()}
    assert all((kinds[n] == "dense") == (f".{quantized}." not in n) for n in kinds), kinds
    assert_matches(llm, ref, names, False if kind == "w4a16" else None)


def test_compressed_tensors_targets_of_moe_experts_only(tmp_path):
    """Expert-only recipes (targets `re:.*mlp\\.experts.*`): 4-bit experts, 16-bit attention."""
    src = make_checkpoint(tmp_path / "src", "Qwen3MoeForCausalLM", **{
        **tq.SIZES, "moe_intermediate_size": 256, "head_dim": 64, "num_hidden_layers": 1})
    qc = _targets(tq.CT_W4A16, [r"re:.*mlp\.experts.*"])
    ref, names = write_checkpoint(src, tmp_path / "q", tq.write_ct_w4a16, qc,
                                  dense=lambda n: ".experts." not in n)
    llm = LLM(str(tmp_path / "q"), dtype="float32", max_num_seqs=4)
    layer = llm.engine.executor.runner.model.model.layers["0"]
    assert layer.self_attn.qkv_proj.quant.describe() == "dense"
    assert layer.mlp.experts.quant.describe().startswith("experts compressed-tensors 4-bit")
    assert_matches(llm, ref, names, False)


@pytest.mark.parametrize("targets, words", [
    (["LlamaDecoderLayer"], "targets .*'LlamaDecoderLayer'"),  # a class other than Linear
    (["re:.*mlp\\.(gate|up"], "targets .*not a valid regular expression"),
])
def test_compressed_tensors_targets_not_understood_are_refused(tmp_path, targets, words):
    tq.assert_config_refused(tmp_path, _targets(tq.CT_W4A16, targets), words)


def test_a_fused_layer_partly_targeted_is_refused_naming_it(llama, tmp_path):
    """q_proj targeted, k_proj / v_proj not: one fused qkv weight cannot mix them."""
    write_checkpoint(llama, tmp_path / "q", tq.write_ct_w4a16,
                     _targets(tq.CT_W4A16, [r"re:.*q_proj$"]), dense=lambda n: ".q_proj." not in n,
                     reference=False)
    with pytest.raises(ValueError, match=re.escape("model.layers.0.self_attn.qkv_proj") + ".*unquantized"):
        LLM(str(tmp_path / "q"), dtype="float32")


@pytest.mark.parametrize("kind", ["fp8", "w4a16"])
def test_compressed_tensors_scheme_under_compression_config(llama, tmp_path, kind):
    """llm-compressor's 2024 exports (compressed-tensors up to 0.6: neuralmagic's
    Meta-Llama-3.1-*-FP8-dynamic / -quantized.w4a16) keep the scheme under config.json's
    `compression_config`, which vLLM reads where `quantization_config` is absent. They were
    refused ('is stored as fp8 but the checkpoint's config.json has no quantization_config')."""
    import json
    writer, qc = ((tq.write_ct_w4a16, tq.CT_W4A16) if kind == "w4a16"
                  else (tq.write_fp8_channel, {**CT, "ignore": ["lm_head"]}))
    ref, names = write_checkpoint(llama, tmp_path / "q", writer, qc)
    cfg = json.loads((tmp_path / "q" / "config.json").read_text())
    cfg["compression_config"] = cfg.pop("quantization_config")
    (tmp_path / "q" / "config.json").write_text(json.dumps(cfg))
    llm = LLM(str(tmp_path / "q"), dtype="float32", max_num_seqs=4)
    assert llm.engine.executor.runner.model.quant_config.name == "compressed-tensors"
    assert_matches(llm, ref, names, False if kind == "w4a16" else None)


@pytest.mark.parametrize("actorder, strategy", [(True, "group"), (False, "GROUP"), ("Group", "group")])
def test_compressed_tensors_actorder_and_strategy_as_older_versions_wrote_them(
        llama, tmp_path, actorder, strategy):
    """compressed-tensors 0.6 wrote `actorder` as a bool (true: group, false: none), and its
    parser takes strings in any case, as vLLM reads them; they were refused ('actorder True is
    not supported', 'strategy GROUP')."""
    (name, g), = tq.CT_W4A16["config_groups"].items()
    qc = {**tq.CT_W4A16, "config_groups": {name: {**g, "weights": {
        **g["weights"], "actorder": actorder, "strategy": strategy}}}}
    g_idx = actorder is True or actorder == "Group"
    ref, names = write_checkpoint(llama, tmp_path / "q", lambda t: tq.write_ct_w4a16(t, actorder=g_idx), qc)
    llm = LLM(str(tmp_path / "q"), dtype="float32", max_num_seqs=4)
    assert llm.engine.executor.runner.model.model.layers["0"].mlp.down_proj.quant.desc_act == g_idx
    assert_matches(llm, ref, names, False)


def test_fp8_fmt_spelled_as_the_torch_dtype(llama, tmp_path):
    """`fmt: float8_e4m3fn` (MiniMax-M2's config and the tools that copy it) is e4m3 too; vLLM
    does not read `fmt` at all. It was refused ('fp8 format 'float8_e4m3fn' is not supported')."""
    qc = {**tq.FORMATS["fp8-block"][1], "fmt": "float8_e4m3fn"}
    ref, names = write_checkpoint(llama, tmp_path / "q", tq.write_fp8_block, qc)
    assert_matches(LLM(str(tmp_path / "q"), dtype="float32", max_num_seqs=4), ref, names, 128)


def _fp8_block_config_with_per_tensor_scales(w):
    tensors, deq = tq.write_fp8_tensor(w)
    return {"weight": tensors["weight"], "weight_scale_inv": tensors["weight_scale"]}, deq


def _gptq_g_idx_of_one_entry(w):
    tensors, deq = tq.write_gptq(w, sym=False, desc_act=True)
    return {**tensors, "g_idx": tensors["g_idx"][:1]}, deq


@pytest.mark.parametrize("writer, qc, words", [
    # weight_block_size in the config, one scalar scale per layer in the tensors: an IndexError
    (_fp8_block_config_with_per_tensor_scales, tq.FORMATS["fp8-block"][1],
     r"model\.layers\.0\.\w+\.\w+\.weight_scale_inv: has shape \[\] in the checkpoint where this layer reads a "
     r"2-D tensor"),
    # an act-order index of one entry: broadcast to every row (all in group 0), silently
    (_gptq_g_idx_of_one_entry, tq.FORMATS["gptq-zp-actorder"][1],
     r"model\.layers\.0\.\w+\.\w+\.g_idx: has shape \[1\] in the checkpoint, which does not fit"),
    # group 128 in the tensors, 64 in the config: blamed act-order ('set desc_act true')
    (tq.write_gptq, {**tq.FORMATS["gptq-sym"][1], "group_size": 64},
     r"model\.layers\.0\.\w+\.\w+\.g_idx: puts 128 rows in each group where the config has group_size 64"),
])
def test_tensors_not_of_the_configs_layout_are_named(llama, tmp_path, writer, qc, words):
    write_checkpoint(llama, tmp_path / "q", writer, qc, reference=False)
    with pytest.raises(ValueError, match=words):
        LLM(str(tmp_path / "q"), dtype="float32")


def test_per_tensor_expert_scales_under_a_block_config_are_named(tmp_path):
    """The experts' block-scale loader too (an IndexError without the tensor's name)."""
    src = make_checkpoint(tmp_path / "src", "Qwen3MoeForCausalLM", **{
        **tq.SIZES, "moe_intermediate_size": 256, "head_dim": 64, "num_hidden_layers": 1})

    # (the experts' tensors come first in the file: their loader meets the scalar first)
    write_checkpoint(src, tmp_path / "q", _fp8_block_config_with_per_tensor_scales,
                     tq.FORMATS["fp8-block"][1], reference=False)
    with pytest.raises(ValueError, match=r"mlp\.experts\.\d+\.\w+\.weight_scale_inv: has shape \[\] in the "
                                         r"checkpoint where this layer reads a 2-D tensor"):
        LLM(str(tmp_path / "q"), dtype="float32")


def test_compressed_tensors_block_structure_as_a_string(llama, tmp_path):
    """FP8_BLOCK with `block_structure` "128x128" and `type` "FLOAT" (compressed-tensors' parser
    takes both, vLLM with it): were refused ('block strategy needs block_structure [bn, bk]')."""
    def writer(w):
        tensors, deq = tq.write_fp8_block(w)
        return {"weight": tensors["weight"], "weight_scale": tensors["weight_scale_inv"]}, deq
    (name, g), = CT["config_groups"].items()
    qc = {**CT, "ignore": ["lm_head"], "config_groups": {name: {
        **g, "weights": {**g["weights"], "strategy": "block", "block_structure": "128x128", "type": "FLOAT"},
        "input_activations": {**g["input_activations"], "strategy": "group", "group_size": 128}}}}
    ref, names = write_checkpoint(llama, tmp_path / "q", writer, qc)
    assert_matches(LLM(str(tmp_path / "q"), dtype="float32", max_num_seqs=4), ref, names, 128)


def test_compressed_tensors_input_activations_without_dynamic_are_static(llama, tmp_path, caplog):
    """compressed-tensors' `dynamic` defaults to false: input_activations that leave it out are
    static (their `input_scale` tensors are in the checkpoint), and the startup log says that
    scale is not used (it said nothing: the activations were taken for dynamic ones)."""
    (name, g), = CT["config_groups"].items()
    qc = {**CT, "ignore": ["lm_head"], "config_groups": {name: {
        **g, "weights": {**g["weights"], "strategy": "tensor"},
        "input_activations": {"num_bits": 8, "type": "float", "strategy": "tensor", "symmetric": True}}}}
    write_checkpoint(llama, tmp_path / "q", tq.write_fp8_tensor, qc, reference=False)
    with caplog.at_level("INFO", logger="rankserve.runner"):
        LLM(str(tmp_path / "q"), dtype="float32", max_num_seqs=2)
    assert "8 x fp8 e4m3 (per-tensor; static input_scale unused, activations dynamic)" in caplog.text
