"""Speculative decoding with EAGLE-1 / EAGLE-3 heads (runtime/spec_decode.py EagleProposer,
models/eagle.py), on tiny random Llama / Qwen3 targets and tiny heads written to disk in the
published formats: the EAGLE repository's (config.json + pytorch_model.bin, fp16; EAGLE-3's
`midlayer.*`, d2t / t2d and a reduced draft vocabulary) and the `speculators` one
(transformer_layer_config, layers.0.*, model.safetensors, bf16).

Greedy output with speculation equals plain decoding; every proposal equals that of a reference
that runs the head over the whole context from scratch (its KV cache stayed in step with the
target's through chunked prefill, rejections, prefix hits, preemption and async scheduling); a
head built to compute what the target computes gets every draft accepted; mismatched heads are
refused with the reason."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from rankserve import LLM, SamplingParams
from rankserve.runtime.spec_decode import EagleProposer
from test_spec_decode_mtp import DraftLog, _greedy, without_mlp

PROMPTS = [list(range(3, 40)), [5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [9, 10, 11], list(range(3, 40))]
COMMON = dict(dtype="float32", max_num_seqs=4, kv_cache_memory_gb=0.05, max_model_len=128)
H, V = 64, 512  # the conftest targets' width and vocabulary


def spec(method: str, head: str, k: int = 3) -> dict:
    return {"method": method, "model": head, "num_speculative_tokens": k}


# ---- heads in the published formats -------------------------------------------------------------
def _layer(prefix: str, in_dim: int, gen, heads=4, kv_heads=2, hd=16, inter=96, eagle3=True) -> dict:
    r = lambda *s: torch.randn(*s, generator=gen) * 0.1  # noqa: E731
    w = {f"{prefix}self_attn.q_proj.weight": r(heads * hd, in_dim),
         f"{prefix}self_attn.k_proj.weight": r(kv_heads * hd, in_dim),
         f"{prefix}self_attn.v_proj.weight": r(kv_heads * hd, in_dim),
         f"{prefix}self_attn.o_proj.weight": r(H, heads * hd),
         f"{prefix}mlp.gate_proj.weight": r(inter, H), f"{prefix}mlp.up_proj.weight": r(inter, H),
         f"{prefix}mlp.down_proj.weight": r(H, inter),
         f"{prefix}post_attention_layernorm.weight": 1 + r(H)}
    if eagle3:
        w[f"{prefix}input_layernorm.weight"] = 1 + r(H)
        w[f"{prefix}hidden_norm.weight"] = 1 + r(H)
    return w


def _llama_cfg(**kw) -> dict:
    return dict(hidden_size=H, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                num_hidden_layers=1, vocab_size=V, rms_norm_eps=1e-5, max_position_embeddings=64,
                rope_theta=10000.0, hidden_act="silu", bos_token_id=1, eos_token_id=2,
                tie_word_embeddings=False, model_type="llama", **kw)


def eagle1_head(path: Path, seed: int = 0) -> str:
    """The EAGLE repository's EAGLE-1 layout (yuhuili/EAGLE-LLaMA3.1-Instruct-8B): config.json
    with architectures LlamaForCausalLM and `bias`, pytorch_model.bin in fp16 with fc.weight /
    fc.bias, layers.0.* (no input_layernorm) and the target's embed_tokens copy."""
    gen = torch.Generator().manual_seed(seed)
    path.mkdir(parents=True, exist_ok=True)
    w = _layer("layers.0.", H, gen, eagle3=False)
    w["fc.weight"] = torch.randn(H, 2 * H, generator=gen) * 0.1
    w["fc.bias"] = torch.randn(H, generator=gen) * 0.1
    w["embed_tokens.weight"] = torch.randn(V, H, generator=gen)
    torch.save({k: v.half() for k, v in w.items()}, path / "pytorch_model.bin")
    (path / "config.json").write_text(json.dumps(_llama_cfg(
        architectures=["LlamaForCausalLM"], bias=True, torch_dtype="float16")))
    return str(path)


