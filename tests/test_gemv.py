"""Skinny-GEMM ops (kernels/gemv.py) vs their plain-torch references.

CPU: the Triton kernels run in Triton's interpreter in one spawned worker (TRITON_INTERPRET must be
set before triton is imported: the `interp` fixture of conftest.py). M <= MAX_M takes the skinny kernel (one program
per row and column tile), M > MAX_M the prologue kernel + F.linear. Rounding
is checked exactly in fp32 / fp16; the interpreter truncates fp32 -> bf16 instead of rounding to
nearest, so bf16 there is checked to a tolerance (exact on the GPU).
GPU (`-m gpu`): bf16 at Llama-3.1-8B decode sizes, plus CUDA-graph capture.
"""
from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from rankserve.kernels import gemv
from rankserve.kernels.attention import rms_norm

gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
EPS = 1e-5


def make_inputs(M, N, K, dtype, bias, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)

    def r(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(dtype).to(device)
    return dict(x=r(M, K), h=r(M, K), delta=r(M, K), norm_w=1 + r(K, scale=0.1), gu=r(M, 2 * K),
                w=r(N, K, scale=K ** -0.5), bias=r(N) if bias else None)


def check(out, ref, dtype, exact=False, bf16_tol=2e-2):
    if dtype == torch.bfloat16:  # interpreter bf16: each truncating cast adds up to 1 ulp (~0.5%)
        assert (out.float() - ref.float()).norm() <= bf16_tol * ref.float().norm()
    elif exact:
        assert torch.equal(out, ref)
    else:
        tol = 1e-5 if dtype == torch.float32 else 2e-3
        torch.testing.assert_close(out, ref, atol=tol, rtol=tol)


def ops_case(M, N, K, dtype, bias):
    assert gemv._INTERPRET, "the ops would compare the reference with itself"
    gemv.MAX_M = 4  # the multi-row grid too (RANKSERVE_SKINNY_MAX_M; this worker only)
    t = make_inputs(M, N, K, dtype, bias, seed=M * 1000 + N + K)
    w, b = t["w"], t["bias"]
    check(gemv.skinny_linear(t["x"], w, b), gemv.ref_skinny_linear(t["x"], w, b), dtype)

    h = t["h"].clone()
    y, h_new = gemv.add_rms_norm_linear(h, t["delta"], t["norm_w"], EPS, w, b)
    ref_y, ref_h = gemv.ref_add_rms_norm_linear(t["h"], t["delta"], t["norm_w"], EPS, w, b)
    assert torch.equal(h, t["h"]), "h must not be modified"
    check(h_new, ref_h, dtype, exact=True)
    check(y, ref_y, dtype)

    gu, w_down = t["gu"], t["w"]  # w is [N, K]: gu [M, 2K] -> [M, N]
    check(gemv.silu_mul_linear(gu, w_down, b), gemv.ref_silu_mul_linear(gu, w_down, b), dtype)

    # SwiGLU epilogue: w as gate_up [2 * (N / 2), K], its bias split the same way
    act, h_new = gemv.add_rms_norm_swiglu(t["h"], t["delta"], t["norm_w"], EPS, w, b)
    ref_act, ref_h = gemv.ref_add_rms_norm_swiglu(t["h"], t["delta"], t["norm_w"], EPS, w, b)
    assert act.shape == (M, N // 2)
    check(h_new, ref_h, dtype, exact=True)
    check(act, ref_act, dtype, bf16_tol=4e-2)  # two more truncating casts (silu, product)


F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16


# (M, N, K): ragged against the interpreter's BLOCK_N=16, BLOCK_K=32; M > MAX_M: fallback
@pytest.mark.parametrize("M,N,K,dtype,bias", [
    (1, 200, 100, F32, True), (1, 72, 136, BF16, False), (1, 200, 100, F16, True),
    (3, 200, 100, F32, False), (3, 40, 136, BF16, True), (4, 24, 96, F16, False),
    (16, 200, 100, F32, True), (16, 72, 136, BF16, False), (40, 24, 100, F16, False)])
def test_ops_match_reference(interp, M, N, K, dtype, bias):
    assert gemv.MAX_M == 1  # the default
    interp(ops_case, M, N, K, dtype, bias)


def layer(t):
    """One Llama decoder layer's GEMM chain with the fused ops (attention left out)."""
    H = t["h"].shape[1]
    qkv, h = gemv.add_rms_norm_linear(t["h"], t["delta"], t["norm_w"], EPS, t["w_qkv"], t["b_qkv"])
    attn = gemv.skinny_linear(qkv[:, :H], t["w_o"])  # a strided view, like q out of qkv
    gu, h = gemv.add_rms_norm_linear(h, attn, t["norm_w2"], EPS, t["w_gu"])
    return h, gemv.silu_mul_linear(gu, t["w_down"], t["b_down"])


def compile_case():
    import torch._dynamo.utils as dynamo_utils
    H, I = 48, 80
    g = torch.Generator().manual_seed(3)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    weights = dict(norm_w=1 + 0.1 * r(H), norm_w2=1 + 0.1 * r(H), w_qkv=r(2 * H, H) / 7,
                   b_qkv=r(2 * H), w_o=r(H, H) / 7, w_gu=r(2 * I, H) / 7, w_down=r(H, I) / 9,
                   b_down=r(H))
    compiled = torch.compile(layer, fullgraph=True, dynamic=True)
    dynamo_utils.counters.clear()
    assert gemv._INTERPRET
    gemv.MAX_M = 4  # this worker only
    for M in (3, 40, 1):  # skinny kernel, fallback, skinny kernel at M == 1
        t = dict(weights, h=r(M, H), delta=r(M, H))
        for got, want in zip(compiled(t), layer(t)):
            torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    # one graph for every M > 1 (M=1 is specialised by dynamo, a second graph but no break)
    assert dynamo_utils.counters["stats"]["unique_graphs"] <= 2


def test_compile_fullgraph_dynamic(interp):
    interp(compile_case)


def test_ops_cpu_are_reference_and_fake():
    """Without the interpreter the ops are the references; the fake impls give the shapes."""
    t = make_inputs(3, 20, 12, torch.float32, True)
    args = (t["h"], t["delta"], t["norm_w"], EPS, t["w"], t["bias"])
    y, h_new = torch.ops.rankserve.add_rms_norm_linear(*args)
    ref_y, ref_h = gemv.ref_add_rms_norm_linear(*args)
    assert torch.equal(y, ref_y) and torch.equal(h_new, ref_h)
    with FakeTensorMode() as mode:
        fake = {k: mode.from_tensor(v) if v is not None else None for k, v in t.items()}
        y = torch.ops.rankserve.skinny_linear(fake["x"], fake["w"], fake["bias"])
        y2, h2 = torch.ops.rankserve.add_rms_norm_linear(
            fake["h"], fake["delta"], fake["norm_w"], EPS, fake["w"])
        y3 = torch.ops.rankserve.silu_mul_linear(fake["gu"], fake["w"])
        y4, h4 = torch.ops.rankserve.add_rms_norm_swiglu(
            fake["h"], fake["delta"], fake["norm_w"], EPS, fake["w"])
    assert y.shape == y2.shape == y3.shape == (3, 20) and h2.shape == h4.shape == (3, 12)
    assert y4.shape == (3, 10)


# ----------------------------------------------------------------------------------------------
# GPU, bf16, Llama-3.1-8B sizes (run on the H200 with `pytest -m gpu`)
# ----------------------------------------------------------------------------------------------

def gpu_close(out, ref):
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)


@gpu
@needs_cuda
@pytest.mark.parametrize("M", [1, 2, 4, 16])  # 16: fallback
@pytest.mark.parametrize("N,K", [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)])
def test_gpu_ops_bf16(M, N, K):
    t = make_inputs(M, N, K, torch.bfloat16, bias=K == 4096 and N == 6144, device="cuda", seed=M)
    w, b = t["w"], t["bias"]
    gpu_close(gemv.skinny_linear(t["x"], w, b), gemv.ref_skinny_linear(t["x"], w, b))
    y, h_new = gemv.add_rms_norm_linear(t["h"], t["delta"], t["norm_w"], EPS, w, b)
    ref_y, ref_h = gemv.ref_add_rms_norm_linear(t["h"], t["delta"], t["norm_w"], EPS, w, b)
    assert torch.equal(h_new, ref_h)
    gpu_close(y, ref_y)
    gu = torch.randn(M, 2 * K, device="cuda", dtype=torch.bfloat16)
    gpu_close(gemv.silu_mul_linear(gu, w, b), gemv.ref_silu_mul_linear(gu, w, b))
    act, h_new = gemv.add_rms_norm_swiglu(t["h"], t["delta"], t["norm_w"], EPS, w, b)
    ref_act, ref_h = gemv.ref_add_rms_norm_swiglu(t["h"], t["delta"], t["norm_w"], EPS, w, b)
    assert torch.equal(h_new, ref_h)
    gpu_close(act, ref_act)


