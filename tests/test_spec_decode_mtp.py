"""Speculative decoding with DeepSeek-V3's MTP layer (runtime/spec_decode.py MTPProposer), on the
tiny random V3 plus one MTP layer (tests/test_deepseek.py builds it): greedy output equals plain
decoding, every draft equals that of a reference that runs the MTP layer over the whole context
from scratch (so its KV cache stayed in step with the target's through chunked prefill,
rejections, prefix hits, preemption and async scheduling), an MTP layer that copies the target
gets its drafts accepted, and models without MTP weights are refused."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from rankserve import LLM, SamplingParams
from rankserve.runtime.spec_decode import MTPProposer

from test_deepseek import _mtp_checkpoint

MTP = {"method": "mtp", "num_speculative_tokens": 3}
PROMPTS = [list(range(3, 40)), [5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [9, 10, 11], list(range(3, 40))]
COMMON = dict(dtype="float32", max_num_seqs=4, kv_cache_memory_gb=0.05, max_model_len=128)


def _greedy(llm, prompts, n=24, seqs: dict | None = None):
    """Greedy outputs; `seqs` (if given) gets each request's prompt + output by request id."""
    sp = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp)
    if seqs is not None:
        seqs.update({o.request_id: o.prompt_token_ids + o.outputs[0].token_ids for o in outs})
    return [o.outputs[0].token_ids for o in outs]


def without_mlp(w: dict, attn_scale: float) -> None:
    """In place: no MLP output anywhere (down_proj zero), attention outputs times `attn_scale`."""
    for name, t in w.items():
        if "down_proj" in name:
            t.zero_()
        if "o_proj" in name:
            t.mul_(attn_scale)


class DraftLog:
    """Every proposal a proposer class makes, as (request id, context length, drafts); `take`
    turns them into (context, drafts) from the final sequences (a step that ran ahead has its
    last input token on the device only)."""

    def __init__(self, monkeypatch, proposer_cls):
        self.raw = []
        real = proposer_cls.propose

        def propose(p, ctx):
            out = real(p, ctx)
            _, acc = ctx.host()
            self.raw.extend((rid, int(base) + a + 1, d)
                            for rid, base, a, d in zip(ctx.req_ids, ctx.base_pos, acc, out) if d)
            return out
        monkeypatch.setattr(proposer_cls, "propose", propose)

    def take(self, seqs: dict) -> list[tuple[list[int], list[int]]]:
        out = [(seqs[rid][:m], d) for rid, m, d in self.raw]
        self.raw.clear()
        return out


@pytest.fixture(scope="module")
def mtp_dir(checkpoint, tmp_path_factory):
    return _mtp_checkpoint(tmp_path_factory.mktemp("mtp"), checkpoint("DeepseekV3ForCausalLM"))[0]




