"""L2 prefetch of o_proj's weight during decode attention (kernels/l2_prefetch.py,
RANKSERVE_L2_PREFETCH): when it runs, and that it changes no bit of what the kernels compute.
The prefetch itself is inline PTX: the GPU tests (`-m gpu`) run it."""
from __future__ import annotations

import pytest
import torch

from rankserve.kernels import l2_prefetch, triton_attention as ta
from rankserve.runtime import envs

from test_kernels import make_qkv
from test_quantization import base, greedy  # noqa: F401  (the tiny checkpoints fixture)

gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_plan_only_for_small_cuda_batches(monkeypatch):
    w = torch.empty(64, 64)
    monkeypatch.setattr(l2_prefetch, "ENABLED", False)
    assert l2_prefetch.plan(w, 1)[2] == 0  # off by default
    monkeypatch.setattr(l2_prefetch, "ENABLED", True)
    assert l2_prefetch.plan(w, 1)[2] == 0  # not CUDA (the interpreter has no inline PTX)
    assert l2_prefetch.plan(None, 1)[2] == 0


def test_target_is_the_streamed_weight():
    lin = torch.nn.Linear(16, 8, bias=True)
    assert l2_prefetch.target_of(lin) is None  # CPU parameters: nothing to prefetch
    assert l2_prefetch.target_of(torch.nn.Module()) is None


def test_knob(monkeypatch):
    monkeypatch.setenv("RANKSERVE_L2_PREFETCH", "1")
    assert envs.get("RANKSERVE_L2_PREFETCH") is True
    monkeypatch.setenv("RANKSERVE_L2_PREFETCH", "maybe")
    with pytest.raises(ValueError, match="RANKSERVE_L2_PREFETCH"):
        envs.get("RANKSERVE_L2_PREFETCH")


@gpu
@needs_cuda
@pytest.mark.parametrize("T", [1, 16])
def test_gpu_prefetch_changes_nothing(T, monkeypatch):
    """prepare_qkv with the prefetch programs appended (a 64 MiB weight: more than the L2 share,
    so the byte cap applies) writes the same q and cache bits as without, eagerly and replayed
    from a CUDA graph."""
    monkeypatch.setattr(l2_prefetch, "ENABLED", True)
    qkv, positions, cos_sin, qn, kn, eps, caches, slots, H = make_qkv(
        T, 32, 8, 128, 64, 16, norm=True, dtype=torch.bfloat16, device="cuda")
    w = torch.randn(8192, 4096, dtype=torch.bfloat16, device="cuda")
    _, nbytes, programs = l2_prefetch.plan(w, T)
    assert programs > 0 and 0 < nbytes < w.numel() * 2
    q0 = ta.prepare_qkv(qkv, positions, cos_sin, qn, kn, eps, caches[0], caches[1], slots, H)
    q1 = ta.prepare_qkv(qkv, positions, cos_sin, qn, kn, eps, caches[2], caches[3], slots, H, prefetch=w)
    assert torch.equal(q0, q1) and torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        q2 = ta.prepare_qkv(qkv, positions, cos_sin, qn, kn, eps, caches[2], caches[3], slots, H, prefetch=w)
    caches[2].fill_(0)
    graph.replay()
    assert torch.equal(q2, q0) and torch.equal(caches[0], caches[2])
    assert l2_prefetch.plan(w, 17)[2] == 0  # larger batches: attention reads HBM itself


@gpu
@needs_cuda
def test_gpu_engine_same_tokens(base, monkeypatch):  # noqa: F811
    """A tiny Llama (CUDA graphs) decodes the same greedy tokens with RANKSERVE_L2_PREFETCH=1,
    whose attention layers are bound to their o_proj weights."""
    import gc

    from rankserve import LLM
    outs = {}
    for on in ("0", "1"):
        monkeypatch.setenv("RANKSERVE_L2_PREFETCH", on)
        llm = LLM(base("LlamaForCausalLM"), dtype="bfloat16", max_num_seqs=4, gpu_memory_utilization=0.3)
        layers = llm.engine.executor.runner.model.attention_layers()
        assert all((a.l2_prefetch is a.o_proj.weight) == (on == "1") for a in layers)
        outs[on] = greedy(llm)
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    l2_prefetch.ENABLED = False
    assert outs["0"] == outs["1"]
