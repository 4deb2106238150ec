"""Quantized checkpoints driven as users would, at the config variants published checkpoints
use (models/quantization.py). Writers and the reference come from tests/test_quantization.py and
tests/test_quant_edge.py."""
from __future__ import annotations

import pytest

from rankserve import LLM

import test_quantization as tq
from conftest import make_checkpoint
from test_quant_edge import CT, assert_matches, write_checkpoint


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("llama"), "LlamaForCausalLM", **tq.SIZES)


def test_awq_zero_point_false_reads_the_stored_zero_points(llama, tmp_path):
    """AutoAWQ's GEMM layout always stores `qzeros`; a config saying `zero_point: false` must not
    make the loader drop them for a fixed zero of 8 (silently wrong weights). vLLM reads them too."""
    qc = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": False, "version": "gemm"}
    ref, quantized = write_checkpoint(llama, tmp_path / "q", tq.write_awq, qc)
    assert_matches(LLM(str(tmp_path / "q"), dtype="float32", max_num_seqs=4), ref, quantized, False)


def _ct(weights=None, acts=None):
    g = CT["config_groups"]["group_0"]
    return {**CT, "config_groups": {"group_0": {**g, "weights": {**g["weights"], **(weights or {})},
                                                "input_activations": {**g["input_activations"], **(acts or {})}}}}


@pytest.mark.parametrize("qc, words", [
    # asymmetric FP8 stores `weight_zero_point`: dropping it would be silently wrong
    (_ct(weights={"symmetric": False}), "compressed-tensors FP8 weights with symmetric: false"),
    # W8A8 int8 / 4-bit activations: running them as e4m3 would ignore the scheme
    (_ct(acts={"type": "int"}), "compressed-tensors input_activations of 8-bit int"),
    (_ct(acts={"num_bits": 4}), "compressed-tensors input_activations of 4-bit float"),
])
def test_compressed_tensors_fields_not_run_are_refused(tmp_path, qc, words):
    tq.assert_config_refused(tmp_path, qc, words)


def _per_tensor_ct(w):
    t, d = tq.write_fp8_tensor(w)
    del t["input_scale"]
    return t, d


@pytest.mark.parametrize("writer, qc, kind", [
    (tq.write_fp8_tensor, tq.FORMATS["fp8-tensor"][1],  # activation_scheme static
     "fp8 e4m3 (per-tensor; static input_scale unused, activations dynamic)"),
    (_per_tensor_ct, _ct(weights={"strategy": "tensor"}), "fp8 e4m3 (per-tensor)"),
    (tq.write_fp8_channel, tq.FORMATS["fbgemm_fp8"][1], "fp8 e4m3 (per-channel)"),
    (lambda w: tq.write_gptq(w, group=w.shape[1], sym=False),
     {"quant_method": "gptq", "bits": 4, "group_size": -1, "desc_act": False, "sym": False},
     "gptq 4-bit (per-channel, zero point)"),
])
def test_startup_log_names_the_scale_granularity(llama, tmp_path, caplog, writer, qc, kind):
    """The startup log says what the checkpoint holds: per-tensor scales are not per-channel, a
    static activation scale is not used, and GPTQ's group_size -1 is one group per output channel
    (not a group of -1)."""
    write_checkpoint(llama, tmp_path / "q", writer, qc, reference=False)
    with caplog.at_level("INFO", logger="rankserve.runner"):
        LLM(str(tmp_path / "q"), dtype="float32", max_num_seqs=2)
    assert f"linear layers: 8 x {kind}" in caplog.text, caplog.text[-2000:]


KV_FP8 = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}


@pytest.mark.parametrize("kv, words", [
    # int8 KV scales used as e4m3 scales would silently corrupt the cache
    ({**KV_FP8, "type": "int"}, "kv_cache_scheme of 8-bit int"),
    ({**KV_FP8, "num_bits": 4}, "kv_cache_scheme of 4-bit float"),
    ({**KV_FP8, "symmetric": False}, "kv_cache_scheme with symmetric: false"),
    ({**KV_FP8, "strategy": "attn_head"}, "kv_cache_scheme strategy 'attn_head'"),
])
def test_kv_cache_schemes_not_run_are_refused(tmp_path, kv, words):
    tq.assert_config_refused(tmp_path, {**CT, "kv_cache_scheme": kv}, words)


