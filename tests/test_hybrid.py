"""Hybrid Mamba2 + attention family (Nemotron-H): greedy parity with transformers (fp32, tiny
random config), chunked prefill equal to unchunked, batches mixing prefill and decode."""
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
@pytest.mark.parametrize("groups", [2, 1])
def test_nemotron_h_tp2_matches_single_rank(checkpoint, groups):
    """Mamba2 mixer under --tp 2: heads and their state split; 2 groups: one B/C group and one
    norm group per rank; 1 group: B/C replicated, the norm's group spread over both ranks."""
    from test_multirank import mpi_generate, single
    model = checkpoint("NemotronHForCausalLM", n_groups=groups)
    assert mpi_generate(2, model, "--tp", "2") == single(model)
