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


@pytest.mark.parametrize("arch", ["Qwen3ForCausalLM", "Qwen3MoeForCausalLM"])
def test_plain_blocks_equal_fused(checkpoint, arch):
    """The family built as plain blocks (`x = x + attn(norm(x)); x = x + mlp(norm(x))`, without
    the fused residual stream of models/fused.py) gives the fast path's logits, step by step: two
    prefills, then a chunk after a prefix beside a decode, then a decode step."""
    from rankserve.models.parallel import ParallelInfo
    from rankserve.models.loader import load_hf_config, load_weights, model_class
    path = checkpoint(arch)
    cfg = load_hf_config(path)
    fused_cls = model_class(cfg)
    plain_cls = type("Plain" + fused_cls.__name__, (fused_cls,), {"fused_residual": False})
    # (ids, positions, slots, query_start_loc, seq_lens, is_decode); request i owns block i
    steps = [(torch.arange(3, 23), torch.cat([torch.arange(7), torch.arange(13)]),
              torch.cat([torch.arange(7), 16 + torch.arange(13)]), [0, 7, 20], [7, 13], False),
             (torch.tensor([40, 41, 42, 43]), torch.tensor([7, 8, 9, 13]),
              torch.tensor([7, 8, 9, 29]), [0, 3, 4], [10, 14], False),
             (torch.tensor([50, 51]), torch.tensor([10, 14]), torch.tensor([10, 30]), [0, 1, 2],
              [11, 15], True)]
    outs = []
    for cls in (fused_cls, plain_cls):
        model = cls(cfg, ParallelInfo(), torch.float32).eval()
        assert model.model.layers["0"].__class__.__name__ == (
            "FusedDecoderLayer" if cls is fused_cls else "DecoderLayer")
        load_weights(model, path, progress=False)
        for a in model.attention_layers():
            a.k_cache = torch.zeros(4, 16, a.qkv_proj.num_kv_heads, a.head_dim)
            a.v_cache = torch.zeros_like(a.k_cache)
        logits = []
        with torch.inference_mode():
            for ids, pos, slots, qsl, lens, decode in steps:
                attn = AttnMeta(slots, torch.tensor(qsl, dtype=torch.int32),
                                torch.tensor(lens, dtype=torch.int32),
                                torch.tensor([[0], [1]], dtype=torch.int32), is_decode=decode)
                logits.append(model.compute_logits(model(ids, pos, attn)))
        outs.append(torch.cat(logits))
    torch.testing.assert_close(outs[1], outs[0], atol=1e-5, rtol=1e-5)
