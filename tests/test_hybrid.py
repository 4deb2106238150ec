"""Hybrid Mamba2 + attention family (Nemotron-H): greedy parity with transformers (fp32, tiny
random config), chunked prefill equal to unchunked, batches mixing prefill and decode."""
import gc
import shutil

import pytest
import torch

from rankserve import LLM, SamplingParams

from rankserve.models.layers import AttnMeta

from test_parity import hf_greedy

PROMPTS = [list(range(3, 43)), [1, 5, 9, 200, 31] * 5, [1, 300, 7]]
NEW = 12


def test_nemotron_h_parity(checkpoint):
    import transformers
    path = checkpoint("NemotronHForCausalLM")
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    params = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
    expected = [hf_greedy(hf, p) for p in PROMPTS]
    whole = LLM(path, dtype="float32", max_num_seqs=4)
    chunked = LLM(path, dtype="float32", max_num_seqs=4, max_num_batched_tokens=16)
    for llm in (whole, chunked):
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
        for p, o, e in zip(PROMPTS, outs, expected):
            assert o.outputs[0].token_ids == e, f"prompt of {len(p)} tokens"
    for p in PROMPTS[:2]:
        with torch.no_grad():
            ref = hf(torch.tensor([p])).logits[0, -1]
        torch.testing.assert_close(last_logits(whole, p), ref, atol=1e-4, rtol=1e-4)


