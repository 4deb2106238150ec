"""Quantized checkpoints, fourth hunt (issue #14): layouts of published exports that the earlier
hunts (test_quant_hunt*.py, test_quant_edge.py) did not write. Writers and references come from
tests/test_quantization.py and tests/test_quant_moe_w4.py (they never call rankserve's code)."""
from __future__ import annotations

import shutil
import subprocess
import sys

import pytest
import torch

from rankserve import LLM

import test_quantization as tq
from conftest import make_checkpoint
from test_quant_edge import assert_matches, write_checkpoint
from test_quant_moe_w4 import write

MLA = ("kv_a_proj_with_mqa", "q_a_proj", "q_b_proj", "kv_b_proj")


@pytest.mark.parametrize("arch, fmt", [("DeepseekV2ForCausalLM", "gptq-zp-actorder"),
                                       ("DeepseekV3ForCausalLM", "awq")])
def test_deepseek_4bit_kv_b_proj_is_dequantized_for_mla(tmp_path, monkeypatch, arch, fmt):
    """GPTQModel's and AutoAWQ's DeepSeek exports quantize every attention projection, kv_b_proj
    included; MLA's absorbed form needs kv_b_proj's weight itself, so it is dequantized once
    (as an FP8 one is), not refused."""
    monkeypatch.setattr(tq, "LINEARS", tq.LINEARS + MLA)
    src = make_checkpoint(tmp_path / "src", arch, hidden_size=256, intermediate_size=512,
                          moe_intermediate_size=256, **({"q_lora_rank": 64} if "V3" in arch else {}))
    writer, qc = tq.FORMATS[fmt]
    group = {"group_size": 32, "modules_to_not_convert": ["gate"]}
    w = (lambda t: tq.write_gptq(t, group=32, sym=False, desc_act=True)) if fmt.startswith("gptq") else \
        (lambda t: tq.write_awq(t, group=32))
    ref, names = write(src, tmp_path / "q", (w, {**qc, **group}))
    assert any(n.endswith("kv_b_proj.weight") for n in names)
    llm = LLM(str(tmp_path / "q"), dtype="float32", max_num_seqs=4)
    attn = llm.engine.executor.runner.model.model.layers["1"].self_attn
    assert attn.kv_b_proj.qweight.dtype == torch.int32 and attn.w_kv_b is not None
    assert_matches(llm, ref, names, False)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("llama"), "LlamaForCausalLM", **tq.SIZES)


@pytest.mark.parametrize("fmt, stored, reads", [("fp8-block", "weight_scale", "weight_scale_inv"),
                                                ("fp8-tensor", "weight_scale_inv", "weight_scale")])
def test_fp8_scales_under_the_other_layouts_name_are_named(llama, tmp_path, fmt, stored, reads):
    """Block scales stored as `weight_scale` (or per-tensor ones as `weight_scale_inv`): the
    error says which tensors the layer reads, not that the layer runs unquantized."""
    writer, qc = tq.FORMATS[fmt]

    def renamed(w):
        tensors, deq = writer(w)
        return {stored if k.startswith("weight_scale") else k: v for k, v in tensors.items()}, deq
    write_checkpoint(llama, tmp_path / "q", renamed, qc, reference=False)
    with pytest.raises(ValueError, match=rf"\.{stored}: is not a tensor .* reads \(input_scale, weight, {reads}\)"
                       if fmt == "fp8-tensor" else rf"\.{stored}: is not a tensor .* reads \(weight, {reads}\)") as e:
        LLM(str(tmp_path / "q"), dtype="float32")
    assert "runs unquantized" not in str(e.value)


def test_a_quantization_config_without_quant_method_says_so(tmp_path):
    """A config.json `quantization_config` that names no `quant_method` (a hand-merged AutoGPTQ
    `quantize_config.json`) is refused saying that, not as "unsupported quantization method ''"."""
    from test_quantization import assert_config_refused
    assert_config_refused(tmp_path, {"bits": 4, "group_size": 128, "desc_act": False},
                          r"quantization_config has no quant_method \(its fields: bits, desc_act, "
                          r"group_size\); supported: awq, compressed-tensors")


@pytest.mark.parametrize("fmt", ["ct-w4a16", "fp8-block"])
def test_a_quantized_lm_head_is_refused_naming_the_lm_head(llama, tmp_path, monkeypatch, fmt):
    """An export that quantized lm_head too (compressed-tensors with an empty ignore list, or
    block FP8 without lm_head in modules_to_not_convert): the error names the LM head as what
    runs 16-bit only, not a router or a layer listed as not converted."""
    writer, qc = tq.FORMATS[fmt]
    qc = {**qc, "ignore": []} if "ignore" in qc else qc
    is_linear = tq.is_linear
    monkeypatch.setattr(tq, "is_linear", lambda name: is_linear(name) or name == "lm_head.weight")
    write_checkpoint(llama, tmp_path / "q", writer, qc, reference=False)
    with pytest.raises(ValueError, match=r"lm_head\.\w+: .*lm_head.*the embedding, the LM head, norms and "
                                         r"MoE routers take 16-bit weights only"):
        LLM(str(tmp_path / "q"), dtype="float32")


@pytest.mark.mpi
@pytest.mark.skipif(shutil.which("mpiexec") is None, reason="mpiexec not on PATH")
def test_tp2_cut_through_packed_zero_points_names_the_cut_on_every_rank(tmp_path, monkeypatch):
    """Nemotron-H's in_proj ends in a dt section of one row per Mamba head: 8 heads at --tp 2
    give each rank 4 rows, half of a packed zero-point word. Rank 1's offset (772) was named;
    rank 0 (offset 768, aligned) read the whole word and failed with a shape mismatch that
    blamed the checkpoint's tensor instead."""
    monkeypatch.setattr(tq, "LINEARS", tq.LINEARS + ("in_proj", "out_proj"))
    src = make_checkpoint(tmp_path / "src", "NemotronHForCausalLM", hidden_size=256, intermediate_size=512,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=64, mamba_num_heads=8,
                          mamba_head_dim=32, n_groups=2, ssm_state_size=64)
    write_checkpoint(src, tmp_path / "q", tq.FORMATS["gptq-zp-actorder"][0], tq.FORMATS["gptq-zp-actorder"][1],
                     reference=False)
    r = subprocess.run(["mpiexec", "-n", "2", sys.executable, "-m", "rankserve.launch", "generate",
                        str(tmp_path / "q"), "--tp", "2", "--dtype", "float32", "--max-tokens", "2",
                        "--prompt", "Once"], capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    assert "in_proj.qzeros: output shard size (4) is not a multiple of 8" in r.stderr, r.stderr[-3000:]
    assert "does not fit this layer" not in r.stderr, r.stderr[-3000:]

