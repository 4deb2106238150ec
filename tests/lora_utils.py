"""Random PEFT adapters for tiny checkpoints, and their merged transformers references."""
from __future__ import annotations

from pathlib import Path

import torch

NEW = 10
PROMPTS = [[1, 5, 9, 200, 31], [1, 400, 5, 77, 78, 79, 80, 81, 82, 83, 84, 17, 3], [1, 300],
           list(range(1, 30))]
# (name, rank, alpha, rsLoRA, targets)
ADAPTERS = [
    ("all", 8, 16, False, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
    ("qv-down-rs", 4, 8, True, ["q_proj", "v_proj", "down_proj"]),
    ("mlp", 16, 8, False, ["o_proj", "gate_proj", "up_proj"]),
]


def make_adapter(base: str, out: Path, rank: int, alpha: int, rslora: bool, targets, seed: int) -> str:
    import peft
    import transformers
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    cfg = peft.LoraConfig(r=rank, lora_alpha=alpha, use_rslora=rslora, target_modules=targets,
                          init_lora_weights=False, lora_dropout=0.0)
    pm = peft.get_peft_model(model, cfg)
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_" in name:
                p.normal_(0, 0.15)
    pm.save_pretrained(out)
    return str(out)


def merged_greedy(base: str, adapter: str | None, prompts, new: int = NEW) -> list[list[int]]:
    import transformers
    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    if adapter is not None:
        import peft
        model = peft.PeftModel.from_pretrained(model, adapter).merge_and_unload()
    model.eval()
    outs = []
    for p in prompts:
        ids = torch.tensor([p])
        o = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                           do_sample=False, eos_token_id=None, pad_token_id=0)
        outs.append(o[0, len(p):].tolist())
    return outs
