"""DeepSeek-V2/V3 (models/deepseek.py): parity with transformers (fp32, tiny random configs with
dense + MoE layers, grouped routing, YaRN), the MLA latent cache, MTP loading."""
import pytest
import torch

from rankserve import LLM, SamplingParams

from test_parity import PROMPTS, NEW, hf_greedy, model_logits

V3_VARIANTS = {  # beyond the fixture's config: q without compression, rotate-half RoPE, no YaRN
    "plain": dict(q_lora_rank=None, rope_interleave=False, n_group=1, topk_group=1,
                  norm_topk_prob=False, rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
}


def _parity(path):
    import transformers
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    llm = LLM(path, dtype="float32", max_num_seqs=8)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                        SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True))
    for p, o in zip(PROMPTS, outs):
        assert o.outputs[0].token_ids == hf_greedy(hf, p), f"prompt of {len(p)} tokens"
    for p in PROMPTS:
        with torch.no_grad():
            ref = hf(torch.tensor([p])).logits[0, -1]
        torch.testing.assert_close(model_logits(llm, p), ref, atol=1e-4, rtol=1e-4)
    return llm


@pytest.mark.parametrize("arch", ["DeepseekV3ForCausalLM", "DeepseekV2ForCausalLM"])
def test_greedy_and_logits_match_transformers(checkpoint, arch):
    llm = _parity(checkpoint(arch))
    runner = llm.engine.executor.runner
    a = runner.model.attention_layers()[0]
    # one latent cache per layer: L + R values per token, no V cache
    assert a.k_cache.shape[1:] == (runner.block_size, 1, 32 + 16) and a.v_cache.numel() == 0
    assert runner.kv_bytes_per_block() == 3 * (32 + 16) * 4 * runner.block_size


def test_v3_variant_matches_transformers(checkpoint):
    _parity(checkpoint("DeepseekV3ForCausalLM", **V3_VARIANTS["plain"]))


@pytest.mark.mpi
@pytest.mark.parametrize("flags", [["--tp", "2"], ["--pp", "2"], ["--tp", "2", "--enable-expert-parallel"]])
def test_v3_parallel_matches_single_rank(checkpoint, flags):
    """The tiny V3 (MLA, dense + MoE layers, shared expert, grouped routing) under mpiexec -n 2."""
    import shutil
    if shutil.which("mpiexec") is None:
        pytest.skip("mpiexec not on PATH")
    from test_multirank import mpi_generate, single
    model = checkpoint("DeepseekV3ForCausalLM")
    assert mpi_generate(2, model, *flags) == single(model)