def eagle3_head(path: Path, seed: int = 0, draft_vocab: int = 128, speculators: bool = False,
                aux_ids: list[int] | None = None) -> str:
    """EAGLE-3: the EAGLE repository's layout (yuhuili/EAGLE3-LLaMA3.1-Instruct-8B: architectures
    LlamaForCausalLMEagle3, draft_vocab_size, pytorch_model.bin in fp16 with midlayer.*, fc,
    norm, lm_head, d2t, t2d; no embed_tokens) or, with `speculators`, that library's
    (Eagle3Speculator config with transformer_layer_config, model.safetensors in bf16 with
    layers.0.* and its own embed_tokens)."""
    gen = torch.Generator().manual_seed(seed)
    path.mkdir(parents=True, exist_ok=True)
    prefix = "layers.0." if speculators else "midlayer."
    w = _layer(prefix, 2 * H, gen)
    w["fc.weight"] = torch.randn(H, 3 * H, generator=gen) * 0.05
    w["norm.weight"] = 1 + torch.randn(H, generator=gen) * 0.1
    w["lm_head.weight"] = torch.randn(draft_vocab, H, generator=gen) * 0.3
    ids = torch.sort(torch.randperm(V, generator=gen)[:draft_vocab]).values  # the draft vocabulary
    w["d2t"] = ids - torch.arange(draft_vocab)
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[ids] = True
    w["t2d"] = t2d
    layer = _llama_cfg(architectures=["LlamaForCausalLM"], torch_dtype="bfloat16")
    if speculators:
        w["embed_tokens.weight"] = torch.randn(V, H, generator=gen)
        save_file({k: v.bfloat16() if v.is_floating_point() else v for k, v in w.items()},
                  str(path / "model.safetensors"))
        cfg = {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
               "speculators_version": "0.1.0", "transformer_layer_config": layer,
               "draft_vocab_size": draft_vocab, "norm_before_residual": True, "target_hidden_size": None,
               "speculators_config": {"algorithm": "eagle3", "default_proposal_method": "greedy",
                                      "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3}],
                                      "verifier": {"name_or_path": "tiny", "architectures": ["LlamaForCausalLM"]}}}
        if aux_ids is not None:
            cfg["eagle_aux_hidden_state_layer_ids"] = aux_ids
    else:
        torch.save({k: v.half() if v.is_floating_point() else v for k, v in w.items()},
                   path / "pytorch_model.bin")
        cfg = {**layer, "architectures": ["LlamaForCausalLMEagle3"], "draft_vocab_size": draft_vocab,
               "torch_dtype": "float16"}
        if aux_ids is not None:
            cfg["eagle_aux_hidden_state_layer_ids"] = aux_ids
    (path / "config.json").write_text(json.dumps(cfg))
    return str(path)


def copying_target(target: str, path: Path, attn_scale: float) -> str:
    """The target made to predict from the current token mostly (no MLP output, attention
    outputs scaled by `attn_scale`, final norm 1): at 0 the next token is a function of the
    current one."""
    shutil.copytree(target, path)
    w = load_file(str(path / "model.safetensors"))
    without_mlp(w, attn_scale)
    w["model.norm.weight"].fill_(1)
    save_file(w, str(path / "model.safetensors"))
    return str(path)


