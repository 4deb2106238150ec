"""Quantized checkpoints (models/quantization.py) written in the exact on-disk formats that published
checkpoints use (tensor names, dtypes, scale shapes, `quantization_config`), for Llama, Qwen3 and
Qwen3-MoE. The writers below follow the formats' own definitions (GPTQ / AutoGPTQ packing,
AutoAWQ's GEMM packing and column order, DeepSeek-V3 / Qwen3-FP8 block scales, Meta's
fbgemm_fp8, llm-compressor's FP8) and never call rankserve's code.

Each test compares with a transformers model whose weights are the dequantized ones (fp32):
- 4-bit weight-only: dequantized weights are exact and activations stay fp32: greedy tokens equal
  and last-position logits within 1e-5 (relative norm).
- FP8 W8A8: activations are quantized too (dynamic e4m3, per token or per 1 x 128 group); the
  reference does the same in plain torch (`fake_quant_activations`, around every F.linear on a
  quantized weight, experts included): greedy tokens equal, logits as LOGIT_TOL says.
"""
from __future__ import annotations

import contextlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from rankserve import LLM, SamplingParams

from conftest import STORIES_EMBEDDED, make_checkpoint

FP8 = torch.float8_e4m3fn
PROMPTS = [[1, 5, 9, 200, 31], [1, 400, 5, 77, 78, 79, 80, 81, 82, 83, 84, 17, 3], list(range(1, 40))]
NEW = 12
# FP8 logits, relative norm error vs the reference: the median prompt within LOGIT_TOL (measured
# ~5e-7: the same quantized math summed in another order); any prompt within LOGIT_TIE_TOL, since
# that order can flip an activation's e4m3 rounding (one 1/16 step) and this random tiny model
# amplifies it, or flips an MoE routing choice (measured up to 6e-2 on one prompt)
LOGIT_TOL, LOGIT_TIE_TOL = 1e-4, 0.1
SIZES = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
             head_dim=64)
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def is_linear(name: str) -> bool:
    parts = name.split(".")
    return name.endswith(".weight") and len(parts) >= 2 and parts[-2] in LINEARS


# ---- writers (format definitions) ----------------------------------------------------------------

