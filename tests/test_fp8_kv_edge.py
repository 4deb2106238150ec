"""FP8 KV cache and FP8 weights at the edges of the product (CPU): weight reloads and updates of
an FP8 model (sleep level 2, update_weights_from_disk), checkpoint k/v scales in every naming
scheme and family, and the scales a checkpoint must not be allowed to ship."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from rankserve import LLM, SamplingParams

from conftest import STORIES_EMBEDDED

STORIES = str(STORIES_EMBEDDED)
SMALL = dict(num_gpu_blocks_override=64, max_model_len=128)  # fast to (re)allocate
PROMPTS = [list(range(3, 40)), [5, 6, 7, 8, 5, 6, 7, 8], [9, 10, 11]]
SP = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
T = torch.tensor


def greedy(llm, prompts=PROMPTS):
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], SP)]


def with_tensors(src, dst: Path, tensors: dict, perturb: float = 0.0) -> str:
    """A copy of checkpoint `src` plus a file of extra tensors (k/v scales); `perturb`: other
    weights too (noise of that size on every matrix)."""
    from safetensors.torch import load_file
    shutil.copytree(src, dst)
    if perturb:
        g = torch.Generator().manual_seed(1)
        for f in dst.glob("*.safetensors"):
            sd = load_file(str(f))
            save_file({k: v + perturb * torch.randn(v.shape, generator=g) if v.dim() >= 2 else v
                       for k, v in sd.items()}, str(f), metadata={"format": "pt"})
    if tensors:
        save_file(tensors, str(dst / "kv_scales.safetensors"))
    return str(dst)


def scales_of(llm) -> list[tuple[float, float]]:
    return [(round(float(a.k_scale), 6), round(float(getattr(a, "v_scale", torch.tensor(1.0))), 6))
            for a in llm.engine.executor.runner.model.attention_layers()]


def weights_of(llm) -> dict[str, tuple[int, torch.Tensor]]:
    return {n: (p.data_ptr(), p.detach().clone())
            for n, p in llm.engine.executor.runner.model.named_parameters()}


# ----------------------------------------------------------------------------------------------
# weight reloads and updates of FP8 models
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("arch", ["stories", "Qwen3MoeForCausalLM"])
def test_online_fp8_weights_reload_in_place(checkpoint, tmp_path, arch):
    """`--quantization fp8` quantizes at load time; sleep level 2 + reload_weights (and
    update_weights_from_disk) read the 16-bit checkpoint again: each shard is quantized as it
    arrives, into the same fp8 storage (CUDA graphs keep their addresses), bit for bit what a
    fresh engine loads. Failed before: the quantized parameters had lost their loaders."""
    src = STORIES if arch == "stories" else checkpoint(arch)
    kw = dict(quantization="fp8", kv_cache_dtype="fp8", **SMALL)
    llm = LLM(src, enable_sleep_mode=True, **kw)
    want, before = greedy(llm), weights_of(llm)
    assert any(t.dtype == torch.float8_e4m3fn for _, t in before.values())
    llm.sleep(2)
    llm.wake_up()
    woken = weights_of(llm)  # new storages (the graphs are captured again on wake-up)
    llm.engine.reload_weights()
    after = weights_of(llm)
    assert after.keys() == before.keys()
    for n, (_, t) in before.items():
        assert after[n][0] == woken[n][0], f"{n} moved"
        assert torch.equal(after[n][1].view(torch.uint8), t.view(torch.uint8)), n
    assert greedy(llm) == want
    if arch != "stories":
        return  # (one family suffices for updates)
    other = with_tensors(src, tmp_path / "other", {}, perturb=0.05)
    llm.update_weights_from_disk(other)
    fresh = LLM(other, **kw)
    assert greedy(llm) == greedy(fresh) != want


def test_update_weights_from_disk_takes_the_new_kv_scales(tmp_path):
    """The fp8 cache's scales belong to the checkpoint: new weights from disk bring theirs (and a
    layer the new checkpoint has none for goes back to 1.0), as a fresh engine would load them.
    Failed before: the old checkpoint's scales stayed."""
    n = 5  # stories260K's layers
    a = with_tensors(STORIES, tmp_path / "a", {f"model.layers.{i}.self_attn.kv_scale": T(0.02)
                                               for i in range(n)})
    b = with_tensors(STORIES, tmp_path / "b", {f"model.layers.{i}.self_attn.k_scale": T(4.0)
                                               for i in range(1, n)})
    llm = LLM(a, kv_cache_dtype="fp8", **SMALL)
    want_a = greedy(llm)
    fresh_b = LLM(b, kv_cache_dtype="fp8", **SMALL)
    assert scales_of(fresh_b) == [(1.0, 1.0)] + [(4.0, 1.0)] * (n - 1)
    llm.update_weights_from_disk(b)
    assert scales_of(llm) == scales_of(fresh_b)
    assert greedy(llm) == greedy(fresh_b) != want_a
    llm.update_weights_from_disk(a)
    assert scales_of(llm) == [(0.02, 0.02)] * n
    assert greedy(llm) == want_a
    # a checkpoint with an unusable scale is refused before anything is loaded
    bad = with_tensors(STORIES, tmp_path / "bad", {"model.layers.3.self_attn.k_scale": T(0.0)},
                       perturb=0.05)
    with pytest.raises(ValueError, match="model.layers.3.self_attn.k_scale: a KV-cache scale must"):
        llm.update_weights_from_disk(bad)
    assert scales_of(llm) == [(0.02, 0.02)] * n
    assert greedy(llm) == want_a


