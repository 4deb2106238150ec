"""Shared pieces of `rankserve bench throughput|latency`: model resolution, workloads, device
ceilings, the physical floor, and JSON / plot output.

The physical floor
------------------
A lower bound on the time of a workload on this device, from what it must move and compute:

    floor = max(bytes / HBM bandwidth, FLOPs / matmul rate)     (ceilings measured on one device, × TP × PP ranks)

Bytes (in the model dtype, except quantized linear weights and an fp8 KV cache, counted at their
measured width: `byte_widths`; P = prompt length, O = output tokens of a request):
  weights   Σ over engine steps that ran a forward of the weights that step must read:
            every non-embedding parameter plus the LM head (the input embedding is a row gather;
            a tied matrix counts once, as the head). For MoE the routed experts count by the
            expected share a step of n tokens touches under uniform routing, 1 - (1 - k/E)^n.
  KV read   Σ_req Σ_{t<O} (P + t) × kv_bytes_per_token (MLA: the latent, layers × (L + R)
            values): each step that produces a token reads
            the KV of its whole context once (t = 0 is the prefill over the prompt).
  KV write  Σ_req (P + O - 1) × kv_bytes_per_token (the last sampled token is never written).
            (KV layers only: a hybrid model's Mamba2 and MLP blocks have none.)
  state     hybrid models: Σ_req (2 O - 1) × recurrent state bytes (conv + SSM): the prefill
            writes a request's state, each of its O - 1 decode steps reads and writes it.
FLOPs:
  linear    2 × (non-embedding parameters active per token) × Σ (P + O - 1) tokens processed
            + 2 × V × H × Σ O (the LM head only runs on sampled positions).
  attention 4 × head_dim × heads × layers × Σ context over processed tokens (QKᵀ and PV; MLA:
            2 × (2 kv_lora_rank + rope dims) per head, the absorbed form), where
            a prompt token at position i sees i + 1 tokens and decode token t sees P + t.
  SSM       Mamba2 layers: (4 × heads × head_dim × state + 2 × conv width × conv channels) per
            processed token and layer (the recurrence's update and readout, the conv).

The floor ignores activations, the sampler, launch overheads and communication, so
`achieved_fraction = floor / measured` is at most ~1 and says how close a run is to the hardware.
"""
from __future__ import annotations

import datetime
import json
import os
import platform
import shlex
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from .. import startup_clock
from ..startup_clock import format_account, process_age  # noqa: F401  (re-exported)

CONFIGS_DIR = Path(__file__).resolve().parent / "configs"


# ---- models ---------------------------------------------------------------------------------
def shipped_configs() -> list[str]:
    return sorted(p.stem for p in CONFIGS_DIR.glob("*.json"))


def resolve_model(model: str | None) -> tuple[str | None, bool]:
    """(model directory, is_named): a shipped config name becomes a temp dir with its config.json."""
    if model is None or os.path.isdir(model):
        return model, False
    path = CONFIGS_DIR / f"{model.lower()}.json"
    if not path.is_file():
        raise ValueError(f"{model!r} is neither a model directory nor a shipped config "
                         f"({', '.join(shipped_configs())})")
    tmp = tempfile.mkdtemp(prefix=f"rankserve-{model.lower()}-")
    with open(os.path.join(tmp, "config.json"), "w") as f:
        f.write(path.read_text())
    return tmp, True