def fp8_quant(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (w / scale).clamp(-448, 448).to(FP8)


def write_fp8_block(w, bn=128, bk=128):
    """DeepSeek-V3 / Qwen3-FP8: `weight` e4m3, `weight_scale_inv` fp32 [ceil(N/bn), ceil(K/bk)]."""
    N, K = w.shape
    s = torch.zeros(-(-N // bn), -(-K // bk))
    for i in range(s.shape[0]):
        for j in range(s.shape[1]):
            s[i, j] = w[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk].abs().max() / 448
    full = s.repeat_interleave(bn, 0)[:N].repeat_interleave(bk, 1)[:, :K]
    q = fp8_quant(w, full)
    return {"weight": q, "weight_scale_inv": s}, q.float() * full


def write_fp8_tensor(w):
    """HF fp8 without blocks (static activations): scalar `weight_scale` and `input_scale`."""
    s = w.abs().max() / 448
    q = fp8_quant(w, s)
    return {"weight": q, "weight_scale": s.reshape(()), "input_scale": torch.tensor(0.05)}, q.float() * s


def write_fp8_channel(w):
    """fbgemm_fp8 / compressed-tensors channel: `weight_scale` [N, 1]."""
    s = w.abs().amax(1, keepdim=True) / 448
    q = fp8_quant(w, s)
    return {"weight": q, "weight_scale": s}, q.float() * s


def _pack_rows(q):  # [K, N] 0..15 -> int32 [K/8, N], nibble j = row 8i + j (GPTQ qweight)
    K, N = q.shape
    out = torch.zeros(K // 8, N, dtype=torch.int64)
    for j in range(8):
        out |= q[j::8].long() << (4 * j)
    return out.to(torch.int32) if out.max() < 2**31 else (out - (out >= 2**31).long() * 2**32).to(torch.int32)


def _pack_cols(q, order=tuple(range(8))):  # [R, C] -> int32 [R, C/8], nibble i = column 8c + order[i]
    R, C = q.shape
    out = torch.zeros(R, C // 8, dtype=torch.int64)
    for i, col in enumerate(order):
        out |= q[:, col::8].long() << (4 * i)
    return (out - (out >= 2**31).long() * 2**32).to(torch.int32)


def _quant_groups(W, group_of_row, G, sym):
    """W [K, N]; per (group, column) scale and zero; returns q [K, N], scales, zeros [G, N]."""
    scales = torch.zeros(G, W.shape[1])
    zeros = torch.zeros(G, W.shape[1], dtype=torch.int64)
    for g in range(G):
        rows = W[group_of_row == g]
        if sym:
            scales[g] = rows.abs().amax(0) / 7.5
            zeros[g] = 8
        else:
            lo, hi = rows.amin(0).clamp(max=0), rows.amax(0).clamp(min=0)
            scales[g] = (hi - lo) / 15
            zeros[g] = torch.round(-lo / scales[g]).clamp(0, 15).long()
    scales = scales.half().float()  # stored fp16
    z, s = zeros[group_of_row], scales[group_of_row]
    q = (torch.round(W / s) + z).clamp(0, 15).long()
    return q, scales, zeros, (q - z) * s


def write_gptq(w, group=128, sym=True, desc_act=False, seed=0):
    """AutoGPTQ v1: qweight [K/8, N], qzeros [G, N/8] ((zero - 1) mod 16), scales fp16 [G, N],
    g_idx [K]."""
    W = w.T.contiguous()
    K = W.shape[0]
    G = K // group
    if desc_act:  # act-order: groups follow a permutation of the rows
        perm = torch.randperm(K, generator=torch.Generator().manual_seed(seed))
        g_idx = torch.empty(K, dtype=torch.int32)
        g_idx[perm] = (torch.arange(K) // group).to(torch.int32)
    else:
        g_idx = (torch.arange(K) // group).to(torch.int32)
    q, scales, zeros, deq = _quant_groups(W, g_idx.long(), G, sym)
    return {"qweight": _pack_rows(q), "qzeros": _pack_cols((zeros - 1) & 0xF), "scales": scales.half(),
            "g_idx": g_idx}, deq.T


AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def write_awq(w, group=128):
    """AutoAWQ GEMM: qweight [K, N/8] and qzeros [G, N/8] packed along N in AWQ's order."""
    W = w.T.contiguous()
    K = W.shape[0]
    q, scales, zeros, deq = _quant_groups(W, torch.arange(K) // group, K // group, sym=False)
    return {"qweight": _pack_cols(q, AWQ_ORDER), "qzeros": _pack_cols(zeros, AWQ_ORDER),
            "scales": scales.half()}, deq.T


def write_ct_w4a16(w, group=128, sym=True, actorder=False):
    """compressed-tensors pack-quantized (llm-compressor W4A16): `weight_packed` int32 [N, K/8]
    packed along K (nibble i = column 8c + i, values offset by 8 to 0..15), `weight_scale`
    [N, K/group], `weight_shape` [N, K]; asymmetric (W4A16_ASYM, llm-compressor's AWQ):
    `weight_zero_point` int32 [N/8, K/group] packed along N, offset by 8 likewise."""
    W = w.T.contiguous()
    K = W.shape[0]
    g_idx = (torch.arange(K) // group).to(torch.int32)
    if actorder:  # actorder group: groups follow a permutation of the columns, `weight_g_idx` [K]
        g_idx[torch.randperm(K, generator=torch.Generator().manual_seed(0))] = g_idx.clone()
    q, scales, zeros, deq = _quant_groups(W, g_idx.long(), K // group, sym=sym)
    out = {"weight_packed": _pack_cols(q.T.contiguous()), "weight_scale": scales.T.contiguous().half(),
           "weight_shape": torch.tensor(list(w.shape), dtype=torch.int64)}
    if not sym:
        out["weight_zero_point"] = _pack_cols(zeros).T.contiguous()
    if actorder:
        out["weight_g_idx"] = g_idx
    return out, deq.T


CT_W4A16 = {"quant_method": "compressed-tensors", "format": "pack-quantized", "ignore": ["lm_head"],
            "quantization_status": "compressed", "config_groups": {"group_0": {
                "targets": ["Linear"], "input_activations": None, "output_activations": None,
                "weights": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128,
                            "symmetric": True, "dynamic": False, "actorder": None}}}}

FORMATS = {
    "fp8-block": (write_fp8_block, {"quant_method": "fp8", "activation_scheme": "dynamic",
                                    "fmt": "e4m3", "weight_block_size": [128, 128]}),
    "fp8-tensor": (write_fp8_tensor, {"quant_method": "fp8", "activation_scheme": "static"}),
    "fbgemm_fp8": (write_fp8_channel, {"quant_method": "fbgemm_fp8", "activation_scale_ub": 1200.0,
                                       "modules_to_not_convert": ["lm_head"]}),
    "ct-fp8": (write_fp8_channel, {
        "quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
        "config_groups": {"group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True,
                        "dynamic": False},
            "input_activations": {"num_bits": 8, "type": "float", "strategy": "token",
                                  "dynamic": True, "symmetric": True}}}}),
    "gptq-sym": (lambda w: write_gptq(w, sym=True), {
        "quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True,
        "checkpoint_format": "gptq"}),
    "gptq-zp-actorder": (lambda w: write_gptq(w, sym=False, desc_act=True), {
        "quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": True, "sym": False}),
    "awq": (write_awq, {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True,
                        "version": "gemm"}),
    "ct-w4a16": (write_ct_w4a16, CT_W4A16),
}


def write_quantized_dir(src, dst, tensors, qc) -> None:
    """dst: the quantized tensors, src's config with `qc` as its quantization_config, and src's
    tokenizer and generation config."""
    save_file(tensors, str(dst / "model.safetensors"))
    cfg = json.loads((Path(src) / "config.json").read_text())
    cfg["quantization_config"] = qc
    (dst / "config.json").write_text(json.dumps(cfg))
    for f in Path(src).iterdir():
        if f.name.startswith("tokenizer") or f.name == "generation_config.json":
            shutil.copy(f, dst / f.name)


def quantize_checkpoint(src: str, dst: Path, fmt: str) -> torch.nn.Module:
    """Write `src` in format `fmt` to `dst`; returns the transformers model of the dequantized
    weights (the reference)."""
    import transformers
    from safetensors.torch import load_file
    writer, qc = FORMATS[fmt]
    dst.mkdir(parents=True, exist_ok=True)
    state = load_file(str(Path(src) / "model.safetensors"))
    out, deq = {}, {}
    for name, t in state.items():
        if is_linear(name):
            tensors, d = writer(t.float())
            base = name[:-len("weight")]
            out.update({base + k: v.contiguous() for k, v in tensors.items()})
            deq[name] = d.to(t.dtype).contiguous()
        else:
            out[name] = t
            deq[name] = t
    write_quantized_dir(src, dst, out, qc)
    ref_dir = dst.parent / (dst.name + "-dequantized")
    shutil.copytree(src, ref_dir)
    save_file(deq, str(ref_dir / "model.safetensors"))
    # eager experts: each expert through F.linear, where the FP8 reference hooks in
    return transformers.AutoModelForCausalLM.from_pretrained(
        ref_dir, dtype=torch.float32, experts_implementation="eager").eval()


def fake_quant_rows(x: torch.Tensor, group: int | None) -> torch.Tensor:
    """Dynamic e4m3 activation quantization, per token (or per 1 x group), then back to fp32."""
    shape = x.shape
    xf = x.float().reshape(-1, shape[-1] if group is None else group)
    s = xf.abs().amax(-1, keepdim=True).clamp(min=1e-12) / 448
    q = (xf * (1 / s)).clamp(-448, 448).to(FP8).float() * s
    return q.reshape(shape).to(x.dtype)


class fake_quant_activations:
    """While active, every F.linear on a quantized weight of `model` (nn.Linear layers and the
    experts' stacked weights alike) first quantizes its input as the FP8 scheme does."""

    def __init__(self, model, group: int | None):
        quantized = [p for n, p in model.named_parameters()
                     if ".experts." in n or any(f".{k}." in n + "." for k in LINEARS)]
        self.storages = {p.untyped_storage().data_ptr() for p in quantized}
        self.group = group

    def __enter__(self):
        self.orig = torch.nn.functional.linear

        def linear(x, w, b=None):
            if w.untyped_storage().data_ptr() in self.storages:
                x = fake_quant_rows(x, self.group)
            return self.orig(x, w, b)
        torch.nn.functional.linear = linear

    def __exit__(self, *exc):
        torch.nn.functional.linear = self.orig


def hf_greedy(model, prompt):
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW,
                         do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def greedy(llm):
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                        SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True))
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """Unquantized tiny checkpoints with shapes the 128-wide blocks and groups divide."""
    cache = {}

    def get(arch, **kw):
        key = (arch, tuple(sorted(kw.items())))
        if key not in cache:
            extra = dict(moe_intermediate_size=256, head_dim=64) if arch == "Qwen3MoeForCausalLM" else {}
            cache[key] = make_checkpoint(tmp_path_factory.mktemp(arch), arch, **{**SIZES, **extra, **kw})
        return cache[key]
    return get


CASES = [("LlamaForCausalLM", f) for f in FORMATS] + [
    ("Qwen3ForCausalLM", "fp8-block"), ("Qwen3ForCausalLM", "gptq-sym"),
    ("Qwen3MoeForCausalLM", "fp8-block"), ("Qwen3MoeForCausalLM", "fp8-tensor"),
    # 4-bit experts (issue #14): Qwen3-30B-A3B-GPTQ-Int4's format, AWQ, GPTQ zero points + act-order
    ("Qwen3MoeForCausalLM", "gptq-sym"), ("Qwen3MoeForCausalLM", "awq"),
    ("Qwen3MoeForCausalLM", "gptq-zp-actorder"), ("Qwen3MoeForCausalLM", "ct-w4a16")]


@pytest.mark.parametrize("arch, fmt", CASES, ids=[f"{a[:-11]}-{f}" for a, f in CASES])
def test_quantized_checkpoint_matches_dequantized_reference(base, tmp_path, arch, fmt):
    from test_parity import model_logits
    path = tmp_path / fmt
    ref = quantize_checkpoint(base(arch), path, fmt)
    llm = LLM(str(path), dtype="float32", max_num_seqs=4)
    ours = greedy(llm)
    four_bit = fmt.startswith(("gptq", "awq", "ct-w4"))
    # FP8: the reference quantizes its activations the same way (in plain torch, above)
    group = 128 if fmt == "fp8-block" else None
    with fake_quant_activations(ref, group) if not four_bit else contextlib.nullcontext():
        theirs = [hf_greedy(ref, p) for p in PROMPTS]
        with torch.no_grad():
            refs = [ref(torch.tensor([p])).logits[0, -1] for p in PROMPTS]
    errs = [float((model_logits(llm, p) - r).norm() / r.norm()) for p, r in zip(PROMPTS, refs)]
    if four_bit:
        assert ours == theirs
        assert max(errs) < 1e-5, errs
    else:  # see LOGIT_TOL: most prompts exact, every prompt close
        exact = [o == t and e < LOGIT_TOL for o, t, e in zip(ours, theirs, errs)]
        need = 1 if "Moe" in arch else 2  # MoE routing amplifies ties further
        assert sum(exact) >= need and max(errs) < LOGIT_TIE_TOL, (errs, ours, theirs)


def test_quantized_layers_are_what_the_checkpoint_says(base, tmp_path):
    path = tmp_path / "q"
    quantize_checkpoint(base("Qwen3MoeForCausalLM"), path, "fp8-block")
    llm = LLM(str(path), dtype="float32")
    m = llm.engine.executor.runner.model
    layer = m.model.layers["0"]
    assert layer.self_attn.qkv_proj.weight.dtype == FP8
    assert layer.self_attn.qkv_proj.weight_scale_inv.shape == (4, 2)  # (256 + 2*128) / 128, 256 / 128
    assert layer.mlp.experts.w13.dtype == FP8 and layer.mlp.experts.w13_scale.shape == (8, 4, 2)
    assert m.lm_head.weight.dtype == torch.float32  # the head stays dense


def test_fp8_quantization_at_load_time():
    """`--quantization fp8` on a 16-bit checkpoint: per-channel FP8 weights, same story."""
    llm = LLM(quantization="fp8")
    lin = llm.engine.executor.runner.model.model.layers["0"].mlp.down_proj
    assert lin.weight.dtype == FP8 and lin.weight_scale.shape == (lin.weight.shape[0],)
    dense = LLM()
    sp = SamplingParams(temperature=0, max_tokens=12)
    a = llm.generate("Once upon a time", sp)[0].outputs[0].token_ids
    b = dense.generate("Once upon a time", sp)[0].outputs[0].token_ids
    assert a[:6] == b[:6]  # measured: the first 16 agree on stories260K


def test_bench_floor_counts_quantized_bytes(base, tmp_path):
    """The benchmarks' floor reads quantized weights at their width (FP8: 1 byte and the scales;
    GPTQ: half a byte, the scales and zero points), the head at the model dtype."""
    from rankserve.runtime.bench import common
    from rankserve.runtime.bench.throughput import engine_runner
    dense = engine_runner(LLM(base("LlamaForCausalLM"), dtype="float32"))
    assert common.byte_widths(dense) == {"linear": 4.0, "kv": 4}
    fp8 = engine_runner(LLM(base("LlamaForCausalLM"), dtype="float32", quantization="fp8"))
    assert 1.0 < common.byte_widths(fp8)["linear"] < 1.02  # + fp32 scales per row
    quantize_checkpoint(base("LlamaForCausalLM"), tmp_path / "g", "gptq-sym")
    w4 = common.byte_widths(engine_runner(LLM(str(tmp_path / "g"), dtype="float32")))
    assert 0.5 < w4["linear"] < 0.55  # + fp32 scales per 128-group
    stats = common.model_stats(fp8.hf_config)
    ceil = {"hbm_GBps": 1.0, "matmul_TFLOPs": 1e9}
    a = common.physical_floor(stats, [8], [4], [8, 1, 1, 1], 4, ceil)
    b = common.physical_floor(stats, [8], [4], [8, 1, 1, 1], 4, ceil, widths=common.byte_widths(fp8))
    head = 4 * stats.head_params * 4
    assert b["bytes_weights"] == pytest.approx((a["bytes_weights"] - head) * common.byte_widths(fp8)["linear"] / 4
                                               + head)


@pytest.mark.parametrize("qc, words", [
    ({"quant_method": "bitsandbytes"}, "unsupported quantization method 'bitsandbytes'"),
    ({"quant_method": "gptq", "bits": 8}, "gptq with 8 bits"),
    ({"quant_method": "awq", "version": "gemv"}, "awq version 'gemv'"),
    ({"quant_method": "fp8", "fmt": "e5m2"}, "fp8 format 'e5m2'"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"g": {
        "targets": ["Linear"], "weights": {"num_bits": 8, "type": "int", "strategy": "group"}}}},
     "8-bit int weights"),
])
def test_unsupported_schemes_are_clear_errors(tmp_path, qc, words):
    assert_config_refused(tmp_path, qc, words)


def assert_config_refused(tmp_path, qc, words):
    """stories260K with `qc` as its quantization_config: LLM refuses it, naming `words`."""
    shutil.copytree(STORIES_EMBEDDED, tmp_path / "m")
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    cfg["quantization_config"] = qc
    (tmp_path / "m" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=words):
        LLM(str(tmp_path / "m"))


def test_flag_disagreeing_with_checkpoint_is_an_error(base, tmp_path):
    quantize_checkpoint(base("LlamaForCausalLM"), tmp_path / "g", "gptq-sym")
    with pytest.raises(ValueError, match="--quantization fp8 does not match"):
        LLM(str(tmp_path / "g"), quantization="fp8")


def test_vllm_kernel_named_flags_take_their_format(base, tmp_path):
    """vLLM's `--quantization gptq_marlin` / `awq_marlin` name a kernel for the GPTQ / AWQ
    format: here they load those checkpoints (rankserve's kernels), and still must match."""
    quantize_checkpoint(base("LlamaForCausalLM"), tmp_path / "g", "gptq-sym")
    quantize_checkpoint(base("LlamaForCausalLM"), tmp_path / "a", "awq")
    assert greedy(LLM(str(tmp_path / "g"), quantization="gptq_marlin")) == \
        greedy(LLM(str(tmp_path / "g")))
    assert greedy(LLM(str(tmp_path / "a"), quantization="awq_marlin")) == \
        greedy(LLM(str(tmp_path / "a")))
    with pytest.raises(ValueError, match="--quantization awq_marlin does not match"):
        LLM(str(tmp_path / "g"), quantization="awq_marlin")


@pytest.mark.mpi
@pytest.mark.skipif(shutil.which("mpiexec") is None, reason="mpiexec not on PATH")
@pytest.mark.parametrize("arch, fmt, ep", [
    ("LlamaForCausalLM", "fp8-block", False), ("LlamaForCausalLM", "gptq-zp-actorder", False),
    ("LlamaForCausalLM", "awq", False), ("LlamaForCausalLM", "ct-w4a16", False),
    ("Qwen3MoeForCausalLM", "fp8-block", False),
    ("Qwen3MoeForCausalLM", "fp8-block", True),
    ("Qwen3MoeForCausalLM", "gptq-sym", False), ("Qwen3MoeForCausalLM", "awq", True)])
def test_tp2_loads_quantized_checkpoints_like_one_rank(base, tmp_path, arch, fmt, ep):
    """Same tokens as one rank. Block FP8 and 4-bit are exact under any sharding; per-token FP8
    (per-tensor / per-channel weights) is not checked here: a row-parallel layer quantizes each
    rank's slice of a token with that slice's own scale (as vLLM does), which is not the
    one-rank scale, so its tokens may drift from one rank's on this chaotic random model."""
    path = tmp_path / fmt
    # 4 kv heads: each rank's k and v (2 x 64 rows) are whole 128-row blocks
    quantize_checkpoint(base(arch, num_key_value_heads=4), path, fmt)
    prompts = ["Once upon a time", "The little dog ran"]
    cmd = ["mpiexec", "-n", "2", sys.executable, "-m", "rankserve.launch", "generate", str(path),
           "--tp", "2", "--dtype", "float32", "--max-tokens", "10", "--ignore-eos", "--json",
           *(["--enable-expert-parallel"] if ep else [])]
    for p in prompts:
        cmd += ["--prompt", p]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    tp = [json.loads(x)["token_ids"] for x in r.stdout.splitlines() if x.startswith("{")]
    llm = LLM(str(path), dtype="float32")
    one = [o.outputs[0].token_ids for o in llm.generate(prompts, SamplingParams(
        temperature=0, max_tokens=10, ignore_eos=True))]
    assert tp == one