def copying_head(target: str, path: Path, method: str, aux_ids: list[int] | None = None) -> str:
    """A head that computes the embedding of its input token, so that its draft is the copying
    target's next token (argmax lm_head(e) = argmax lm_head(norm(e))). EAGLE-1: fc = [I | 0], no
    attention or MLP output. EAGLE-3: q = k = 20 [I | 0] (RoPE makes each token attend to
    itself only), v = [I | -I], o = I, no MLP output: the layer returns h + n(e) - n(h), which is
    n(e) both for the target's states (fc = 0: h = 0) and for its own fed back (h = n(e'), of
    RMS 1: n(h) = h); full draft vocabulary, lm_head the target's."""
    tw = load_file(str(Path(target) / "model.safetensors"))
    eye, zero = torch.eye(H), torch.zeros(H, H)
    path.mkdir(parents=True, exist_ok=True)
    if method == "eagle":
        eagle1_head(path)
        w = torch.load(path / "pytorch_model.bin")
        w = {k: v.float() for k, v in w.items()}
        w["fc.weight"], w["fc.bias"] = torch.cat([eye, zero], 1), torch.zeros(H)
        w["layers.0.self_attn.o_proj.weight"].zero_()
        w["layers.0.mlp.down_proj.weight"].zero_()
        torch.save(w, path / "pytorch_model.bin")
        return str(path)
    eagle3_head(path, draft_vocab=V, aux_ids=aux_ids)
    cfg = json.loads((path / "config.json").read_text())
    cfg["num_key_value_heads"] = 4
    (path / "config.json").write_text(json.dumps(cfg))
    w = {k: v.float() if v.is_floating_point() else v for k, v in torch.load(path / "pytorch_model.bin").items()}
    m = "midlayer."
    w["fc.weight"].zero_()
    w[m + "self_attn.q_proj.weight"] = w[m + "self_attn.k_proj.weight"] = 20 * torch.cat([eye, zero], 1)
    w[m + "self_attn.v_proj.weight"] = torch.cat([eye, -eye], 1)
    w[m + "self_attn.o_proj.weight"] = eye.clone()
    w[m + "mlp.down_proj.weight"].zero_()
    for n in ("input_layernorm", "hidden_norm"):
        w[f"{m}{n}.weight"].fill_(1)
    w["norm.weight"].fill_(1)
    w["lm_head.weight"] = tw["lm_head.weight"].clone()
    w["d2t"] = torch.zeros(V, dtype=torch.long)
    torch.save(w, path / "pytorch_model.bin")
    return str(path)


@pytest.fixture(scope="module")
def llama(checkpoint):
    return checkpoint("LlamaForCausalLM")


@pytest.fixture(scope="module")
def llama7(checkpoint):
    """7 layers: EAGLE-3's default auxiliary layers 2, 3, 4 are distinct."""
    return checkpoint("LlamaForCausalLM", num_hidden_layers=7)