@dataclass
class ModelStats:
    """Parameter counts of the full (unsharded) model, by how a forward step uses them."""
    num_params: int  # unique parameters (a tied embedding counted once)
    body_params: int  # dense non-embedding parameters: attention, norms, dense MLPs, routers
    expert_params: int  # routed experts, all layers
    num_experts: int  # E (0 for dense models)
    top_k: int  # experts per token
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    # MLA (DeepSeek-V2/V3): the cached latent per token and layer (kv_lora_rank + rope dims), and
    # kv_lora_rank itself; 0 for models that cache per-head keys and values
    kv_latent: int = 0
    kv_lora_rank: int = 0
    num_kv_layers: int | None = None  # layers with a KV cache (None: all of them)
    conv_state_elems: int = 0  # recurrent state per request, in the model dtype (Mamba2 conv)
    ssm_state_elems: int = 0  # recurrent state per request (Mamba2 SSM, fp32 by default)
    ssm_flops_per_token: int = 0  # Mamba2 layers' recurrence + conv FLOPs, all layers

    @property
    def head_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def kv_layers(self) -> int:
        """Layers with a KV cache (a hybrid's attention layers only)."""
        return self.num_layers if self.num_kv_layers is None else self.num_kv_layers

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        if self.kv_latent:
            return self.kv_layers * self.kv_latent * dtype_bytes
        return 2 * self.kv_layers * self.num_kv_heads * self.head_dim * dtype_bytes

    def state_bytes(self, dtype_bytes: int, ssm_bytes: int = 4) -> int:
        """Recurrent (Mamba2) state of one request, any length."""
        return self.conv_state_elems * dtype_bytes + self.ssm_state_elems * ssm_bytes

    @property
    def attn_flops_per_context(self) -> int:
        """FLOPs of one query token against one context token, all heads and layers: QK^T and
        PV over head_dim, or for MLA's absorbed form over the latent (L + R, then L)."""
        per_head = 2 * (2 * self.kv_lora_rank + (self.kv_latent - self.kv_lora_rank)) \
            if self.kv_latent else 4 * self.head_dim
        return per_head * self.num_heads * self.kv_layers

    def step_weight_params(self, num_tokens: int) -> float:
        """Parameters one forward over `num_tokens` tokens must read."""
        touched = 1.0
        if self.num_experts:
            touched = 1 - (1 - self.top_k / self.num_experts) ** num_tokens
        return self.body_params + self.head_params + self.expert_params * touched

    @property
    def active_params_per_token(self) -> float:
        """Non-embedding, non-head parameters each token multiplies with."""
        share = self.top_k / self.num_experts if self.num_experts else 0.0
        return self.body_params + self.expert_params * share


def model_stats(hf_config) -> ModelStats:
    """Count parameters by building the rankserve model on the meta device (no memory). A
    quantized checkpoint's model is built dense: its logical weights are counted (the floor
    multiplies them by the bytes per weight that `byte_widths` measures), not its packed
    tensors (4-bit: eight weights per int32)."""
    import copy

    from ...models.parallel import ParallelInfo
    from ...models.loader import build_model
    from ...models.config_queries import without_mtp  # the floor of the main model (MTP: a proposer)
    cfg = without_mtp(hf_config)
    if getattr(cfg, "quantization_config", None):
        cfg = copy.deepcopy(cfg)
        cfg.quantization_config = None
    model = build_model(cfg, ParallelInfo(), torch.bfloat16, torch.device("meta"))
    total = body = experts = 0
    for name, p in model.named_parameters():  # tied weights appear once
        total += p.numel()
        if name.endswith(("embed_tokens.weight", "embeddings.weight")) or name.startswith("lm_head"):
            continue
        if ".experts." in name:
            experts += p.numel()
        else:
            body += p.numel()
    num_experts = getattr(hf_config, "num_experts", None) or getattr(hf_config, "num_local_experts", 0)
    conv = ssm = flops = 0
    for m in getattr(model, "mamba_layers", list)():
        c, st = m.state_shapes(1)
        conv, ssm = conv + c[1] * c[2], ssm + st[1] * st[2] * st[3]
        flops += 4 * st[1] * st[2] * st[3] + 2 * m.K * m.conv_dim
    heads = hf_config.num_attention_heads
    return ModelStats(
        num_params=total, body_params=body, expert_params=experts,
        num_experts=num_experts if experts else 0,
        top_k=getattr(hf_config, "num_experts_per_tok", 0) if experts else 0,
        vocab_size=hf_config.vocab_size, hidden_size=hf_config.hidden_size,
        num_layers=hf_config.num_hidden_layers, num_heads=heads,
        num_kv_heads=getattr(hf_config, "num_key_value_heads", None) or heads,
        head_dim=getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads,
        kv_latent=(hf_config.kv_lora_rank + hf_config.qk_rope_head_dim)
        if getattr(hf_config, "kv_lora_rank", None) else 0,
        kv_lora_rank=getattr(hf_config, "kv_lora_rank", None) or 0,
        num_kv_layers=len(model.attention_layers()), conv_state_elems=conv, ssm_state_elems=ssm,
        ssm_flops_per_token=flops)


# ---- workloads ------------------------------------------------------------------------------
WORKLOADS = {
    # W1: offline throughput, 256 requests, lengths uniform in [100, 1024], EOS ignored
    "w1": dict(num_prompts=256, input_len=(100, 1024), output_len=(100, 1024)),
    # W2: batch 1, 128-token prompt, 256 new tokens
    "w2": dict(num_prompts=1, input_len=(128, 128), output_len=(256, 256)),
}


