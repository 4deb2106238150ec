"""4-bit weight-only MoE experts (issue #14): GPTQ, AWQ and compressed-tensors W4A16 experts of
Qwen3-MoE and Mixtral checkpoints, written in those formats' exact on-disk layouts by the writers
of tests/test_quantization.py (which never call rankserve's code), per expert and named as the
published checkpoints name them (`mlp.experts.E.{gate,up,down}_proj.*`,
`block_sparse_moe.experts.E.{w1,w3,w2}.*`).

The reference is a transformers model of the dequantized weights (fp32): the dequantized weights
are exact and the activations stay fp32 (no activation quantization in W4A16), so greedy tokens
are equal and last-position logits within 1e-5 (relative norm), as for the dense 4-bit layers.
The fused-MoE kernel's w4a16 path is checked against its plain-torch reference in
tests/test_quant_kernels.py (interpreter); `mpiexec -n 2 ... --tp 2` in tests/test_quantization.py.
"""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from rankserve import LLM

import test_quantization as tq
from conftest import make_checkpoint
from test_quant_edge import assert_matches

MOE = dict(tq.SIZES, moe_intermediate_size=256, head_dim=64)
MIXTRAL = dict(tq.SIZES, intermediate_size=256)


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("moe"), "Qwen3MoeForCausalLM", **MOE)


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("mixtral"), "MixtralForCausalLM", **MIXTRAL)


def quantized(name: str) -> bool:
    """Every linear weight and every expert's (Mixtral's w1 / w2 / w3 too), not the router."""
    return tq.is_linear(name) or ".experts." in name and name.endswith(".weight")


def write(src: str, dst: Path, fmt, reference: bool = True):
    """`src` in format `fmt` (tests/test_quantization.py FORMATS, or a (writer, config) pair) at
    `dst`; returns (the transformers model of the dequantized weights or None, the names it
    quantized)."""
    import transformers
    writer, qc = tq.FORMATS[fmt] if isinstance(fmt, str) else fmt
    dst.mkdir(parents=True)
    out, deq, names = {}, {}, set()
    for name, t in load_file(str(Path(src) / "model.safetensors")).items():
        if quantized(name):
            tensors, d = writer(t.float())
            out.update({name[:-len("weight")] + k: v.contiguous() for k, v in tensors.items()})
            deq[name] = d.to(t.dtype).contiguous()
            names.add(name)
        else:
            out[name] = deq[name] = t
    tq.write_quantized_dir(src, dst, out, qc)
    if not reference:
        return None, names
    ref_dir = dst.parent / (dst.name + "-dequantized")
    shutil.copytree(src, ref_dir)
    save_file(deq, str(ref_dir / "model.safetensors"))
    return transformers.AutoModelForCausalLM.from_pretrained(ref_dir, dtype=torch.float32).eval(), names