def _reference_drafts(model, context: list[int], k: int) -> list[int]:
    """The MTP layer's k greedy drafts after `context`, computed from scratch: the target over
    the context, the pairs (h_t, token t + 1), then each draft's pair appended, in one prefill."""
    from rankserve.models.layers import AttnMeta

    def meta(m):
        return AttnMeta(torch.arange(m), torch.tensor([0, m], dtype=torch.int32),
                        torch.tensor([m], dtype=torch.int32), torch.arange(-(-m // 16), dtype=torch.int32)[None])
    ids = torch.tensor(context)
    n = len(context)
    with torch.inference_mode():
        h = model(ids, torch.arange(n), meta(n))[:-1]  # h_0 .. h_{n-2}
        nxt, drafts = ids[1:], []
        for _ in range(k):
            g = model.mtp_forward(h, nxt, torch.arange(len(nxt)), meta(len(nxt)))
            d = int(model.mtp_logits(g[-1:])[0].argmax())
            drafts.append(d)
            h, nxt = torch.cat([h, g[-1:]]), torch.cat([nxt, torch.tensor([d])])
    return drafts


@pytest.mark.parametrize("attn_scale", [None, 0.03], ids=["random", "half-right"])
def test_greedy_equals_plain_and_drafts_match_a_from_scratch_reference(mtp_dir, tmp_path, attn_scale,
                                                                      monkeypatch):
    """Chunked prefill (budget 16), a prefix hit (the first prompt twice), preemption (14 blocks
    of 8 for 4 requests), async scheduling: the tokens of plain decoding, and each proposal the
    MTP layer makes equals the reference's (its KV cache holds the right pairs). The random
    MTP layer's drafts are all rejected (drafting pauses: the proposer only keeps its KV in
    step); the other one gets about half accepted, with partial accepts."""
    path = mtp_dir if attn_scale is None else copying(mtp_dir, tmp_path / "mtp", attn_scale)
    plain = LLM(path, **COMMON)
    want = _greedy(plain, PROMPTS)
    seen, log = [], DraftLog(monkeypatch, MTPProposer)
    for extra in (dict(max_num_batched_tokens=16, block_size=8, num_gpu_blocks_override=14, max_model_len=96,
                       async_scheduling=True),
                  dict(enable_prefix_caching=True)):
        llm = LLM(path, **{**COMMON, **extra}, speculative_config=MTP)
        assert _greedy(llm, PROMPTS, seqs=(seqs := {})) == want, extra
        seen += log.take(seqs)
        sch = llm.engine.scheduler
        s = sch.stats()
        assert s.spec_num_drafts > 0
        if attn_scale is not None:  # accepts of every length
            assert 0.25 * s.spec_num_draft_tokens < s.spec_num_accepted_tokens < s.spec_num_draft_tokens
            assert s.spec_accepted_per_pos[-1] > 0
        assert sch.kv.num_free_blocks == sch.kv.num_blocks
        if "async_scheduling" in extra:
            assert sch.num_preemptions > 0
        else:
            assert sch.kv.prefix_hits > 0
    model = llm.engine.executor.runner.model  # (its cache is scratch now; the plain one has no MTP)
    assert len(seen) > 20
    rng = np.random.default_rng(0)
    for i in rng.choice(len(seen), 12, replace=False):
        context, drafts = seen[i]
        assert _reference_drafts(model, context, len(drafts)) == drafts, f"context of {len(context)}"


def copying(mtp_dir, path, attn_scale: float) -> str:
    """The MTP checkpoint made to agree with its target: no MLP output anywhere (down_proj
    zero), attention outputs scaled by `attn_scale`, and an MTP layer that embeds, normalizes
    and decodes as the target does. At 0 the next token is a function of the current one that
    the MTP layer computes too (every draft right); above 0 the context pulls them apart."""
    shutil.copytree(mtp_dir, path)
    w = load_file(str(path / "model.safetensors"))
    without_mlp(w, attn_scale)
    H = w["model.norm.weight"].shape[0]
    m = "model.layers.3."
    w["model.norm.weight"].fill_(1)
    w[m + "enorm.weight"].fill_(1)
    w[m + "shared_head.norm.weight"].fill_(1)
    w[m + "eh_proj.weight"] = torch.cat([torch.eye(H), torch.zeros(H, H)], 1)
    w[m + "embed_tokens.weight"] = w["model.embed_tokens.weight"].clone()
    w[m + "shared_head.head.weight"] = w["lm_head.weight"].clone()
    save_file(w, str(path / "model.safetensors"))
    return str(path)


def test_mtp_that_copies_the_target_is_accepted(mtp_dir, tmp_path):
    """Every draft of an MTP layer that computes what the target does is accepted (1 + k
    tokens a verify step)."""
    path = copying(mtp_dir, tmp_path / "copy", 0.0)
    want = _greedy(LLM(path, **COMMON), PROMPTS[:3], 30)
    llm = LLM(path, **COMMON, speculative_config=MTP)
    assert _greedy(llm, PROMPTS[:3], 30) == want
    s = llm.engine.scheduler.stats()
    assert s.spec_num_accepted_tokens >= 0.95 * s.spec_num_draft_tokens > 0, s
    assert s.spec_accepted_per_pos[-1] > 0


def test_host_kv_tier_carries_the_mtp_cache(mtp_dir, tmp_path):
    """The MTP layer's latent cache is one of the target's layers: a host tier behind an 8-block
    device cache brings it back with the rest (prefix hits from the host), same tokens, and
    the drafts stay mostly right."""
    path = copying(mtp_dir, tmp_path / "mtp", 0.03)
    base = list(range(3, 40))
    prompts = [base, base[:16] + [7, 8, 9], base[:32] + [11], base[:5]]
    filler = [list(range(100 + 40 * i, 140 + 40 * i)) for i in range(2)]

    def run(**kw):
        llm = LLM(path, dtype="float32", max_num_seqs=4, max_num_batched_tokens=8, num_gpu_blocks_override=8,
                  max_model_len=64, kv_offload_size=32 * 16 * 4 * 48 * 4 / 2**30, **kw)
        return [_greedy(llm, batch, 16) for batch in (prompts, filler, prompts)], llm
    want, _ = run()
    got, llm = run(speculative_config=MTP)
    assert got == want
    s = llm.engine.scheduler.stats()
    assert llm.engine.scheduler.kv.offload.hits > 0
    assert s.spec_num_accepted_tokens > 0.5 * s.spec_num_draft_tokens, s


def test_passes_and_stores_run_through_the_proposers_compiled_models(mtp_dir, tmp_path):
    """The MTP layer runs as a model of its own (models/deepseek.py MTPDrafter): every pass
    goes through the proposer's CompiledModel (CUDA graphs on the GPU, torch.compile at level
    2), a step's stores through another (verify graphs); the tokens of plain decoding."""
    path = copying(mtp_dir, tmp_path / "mtp", 0.03)
    want = _greedy(LLM(path, **COMMON), PROMPTS, 16)
    llm = LLM(path, **COMMON, speculative_config=MTP)
    p = llm.engine.executor.runner.proposer
    assert not p.compiled.model.store_only and p.stores.model.store_only
    assert p.stores.verify_len == 1 + MTP["num_speculative_tokens"]
    calls = []
    for c in (p.compiled, p.stores):
        real = c.forward
        c.forward = lambda *a, _real=real, _c=c: calls.append(_c) or _real(*a)
    assert _greedy(llm, PROMPTS, 16) == want
    s = llm.engine.scheduler.stats()
    n = calls.count(p.compiled)  # k passes (over the batch) a proposing step
    assert n > 0 and n % MTP["num_speculative_tokens"] == 0 and calls.count(p.stores) > 0
    assert 0.25 * s.spec_num_draft_tokens < s.spec_num_accepted_tokens < s.spec_num_draft_tokens, s


@pytest.mark.mpi
@pytest.mark.slow
@pytest.mark.skipif(shutil.which("mpiexec") is None, reason="mpiexec not on PATH")
def test_tp2_matches_single_rank(mtp_dir, tmp_path):
    """mpiexec -n 2 --tp 2: the MTP layer's heads split like the target's; same greedy tokens."""
    from test_multirank import mpi_generate, single
    path = copying(mtp_dir, tmp_path / "mtp", 0.03)
    spec = json.dumps({**MTP, "method": "deepseek_mtp"})
    assert mpi_generate(2, path, "--tp", "2", "--speculative-config", spec) == single(path)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("level", [1, 2])
def test_gpu_greedy_equals_plain_with_graphs(mtp_dir, tmp_path, level, monkeypatch):
    """On the GPU: the target's decode and verify CUDA graphs, and the MTP layer's own: its
    passes replay decode graphs, a uniform verify step's stores a verify graph (at level 2 over
    the torch.compile'd MTP block); the tokens of plain decoding (with graphs) and about half
    the drafts accepted."""
    import gc

    from rankserve.runtime.compilation import CompiledModel
    path = copying(mtp_dir, tmp_path / "mtp", 0.03)
    common = dict(dtype="float32", max_num_seqs=8, gpu_memory_utilization=0.3, max_model_len=128,
                  compilation_level=level)
    plain = LLM(path, **common)
    want = _greedy(plain, PROMPTS, 40)
    del plain
    gc.collect()
    torch.cuda.empty_cache()
    llm = LLM(path, **common, speculative_config=MTP)
    runner = llm.engine.executor.runner
    p = runner.proposer
    assert runner.compiled_model.verify_graphs, "no verify graph was captured"
    assert p.compiled.graphs and p.stores.graphs and p.stores.verify_graphs, "no MTP graph was captured"
    replays = []
    for name in ("_run_graph", "_run_verify_graph"):
        real = getattr(CompiledModel, name)

        def counted(self, *a, _real=real, _name=name):
            out = _real(self, *a)
            if out is not None:
                replays.append((self, _name))
            return out
        monkeypatch.setattr(CompiledModel, name, counted)
    assert _greedy(llm, PROMPTS, 40) == want
    s = llm.engine.scheduler.stats()
    assert replays.count((p.compiled, "_run_graph")) >= MTP["num_speculative_tokens"] * 4
    assert replays.count((p.stores, "_run_verify_graph")) > 0
    assert 0.25 * s.spec_num_draft_tokens < s.spec_num_accepted_tokens, s


def test_models_without_mtp_weights_are_refused(checkpoint):
    # the fixture's config says num_nextn_predict_layers 1, but save_pretrained dropped the layer
    with pytest.raises(ValueError, match="no weights for its 1 MTP layer"):
        LLM(checkpoint("DeepseekV3ForCausalLM"), **COMMON, speculative_config=MTP)
    with pytest.raises(ValueError, match="LlamaForCausalLM has no multi-token-prediction"):
        LLM(checkpoint("LlamaForCausalLM"), kv_cache_memory_gb=0.05, speculative_config=MTP)


def test_config_accepts_vllm_names():
    from rankserve.runtime.config import ConfigError, EngineConfig, parse_speculative_config
    assert parse_speculative_config({"method": "deepseek_mtp", "num_speculative_tokens": 2}).method == "mtp"
    with pytest.raises(ConfigError, match="MTP layers come from the target"):
        parse_speculative_config({**MTP, "model": "/x"})
    with pytest.raises(ConfigError, match="pipeline"):
        EngineConfig.from_kwargs(pp=2, speculative_config=json.dumps(MTP))