def test_kv_cache_only_compressed_tensors_checkpoint(tmp_path):
    """llm-compressor's KV-cache-only scheme (no config_groups, 16-bit weights, k/v scales): the
    weights stay dense and an fp8 cache takes the scales (it was refused as "0 config groups")."""
    import json
    import shutil

    import torch
    from safetensors.torch import save_file

    from conftest import STORIES_EMBEDDED
    shutil.copytree(STORIES_EMBEDDED, tmp_path / "m")
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "compressed-tensors", "format": "dense",
                                  "config_groups": {}, "kv_cache_scheme": KV_FP8, "ignore": ["lm_head"]}
    (tmp_path / "m" / "config.json").write_text(json.dumps(cfg))
    save_file({"model.layers.0.self_attn.k_scale": torch.tensor(0.5),
               "model.layers.0.self_attn.v_scale": torch.tensor(0.25)}, str(tmp_path / "m" / "kv.safetensors"))
    llm = LLM(str(tmp_path / "m"), kv_cache_dtype="fp8")
    m = llm.engine.executor.runner.model
    assert all(mod.quant.dense for mod in m.modules() if hasattr(mod, "set_method"))
    a = m.attention_layers()[0]
    assert (float(a.k_scale), float(a.v_scale)) == (0.5, 0.25)
    assert llm.generate("Once upon a time", tq.SamplingParams(temperature=0, max_tokens=8))[0].outputs[0].text


def test_gptq_act_order_g_idx_under_desc_act_false_is_refused(llama, tmp_path):
    """A checkpoint whose g_idx is an act-order permutation while its config says desc_act false:
    rows in order would be the wrong groups (silently wrong weights); the error names the tensor."""
    qc = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": False}
    write_checkpoint(llama, tmp_path / "q", lambda w: tq.write_gptq(w, sym=False, desc_act=True), qc,
                     reference=False)
    with pytest.raises(ValueError, match=r"model\.layers\.0\.\w+\.\w+\.g_idx: .*desc_act"):
        LLM(str(tmp_path / "q"), dtype="float32")


TP_CASES = {  # fmt: (writer, config, FP8 activation group or False)
    "gptq-sym": (*tq.FORMATS["gptq-sym"], False),
    "gptq-zp-actorder": (*tq.FORMATS["gptq-zp-actorder"], False),
    "awq": (*tq.FORMATS["awq"], False),
    "fp8-block": (*tq.FORMATS["fp8-block"], 128),
    "ct-w4a16": (*tq.FORMATS["ct-w4a16"], False),
    "ct-w4a16-asym-actorder": (lambda w: tq.write_ct_w4a16(w, sym=False, actorder=True), {
        **tq.CT_W4A16, "config_groups": {"group_0": {**tq.CT_W4A16["config_groups"]["group_0"], "weights": {
            **tq.CT_W4A16["config_groups"]["group_0"]["weights"], "symmetric": False, "actorder": "group"}}}}, False),
}


@pytest.fixture(scope="module")
def llama_kv4(tmp_path_factory):  # 4 kv heads: each rank's k and v (2 x 64 rows) are whole 128-row blocks
    return make_checkpoint(tmp_path_factory.mktemp("llama_kv4"), "LlamaForCausalLM",
                           **{**tq.SIZES, "num_key_value_heads": 4})


@pytest.mark.parametrize("fmt", TP_CASES)
def test_tp2_shards_of_each_rank_add_up_to_the_dequantized_layer(llama_kv4, tmp_path, fmt):
    """The loader's sharding without mpiexec: both ranks of --tp 2 built and loaded in one
    process; for the row-parallel down_proj (input columns cut, act-order rows on any rank) the
    ranks' partial products add up to the dequantized weight's, and each rank's column-parallel
    gate_up (gate and up each cut) is its rows of the dequantized weights."""
    import torch
    from safetensors.torch import load_file

    from rankserve.models.loader import build_model, load_hf_config, load_weights
    from rankserve.models.parallel import ParallelInfo
    llama, (writer, qc, group) = llama_kv4, TP_CASES[fmt]
    write_checkpoint(llama, tmp_path / "q", writer, qc, reference=False)
    deq = {n: writer(t.float())[1] for n, t in load_file(f"{llama}/model.safetensors").items()
           if n.startswith("model.layers.1.mlp.") and tq.is_linear(n)}
    cfg = load_hf_config(str(tmp_path / "q"))
    ranks = []
    for r in range(2):
        model = build_model(cfg, ParallelInfo(tp_rank=r, tp_size=2), torch.float32, torch.device("cpu"))
        load_weights(model, str(tmp_path / "q"), progress=False)
        ranks.append(model.model.layers["1"].mlp)
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(0))
    q = (lambda t: tq.fake_quant_rows(t, group)) if group else (lambda t: t)
    down = deq["model.layers.1.mlp.down_proj.weight"]
    got = sum(m.down_proj.linear(x[:, 256 * r:256 * (r + 1)]) for r, m in enumerate(ranks))
    torch.testing.assert_close(got, q(x) @ down.T, rtol=1e-4, atol=1e-4)
    h = torch.randn(3, 256, generator=torch.Generator().manual_seed(1))
    for r, m in enumerate(ranks):
        rows = slice(256 * r, 256 * (r + 1))
        want = torch.cat([q(h) @ deq[f"model.layers.1.mlp.{p}_proj.weight"][rows].T for p in ("gate", "up")], 1)
        torch.testing.assert_close(m.gate_up_proj.linear(h), want, rtol=1e-4, atol=1e-4)


