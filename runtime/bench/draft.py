"""Cut a draft model from a checkpoint: its first N decoder layers, the same embeddings, head and
tokenizer (a draft with the target's vocabulary, as `draft_model` speculation needs).
`python -m rankserve.runtime.bench.draft SRC DST --num-layers 3`"""
from __future__ import annotations

import argparse
import json
import os
import shutil


def cut_draft(src: str, dst: str, num_layers: int) -> str:
    from safetensors.torch import load_file, save_file
    os.makedirs(dst, exist_ok=True)
    files = os.listdir(src)
    if "model.safetensors" not in files:
        raise SystemExit(f"{src}: needs one model.safetensors file")
    for f in files:
        if f not in ("config.json", "model.safetensors") and os.path.isfile(os.path.join(src, f)):
            shutil.copy(os.path.join(src, f), dst)
    with open(os.path.join(src, "config.json")) as fh:
        cfg = json.load(fh)
    if not 1 <= num_layers <= cfg["num_hidden_layers"]:
        raise SystemExit(f"--num-layers must be in [1, {cfg['num_hidden_layers']}], got {num_layers}")
    cfg["num_hidden_layers"] = num_layers
    with open(os.path.join(dst, "config.json"), "w") as fh:
        json.dump(cfg, fh)
    w = load_file(os.path.join(src, "model.safetensors"))
    save_file({k: v for k, v in w.items()
               if not k.startswith("model.layers.") or int(k.split(".")[2]) < num_layers},
              os.path.join(dst, "model.safetensors"))
    return dst


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("src")
    p.add_argument("dst")
    p.add_argument("--num-layers", type=int, default=3)
    a = p.parse_args()
    print(cut_draft(a.src, a.dst, a.num_layers))


if __name__ == "__main__":
    main()
