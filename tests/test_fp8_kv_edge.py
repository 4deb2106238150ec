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
    llm.engine.reload_weights()
    after = weights_of(llm)
    assert after.keys() == before.keys()
    for n, (ptr, t) in before.items():
        assert after[n][0] == ptr, f"{n} moved"
        assert torch.equal(after[n][1].view(torch.uint8), t.view(torch.uint8)), n
    assert greedy(llm) == want
    other = with_tensors(src, tmp_path / "other", {}, perturb=0.05)
    llm.update_weights_from_disk(other)
    fresh = LLM(other, **kw)
    assert greedy(llm) == greedy(fresh) != want


def test_update_weights_from_disk_takes_the_new_kv_scales(tmp_path):
    """The fp8 cache's scales belong to the checkpoint: new weights from disk bring theirs (and a
    layer the new checkpoint has none for goes back to 1.0), as a fresh engine would load them.
    Failed before: the old checkpoint's scales stayed."""
    n = 5  # stories260K's layers
    a = with_tensors(STORIES, tmp_path / "a", {f"model.layers.{i}.self_attn.kv_scale": torch.tensor(0.02)
                                               for i in range(n)})
    b = with_tensors(STORIES, tmp_path / "b", {f"model.layers.{i}.self_attn.k_scale": torch.tensor(4.0)
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
