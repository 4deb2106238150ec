"""Cold compile time of a deep model: whole-model torch.compile vs regional (one graph shared by
every decoder layer, as the model runner does at --compilation-level 2).

`python -m rankserve.runtime.bench.compile_time [--layers 32] [--device cpu|cuda]` builds a
narrow Llama of that depth with random weights, compiles it both ways in fresh processes with an
empty Inductor cache, and prints the first-call seconds and the largest difference to eager.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time


def one(mode: str, layers: int, device: str) -> None:
    import torch
    import transformers

    from ...models.layers import AttnMeta
    from ...models.parallel import ParallelInfo
    from ...models.loader import build_model
    cfg = transformers.LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=layers, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=512)
    cfg.architectures = ["LlamaForCausalLM"]
    dev = torch.device(device)
    torch.manual_seed(0)
    model = build_model(cfg, ParallelInfo(), torch.float32, dev)
    for p in model.parameters():
        p.data.normal_(0, 0.02)
    for a in model.attention_layers():
        a.k_cache = torch.zeros(8, 16, 2, 16, device=dev)
        a.v_cache = torch.zeros_like(a.k_cache)
    T = 24  # two prompts of 12 tokens, no cached context
    i32 = dict(dtype=torch.int32, device=dev)
    attn = AttnMeta(torch.arange(T, device=dev), torch.tensor([0, 12, T], **i32),
                    torch.tensor([12, 12], **i32), torch.tensor([[0], [1]], **i32))
    ids = torch.randint(0, 512, (T,), device=dev)
    pos = torch.arange(T, device=dev) % 12
    with torch.inference_mode():
        ref = model(ids, pos, attn)
        if mode == "whole":
            fwd = torch.compile(model.forward, fullgraph=True, dynamic=True)
        else:
            for layer in model.model.layers.values():
                layer.compile(fullgraph=True, dynamic=True)
            fwd = model.forward
        t0 = time.perf_counter()
        out = fwd(ids, pos, attn)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        print(f"{mode:<9} {time.perf_counter() - t0:7.1f} s   max |compiled - eager| "
              f"{(out - ref).abs().max().item():.1e}", flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--mode", choices=["whole", "regional"], help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.mode:
        one(args.mode, args.layers, args.device)
        return 0
    print(f"cold compile of a {args.layers}-layer Llama on {args.device} (first call)")
    for mode in ("whole", "regional"):  # each in a fresh process with an empty cache
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=tempfile.mkdtemp(), TRITON_CACHE_DIR=tempfile.mkdtemp())
        rc = subprocess.call([sys.executable, "-m", "rankserve.runtime.bench.compile_time", "--mode", mode,
                              "--layers", str(args.layers), "--device", args.device], env=env)
        if rc:
            return rc
    return 0


if __name__ == "__main__":
    sys.exit(main())