# ---- reference drafts -------------------------------------------------------------------------
def _meta(m):
    from rankserve.models.layers import AttnMeta
    return AttnMeta(torch.arange(m), torch.tensor([0, m], dtype=torch.int32), torch.tensor([m], dtype=torch.int32),
                    torch.arange(-(-m // 16), dtype=torch.int32)[None])


def _reference_drafts(proposer, context: list[int], k: int) -> list[int]:
    """The head's k greedy drafts after `context`, from scratch: the target over the context,
    the pairs (state_t, token t + 1), then each draft's pair appended, in one prefill each."""
    target, head = proposer.runner.model, proposer.model
    ids, n = torch.tensor(context), len(context)
    with torch.inference_mode():
        h = target(ids, torch.arange(n), _meta(n))
        h = (h if proposer.aux is None else head.combine(proposer.aux[:n]))[:-1]
        nxt, drafts = ids[1:], []
        for _ in range(k):
            g = head(nxt, torch.arange(len(nxt)), _meta(len(nxt)), h)
            d = int(head.draft_tokens(g[-1:])[0])
            drafts.append(d)
            h, nxt = torch.cat([h, g[-1:]]), torch.cat([nxt, torch.tensor([d])])
    return drafts


@pytest.mark.parametrize("kind", ["eagle", "eagle3", "eagle3-speculators"])
def test_greedy_equals_plain_and_drafts_match_a_from_scratch_reference(kind, llama, tmp_path, monkeypatch):
    """Chunked prefill (budget 16), preemption (14 blocks of 8), async scheduling, then prefix
    caching: the tokens of plain decoding, and the proposals equal the reference's. The target
    is nudged towards its current token (so that a copying-ish random head gets some drafts
    accepted: partial accepts and rollbacks), the head random otherwise."""
    method = kind.split("-")[0]
    target = copying_target(llama, tmp_path / "t", 0.05)
    if method == "eagle":
        head = copying_head(target, tmp_path / "h", "eagle")
        w = torch.load(Path(head) / "pytorch_model.bin")
        w["layers.0.self_attn.o_proj.weight"] = torch.randn(H, H) * 0.01  # not quite right
        torch.save(w, Path(head) / "pytorch_model.bin")
    else:
        head = eagle3_head(tmp_path / "h", speculators=kind.endswith("speculators"),
                           aux_ids=[0, 1, 2] if kind.endswith("speculators") else [2, 0, 1])
    want = _greedy(LLM(target, **COMMON), PROMPTS)
    seen, log = [], DraftLog(monkeypatch, EagleProposer)
    for extra in (dict(max_num_batched_tokens=16, block_size=8, num_gpu_blocks_override=14, max_model_len=96,
                       async_scheduling=True),
                  dict(enable_prefix_caching=True)):
        llm = LLM(target, **{**COMMON, **extra}, speculative_config=spec(method, head))
        assert _greedy(llm, PROMPTS, seqs=(seqs := {})) == want, extra
        seen += log.take(seqs)
        sch = llm.engine.scheduler
        s = sch.stats()
        assert s.spec_num_drafts > 0
        assert sch.kv.num_free_blocks == sch.kv.num_blocks
        if "async_scheduling" in extra:
            assert sch.num_preemptions > 0
        else:
            assert sch.kv.prefix_hits > 0
        if method == "eagle":  # accepts of every length
            assert 0.2 * s.spec_num_draft_tokens < s.spec_num_accepted_tokens < s.spec_num_draft_tokens, s
    proposer = llm.engine.executor.runner.proposer  # (its caches are scratch now)
    assert len(seen) > 10
    rng = np.random.default_rng(0)
    for i in rng.choice(len(seen), 8, replace=False):
        context, drafts = seen[i]
        assert _reference_drafts(proposer, context, len(drafts)) == drafts, f"context of {len(context)}"


def test_eagle3_reads_the_residual_stream_entering_its_layers(llama7, tmp_path):
    """The auxiliary states are transformers' hidden_states[i] (the stream entering layer i) of
    the configured layers, in layer order; the default is 2, L // 2, L - 3."""
    import transformers
    ids = list(range(3, 30))
    hf = transformers.AutoModelForCausalLM.from_pretrained(llama7, dtype=torch.float32)
    with torch.no_grad():
        want = hf(torch.tensor([ids]), output_hidden_states=True).hidden_states
    for aux, head in (([2, 3, 4], eagle3_head(tmp_path / "default")),
                      ([1, 5, 6], eagle3_head(tmp_path / "ids", speculators=True, aux_ids=[6, 1, 5]))):
        proposer = LLM(llama7, **COMMON, speculative_config=spec("eagle3", head)).engine.executor.runner.proposer
        with torch.inference_mode():
            proposer.runner.model(torch.tensor(ids), torch.arange(len(ids)), _meta(len(ids)))
        got = proposer.aux[:len(ids)].reshape(len(ids), 3, H)
        for j, layer in enumerate(aux):
            torch.testing.assert_close(got[:, j], want[layer][0], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_head_that_copies_the_target_is_accepted(method, llama, tmp_path):
    """Every draft of a head that computes what the target does is accepted (1 + k tokens a
    verify step): the acceptance counts are those of the tokens emitted."""
    target = copying_target(llama, tmp_path / "t", 0.0)
    head = copying_head(target, tmp_path / "h", method, [0, 1, 2])
    want = _greedy(LLM(target, **COMMON), PROMPTS[:3], 30)
    llm = LLM(target, **COMMON, speculative_config=spec(method, head, 4))
    assert _greedy(llm, PROMPTS[:3], 30) == want
    s = llm.engine.scheduler.stats()
    assert s.spec_num_accepted_tokens >= 0.9 * s.spec_num_draft_tokens > 0, s
    assert s.spec_accepted_per_pos[-1] >= 0.75 * s.spec_num_drafts  # (the last drafts are cut to max_tokens)
    # tokens emitted by verify passes = accepted drafts + one each: all 3 x 29 decode tokens
    assert s.spec_num_accepted_tokens + s.spec_num_drafts <= 3 * 29


def test_qwen3_target_with_an_eagle3_head(checkpoint, tmp_path):
    """A Qwen3 target (q/k norms, head_dim 32) reads its auxiliary states the same way."""
    target = checkpoint("Qwen3ForCausalLM")
    head = eagle3_head(tmp_path / "h", aux_ids=[0, 1, 2])
    want = _greedy(LLM(target, **COMMON), PROMPTS[:2], 16)
    llm = LLM(target, **COMMON, speculative_config=spec("eagle3", head, 2))
    assert _greedy(llm, PROMPTS[:2], 16) == want
    assert llm.engine.scheduler.stats().spec_num_drafts > 0


def test_mismatched_heads_are_refused(llama, llama7, checkpoint, tmp_path):
    e1, e3 = eagle1_head(tmp_path / "e1"), eagle3_head(tmp_path / "e3")
    cases = [
        (llama7, "eagle", e3, "is an EAGLE-3 head"),
        (llama7, "eagle3", e1, "an EAGLE-1 head? Use method 'eagle'"),
        (llama, "eagle3", e3, "auxiliary layer(s) [-1]"),  # 2 layers: 2, 1, -1
        (llama7, "eagle", str(Path(llama)), "has no fc.weight: not an EAGLE head"),
        (checkpoint("LlamaForCausalLM", hidden_size=32, num_attention_heads=2, num_key_value_heads=1),
         "eagle", e1, "hidden_size (64) differs from the target's (32)"),
        (checkpoint("LlamaForCausalLM", vocab_size=256), "eagle", e1, "vocab_size (512) differs"),
    ]
    spec_path = eagle3_head(tmp_path / "e3s", speculators=True, aux_ids=[0, 1])  # fc takes 3 layers
    cases.append((llama7, "eagle3", spec_path, "fc.weight is [64, 192]; the target (64 wide, 2 auxiliary"))
    for target, method, head, words in cases:
        with pytest.raises(ValueError) as e:
            LLM(target, **COMMON, speculative_config=spec(method, head))
        assert words in str(e.value) and "--speculative-config" in str(e.value), (words, str(e.value))
    # a truncated checkpoint: the loader names what is missing
    trunc = tmp_path / "trunc"
    shutil.copytree(e3, trunc)
    w = torch.load(trunc / "pytorch_model.bin")
    del w["norm.weight"]
    torch.save(w, trunc / "pytorch_model.bin")
    with pytest.raises(ValueError, match=r"lacks weights for: \['model.norm.weight'\]"):
        LLM(llama7, **COMMON, speculative_config=spec("eagle3", str(trunc)))


def test_config_needs_the_head_directory(tmp_path):
    from rankserve.runtime.config import ConfigError, EngineConfig, parse_speculative_config
    for method in ("eagle", "eagle3"):
        with pytest.raises(ConfigError, match=f"method {method} needs \"model\""):
            parse_speculative_config({"method": method, "num_speculative_tokens": 2})
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ConfigError, match="kv-offload-size"):
        EngineConfig.from_kwargs(kv_offload_size=1.0, enable_prefix_caching=True, speculative_config={
            "method": "eagle", "model": str(tmp_path), "num_speculative_tokens": 2})


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_gpu_greedy_equals_plain_with_graphs(method, llama, llama7, tmp_path):
    """On the GPU: the target's decode and verify CUDA graphs (EAGLE-3's auxiliary copies
    inside them), the head's drafting passes replayed as its own decode graphs; the tokens of
    plain decoding, and the copying head's drafts accepted."""
    target = copying_target(llama if method == "eagle" else llama7, tmp_path / "t", 0.0)
    head = copying_head(target, tmp_path / "h", method)  # EAGLE-3: the default layers 2, 3, 4
    common = dict(dtype="float32", max_num_seqs=8, gpu_memory_utilization=0.3, max_model_len=128)
    want = _greedy(LLM(target, **common), PROMPTS, 40)
    llm = LLM(target, **common, speculative_config=spec(method, head))
    runner = llm.engine.executor.runner
    assert runner.compiled_model.verify_graphs and runner.proposer.compiled.graphs
    assert runner.proposer.compiled.verify_graphs
    assert _greedy(llm, PROMPTS, 40) == want
    s = llm.engine.scheduler.stats()
    assert s.spec_num_accepted_tokens >= 0.9 * s.spec_num_draft_tokens > 0, s


@pytest.mark.slow
def test_server_greedy_equals_plain_and_metrics(tmp_path):
    """Through the server (stories260K, 5 layers, and an EAGLE-3 head reading layers 1-3):
    completions, streamed or not, are those of plain decoding; /metrics counts the drafts."""
    import httpx

    from conftest import STORIES_EMBEDDED
    from test_server import Server
    head = eagle3_head(tmp_path / "h", aux_ids=[1, 2, 3])
    prompts = ["Lily and Tom went to the park. Lily and Tom went to the", "Once upon a time"]
    llm = LLM(str(STORIES_EMBEDDED), kv_cache_memory_gb=0.05)
    want = [o.outputs[0].text for o in llm.generate(prompts, SamplingParams(temperature=0, max_tokens=32))]
    s = Server(str(STORIES_EMBEDDED), "--speculative-config", json.dumps(spec("eagle3", head, 2)),
               "--kv-cache-memory-gb", "0.05")
    try:
        with httpx.Client(base_url=s.url, timeout=120) as c:
            for prompt, w in zip(prompts, want):
                r = c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 32, "temperature": 0})
                assert r.status_code == 200, r.text
                assert r.json()["choices"][0]["text"] == w
            with c.stream("POST", "/v1/completions", json={
                    "prompt": prompts[0], "max_tokens": 32, "temperature": 0, "stream": True}) as r:
                text = "".join(json.loads(line[6:])["choices"][0]["text"] for line in r.iter_lines()
                               if line.startswith("data: {"))
            assert text == want[0]
            m = c.get("/metrics").text
        drafts = [float(line.split(" ")[-1]) for line in m.splitlines()
                  if line.startswith("rankserve:spec_decode_num_drafts_total")]
        assert drafts and drafts[0] > 0, m
    finally:
        assert s.stop() == 0


@pytest.mark.mpi
@pytest.mark.slow
@pytest.mark.skipif(shutil.which("mpiexec") is None, reason="mpiexec not on PATH")
def test_tp2_matches_single_rank(llama, tmp_path):
    """mpiexec -n 2 --tp 2: the head's attention and MLP split like the target's (fc
    replicated, the draft-vocabulary lm_head vocab-parallel), the auxiliary states captured on
    every rank; same greedy tokens as one rank, with drafts accepted (a nearly copying head)."""
    from test_multirank import mpi_generate, single
    target = copying_target(llama, tmp_path / "t", 0.05)
    head = copying_head(target, tmp_path / "h", "eagle3", [0, 1, 2])
    assert mpi_generate(2, target, "--tp", "2", "--speculative-config",
                        json.dumps(spec("eagle3", head))) == single(target)
