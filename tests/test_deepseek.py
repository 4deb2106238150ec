"""DeepSeek-V2/V3 (models/deepseek.py): parity with transformers (fp32, tiny random configs with
dense + MoE layers, grouped routing, YaRN), the MLA latent cache, MTP loading."""
import pytest
import torch

from rankserve import LLM, SamplingParams

from test_parity import PROMPTS, NEW, hf_greedy, model_logits

VARIANTS = {  # beyond the fixtures' configs
    # V3: q without compression, rotate-half RoPE, no YaRN, one group, no normalization
    "v3-plain": ("DeepseekV3ForCausalLM", dict(
        q_lora_rank=None, rope_interleave=False, n_group=1, topk_group=1, norm_topk_prob=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
    # V2: plain softmax top-k, compressed q, YaRN, no shared expert, every layer MoE
    "v2-greedy": ("DeepseekV2ForCausalLM", dict(
        topk_method="greedy", n_group=None, topk_group=None, q_lora_rank=48, n_shared_experts=0,
        first_k_dense_replace=0, rope_parameters={
            "rope_type": "yarn", "rope_theta": 10000.0, "factor": 2.0,
            "original_max_position_embeddings": 128, "mscale": 1.0, "mscale_all_dim": 0.5})),
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


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_variant_matches_transformers(checkpoint, variant):
    arch, overrides = VARIANTS[variant]
    _parity(checkpoint(arch, **overrides))


def test_chunked_prefill_and_prefix_hits_keep_tokens(checkpoint):
    """The latent cache through the engine's paths: chunked prefill (8-token budget) beside
    decodes, prefix-cache hits (prompts sharing 16 and 32 tokens, then a second round), a small
    cache (8 blocks) with a host tier behind it give transformers' greedy tokens."""
    import transformers
    path = checkpoint("DeepseekV3ForCausalLM")
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    base = list(range(3, 40))
    prompts = [base, base[:16] + [7, 8, 9], base[:32] + [11], base[:5]]
    # a host tier of 32 blocks behind the 8 device blocks: the latent cache (no V) goes out and back
    llm = LLM(path, dtype="float32", max_num_seqs=4, max_num_batched_tokens=8,
              num_gpu_blocks_override=8, max_model_len=64, kv_offload_size=32 * 16 * 3 * 48 * 4 / 2**30)
    sp = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
    filler = [list(range(100 + 40 * i, 140 + 40 * i)) for i in range(2)]
    want = [hf_greedy(hf, p) for p in prompts]
    # the third round finds the first one's prefixes in the host tier (the filler evicted them)
    for batch in (prompts, filler, prompts):
        outs = llm.generate([{"prompt_token_ids": p} for p in batch], sp)
        if batch is prompts:
            assert [o.outputs[0].token_ids for o in outs] == want
    kv = llm.engine.scheduler.kv
    assert kv.prefix_hits > 0 and kv.offload.hits > 0


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


def _mtp_checkpoint(tmp_path, base: str):
    """The tiny V3 plus one MTP layer as DeepSeek ships it (model.layers.3.*: a decoder layer,
    enorm, hnorm, eh_proj, shared_head, embed_tokens), made from a 4-layer transformers model
    whose layer 3 serves as the reference block."""
    import json
    import shutil
    import transformers
    from safetensors.torch import load_file, save_file
    cfg = json.loads(open(f"{base}/config.json").read())
    cfg4 = transformers.DeepseekV3Config(**{**cfg, "num_hidden_layers": 4})
    torch.manual_seed(1)
    hf = transformers.AutoModelForCausalLM.from_config(cfg4, dtype=torch.float32).eval()
    with torch.no_grad():
        for p in hf.parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.1)
    hf.save_pretrained(tmp_path / "hf4")
    state = load_file(str(tmp_path / "hf4" / "model.safetensors"))
    g = torch.Generator().manual_seed(2)
    extra = {"enorm.weight": 1 + 0.1 * torch.randn(64, generator=g),
             "hnorm.weight": 1 + 0.1 * torch.randn(64, generator=g),
             "eh_proj.weight": 0.1 * torch.randn(64, 128, generator=g),
             "shared_head.norm.weight": 1 + 0.1 * torch.randn(64, generator=g),
             "shared_head.head.weight": 0.1 * torch.randn(512, 64, generator=g),
             "embed_tokens.weight": 0.1 * torch.randn(512, 64, generator=g)}
    state.update({f"model.layers.3.{k}": v for k, v in extra.items()})
    out = tmp_path / "mtp"
    shutil.copytree(base, out)
    save_file(state, str(out / "model.safetensors"))
    cfg.update(num_hidden_layers=3, num_nextn_predict_layers=1)
    (out / "config.json").write_text(json.dumps(cfg))
    return str(out), hf, extra


def test_mtp_layer_loads_and_matches_reference(checkpoint, tmp_path):
    from rankserve.models.layers import AttnMeta
    path, hf, extra = _mtp_checkpoint(tmp_path, checkpoint("DeepseekV3ForCausalLM"))
    plain = LLM(path, dtype="float32", max_num_seqs=2).engine.executor.runner.model
    # without MTP speculation the layer is neither built nor loaded nor given a cache
    assert not hasattr(plain, "mtp") and len(plain.attention_layers()) == 3
    del plain
    llm = LLM(path, dtype="float32", max_num_seqs=2,
              speculative_config={"method": "mtp", "num_speculative_tokens": 1})
    runner = llm.engine.executor.runner
    model = runner.model
    assert len(model.mtp) == 1 and len(model.attention_layers()) == 4  # its own latent cache
    prompt = PROMPTS[3][:20]
    n = len(prompt)
    ids = torch.tensor(prompt)

    def meta(m):
        return AttnMeta(torch.arange(m), torch.tensor([0, m], dtype=torch.int32),
                        torch.tensor([m], dtype=torch.int32),
                        torch.arange(-(-m // runner.block_size), dtype=torch.int32)[None])
    with torch.inference_mode():
        h = model(ids, torch.arange(n), meta(n))  # main model, after its final norm
        # pairs (h_t, token t+1) at t's position, as speculative decoders feed them
        ours = model.mtp_logits(model.mtp_forward(h[:-1], ids[1:], torch.arange(n - 1), meta(n - 1)))
    # reference: transformers' layer 3 on eh_proj([enorm(E t+1) | hnorm(h_t)]), causal
    def rms(x, w):
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))
    with torch.no_grad():
        x = torch.cat([rms(extra["embed_tokens.weight"][ids[1:]], extra["enorm.weight"]),
                       rms(h[:-1], extra["hnorm.weight"])], -1) @ extra["eh_proj.weight"].T
        x = x[None]
        pos = torch.arange(n - 1)[None]
        mask = torch.full((n - 1, n - 1), float("-inf")).triu(1)[None, None]
        y = hf.model.layers[3](x, attention_mask=mask, position_ids=pos,
                               position_embeddings=hf.model.rotary_emb(x, pos))
        y = y[0] if isinstance(y, tuple) else y
        ref = rms(y[0], extra["shared_head.norm.weight"]) @ extra["shared_head.head.weight"].T
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)
    # the main forward skips MTP: transformers' 3 layers (it ignores layer 3) give the same tokens
    import transformers
    hf3 = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    out = llm.generate([{"prompt_token_ids": prompt}],
                       SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True))
    assert out[0].outputs[0].token_ids == hf_greedy(hf3, prompt)


def test_checkpoint_without_mtp_runs_without_it(checkpoint):
    llm = LLM(checkpoint("DeepseekV3ForCausalLM"), dtype="float32", max_num_seqs=2)
    model = llm.engine.executor.runner.model
    assert not hasattr(model, "mtp") and len(model.attention_layers()) == 3


def _quantize_block_fp8(src: str, dst, block: int = 16):
    """Block-FP8 copy of a tiny DeepSeek checkpoint as DeepSeek-V3 ships it (`weight` e4m3 and
    `weight_scale_inv` per block for every attention, MLP and expert projection; embeddings, norms,
    router and head dense), and a dense copy of the dequantized weights (the reference)."""
    import json
    import shutil
    from safetensors.torch import load_file, save_file
    state = load_file(f"{src}/model.safetensors")
    out, deq = {}, {}
    for name, w in state.items():
        if w.dim() == 2 and (".self_attn." in name or ("_proj." in name and ".mlp." in name)):
            s = w.abs().unflatten(0, (-1, block)).unflatten(2, (-1, block)).amax((1, 3)) / 448
            full = s.repeat_interleave(block, 0).repeat_interleave(block, 1)
            q = (w / full).clamp(-448, 448).to(torch.float8_e4m3fn)
            out[name], out[name + "_scale_inv"] = q, s
            deq[name] = q.float() * full
        else:
            out[name] = deq[name] = w
    for d, tensors in ((dst / "fp8", out), (dst / "deq", deq)):
        shutil.copytree(src, d)
        save_file(tensors, str(d / "model.safetensors"))
    cfg = json.loads((dst / "fp8" / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                                  "weight_block_size": [block, block]}
    (dst / "fp8" / "config.json").write_text(json.dumps(cfg))
    return str(dst / "fp8"), str(dst / "deq")


def test_block_fp8_checkpoint(checkpoint, tmp_path):
    """DeepSeek-V3's block FP8: projections and experts stay FP8 and the absorbed form uses the
    dequantized kv_b_proj. Against transformers on the dequantized weights with its activations
    quantized as ours are (per 1 x 16 group; test_quantization's reference), except c_kv, which
    the absorbed form never quantizes: close logits, as test_quantization allows."""
    import transformers
    from rankserve.kernels.quant import FP8
    from test_quantization import LOGIT_TIE_TOL, LOGIT_TOL, fake_quant_activations
    fp8, deq = _quantize_block_fp8(checkpoint("DeepseekV3ForCausalLM"), tmp_path)
    llm = LLM(fp8, dtype="float32", max_num_seqs=2)
    model = llm.engine.executor.runner.model
    layer = model.model.layers["1"]
    assert layer.self_attn.q_a_proj.weight.dtype == FP8 and layer.self_attn.kv_b_proj.weight.dtype == FP8
    assert layer.mlp.experts.w13.dtype == FP8 and layer.mlp.shared_experts.gate_up_proj.weight.dtype == FP8
    hf = transformers.AutoModelForCausalLM.from_pretrained(deq, dtype=torch.float32,
                                                           experts_implementation="eager").eval()
    dense = hf.model.layers[1].self_attn.kv_b_proj.weight
    torch.testing.assert_close(layer.self_attn.w_kv_b, dense, atol=0, rtol=0)
    fq = fake_quant_activations(hf, 16)
    fq.storages = {p.untyped_storage().data_ptr() for n, p in hf.named_parameters()
                   if ("_proj" in n and "kv_b_proj" not in n) and "embed" not in n}
    with fq, torch.no_grad():
        refs = [hf(torch.tensor([p])).logits[0, -1] for p in PROMPTS]
    errs = [float((model_logits(llm, p) - r).norm() / r.norm()) for p, r in zip(PROMPTS, refs)]
    assert sum(e < LOGIT_TOL for e in errs) >= 2 and max(errs) < LOGIT_TIE_TOL, errs


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("level", [1, 2])
def test_gpu_graphs_match_eager(checkpoint, level):
    """The Triton MLA path (prefill and split-KV decode) under CUDA graphs / torch.compile gives
    eager's greedy tokens; a long prompt makes decode split its keys."""
    path = checkpoint("DeepseekV3ForCausalLM")
    prompts = [{"prompt_token_ids": p} for p in PROMPTS + [list(range(3, 200))]] * 2
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    common = dict(dtype="float32", max_num_seqs=16, gpu_memory_utilization=0.3)
    eager = [o.outputs[0].token_ids for o in LLM(path, enforce_eager=True, **common).generate(prompts, sp)]
    fast = LLM(path, compilation_level=level, **common)
    assert fast.engine.executor.runner.compiled_model.graphs, "no CUDA graph was captured"
    assert [o.outputs[0].token_ids for o in fast.generate(prompts, sp)] == eager


@pytest.mark.gpu
@needs_cuda
def test_gpu_bf16_close_to_transformers(checkpoint):
    import transformers
    path = checkpoint("DeepseekV3ForCausalLM")
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    llm = LLM(path, dtype="bfloat16", max_num_seqs=4, gpu_memory_utilization=0.3)
    for p in PROMPTS:
        with torch.no_grad():
            ref = hf(torch.tensor([p])).logits[0, -1]
        ours = _device_logits(llm, p).float().cpu()
        assert float((ours - ref).norm() / ref.norm()) < 3e-2


def _device_logits(llm, prompt):
    """test_parity.model_logits on the runner's device (the Triton path on CUDA)."""
    from rankserve.models.layers import AttnMeta
    runner = llm.engine.executor.runner
    n, dev = len(prompt), runner.device
    i32 = dict(dtype=torch.int32, device=dev)
    attn = AttnMeta(torch.arange(n, device=dev), torch.tensor([0, n], **i32), torch.tensor([n], **i32),
                    torch.arange(-(-n // runner.block_size), **i32)[None])
    with torch.inference_mode():
        h = runner.model(torch.tensor(prompt, device=dev), torch.arange(n, device=dev), attn)
        return runner.model.compute_logits(h[-1:])[0]


@pytest.mark.parametrize("field, value, words", [
    ("topk_method", "noaux_tc", "topk_method 'noaux_tc' is not supported for DeepseekV2"),
    ("moe_layer_freq", 2, "moe_layer_freq 2"),
    ("rope_parameters", {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}, "rope_type 'linear'"),
])
def test_unsupported_settings_are_refused(checkpoint, field, value, words):
    from rankserve.models.loader import build_model, load_hf_config
    from rankserve.models.parallel import ParallelInfo
    cfg = load_hf_config(checkpoint("DeepseekV2ForCausalLM"))
    setattr(cfg, field, value)
    with pytest.raises(ValueError, match=words):
        build_model(cfg, ParallelInfo(), torch.float32, torch.device("meta"))


def test_fp8_latent_cache(checkpoint, monkeypatch):
    """--kv-cache-dtype fp8: the latent stored in e4m3 (1 byte a value, scale 1.0 without
    checkpoint scales). Reference: the 16-bit cache holding the same e4m3-rounded latents gives
    the same logits (the random tiny model amplifies e4m3's 3-bit rounding too much for a
    tolerance against the unrounded cache)."""
    from rankserve.kernels import mla
    from rankserve.kernels.attention import quantize_fp8
    path = checkpoint("DeepseekV3ForCausalLM")
    fp8 = LLM(path, dtype="float32", kv_cache_dtype="fp8", max_num_seqs=2)
    ref = LLM(path, dtype="float32", max_num_seqs=2)
    runner = fp8.engine.executor.runner
    assert runner.model.attention_layers()[0].k_cache.dtype == torch.float8_e4m3fn
    assert runner.kv_bytes_per_block() * 4 == ref.engine.executor.runner.kv_bytes_per_block()
    store = mla.store_latent_ref
    monkeypatch.setattr(mla, "store_latent_ref", lambda kv, cache, slots, scale=None: store(
        quantize_fp8(kv, None).float(), cache, slots))
    for p in PROMPTS:
        torch.testing.assert_close(model_logits(fp8, p), model_logits(ref, p), atol=1e-4, rtol=1e-4)


def test_kimi_k2_style_config_loads_without_remote_code(checkpoint, tmp_path):
    """Kimi-K2 ships the V3 architecture under model_type "kimi_k2" with remote code: read with
    transformers' DeepseekV3Config (the remote code never runs), the same model."""
    import json
    import shutil
    src = checkpoint("DeepseekV3ForCausalLM")
    kimi = tmp_path / "kimi"
    shutil.copytree(src, kimi)
    cfg = json.loads((kimi / "config.json").read_text())
    cfg.update(model_type="kimi_k2", auto_map={"AutoConfig": "configuration_deepseek.DeepseekV3Config"})
    (kimi / "config.json").write_text(json.dumps(cfg))
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    a, b = (LLM(p, dtype="float32", max_num_seqs=2).generate([{"prompt_token_ids": PROMPTS[0]}], sp)
            for p in (str(kimi), src))
    assert a[0].outputs[0].token_ids == b[0].outputs[0].token_ids


def test_bench_counts_the_latent(capsys):
    """The shipped deepseek-v3-small: its floor counts MLA's latent KV (layers x 576 values) and
    the absorbed form's attention FLOPs; the KV table sets it beside decompressed K/V and GQA."""
    from rankserve.models.loader import load_hf_config
    from rankserve.runtime.bench import kv_bytes
    from rankserve.runtime.bench.common import model_stats, resolve_model
    s = model_stats(load_hf_config(resolve_model("deepseek-v3-small")[0]))
    assert s.kv_bytes_per_token(2) == 8 * (512 + 64) * 2
    assert s.attn_flops_per_context == 2 * (2 * 512 + 64) * 128 * 8
    assert 18e9 < s.num_params < 19e9 and s.num_experts == 64 and s.top_k == 8
    kv_bytes.main(["deepseek-v3-small", "llama-3.1-70b"])
    out = capsys.readouterr().out
    assert "MLA latent (512 + 64)" in out and "1,152" in out and "81,920" in out and "4,096" in out