class TrainerStandIn:
    """A weight-update group whose broadcasts deliver a checkpoint's tensors, in order."""
    device = torch.device("cpu")

    def __init__(self, tensors):
        self.tensors = iter(tensors)

    def broadcast(self, t, src=0):
        t.copy_(next(self.tensors))


def test_mla_fp8_kv_b_proj_follows_weights_from_a_trainer(checkpoint, tmp_path):
    """DeepSeek with FP8 weights: MLA's absorbed attention runs on kv_b_proj dequantized once
    after loading; weights received from a trainer must redo that (as loading from disk does).
    Failed before: the old kv_b_proj stayed in use, so the tokens were neither model's."""
    from safetensors.torch import load_file

    from rankserve.runtime.weight_update import receive_weights
    a = checkpoint("DeepseekV3ForCausalLM")
    b = with_tensors(a, tmp_path / "b", {}, perturb=0.05)
    kw = dict(quantization="fp8", **SMALL)
    llm, want = LLM(a, **kw), greedy(LLM(b, **kw))
    assert greedy(llm) != want
    sd = {k: v for f in sorted(Path(b).glob("*.safetensors")) for k, v in load_file(str(f)).items()}
    names = sorted(sd)
    receive_weights(llm.engine.executor.runner.model, TrainerStandIn(sd[n] for n in names), names,
                    [str(sd[n].dtype) for n in names], [list(sd[n].shape) for n in names],
                    torch.device("cpu"))
    llm.reset_prefix_cache()
    assert greedy(llm) == want


# ----------------------------------------------------------------------------------------------
# checkpoint k/v scales: naming schemes, families, values
# ----------------------------------------------------------------------------------------------

SCALE_NAMES = {  # family: (checkpoint tensors, the (k, v) scales of its attention layers)
    "llama-modelopt": ("LlamaForCausalLM", {"model.layers.1.self_attn.k_proj.k_scale": T([0.5]),
                                            "model.layers.1.self_attn.v_proj.v_scale": T([0.25])},
                       [(1.0, 1.0), (0.5, 0.25)]),
    "nemotron-h-output-scale": ("NemotronHForCausalLM",
                                {"model.layers.1.mixer.k_proj.output_scale": T([0.5]),
                                 "model.layers.1.mixer.v_proj.output_scale": T([0.25])}, [(0.5, 0.25)]),
    "nemotron-h-kv-scale": ("NemotronHForCausalLM", {"backbone.layers.1.mixer.kv_scale": T(0.5)},
                            [(0.5, 0.5)]),
    # MLA: one latent cache, one scale; an older single kv_scale is that scale, a v_scale has
    # nothing to scale (as in vLLM)
    "deepseek-kv-scale": ("DeepseekV3ForCausalLM", {"model.layers.1.self_attn.kv_scale": T(0.5),
                                                    "model.layers.2.self_attn.k_scale": T([[0.125]]),
                                                    "model.layers.2.self_attn.v_scale": T(4.0)},
                          [(1.0, 1.0), (0.5, 1.0), (0.125, 1.0)]),
}


@pytest.mark.parametrize("case", SCALE_NAMES)
def test_kv_scale_names_of_every_family(checkpoint, tmp_path, case):
    """Failed before: these schemes were silently left at 1.0 (Nemotron-H's `mixer.` attention
    only took `k_scale` / `v_scale`, MLA dropped `kv_scale`, ModelOpt's names went nowhere)."""
    arch, tensors, want = SCALE_NAMES[case]
    path = with_tensors(checkpoint(arch), tmp_path / "ck", tensors)
    llm = LLM(path, kv_cache_dtype="fp8", **SMALL)
    assert scales_of(llm) == want
    assert len(greedy(llm, PROMPTS[:1])[0]) == SP.max_tokens


