"""The whole model forward traces with torch.compile(fullgraph=True) and a dynamic token count."""
import torch

from rankserve.models.layers import AttnMeta, ParallelInfo
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
