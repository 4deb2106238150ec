"""GPU end-to-end: compile + CUDA graphs give the eager greedy tokens (run on the GPU machine)."""
import pytest
import torch

from rankserve import LLM, SamplingParams

from conftest import STORIES_EMBEDDED, STORIES_TEXT

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

PROMPTS = ["Once upon a time", "The little dog ran to the park and saw", "Lily and Tom were",
           "Sam had a red ball"] * 3


def greedy(llm, n=32):
    sp = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    ids = [{"prompt_token_ids": llm.tokenizer(p).input_ids} for p in PROMPTS]
    return [o.outputs[0].token_ids for o in llm.generate(ids, sp)]


@pytest.mark.parametrize("level", [1, 2])
@pytest.mark.parametrize("model", ["stories", "Qwen3ForCausalLM", "LlamaForCausalLM", "Qwen3MoeForCausalLM"])
def test_graphs_match_eager(checkpoint, model, level):
    path = str(STORIES_EMBEDDED) if model == "stories" else checkpoint(model)
    common = dict(dtype="float32", max_num_seqs=16, gpu_memory_utilization=0.3)
    eager = greedy(LLM(path, enforce_eager=True, **common))
    fast_llm = LLM(path, compilation_level=level, **common)
    assert fast_llm.engine.executor.runner.compiled_model.graphs, "no CUDA graph was captured"
    assert greedy(fast_llm) == eager
    if model == "stories":
        out = fast_llm.generate("Once upon a time", SamplingParams(temperature=0, max_tokens=40))
        assert out[0].outputs[0].text.startswith(STORIES_TEXT)


def test_bf16_graphs_close_to_eager(checkpoint):
    path = checkpoint("LlamaForCausalLM")
    common = dict(dtype="bfloat16", max_num_seqs=16, gpu_memory_utilization=0.3)
    a = greedy(LLM(path, enforce_eager=True, **common), 8)
    b = greedy(LLM(path, **common), 8)
    same = sum(x[:4] == y[:4] for x, y in zip(a, b))
    assert same >= len(a) - 2  # bf16 rounding may flip a near-tie


def test_level2_two_new_tokens_equal_eager(checkpoint):
    """Issue 11: a request alone in a step with 2 new tokens after a prefix (the last chunk of an
    18-token prompt on an 8-token budget; a prefix-cache hit of 16 tokens plus 2) is padded by
    level 2 to T = B = 2 and must still run as a prefill, not as decode: tokens and logprobs
    equal eager's."""
    path = checkpoint("Qwen3ForCausalLM")
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)
    a = list(range(3, 21))
    prompts = [a, a[:16] + [40, 41]]  # run one at a time: each step has one request
    common = dict(dtype="float32", max_num_seqs=2, max_num_batched_tokens=8,
                  gpu_memory_utilization=0.3)
    runs = []
    for kw in (dict(enforce_eager=True), dict(compilation_level=2)):
        llm = LLM(path, **common, **kw)
        outs = [llm.generate([{"prompt_token_ids": p}], sp)[0].outputs[0] for p in prompts]
        runs.append([(o.token_ids, [d[t].logprob for t, d in zip(o.token_ids, o.logprobs)]) for o in outs])
        del llm
    for (eager_ids, eager_lp), (got_ids, got_lp) in zip(*runs):
        assert got_ids == eager_ids
        torch.testing.assert_close(torch.tensor(got_lp), torch.tensor(eager_lp), atol=1e-3, rtol=1e-3)


def test_two_live_engines_each_get_their_share():
    """--gpu-memory-utilization is each engine's share: a second live engine in the process
    (0.3 + 0.3) gets a KV cache like the first, instead of counting the first one's cache as its
    own peak ("no memory left for the KV cache")."""
    kw = dict(dtype="float32", max_num_seqs=8, gpu_memory_utilization=0.3)
    a = LLM(str(STORIES_EMBEDDED), **kw)
    b = LLM(str(STORIES_EMBEDDED), **kw)
    na, nb = (x.engine.executor.runner.num_blocks for x in (a, b))
    assert abs(na - nb) <= 0.05 * na, (na, nb)
    assert greedy(a, 8) == greedy(b, 8)


@pytest.mark.parametrize("model", ["Qwen3ForCausalLM", "LlamaForCausalLM"])
def test_fused_decode_attention_gives_the_same_tokens(checkpoint, model, monkeypatch):
    """RANKSERVE_FUSED_DECODE_MAX_B (q/k norm, RoPE and the KV store inside the split-KV kernel)
    against the default path, eager and with CUDA graphs: the same greedy tokens."""
    path = checkpoint(model)
    common = dict(dtype="float32", max_num_seqs=16, gpu_memory_utilization=0.3)
    ref = greedy(LLM(path, enforce_eager=True, **common))
    monkeypatch.setenv("RANKSERVE_FUSED_DECODE_MAX_B", "16")
    assert greedy(LLM(path, enforce_eager=True, **common)) == ref
    assert greedy(LLM(path, **common)) == ref


def test_swiglu_epilogue_gives_the_same_tokens(checkpoint, monkeypatch):
    """RANKSERVE_SWIGLU_EPILOGUE (silu(gate) * up in gate_up's skinny GEMV epilogue) against the
    default path, one request at a time (the skinny kernels' M = 1), eager and with CUDA graphs."""
    path = checkpoint("LlamaForCausalLM")
    common = dict(dtype="float32", max_num_seqs=4, gpu_memory_utilization=0.3)
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)

    def one_by_one(llm):
        return [llm.generate([{"prompt_token_ids": llm.tokenizer(p).input_ids}], sp)[0]
                .outputs[0].token_ids for p in PROMPTS]
    ref = one_by_one(LLM(path, enforce_eager=True, **common))
    monkeypatch.setenv("RANKSERVE_SWIGLU_EPILOGUE", "1")
    assert one_by_one(LLM(path, enforce_eager=True, **common)) == ref
    assert one_by_one(LLM(path, **common)) == ref


@pytest.mark.parametrize("model", ["Qwen3ForCausalLM", "LlamaForCausalLM"])
def test_decode_lpt_order_gives_the_same_tokens(checkpoint, model, monkeypatch):
    """RANKSERVE_DECODE_LPT (decode programs longest context first, the runner's argsort) against
    the default launch order: the same greedy tokens, eager and with CUDA graphs (padded
    batches read the padding requests last)."""
    path = checkpoint(model)
    common = dict(dtype="float32", max_num_seqs=16, gpu_memory_utilization=0.3)
    ref = greedy(LLM(path, enforce_eager=True, **common))
    monkeypatch.setenv("RANKSERVE_DECODE_LPT", "1")
    assert greedy(LLM(path, enforce_eager=True, **common)) == ref
    assert greedy(LLM(path, **common)) == ref