@pytest.mark.parametrize("tensors, match", [
    ({"model.layers.1.self_attn.k_scale": T(0.0)}, "must be finite and > 0"),
    ({"model.layers.1.self_attn.v_scale": T(-0.5)}, "must be finite and > 0"),
    ({"model.layers.1.self_attn.kv_scale": T(float("nan"))}, "must be finite and > 0"),
    ({"model.layers.1.self_attn.k_proj.output_scale": T([float("inf")])}, "must be finite and > 0"),
    ({"model.layers.1.self_attn.k_scale": T([0.5, 0.25, 0.5, 0.25])}, "only per-tensor"),  # per head
    ({"model.layers.1.self_attn.attn.k_scale": T(0.5)}, "not a KV-cache scale rankserve can use"),
    ({"model.layers.1.self_attn.qkv_proj.v_scale": T(0.5)}, "not a KV-cache scale rankserve can use"),
], ids=["zero", "negative", "nan", "inf", "per-head", "attn-prefix", "fused-qkv"])
def test_unusable_kv_scales_are_refused(tmp_path, tensors, match):
    """A scale of 0 / < 0 / NaN / inf turns the cache into NaN or garbage, and a scale under a
    name no layer takes would be silently replaced by 1.0: each is a startup error naming the
    tensor. Failed before: loaded as they were, or ignored."""
    path = with_tensors(STORIES, tmp_path / "ck", tensors)
    with pytest.raises(ValueError, match=match) as e:
        LLM(path, kv_cache_dtype="fp8", **SMALL)
    assert next(iter(tensors)) in str(e.value)
    LLM(path, **SMALL)  # a 16-bit cache does not read them


def test_draft_model_takes_its_own_kv_scales(tmp_path):
    """A draft model's fp8 cache uses the draft checkpoint's scales. Failed before: 1.0."""
    draft = with_tensors(STORIES, tmp_path / "draft",
                         {f"model.layers.{i}.self_attn.k_scale": T(0.25) for i in range(5)})
    spec = {"method": "draft_model", "model": draft, "num_speculative_tokens": 2}
    llm = LLM(STORIES, kv_cache_dtype="fp8", speculative_config=spec, **SMALL)
    draft_layers = llm.engine.executor.runner.proposer.model.attention_layers()
    assert [float(a.k_scale) for a in draft_layers] == [0.25] * 5
    assert scales_of(llm) == [(1.0, 1.0)] * 5
    plain = LLM(STORIES, kv_cache_dtype="fp8", **SMALL)
    assert greedy(llm) == greedy(plain)


# ----------------------------------------------------------------------------------------------
# GPU (run on the H200 with `pytest -m gpu`)
# ----------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("arch", ["stories", "DeepseekV3ForCausalLM"])
def test_gpu_fp8_weight_and_scale_updates_reach_the_cuda_graphs(checkpoint, tmp_path, arch):
    """CUDA graphs captured at startup replay whatever the fp8 weights, the k/v scales and
    MLA's dequantized kv_b_proj hold: updates from disk and from a trainer write all of them in
    place (no sleep, no recapture), so the tokens are a fresh engine's."""
    from safetensors.torch import load_file

    from rankserve.runtime.weight_update import receive_weights
    src = STORIES if arch == "stories" else checkpoint(arch)
    n = 5 if arch == "stories" else 3
    kw = dict(quantization="fp8", kv_cache_dtype="fp8", **SMALL)
    b = with_tensors(src, tmp_path / "b", {f"model.layers.{i}.self_attn.k_scale": T(0.05)
                                           for i in range(n)}, perturb=0.05)
    c = with_tensors(src, tmp_path / "c", {}, perturb=0.05)
    llm = LLM(src, **kw)
    runner = llm.engine.executor.runner
    assert runner.compiled_model.graphs, "no CUDA graphs captured"
    want_a, want_b, want_c = greedy(llm), greedy(LLM(b, **kw)), greedy(LLM(c, **kw))
    assert want_a != want_b and want_a != want_c
    llm.update_weights_from_disk(b)
    assert scales_of(llm) == [(0.05, 1.0)] * n
    assert greedy(llm) == want_b
    llm.update_weights_from_disk(src)
    assert greedy(llm) == want_a
    sd = {k: v for f in sorted(Path(c).glob("*.safetensors")) for k, v in load_file(str(f)).items()}
    names = sorted(sd)
    receive_weights(runner.model, TrainerStandIn(sd[k] for k in names), names,
                    [str(sd[k].dtype) for k in names], [list(sd[k].shape) for k in names], runner.device)
    llm.reset_prefix_cache()
    assert greedy(llm) == want_c