@pytest.mark.parametrize("fmt", ["gptq-sym", "awq", "gptq-zp-actorder"])
def test_mixtral_4bit_experts_match_the_dequantized_reference(mixtral, tmp_path, fmt):
    """Mixtral's `block_sparse_moe.experts.E.w1 / w3 / w2` (AWQ Mixtral checkpoints) load too;
    AWQ with TheBloke's Mixtral AWQ config, whose `modules_to_not_convert` lists the router."""
    writer, qc = tq.FORMATS[fmt]
    if fmt == "awq":
        qc = {**qc, "modules_to_not_convert": ["gate"]}
    ref, names = write(mixtral, tmp_path / "q", (writer, qc))
    assert any(".experts.0.w2." in n for n in names)
    llm = LLM(str(tmp_path / "q"), dtype="float32", max_num_seqs=4)
    ex = llm.engine.executor.runner.model.model.layers["0"].mlp.experts
    assert ex.w13_qweight.shape == (4, 256 // 8, 2 * 256) and ex.w2_qweight.shape == (4, 256 // 8, 256)
    assert_matches(llm, ref, names, False)


def test_compressed_tensors_w4a16_asym_actorder_experts(moe, tmp_path):
    """llm-compressor's W4A16_ASYM with actorder group: `weight_zero_point` packed along N and
    `weight_g_idx` per expert (refused as "does not support MoE experts" before)."""
    qc = {**tq.CT_W4A16, "config_groups": {"group_0": {**tq.CT_W4A16["config_groups"]["group_0"], "weights": {
        **tq.CT_W4A16["config_groups"]["group_0"]["weights"], "symmetric": False, "actorder": "group"}}}}
    ref, names = write(moe, tmp_path / "q", (lambda t: tq.write_ct_w4a16(t, sym=False, actorder=True), qc))
    llm = LLM(str(tmp_path / "q"), dtype="float32", max_num_seqs=4)
    ex = llm.engine.executor.runner.model.model.layers["0"].mlp.experts
    assert ex.quant.describe() == "experts compressed-tensors 4-bit (group 128, zero point, act-order)"
    assert ex.w13_weight_zero_point.shape == (8, 2, 512) and ex.w2_weight_g_idx.shape == (8, 256)
    assert_matches(llm, ref, names, False)


def test_4bit_experts_startup_log_counts_their_bytes(moe, tmp_path, caplog):
    """Qwen3-30B-A3B-GPTQ-Int4's format (group 128, symmetric, desc_act false): the experts are
    packed int32 words and scales (no zero points: symmetric; no g_idx: rows in order), counted
    in the startup log's weight bytes and named there; the benchmarks' floor reads them at half
    a byte and their scales."""
    from rankserve.runtime.bench import common
    from rankserve.runtime.bench.throughput import engine_runner
    write(moe, tmp_path / "q", "gptq-sym", reference=False)
    with caplog.at_level("INFO", logger="rankserve.runner"):
        llm = LLM(str(tmp_path / "q"), dtype="float32", max_num_seqs=2)
    m = llm.engine.executor.runner.model
    ex = m.model.layers["0"].mlp.experts
    E, H, inter, G = 8, 256, 256, 256 // 128
    shapes = {n: (tuple(p.shape), p.dtype) for n, p in ex.named_parameters()}
    assert shapes == {"w13_qweight": ((E, H // 8, 2 * inter), torch.int32),
                      "w13_scales": ((E, G, 2 * inter), torch.float32),
                      "w2_qweight": ((E, inter // 8, H), torch.int32),
                      "w2_scales": ((E, G, H), torch.float32)}
    experts = 2 * E * 4 * (H // 8 * 2 * inter + G * 2 * inter + inter // 8 * H + G * H)  # 2 layers
    dense = sum(p.numel() * p.element_size() for n, p in m.named_parameters() if ".experts." not in n)
    assert (f"quantization gptq: weights {(experts + dense) / 2**20:.2f} MiB on this rank; linear layers: "
            "2 x experts gptq 4-bit (group 128, symmetric), 4 x gptq 4-bit (group 128, symmetric)") in caplog.text
    assert 0.5 < common.byte_widths(engine_runner(llm))["linear"] < 0.55  # + fp32 scales per 128-group


# and GPTQ group_size -1 (one group along all of K: every rank keeps down_proj's one scale row)
TP_FORMATS = {f: tq.FORMATS[f] for f in ("gptq-sym", "awq", "gptq-zp-actorder", "ct-w4a16")} | {
    "gptq-channel": (lambda w: tq.write_gptq(w, group=w.shape[1], sym=False),
                     {**tq.FORMATS["gptq-sym"][1], "group_size": -1, "sym": False})}


@pytest.mark.parametrize("ep", [False, True], ids=["tp", "ep"])
@pytest.mark.parametrize("fmt", TP_FORMATS)
def test_tp2_expert_shards_add_up_to_one_rank(moe, tmp_path, fmt, ep):
    """The loader's sharding without mpiexec: both ranks of --tp 2 built and loaded in one
    process. TP: each rank keeps its half of every expert's intermediate size (gate / up rows,
    down columns: packed words, whole groups; act-order keeps every group's scales), and the
    ranks' partial outputs add up to one rank's; EP: each keeps 4 whole experts, routed to
    locally, the others skipped."""
    from rankserve.models.loader import build_model, load_hf_config, load_weights
    from rankserve.models.parallel import ParallelInfo
    write(moe, tmp_path / "q", TP_FORMATS[fmt], reference=False)
    cfg = load_hf_config(str(tmp_path / "q"))

    def experts(pi):
        model = build_model(cfg, pi, torch.float32, torch.device("cpu"))
        load_weights(model, str(tmp_path / "q"), progress=False)
        return model.model.layers["1"].mlp.experts
    one = experts(ParallelInfo())
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 256, generator=g)
    ids = torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(5)]).int()
    weights = torch.softmax(torch.randn(5, 2, generator=g), -1)
    want = one(x, weights, ids)
    got = 0
    for r in range(2):
        ex = experts(ParallelInfo(tp_rank=r, tp_size=2, enable_expert_parallel=ep))
        if ep:
            assert ex.w13_scale.shape[0] == 4 if fmt == "ct-w4a16" else ex.w13_qweight.shape[0] == 4
            local = ids - ex.first_expert
            got = got + ex(x, weights, torch.where((local >= 0) & (local < 4), local, -1).int())
        else:
            assert ex.inter == 128
            got = got + ex(x, weights, ids)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fmt", ["gptq-sym", "awq"])
def test_tp_split_through_a_group_names_the_experts_and_sizes(fmt):
    """Qwen3-30B-A3B-GPTQ-Int4 (moe_intermediate_size 768, group 128) at --tp 4 leaves 192
    columns of each down_proj per rank: one group's scale would be read by two ranks for part
    of it. Refused naming the experts, the sizes and the way out; expert parallelism keeps the
    experts whole and builds; act-order keeps every group on every rank and builds."""
    from rankserve.models.moe import FusedExperts
    from rankserve.models.parallel import ParallelInfo
    from rankserve.models.quantization import QUANT_METHODS, building
    qc = QUANT_METHODS.get(tq.FORMATS[fmt][1]["quant_method"])(tq.FORMATS[fmt][1])
    with building(qc), pytest.raises(ValueError, match=r"MoE experts \(mlp\.experts\): intermediate size "
                                                       r"768 split over 4 tensor-parallel ranks \(192 per "
                                                       r"rank\) is not a multiple of the checkpoint's "
                                                       r"group_size 128; use --enable-expert-parallel"):
        FusedExperts(8, 256, 768, ParallelInfo(tp_size=4), torch.float16)
    with building(qc):
        ex = FusedExperts(8, 256, 768, ParallelInfo(tp_size=4, enable_expert_parallel=True), torch.float16)
    assert ex.w13_qweight.shape == (2, 32, 2 * 768) and ex.w2_scales.shape == (2, 6, 256)
    act_order = QUANT_METHODS.get("gptq")(tq.FORMATS["gptq-zp-actorder"][1])
    with building(act_order):
        ex = FusedExperts(8, 256, 768, ParallelInfo(tp_size=4), torch.float16)
    assert ex.w2_qweight.shape == (8, 192 // 8, 256) and ex.w2_scales.shape == (8, 6, 256)
    assert ex.w2_g_idx.shape == (8, 192)


def test_some_experts_quantized_and_others_not_is_an_error_naming_the_tensor(moe, tmp_path):
    """A checkpoint whose expert 3 of layer 1 is left 16-bit where the config quantizes the
    experts: its `weight` has no parameter to go to; the loader names what is missing."""
    write(moe, tmp_path / "q", "gptq-sym", reference=False)
    path = tmp_path / "q" / "model.safetensors"
    state = load_file(str(path))
    for k in [k for k in state if ".layers.1.mlp.experts.3.up_proj." in k]:
        del state[k]
    state["model.layers.1.mlp.experts.3.up_proj.weight"] = torch.zeros(256, 256)
    save_file(state, str(path))
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.experts\.3\.up_proj\.weight"):
        LLM(str(tmp_path / "q"), dtype="float32")


def test_4bit_experts_reload_after_sleep_and_weight_updates(moe, tmp_path):
    """Sleep level 2 then update_weights_from_disk, and an update while awake, load 4-bit
    experts again through the same per-expert loaders (act-order g_idx kept, zero points)."""
    write(moe, tmp_path / "a", "gptq-zp-actorder", reference=False)
    state = load_file(f"{moe}/model.safetensors")
    other = tmp_path / "other"
    shutil.copytree(moe, other)
    save_file({k: v.flip(0).contiguous() if ".experts." in k else v for k, v in state.items()},
              str(other / "model.safetensors"))  # experts permuted within each: other tokens
    write(str(other), tmp_path / "b", "gptq-zp-actorder", reference=False)
    want = {p: tq.greedy(LLM(str(tmp_path / p), dtype="float32", max_num_seqs=4)) for p in "ab"}
    assert want["a"] != want["b"]
    llm = LLM(str(tmp_path / "a"), dtype="float32", enable_sleep_mode=True, max_num_seqs=4)
    llm.sleep(2)
    llm.wake_up(["weights"])
    llm.update_weights_from_disk(str(tmp_path / "b"))
    llm.wake_up(["kv_cache"])
    assert tq.greedy(llm) == want["b"]
    llm.update_weights_from_disk(str(tmp_path / "a"))
    assert tq.greedy(llm) == want["a"]


def test_an_expert_missing_from_the_checkpoint_is_named(moe, tmp_path):
    """Expert 5's down_proj of layer 1 left out: the loader only checked that each stacked
    parameter got some tensor, and expert 5 would have run on uninitialized memory."""
    write(moe, tmp_path / "q", "awq", reference=False)
    path = tmp_path / "q" / "model.safetensors"
    state = load_file(str(path))
    save_file({k: v for k, v in state.items() if ".layers.1.mlp.experts.5.down_proj." not in k}, str(path))
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.experts: the checkpoint has no qweight "
                                         r"for expert 5's down_proj \(w2\)"):
        LLM(str(tmp_path / "q"), dtype="float32")


def test_4bit_experts_where_the_config_says_dense_are_named(moe, tmp_path):
    """Experts the ignore list names run dense; a checkpoint that stores them 4-bit anyway had
    its expert tensors dropped, and the error said only that the checkpoint "lacks weights for
    ...experts.w13": the first such tensor is named now, with the reason."""
    writer, qc = tq.FORMATS["gptq-sym"]
    write(moe, tmp_path / "q", (writer, {**qc, "modules_to_not_convert": ["mlp.experts"]}), reference=False)
    with pytest.raises(ValueError, match=r"model\.layers\.\d\.mlp\.experts\.\d\.\w+_proj\.\w+: the checkpoint "
                                         r"quantizes these MoE experts, which run unquantized here"):
        LLM(str(tmp_path / "q"), dtype="float32")


@pytest.mark.parametrize("arch", ["DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM"])
def test_deepseek_4bit_routed_and_shared_experts(tmp_path, monkeypatch, arch):
    """DeepSeek's always-on shared experts (a GatedMLP) and its routed experts in 4 bits, MLA's
    projections too but kv_b_proj (listed as not converted; a 4-bit kv_b_proj: test_quant_hunt4.py)."""
    monkeypatch.setattr(tq, "LINEARS", tq.LINEARS + ("kv_a_proj_with_mqa", "q_a_proj", "q_b_proj"))
    src = make_checkpoint(tmp_path / "src", arch, hidden_size=256, intermediate_size=512,
                          moe_intermediate_size=256, **({"q_lora_rank": 64} if "V3" in arch else {}))
    qc = {**tq.FORMATS["gptq-sym"][1], "group_size": 32, "modules_to_not_convert": ["kv_b_proj", "gate"]}
    ref, names = write(src, tmp_path / "q", (lambda t: tq.write_gptq(t, group=32), qc))
    assert any(".shared_experts.down_proj." in n for n in names)
    llm = LLM(str(tmp_path / "q"), dtype="float32", max_num_seqs=4)
    layer = llm.engine.executor.runner.model.model.layers["1"]
    assert layer.mlp.shared_experts.gate_up_proj.qweight.dtype == torch.int32
    assert layer.mlp.experts.w13_qweight.shape == (8, 256 // 8, 2 * 256)
    assert_matches(llm, ref, names, False)