@dataclass
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def prompt_lens(self) -> list[int]:
        return [len(p) for p in self.prompts]

    def summary(self) -> dict:
        p, o = self.prompt_lens, self.output_lens
        return dict(num_requests=len(p), prompt_tokens=sum(p), output_tokens=sum(o),
                    prompt_len_min=min(p), prompt_len_max=max(p),
                    output_len_min=min(o), output_len_max=max(o))


def make_workload(num_prompts: int, input_len: tuple[int, int], output_len: tuple[int, int],
                  vocab_size: int, seed: int, repeat_period: int = 0) -> Workload:
    """Random token-id prompts (no shared prefixes, so prefix caching cannot shortcut the run).
    `repeat_period` > 0: each prompt tiles a random segment of that many tokens (a text the
    answer can copy from: n-gram speculation finds its continuations)."""
    g = torch.Generator().manual_seed(seed)

    def lens(lo, hi):
        return torch.randint(lo, hi + 1, (num_prompts,), generator=g).tolist()
    plens, olens = lens(*input_len), lens(*output_len)
    prompts = []
    for n in plens:
        seg = torch.randint(0, vocab_size, (repeat_period or n,), generator=g).tolist()
        prompts.append((seg * (n // len(seg) + 1))[:n])
    return Workload(prompts, olens)


def spec_snapshot(llm) -> tuple:
    """The engine's cumulative speculative-decoding counts (runtime/scheduler.py)."""
    s = llm.engine.scheduler.spec
    return (s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens, list(s.accepted_per_pos))


def spec_summary(before: tuple, after: tuple) -> dict | None:
    """Acceptance over a run (None without speculation): rate = accepted / draft tokens, mean
    acceptance length = tokens emitted per verify pass (1 + accepted / drafts, as vLLM), and
    per draft position the fraction of verify passes that accepted it."""
    drafts, tokens, acc = (a - b for a, b in zip(after[:3], before[:3]))
    if not drafts:
        return None
    per_pos = [a - (before[3][i] if i < len(before[3]) else 0) for i, a in enumerate(after[3])]
    return dict(num_drafts=drafts, num_draft_tokens=tokens, num_accepted_tokens=acc,
                acceptance_rate=acc / max(tokens, 1), mean_acceptance_length=1 + acc / drafts,
                acceptance_per_pos=[n / drafts for n in per_pos])


def format_spec(s: dict | None) -> str:
    if not s:
        return "  speculative decoding: no drafts verified"
    return (f"  speculative decoding: acceptance rate {100 * s['acceptance_rate']:.1f}%, mean "
            f"acceptance length {s['mean_acceptance_length']:.2f} ({s['num_drafts']} verify passes, "
            f"{s['num_accepted_tokens']} of {s['num_draft_tokens']} drafts accepted; per position "
            + " ".join(f"{x:.2f}" for x in s["acceptance_per_pos"]) + ")")


# ---- device ceilings ------------------------------------------------------------------------
def _time(fn, device: torch.device, reps: int, warmup: int = 2) -> float:
    """Median seconds of `fn` (CUDA events on GPU, perf_counter on CPU)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure_ceilings(device: torch.device, reps: int = 5) -> dict:
    """HBM bandwidth (device-to-device copy, read + write) and dense matmul rate of this device.

    GPU: a 2 GiB copy and a bf16 8192³ matmul. CPU: a 64 MiB copy and an fp32 1024³ matmul
    (bf16 is not the CPU path's dtype, and the large sizes would take minutes)."""
    cuda = device.type == "cuda"
    nbytes = 2 * 2**30 if cuda else 64 * 2**20
    n, dtype = (8192, torch.bfloat16) if cuda else (1024, torch.float32)
    while True:
        try:
            src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).fill_(1.0)
            dst = torch.empty_like(src)
            break
        except torch.OutOfMemoryError:  # the engine already holds most of the device
            nbytes //= 2
    copy_s = _time(lambda: dst.copy_(src), device, reps)
    src = dst = None
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    mm_s = _time(lambda: torch.matmul(a, b), device, reps)
    a = b = None
    if cuda:
        torch.cuda.empty_cache()
    return dict(device=device_name(device), hbm_GBps=2 * nbytes / copy_s / 1e9,
                matmul_TFLOPs=2 * n**3 / mm_s / 1e12, copy_bytes=nbytes, matmul_n=n,
                matmul_dtype=str(dtype).replace("torch.", ""), reps=reps,
                note="" if cuda else "CPU: small sizes (64 MiB copy, fp32 1024^3 matmul)")


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return platform.processor() or platform.machine() or "cpu"


# ---- the floor ------------------------------------------------------------------------------
@dataclass
class StepLog:
    """Tokens processed by each engine step that ran a forward (filled by an engine step hook)."""
    tokens: list[int] = field(default_factory=list)

    def clear(self):
        self.tokens.clear()


def byte_widths(runner) -> dict:
    """Bytes per weight of the linear layers and experts (quantized: FP8 ~1, 4-bit ~0.52, with
    their scales), per KV-cache element and (hybrid models) per SSM-state element, measured on
    the runner's model, for the floor."""
    nbytes = logical = 0
    # MLA streams a dequantized 16-bit copy of a quantized kv_b_proj (models/deepseek.py), not its own
    dense = {id(a.kv_b_proj): a.w_kv_b for a in runner.model.modules()
             if getattr(a, "w_kv_b", None) is not None}
    for mod in runner.model.modules():
        if getattr(mod, "quant", None) is None:
            continue
        own = [dense[id(mod)]] if id(mod) in dense else [
            p for n, p in mod.named_parameters(recurse=False) if n != "bias"]
        nbytes += sum(p.numel() * p.element_size() for p in own)
        if hasattr(mod, "weight_shape"):  # a parallel linear layer: in x out weights
            logical += mod.weight_shape[0] * mod.weight_shape[1]
        else:  # fused experts
            logical += mod.weight_numel
    kv = getattr(runner, "kv_dtype", runner.dtype)
    widths = dict(linear=nbytes / logical if logical else runner.dtype.itemsize, kv=kv.itemsize)
    if getattr(runner.model, "mamba_layers", list)():  # hybrid: the SSM states' width too
        widths["ssm"] = runner.ssm_dtype.itemsize
    return widths


def physical_floor(stats: ModelStats, prompt_lens: list[int], output_lens: list[int],
                   step_tokens: list[int], dtype_bytes: int, ceilings: dict,
                   num_devices: int = 1, widths: dict | None = None) -> dict:
    """Bytes, FLOPs and the floor time of a workload (see the module docstring). `widths`
    (`byte_widths`): the linear weights' and the KV cache's bytes when they are not the model
    dtype's (quantized weights, an fp8 KV cache); embedding and head stay at `dtype_bytes`."""
    lin_b = widths["linear"] if widths else dtype_bytes
    kv_tok = stats.kv_bytes_per_token(widths["kv"] if widths else dtype_bytes)
    ctx_read = kv_written = tokens = attn_ctx = 0
    for p, o in zip(prompt_lens, output_lens):
        ctx_read += o * p + o * (o - 1) // 2  # Σ_{t<o} (p + t)
        kv_written += p + o - 1
        tokens += p + o - 1
        attn_ctx += p * (p + 1) // 2 + (o - 1) * p + (o - 1) * o // 2  # prompt, then decode
    state_b = stats.state_bytes(dtype_bytes, widths.get("ssm", 4) if widths else 4)
    state = sum(2 * o - 1 for o in output_lens) * state_b
    weights = sum((stats.step_weight_params(n) - stats.head_params) * lin_b
                  + stats.head_params * dtype_bytes for n in step_tokens)
    kv_read, kv_write = ctx_read * kv_tok, kv_written * kv_tok
    flops_linear = 2 * stats.active_params_per_token * tokens + 2 * stats.head_params * sum(output_lens)
    flops_attn = stats.attn_flops_per_context * attn_ctx
    flops_ssm = stats.ssm_flops_per_token * tokens
    nbytes, flops = weights + kv_read + kv_write + state, flops_linear + flops_attn + flops_ssm
    t_mem = nbytes / (ceilings["hbm_GBps"] * 1e9 * num_devices)
    t_comp = flops / (ceilings["matmul_TFLOPs"] * 1e12 * num_devices)
    return dict(num_steps=len(step_tokens), tokens_processed=tokens,
                bytes_weights=weights, bytes_kv_read=kv_read, bytes_kv_write=kv_write,
                bytes_state=state, bytes_total=nbytes, flops_linear=flops_linear,
                flops_attention=flops_attn, flops_ssm=flops_ssm,
                flops_total=flops, t_memory_s=t_mem, t_compute_s=t_comp,
                floor_s=max(t_mem, t_comp), bound="memory" if t_mem >= t_comp else "compute",
                num_devices=num_devices)


def with_achieved(floor: dict, measured_s: float, output_tokens: int) -> dict:
    return dict(floor, floor_output_tokens_per_s=output_tokens / floor["floor_s"],
                achieved_fraction=floor["floor_s"] / measured_s)


def format_floor(f: dict) -> str:
    return (f"  floor: {f['floor_s'] * 1e3:.3f} ms ({f['bound']}-bound: "
            f"{f['bytes_total'] / 1e9:.3f} GB, {f['flops_total'] / 1e12:.3f} TFLOP, "
            f"{f['num_steps']} steps) = {f['floor_output_tokens_per_s']:.1f} output tok/s; "
            f"achieved {100 * f['achieved_fraction']:.1f}% of the floor")


def format_ceilings(c: dict) -> str:
    return (f"device ceilings ({c['device']}): HBM {c['hbm_GBps']:.1f} GB/s, matmul "
            f"{c['matmul_TFLOPs']:.2f} TFLOP/s ({c['matmul_dtype']} {c['matmul_n']}^3)"
            + (f" [{c['note']}]" if c["note"] else ""))


def format_timings(t: dict) -> str:
    return "  startup: " + ", ".join(f"{k} {v:.2f}s" for k, v in t.items())


# ---- output ---------------------------------------------------------------------------------
def environment() -> dict:
    def version(dist):  # the installed version, without importing it (transformers: seconds)
        import importlib.metadata
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            return None
    return dict(date=datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
                host=platform.node(), python=platform.python_version(),
                torch=torch.__version__, triton=version("triton"),
                transformers=version("transformers"), cuda=torch.version.cuda,
                gpu=torch.cuda.get_device_name() if torch.cuda.is_available() else None,
                command=" ".join(["rankserve"] + [shlex.quote(a) for a in sys.argv[1:]]),
                argv=list(sys.argv))


def check_writable(path: str, flag: str, directory: bool = False) -> None:
    """Before a run: `path` (a file, or with `directory` a folder) could be written, its missing
    folders made (nothing is created here); else ValueError naming `flag` (a run that cannot save
    its results is lost)."""
    path = os.path.abspath(path)
    why = None
    if os.path.exists(path):
        if os.path.isdir(path) != directory:
            why = "a directory" if not directory else "not a directory"
        elif not os.access(path, os.W_OK):
            why = "not writable"
    else:
        parent = os.path.dirname(path)
        while not os.path.exists(parent):
            parent = os.path.dirname(parent)
        if not os.path.isdir(parent):
            why = f"{parent} is not a directory"
        elif not os.access(parent, os.W_OK | os.X_OK):
            why = f"{parent} is not writable"
        else:
            try:  # os.access says yes to root everywhere, but /proc, /sys take no files
                tempfile.TemporaryFile(dir=parent).close()  # unnamed: nothing is left behind
            except OSError as e:
                why = f"{parent}: {e.strerror}"
    if why:
        raise ValueError(f"{flag} {path}: cannot write there ({why})")


def vllm_keys(kind: str, results: dict) -> dict:
    """vLLM's `bench throughput` / `bench latency --output-json` keys, of the rankserve run (the
    first backend's without one), so that scripts reading vLLM's files read these."""
    r = results.get("rankserve") or next(iter(results.values()))
    if kind == "throughput":
        total = r["prompt_tokens"] + r["output_tokens"]
        return dict(elapsed_time=r["elapsed_s"], num_requests=r["num_requests"], total_num_tokens=total,
                    requests_per_second=r["requests_per_s"], tokens_per_second=total / r["elapsed_s"])
    lat = r["latencies_s"]
    return dict(avg_latency=sum(lat) / len(lat), latencies=lat,
                percentiles={str(p): _percentile(lat, p) for p in (10, 25, 50, 75, 90, 99)})


def _percentile(xs: list[float], p: float) -> float:
    """numpy's default (linear) percentile, as vLLM reports them."""
    xs = sorted(xs)
    i = (len(xs) - 1) * p / 100
    lo = int(i)
    return xs[lo] + (xs[min(lo + 1, len(xs) - 1)] - xs[lo]) * (i - lo)


def write_json(path: str, data: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(data, f, indent=2, default=lambda o: asdict(o) if hasattr(o, "__dataclass_fields__") else str(o))


def plot_bars(path: str, results: dict, metric: str, title: str) -> bool:
    """Bar chart of `metric` per backend; False when matplotlib is missing."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    names = list(results)
    values = [results[n][metric] for n in names]
    fig, ax = plt.subplots(figsize=(5, 3.5))
    bars = ax.bar(names, values, color=["tab:blue", "tab:orange", "tab:green"][:len(names)])
    # the floor's rate can be far above both bars, so it goes into the labels, not the axis
    ax.bar_label(bars, labels=[f"{v:.0f}\n({100 * results[n]['floor']['achieved_fraction']:.1f}% of floor)"
                               if "floor" in results[n] else f"{v:.0f}" for n, v in zip(names, values)],
                 fontsize=8)
    ax.margins(y=0.2)
    ax.set_ylabel(metric.replace("_", " "))
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def model_record(cfg, name: str | None, stats: ModelStats) -> dict:
    return dict(name=name, path=None if name else cfg.model.model, load_format=cfg.load.load_format,
                stats=asdict(stats))


def parallel_record(cfg) -> dict:
    """The TP/PP/EP split (results' num_devices is only their product)."""
    p = cfg.parallel
    return dict(tp=p.tensor_parallel_size, pp=p.pipeline_parallel_size, ep=p.enable_expert_parallel)


def save(record: dict, json_path: str | None, plot_path: str | None, metric: str, title: str) -> None:
    if json_path:
        write_json(json_path, record)
        print(f"wrote {json_path}")
    if plot_path:
        if plot_bars(plot_path, record["results"], metric, title):
            print(f"wrote {plot_path}")
        else:
            print("--plot: matplotlib is not installed (pip install matplotlib); no plot written")


def check_context(cfg, hf_config, input_len: int, output_len: int) -> None:
    """The longest request must fit the context: the engine would end it early at max_model_len
    (ignore_eos asks for every token), which throughput counted as a shorter request and latency
    found only after the timed run."""
    from ...models.config_queries import rope_max_len
    pos = rope_max_len(hf_config) if getattr(hf_config, "max_position_embeddings", None) else None
    limit = min(x for x in (cfg.model.max_model_len, pos) if x) if cfg.model.max_model_len or pos else None
    if limit and input_len + output_len > limit:
        raise ValueError(f"--input-len {input_len} + --output-len {output_len} = {input_len + output_len} "
                         f"tokens, more than the context of {limit} (--max-model-len"
                         f"{'' if cfg.model.max_model_len else ', from the model config'})")


# ---- profiling ------------------------------------------------------------------------------
def profile_steps(llm, run, total_steps: int, out_dir: str, label: str, row_limit: int = 25,
                  window: tuple[int, int] | None = None) -> dict:
    """Run `run()` again under torch.profiler, recording a window of engine steps: `window` =
    (first step, count), by default the steady state (from a quarter of the way in, up to 40
    steps); print the busiest kernels and how busy the device was, and write a Chrome/Perfetto
    trace to OUT_DIR/trace-LABEL.json.gz."""
    from torch.profiler import ProfilerActivity, profile, schedule
    cuda = torch.cuda.is_available()
    start, active = window or (max(1, total_steps // 4), max(1, min(40, total_steps // 2)))
    if window and start + active > total_steps:
        # a window past the end would record nothing (torch.profiler then has no trace to give):
        # keep it inside the run and say so, rather than losing the timed results to a traceback.
        if start > total_steps:  # the last COUNT steps
            start = max(1, total_steps - active + 1)
        active = max(1, min(active, total_steps - start + 1))
        print(f"--profile-steps {window[0]} {window[1]}: the run has {total_steps} engine steps; "
              f"profiling steps {start}..{start + active - 1}", flush=True)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    prof = profile(activities=acts, schedule=schedule(wait=start - 1, warmup=1, active=active, repeat=1))
    marks: list[float] = []

    def hook(plan):
        marks.append(time.perf_counter())  # before step(): the last one stops and collects the trace
        prof.step()
    llm.engine.step_hooks.append(hook)
    try:
        with prof:
            run()
            end = time.perf_counter()  # the run's last step is timed up to here
    finally:
        llm.engine.step_hooks.remove(hook)
    if len(marks) < start:  # (a run of fewer steps than the timed one): nothing was recorded
        print(f"profile: the run took {len(marks)} engine steps, none from step {start}; no trace",
              flush=True)
        return dict(first_step=start, steps=0, wall_s=0.0, device_busy_s=None, device_busy_fraction=None)
    # step k runs from step() call #k (at marks[k - 1]) to the next call, or to the run's end
    last = min(start + active - 1, len(marks))
    window = (marks[last] if last < len(marks) else end) - marks[start - 1]
    key = "self_device_time_total" if cuda else "self_cpu_time_total"
    print(prof.key_averages().table(sort_by=key, row_limit=row_limit))
    # device time on a GPU only (on the CPU there is no device apart from the host)
    busy = _union_seconds((e.time_range.start, e.time_range.end) for e in prof.events()
                          if e.device_type.name == "CUDA") if cuda else None
    steps = last - start + 1
    summary = dict(first_step=start, steps=steps, wall_s=window, device_busy_s=busy,
                   device_busy_fraction=busy / window if window and cuda else None)
    print(f"profile window: steps {start}..{start + steps - 1} of {len(marks)}, wall {window * 1e3:.1f} ms "
          f"({window * 1e3 / max(steps, 1):.2f} ms/step)"
          + (f", device kernels {busy * 1e3:.1f} ms" if cuda else "")
          + (f" ({100 * busy / window:.0f}% busy; profiling slows the host)" if window and cuda else ""))
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"trace-{label}.json.gz")
    prof.export_chrome_trace(path)
    print(f"trace: {path}")
    return summary


def _union_seconds(intervals) -> float:
    """Total length of a union of (start, end) microsecond intervals, in seconds."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total / 1e6


def startup_without_bench(acc: dict | None) -> dict | None:
    """The engine's start-up account (startup_clock) less the bench's own set-up before the
    engine (phase `bench_setup`: ceiling measurement, the transformers backend), which a user's
    start never pays."""
    if acc is None:
        return None
    pre = dict(acc["pre_engine"])
    bench_s = pre.pop("bench_setup", 0.0)
    return dict(acc, pre_engine=pre, ready_after_s=acc["ready_after_s"] - bench_s)


# ---- running the backends -------------------------------------------------------------------
def drive(cfg, hf_config, backends, on_ranks, multi_process: bool, engine_bench, hf_bench):
    """Run `hf_bench(device, dtype, ceilings)` and/or `engine_bench(llm, ceilings)`.

    The ceilings are measured once, before any model is built when there is one process (under
    mpirun, on rank 0 once its engine is up and its device pinned). transformers runs first and
    frees the device, since the engine then claims most of its memory. `on_ranks(cfg, body)` is
    the launcher's `run_on_ranks` (runtime does not import launch). Returns (exit code,
    {backend: result} — empty on worker ranks —, ceilings)."""
    from ...models.loader import resolve_dtype
    state: dict = {"ceilings": None}
    results: dict = {}

    def ceilings(device):
        if state["ceilings"] is None:
            state["ceilings"] = measure_ceilings(device)
            print(format_ceilings(state["ceilings"]), flush=True)
        return state["ceilings"]

    if not multi_process:
        startup_clock.mark("config")  # since `imports`: the model config, its parameter counts
        device = torch.device(cfg.device.resolve(0))
        ceilings(device)
        if "hf" in backends:
            results["hf"] = hf_bench(device, resolve_dtype(cfg.model.dtype, hf_config, device.type),
                                     state["ceilings"])
            if device.type == "cuda":
                torch.cuda.empty_cache()
        startup_clock.mark("bench_setup")  # left out of the start-up account
    elif "hf" in backends:
        raise ValueError("--backend hf runs in a single process; launch it without mpirun/srun")
    rc = 0
    if "rankserve" in backends:
        def body(llm):
            acc = startup_without_bench(llm.engine.startup)
            ex = llm.engine.executor
            runner = ex.runner if hasattr(ex, "runner") else ex.worker.runner
            results["rankserve"] = engine_bench(llm, ceilings(runner.device))
            results["rankserve"]["ready_after_s"] = None if acc is None else acc["ready_after_s"]
            results["rankserve"]["startup_account"] = acc
        rc = on_ranks(cfg, body)
    # rankserve first, for tables and plots
    return rc, dict(sorted(results.items(), key=lambda kv: kv[0] != "rankserve")), state["ceilings"]
