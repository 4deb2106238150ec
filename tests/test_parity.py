"""Token-for-token parity with transformers for every supported family (fp32, CPU)."""
import pytest
import torch

from rankserve import LLM, SamplingParams
from rankserve.models.layers import AttnMeta

PROMPTS = [[1, 5, 9, 200, 31], [1, 400, 2 + 3, 77, 78, 79, 80, 81, 82, 83, 84, 17, 3],
           [1, 300], list(range(1, 40))]
NEW = 12
FAMILIES = ["LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
            "Qwen3MoeForCausalLM", "MixtralForCausalLM"]


def hf_greedy(model, prompt):
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW,
                         do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def model_logits(llm, prompt):
    """Last-position logits from our model, computed directly through the paged cache."""
    runner = llm.engine.executor.runner
    n, bs = len(prompt), runner.block_size
    nblk = -(-n // bs)
    attn = AttnMeta(torch.arange(n), torch.tensor([0, n], dtype=torch.int32),
                    torch.tensor([n], dtype=torch.int32),
                    torch.arange(nblk, dtype=torch.int32)[None])
    with torch.inference_mode():
        h = runner.model(torch.tensor(prompt), torch.arange(n), attn)
        return runner.model.compute_logits(h[-1:])[0]


@pytest.mark.parametrize("arch", FAMILIES)
def test_greedy_and_logits_match_transformers(checkpoint, arch):
    import transformers
    path = checkpoint(arch)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    llm = LLM(path, dtype="float32", max_num_seqs=8)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                        SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True))
    for p, o in zip(PROMPTS, outs):
        assert o.outputs[0].token_ids == hf_greedy(hf, p), f"{arch} prompt of {len(p)} tokens"
    for p in PROMPTS:
        with torch.no_grad():
            ref = hf(torch.tensor([p])).logits[0, -1]
        ours = model_logits(llm, p)
        torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)