def last_logits(llm, prompt):
    """Last-position logits of one prefill straight through the model (state slot 0, fresh)."""
    runner = llm.engine.executor.runner
    n, bs = len(prompt), runner.block_size
    attn = AttnMeta(torch.arange(n), torch.tensor([0, n], dtype=torch.int32),
                    torch.tensor([n], dtype=torch.int32),
                    torch.arange(-(-n // bs), dtype=torch.int32)[None],
                    state_idx=torch.zeros(1, dtype=torch.int32))
    with torch.inference_mode():
        h = runner.model(torch.tensor(prompt), torch.arange(n), attn)
        return runner.model.compute_logits(h[-1:])[0]


def test_nemotron_h_preemption_and_mixed_batches(checkpoint):
    """A KV budget so tight that requests are preempted (their Mamba2 states restart from zero
    on recompute) and slots are reused, with chunked prefill beside decodes: the same greedy
    tokens as an unconstrained engine."""
    path = checkpoint("NemotronHForCausalLM")
    prompts = [[3 + (7 * i + j) % 500 for j in range(10 + 6 * i)] for i in range(6)]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    free = LLM(path, dtype="float32", max_num_seqs=6, max_model_len=64)
    want = [o.outputs[0].token_ids for o in free.generate(
        [{"prompt_token_ids": p} for p in prompts], params)]
    tight = LLM(path, dtype="float32", max_num_seqs=4, max_model_len=64, block_size=8,
                num_gpu_blocks_override=9, max_num_batched_tokens=16)
    got = [o.outputs[0].token_ids for o in tight.generate(
        [{"prompt_token_ids": p} for p in prompts], params)]
    assert got == want
    assert tight.engine.scheduler.num_preemptions > 0
    assert not tight.engine.scheduler.kv.enable_caching  # off for recurrent models


@pytest.mark.mpi
@pytest.mark.skipif(shutil.which("mpiexec") is None, reason="mpiexec not on PATH")
@pytest.mark.parametrize("groups,n,flags", [(2, 4, ["--tp", "2", "--pp", "2"]), (1, 2, ["--tp", "2"])])
def test_nemotron_h_tp2_matches_single_rank(checkpoint, groups, n, flags):
    """Mamba2 mixer under --tp 2: heads and their state split; 2 groups: one B/C group and one
    norm group per rank; 1 group: B/C replicated, the norm's group spread over both ranks.
    With --pp 2 the second stage (Mamba2 + MLP blocks) has no KV cache at all."""
    from test_multirank import mpi_generate, single
    model = checkpoint("NemotronHForCausalLM", n_groups=groups)
    assert mpi_generate(n, model, *flags) == single(model)


class EagerReplay:
    """A CUDA graph's stand-in on the CPU: `replay` runs the forward again on the arguments it
    was "captured" with (views of the persistent input buffers) into the captured output, so
    whatever a real graph would bake in at capture (shapes, Python values, the mode) stays
    fixed, and everything else must come from the buffers each step fills."""

    def __init__(self, forward, args):
        self.forward, self.args = forward, args
        self.out = forward(*args)
        self.replays = 0

    def replay(self):
        self.replays += 1
        self.out.copy_(self.forward(*self.args))


def test_nemotron_h_graph_replay_path_equals_eager(checkpoint):
    """The decode-graph path of the model runner (CompiledModel._run_graph: batches padded to a
    captured size, padding requests without KV or state slots, state slots read from the
    persistent buffers) on the CPU, with replays standing in for CUDA graphs: the same greedy
    tokens as the eager path, with decode batches of 1 to 4 requests padded to 2 or 8."""
    path = checkpoint("NemotronHForCausalLM")
    prompts = [[3 + (5 * i + j) % 400 for j in range(6 + 7 * i)] for i in range(4)]
    params = [SamplingParams(temperature=0, max_tokens=6 + 3 * i, ignore_eos=True) for i in range(4)]
    kw = dict(dtype="float32", max_num_seqs=8, max_num_batched_tokens=16)
    want = [o.outputs[0].token_ids for o in LLM(path, **kw).generate(
        [{"prompt_token_ids": p} for p in prompts], params)]
    llm = LLM(path, **kw)
    cm = llm.engine.executor.runner.compiled_model
    assert not cm.graphs  # CPU: nothing captured
    with torch.inference_mode():
        for bs in (8, 2):
            g = EagerReplay(cm.forward, cm.graph_inputs(bs))
            cm.graphs[bs] = (g, g.out)
    got = [o.outputs[0].token_ids for o in llm.generate(
        [{"prompt_token_ids": p} for p in prompts], params)]
    assert got == want
    assert cm.graphs[8][0].replays > 0 and cm.graphs[2][0].replays > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("level", [1, 2])
def test_nemotron_h_cuda_graphs_match_eager_gpu(checkpoint, level):
    """On the GPU: decode CUDA graphs (Triton conv1d update and SSD update kernels, state slots
    from the persistent buffers, padded batches) give the eager path's greedy tokens (fp32),
    and bf16 stays close to them."""
    path = checkpoint("NemotronHForCausalLM")
    prompts = [{"prompt_token_ids": [3 + (5 * i + j) % 400 for j in range(6 + 37 * i)]} for i in range(6)]
    params = [SamplingParams(temperature=0, max_tokens=8 + 5 * i, ignore_eos=True) for i in range(6)]
    common = dict(max_num_seqs=8, gpu_memory_utilization=0.3)

    def run(llm, graphs=False):
        """The engine's tokens; the engine is let go before the next one is made (each reserves
        a fraction of the whole device, and the memory profile counts what others still hold)."""
        assert bool(llm.engine.executor.runner.compiled_model.graphs) == graphs
        out = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        del llm
        gc.collect()
        torch.cuda.empty_cache()
        return out
    eager = run(LLM(path, dtype="float32", enforce_eager=True, **common))
    assert run(LLM(path, dtype="float32", compilation_level=level, **common), graphs=True) == eager
    eager16 = run(LLM(path, dtype="bfloat16", enforce_eager=True, **common))
    fast16 = run(LLM(path, dtype="bfloat16", compilation_level=level, **common), graphs=True)
    assert sum(a[:4] == b[:4] for a, b in zip(fast16, eager16)) >= len(eager16) - 2  # near-ties may flip


def test_shipped_hybrid_config_and_its_floor():
    """nemotron-h-8b (the bench config): Nemotron-H-8B's 8,100,852,736 parameters on the meta
    device, 24 Mamba2 / 4 attention / 24 MLP blocks; the floor counts KV for the 4 attention
    layers only, the recurrent state once written by the prefill and read + written by each
    decode step, and the SSM FLOPs."""
    from transformers import AutoConfig

    from rankserve.runtime.bench import common
    path, named = common.resolve_model("nemotron-h-8b")
    cfg = AutoConfig.from_pretrained(path)
    assert named and cfg.architectures == ["NemotronHForCausalLM"]
    s = common.model_stats(cfg)
    assert s.num_params == 8_100_852_736
    assert s.body_params == s.num_params - 2 * 131072 * 4096  # embedding and head apart
    assert s.num_kv_layers == 4 and s.kv_bytes_per_token(2) == 2 * 4 * 8 * 128 * 2
    conv, ssm = 3 * (8192 + 2 * 8 * 128), 128 * 64 * 128  # per layer: K - 1 rows; H x P x N
    assert s.state_bytes(2) == 24 * (conv * 2 + ssm * 4) and s.state_bytes(2, 2) == 24 * (conv + ssm) * 2
    assert s.ssm_flops_per_token == 24 * (4 * ssm + 2 * 4 * (8192 + 2 * 8 * 128))
    ceil = {"hbm_GBps": 1e-9, "matmul_TFLOPs": 1e-12}  # 1 byte/s and 1 FLOP/s
    f = common.physical_floor(s, [3], [2], [3, 1], 2, ceil)
    assert f["bytes_state"] == 3 * s.state_bytes(2)  # prefill writes; the decode step reads + writes
    assert f["flops_ssm"] == 4 * s.ssm_flops_per_token  # 3 prompt tokens + 1 decode token
    assert f["bytes_kv_write"] == 4 * s.kv_bytes_per_token(2)
    assert f["flops_attention"] == 4 * 128 * 32 * 4 * (1 + 2 + 3 + 4)
    half = common.physical_floor(s, [3], [2], [3, 1], 2, ceil, widths=dict(linear=2, kv=2, ssm=2))
    assert half["bytes_state"] == 3 * s.state_bytes(2, 2)  # --mamba-ssm-cache-dtype auto (bf16)


def test_mamba_ssm_cache_dtype(checkpoint):
    """--mamba-ssm-cache-dtype: float32 SSM states by default; auto stores them in the model
    dtype (bf16 here: half the state memory), and greedy decoding stays close."""
    path = checkpoint("NemotronHForCausalLM")
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    runs = {}
    for flag, want in (("float32", torch.float32), ("auto", torch.bfloat16)):
        llm = LLM(path, dtype="bfloat16", max_num_seqs=4, mamba_ssm_cache_dtype=flag)
        runner = llm.engine.executor.runner
        assert {m.ssm_state.dtype for m in runner.model.mamba_layers()} == {want}
        runs[flag] = ([o.outputs[0].token_ids for o in llm.generate(prompts, params)], runner.state_bytes())
    (fp32, fp32_bytes), (bf16, bf16_bytes) = runs["float32"], runs["auto"]
    assert sum(a[:3] == b[:3] for a, b in zip(fp32, bf16)) >= len(PROMPTS) - 1  # near-ties may flip
    elems = 2 * 4 * 16 * 16 * 4  # 2 Mamba2 layers x 4 heads x head_dim 16 x state 16, 4 slots
    assert fp32_bytes - bf16_bytes == 2 * elems  # 2 bytes saved per element


def test_host_kv_tier_is_refused_for_hybrid_models(checkpoint):
    """The host KV tier keeps prefix-cache blocks; prefix caching is off for recurrent models,
    so --kv-offload-size is a clear startup error for them rather than a silent no-op."""
    with pytest.raises(ValueError, match="kv-offload-size"):
        LLM(checkpoint("NemotronHForCausalLM"), dtype="float32", max_num_seqs=4, kv_offload_size=0.01,
            kv_cache_memory_gb=0.01)


def test_sleep_gives_back_the_recurrent_states(checkpoint):
    """Sleep mode gives the Mamba2 state slots back with the KV cache (they are per-request
    context, like it: 97 MiB a slot for Nemotron-H-8B, 24 GiB at --max-num-seqs 256 stayed on
    the device) and wake-up makes them anew: the same greedy tokens after."""
    llm = LLM(checkpoint("NemotronHForCausalLM"), dtype="float32", max_num_seqs=4, enable_sleep_mode=True)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    layers = llm.engine.executor.runner.model.mamba_layers()
    llm.sleep(1)
    assert [(m.conv_state.numel(), m.ssm_state.numel()) for m in layers] == [(0, 0)] * len(layers)
    llm.wake_up()
    assert all(m.ssm_state.dtype == torch.float32 and m.ssm_state.shape[0] == 4 for m in layers)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == want