@gpu
@needs_cuda
def test_gpu_prologues_bf16_exact():
    """The fused prologues round like the model code: the large-M prologue kernels (the same
    math as the skinny kernel's) match RMSNorm and silu * up bit for bit (up to rare 1-ulp
    differences of rsqrt / sigmoid)."""
    t = make_inputs(64, 8, 4096, torch.bfloat16, False, device="cuda")
    x, h_new = gemv.add_rms_norm_triton(t["h"], t["delta"], t["norm_w"], EPS)
    assert torch.equal(h_new, t["h"] + t["delta"])
    ref = rms_norm(h_new, t["norm_w"], EPS)
    assert (x != ref).float().mean() < 1e-3
    assert (gemv.silu_mul_triton(t["gu"]) != gemv.silu_mul_ref(t["gu"])).float().mean() < 1e-3


@gpu
@needs_cuda
def test_gpu_cuda_graph_capture():
    t = make_inputs(4, 4096, 4096, torch.bfloat16, False, device="cuda")
    args = (t["h"], t["delta"], t["norm_w"], EPS, t["w"])
    gemv.add_rms_norm_linear(*args)  # compile outside capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y, h_new = gemv.add_rms_norm_linear(*args)
    t["h"].normal_()
    graph.replay()
    ref_y, ref_h = gemv.ref_add_rms_norm_linear(t["h"], t["delta"], t["norm_w"], EPS, t["w"])
    assert torch.equal(h_new, ref_h)
    gpu_close(y, ref_y)


