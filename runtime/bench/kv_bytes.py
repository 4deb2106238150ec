"""KV-cache bytes per token of shipped configs (or model directories), per layer and in all:
`python -m rankserve.runtime.bench.kv_bytes deepseek-v3-small llama-3.1-70b`. An MLA model
(DeepSeek-V2/V3) also gets the same attention with its keys and values decompressed (per head
qk_nope + qk_rope key values and v_head_dim value values), i.e. what a non-MLA cache of the same
width would hold. Counts in the model dtype (16-bit) unless --dtype-bytes says otherwise."""
from __future__ import annotations

import argparse

from ...models.loader import load_hf_config
from .common import model_stats, resolve_model


def rows(model: str, dtype_bytes: int) -> list[tuple[str, int, int]]:
    """[(label, layers, bytes per token per layer)]"""
    cfg = load_hf_config(resolve_model(model)[0])
    s = model_stats(cfg)
    layers = s.kv_layers
    per_layer = s.kv_bytes_per_token(dtype_bytes) // layers
    if not s.kv_latent:
        return [(f"{model} ({s.num_kv_heads} KV heads x {s.head_dim})", layers, per_layer)]
    full = cfg.num_attention_heads * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim + cfg.v_head_dim)
    return [(f"{model} MLA latent ({cfg.kv_lora_rank} + {cfg.qk_rope_head_dim})", s.num_layers, per_layer),
            (f"{model} decompressed ({cfg.num_attention_heads} heads x "
             f"{cfg.qk_nope_head_dim + cfg.qk_rope_head_dim} K + {cfg.v_head_dim} V)", s.num_layers,
             full * dtype_bytes)]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("models", nargs="+")
    ap.add_argument("--dtype-bytes", type=int, default=2)
    args = ap.parse_args(argv)
    print(f"{'KV cache':<64} {'layers':>6} {'B/token/layer':>14} {'B/token':>10} {'tokens/GiB':>11}")
    for m in args.models:
        for label, layers, per_layer in rows(m, args.dtype_bytes):
            total = per_layer * layers
            print(f"{label:<64} {layers:>6} {per_layer:>14,} {total:>10,} {2**30 // total:>11,}")


if __name__ == "__main__":
    main()
