"""Random PEFT adapters for LoRA benchmarks (`rankserve bench throughput --num-loras N`): the
same workload with its requests spread round-robin over N adapters of rank --max-lora-rank,
to compare with the base model's run (see README, LoRA adapters)."""
from __future__ import annotations

import json
import os
import tempfile

import torch

ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")


def _shapes(hf_config) -> dict[str, tuple[int, int]]:
    """(in, out) of each LoRA target of one decoder layer (MoE models: attention only)."""
    h = hf_config.hidden_size
    hd = getattr(hf_config, "head_dim", None) or h // hf_config.num_attention_heads
    q, kv = hf_config.num_attention_heads * hd, hf_config.num_key_value_heads * hd
    out = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h)}
    moe = any(getattr(hf_config, k, None) for k in ("num_experts", "num_local_experts",
                                                     "n_routed_experts"))
    if not moe:
        i = hf_config.intermediate_size
        out.update(gate_proj=(h, i), up_proj=(h, i), down_proj=(i, h))
    return out


def write_random_adapter(path: str, hf_config, rank: int, seed: int) -> str:
    """A PEFT adapter directory (bf16, all supported targets) with random weights; written
    atomically so ranks that read it while another writes it see whole files."""
    from safetensors.torch import save_file
    if os.path.isfile(os.path.join(path, "adapter_model.safetensors")):
        return path
    os.makedirs(path, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    shapes = _shapes(hf_config)
    tensors = {}
    for layer in range(hf_config.num_hidden_layers):
        for name, (k, n) in shapes.items():
            part = "self_attn" if name in ATTN else "mlp"
            pre = f"base_model.model.model.layers.{layer}.{part}.{name}"
            tensors[f"{pre}.lora_A.weight"] = (torch.randn(rank, k, generator=g) / k ** 0.5).bfloat16()
            tensors[f"{pre}.lora_B.weight"] = (torch.randn(n, rank, generator=g) * 0.01).bfloat16()
    cfg = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(shapes),
           "bias": "none", "base_model_name_or_path": None}
    for fname, write in (("adapter_config.json", lambda f: open(f, "w").write(json.dumps(cfg))),
                         ("adapter_model.safetensors", lambda f: save_file(tensors, f))):
        fd, tmp = tempfile.mkstemp(dir=path)
        os.close(fd)
        write(tmp)
        os.replace(tmp, os.path.join(path, fname))
    return path


def bench_adapters(cfg, hf_config, num_loras: int) -> list:
    """`num_loras` random adapters under the cache dir (shared by the ranks of a job)."""
    from ..messages import LoRARequest
    rank = cfg.lora.max_lora_rank
    root = os.path.join(cfg.compilation.cache_dir, "lora-bench",
                        f"{os.path.basename(os.path.normpath(cfg.model.model))}-r{rank}")
    return [LoRARequest(f"bench-{i}", i + 1,
                        write_random_adapter(os.path.join(root, str(i)), hf_config, rank, i))
            for i in range(num_loras)]
