"""torch.compile: the model forward traces with fullgraph=True and a dynamic token count, and the
runner compiles one graph shared by every decoder layer."""
import pytest
import torch

from rankserve.models.layers import AttnMeta
from rankserve.models.parallel import ParallelInfo
from rankserve.models.loader import build_model, load_hf_config, load_weights


def step_inputs(lens, ctx, bs, num_blocks):
    """A mixed batch: request i has ctx[i] cached tokens and lens[i] new ones."""
    T = sum(lens)
    qsl = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32)
    seq = torch.tensor([c + n for c, n in zip(ctx, lens)], dtype=torch.int32)
    maxb = int((seq.max() + bs - 1) // bs)
    table = torch.stack([torch.arange(i * maxb, (i + 1) * maxb) for i in range(len(lens))]).int()
    pos = torch.cat([torch.arange(c, c + n) for c, n in zip(ctx, lens)])
    req = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))
    slots = table[req, pos // bs].long() * bs + pos % bs
    assert table.max() < num_blocks
    return torch.randint(3, 500, (T,)), pos, AttnMeta(slots, qsl, seq, table)


def test_fullgraph_compile_matches_eager(checkpoint):
    path = checkpoint("Qwen3ForCausalLM")
    cfg = load_hf_config(path)
    model = build_model(cfg, ParallelInfo(), torch.float32, torch.device("cpu"))
    load_weights(model, path, progress=False)
    nb, bs = 32, 16
    for a in model.attention_layers():
        shape = (nb, bs, a.qkv_proj.num_kv_heads, a.head_dim)
        a.k_cache, a.v_cache = torch.zeros(shape), torch.zeros(shape)
    compiled = torch.compile(model.forward, fullgraph=True, dynamic=True)
    torch.manual_seed(0)
    for lens, ctx in (([5, 1, 3], [0, 7, 20]), ([9, 1, 1, 2], [3, 30, 0, 16])):
        ids, pos, attn = step_inputs(lens, ctx, bs, nb)
        with torch.inference_mode():
            eager = model(ids, pos, attn)
            got = compiled(ids, pos, attn)
        torch.testing.assert_close(got, eager, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("arch", ["Qwen3ForCausalLM", "Qwen3MoeForCausalLM"])
def test_runner_compiles_one_layer_graph_for_all_steps(checkpoint, arch):
    """Level 2 through the engine: every layer shares one compiled graph per attention mode
    (mixed, decode; the start-up warm-up compiles both), and prefill, chunked, mixed and decode
    steps of any size reuse them with no recompilation; greedy tokens equal eager."""
    import torch._dynamo.utils as dynamo_utils

    from rankserve import LLM, SamplingParams
    path = checkpoint(arch, num_hidden_layers=3)
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = [{"prompt_token_ids": list(range(3 + i, 20 + 9 * i))} for i in range(5)]
    common = dict(max_num_seqs=8, kv_cache_memory_gb=0.02, max_num_batched_tokens=48)
    eager = [o.outputs[0].token_ids for o in LLM(path, enforce_eager=True, **common).generate(prompts, sp)]
    torch._dynamo.reset()
    dynamo_utils.counters.clear()
    llm = LLM(path, compilation_level=2, **common)
    assert dynamo_utils.counters["stats"]["unique_graphs"] == 2  # 3 layers, one per mode
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]
    assert dynamo_utils.counters["stats"]["unique_graphs"] == 2  # and no step recompiled
    assert got == eager


def level2_two_new_tokens_case(path: str):
    """Runs in the Triton-interpreter worker, with paged attention routed through the Triton
    kernel as on a GPU: a 10-token prompt on an 8-token budget ends with a chunk of 2 new tokens
    after 8 cached, one request alone, which level 2 pads to T = B = 2 (issue 11). Greedy tokens
    and their logprobs equal eager's."""
    from rankserve import LLM, SamplingParams
    from rankserve.kernels import attention as ref, triton_attention as ta
    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=0)
    prompt = [{"prompt_token_ids": list(range(3, 13))}]
    common = dict(max_num_seqs=2, max_num_batched_tokens=8, kv_cache_memory_gb=0.01)
    runs = []
    torch_ref, ref.paged_attention_ref = ref.paged_attention_ref, ta.paged_attention  # same signature
    try:
        for kw in (dict(enforce_eager=True), dict(compilation_level=2)):
            torch._dynamo.reset()
            out = LLM(path, **common, **kw).generate(prompt, sp)[0].outputs[0]
            runs.append((out.token_ids, [d[t].logprob for t, d in zip(out.token_ids, out.logprobs)]))
    finally:
        ref.paged_attention_ref = torch_ref
    (eager_ids, eager_lp), (got_ids, got_lp) = runs
    assert got_ids == eager_ids
    torch.testing.assert_close(torch.tensor(got_lp), torch.tensor(eager_lp), atol=1e-4, rtol=1e-4)


def test_level2_one_request_two_new_tokens(checkpoint, interp):
    interp(level2_two_new_tokens_case, checkpoint("Qwen3ForCausalLM"))