@gpu
@needs_cuda
def test_gpu_pdl_chain_in_a_graph_equals_plain(monkeypatch):
    """Programmatic dependent launch (RANKSERVE_PDL): a decode layer's chain of skinny GEMVs,
    each reading the one before's output, captured in a CUDA graph and replayed on new inputs,
    gives exactly the tokens of plain launches (the first weight tile, read before the wait, is
    summed in the same order)."""
    from rankserve.kernels import pdl
    K, N = 4096, 4096
    t = make_inputs(1, N, K, torch.bfloat16, False, device="cuda")
    w2 = make_inputs(1, 2 * K, K, torch.bfloat16, False, device="cuda", seed=1)["w"]

    def chain():
        y, h_new = gemv.add_rms_norm_linear(t["h"], t["delta"], t["norm_w"], EPS, t["w"])
        gu = gemv.skinny_linear(y, w2)  # [1, 2K]
        return gemv.silu_mul_linear(gu, t["w"][:, :K].contiguous()), h_new

    outs = []
    for on in (False, True):
        monkeypatch.setattr(pdl, "ENABLED", on)
        chain()  # compile outside capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = chain()
        t["h"].copy_(make_inputs(1, N, K, torch.bfloat16, False, device="cuda", seed=5)["h"])
        graph.replay()
        torch.cuda.synchronize()
        outs.append([o.clone() for o in out])
    assert all(torch.equal(a, b) for a, b in zip(*outs))


def swiglu_engine_case(path: str):
    """Runs in the Triton-interpreter worker: a Llama model's decode steps (one request, so the
    skinny kernels) with RANKSERVE_SWIGLU_EPILOGUE give the greedy tokens and logprobs of the
    default path, and the epilogue op really ran."""
    import os

    from rankserve import LLM, SamplingParams
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=0)
    prompt = [{"prompt_token_ids": list(range(3, 12))}]
    calls, real = [], gemv.add_rms_norm_swiglu_triton
    gemv.add_rms_norm_swiglu_triton = lambda *a: calls.append(a[0].shape[0]) or real(*a)
    runs = []
    try:
        for on in ("0", "1"):
            os.environ["RANKSERVE_SWIGLU_EPILOGUE"] = on
            out = LLM(path, enforce_eager=True, max_num_seqs=2,
                      kv_cache_memory_gb=0.01).generate(prompt, sp)[0].outputs[0]
            runs.append((out.token_ids, [d[t].logprob for t, d in zip(out.token_ids, out.logprobs)]))
    finally:
        gemv.add_rms_norm_swiglu_triton = real
        os.environ.pop("RANKSERVE_SWIGLU_EPILOGUE")
    assert 1 in calls, "the decode steps did not take the SwiGLU epilogue"
    (ref_ids, ref_lp), (got_ids, got_lp) = runs
    assert got_ids == ref_ids
    torch.testing.assert_close(torch.tensor(got_lp), torch.tensor(ref_lp), atol=1e-4, rtol=1e-4)


def test_swiglu_epilogue_engine_tokens(checkpoint, interp):
    interp(swiglu_engine_case, checkpoint("LlamaForCausalLM"))