def test_block_fp8_with_static_activations_is_refused(tmp_path):
    """Block scales quantize activations per 1 x 128 group; a static per-tensor input_scale cannot
    be honoured there (vLLM refuses it too) and was dropped without a word."""
    tq.assert_config_refused(tmp_path, {**tq.FORMATS["fp8-block"][1], "activation_scheme": "static"},
                             "weight_block_size .* activation_scheme 'static'")


def test_compressed_tensors_block_strategy_needs_its_block_structure(tmp_path):
    """strategy block without block_structure was run as per channel, its [N/bn, K/bk] scales read
    as [N] (silently wrong)."""
    tq.assert_config_refused(tmp_path, _ct(weights={"strategy": "block"}), "block_structure")


def test_gptq_without_g_idx_when_rows_are_in_order(llama, tmp_path):
    """Without desc_act the index is not needed (rows in group order) and some exporters leave it
    out: the checkpoint loads (it was "lacks weights for ... g_idx"). With desc_act it is needed:
    the error names it."""
    def no_g_idx(w, **kw):
        t, d = tq.write_gptq(w, sym=False, **kw)
        del t["g_idx"]
        return t, d
    qc = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": False}
    ref, quantized = write_checkpoint(llama, tmp_path / "q", no_g_idx, qc)
    assert_matches(LLM(str(tmp_path / "q"), dtype="float32", max_num_seqs=4), ref, quantized, False)
    write_checkpoint(llama, tmp_path / "a", no_g_idx, {**qc, "desc_act": True}, reference=False)
    with pytest.raises(ValueError, match=r"lacks weights for: \['model\.layers\.0\.self_attn\.qkv_proj\.g_idx'"):
        LLM(str(tmp_path / "a"), dtype="float32")


def test_startup_log_of_per_tensor_fp8_experts(tmp_path_factory, tmp_path, caplog):
    moe = make_checkpoint(tmp_path_factory.mktemp("moe"), "Qwen3MoeForCausalLM", **tq.SIZES,
                          moe_intermediate_size=256)
    write_checkpoint(moe, tmp_path / "q", *tq.FORMATS["fp8-tensor"], reference=False)
    with caplog.at_level("INFO", logger="rankserve.runner"):
        LLM(str(tmp_path / "q"), dtype="float32", max_num_seqs=2)
    # (its static expert input_scales are dropped like the dense layers': the log says so)
    assert "2 x experts fp8 e4m3 (per-tensor; static input_scale unused, activations dynamic)" in caplog.text, \
        caplog.text[-2000:]


def test_ignore_entries_that_are_a_middle_part_of_the_name(llama, tmp_path):
    """`modules_to_not_convert` entries such as "layers.0.mlp" (a run of whole name parts, as
    vLLM matches them) leave those layers dense; "layers.0" must not match layers.0x."""
    qc = {"quant_method": "fbgemm_fp8", "modules_to_not_convert": ["layers.0.self_attn", "layers.0.mlp", "lm_head"]}
    dense = lambda n: n.startswith("model.layers.0.")  # noqa: E731
    write_checkpoint(llama, tmp_path / "q", tq.write_fp8_channel, qc, dense=dense, reference=False)
    llm = LLM(str(tmp_path / "q"), dtype="float32", max_num_seqs=2)
    m = llm.engine.executor.runner.model
    assert {n: mod.quant.dense for n, mod in m.named_modules() if hasattr(mod, "set_method")} == {
        f"model.layers.{i}.{s}": i == 0 for i in (0, 1)
        for s in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")}
    from rankserve.models.quantization import _listed
    assert not _listed("model.layers.10.mlp.down_proj", "layers.1")
