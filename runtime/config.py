"""EngineConfig: dataclass sub-configs with defaults and one-line docs.

The CLI flags are generated from these fields (`launch/cli.py`): field `max_num_seqs` becomes
`--max-num-seqs`, the `doc` metadata becomes the help, `flag`/`alias` metadata override the name
(vLLM's names where the meaning is the same), `short` adds vLLM's one-dash form (`-tp`).
Validation errors name the flag.
"""
from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

DEFAULT_MODEL = str(Path(__file__).resolve().parent.parent / "models" / "default" / "stories260K")


def opt(default, doc: str, alias: str | None = None, choices: tuple | None = None, **kw):
    return field(default=default, metadata={"doc": doc, "alias": alias, "choices": choices, **kw})


def _default_cache_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "rankserve")


class ConfigError(ValueError):
    """Invalid configuration; the message names the flag."""


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def json_object_flag(value, flag: str) -> dict | None:
    """A flag given as a JSON object (a string, or a dict from Python) → the dict; None when
    not given (None, "", {})."""
    import json
    if value is None or value == "" or value == {}:
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{flag} must be a JSON object: {e}") from None
    if not isinstance(value, dict):
        raise ConfigError(f"{flag} must be a JSON object, got {value!r}")
    return value


def _check(cond: bool, name: str, rule: str, value) -> None:
    if not cond:
        raise ConfigError(f"{_flag(name)} must be {rule}, got {value!r}")


_DTYPE_ALIASES = {"half": "float16", "float": "float32"}


@dataclass(frozen=True)
class ModelConfig:
    model: str = opt(DEFAULT_MODEL, "HF checkpoint directory (default: the embedded stories260K)",
                     positional=True)
    tokenizer: str | None = opt(None, "tokenizer directory (default: the model directory)")
    dtype: str = opt("auto", "weight and activation dtype (half = float16, float = float32, "
                     "as vLLM)", choices=("auto", "float32", "bfloat16", "float16", "half", "float"))
    max_model_len: int | None = opt(None, "context length (default: from the model config; "
                                    "32k = 32000, 32K = 32768, as vLLM)", tokens=True)
    seed: int = opt(0, "seed for dummy weights and unseeded sampling")
    served_model_name: tuple[str, ...] | None = opt(
        None, "model name(s) of the API: requests may name any of them, responses report the "
        "first (several after one flag, as vLLM, or repeated; default: MODEL)", multiple=True)
    quantization: str | None = opt(None, "weight quantization: read from the checkpoint's "
                                   "quantization_config; fp8 also quantizes a 16-bit checkpoint "
                                   "at load time", alias="q",
                                   choices=("fp8", "fbgemm_fp8", "compressed-tensors", "gptq", "awq", "modelopt",
                                            "gptq_marlin", "awq_marlin"))
    trust_remote_code: bool = opt(False, "let transformers run the tokenizer code a checkpoint "
                                  "ships (auto_map); rankserve runs its own model code either way")
    generation_config: str = opt("auto", "sampling defaults for requests that leave them out: "
                                 "auto (the model's generation_config.json), vllm (none), or a "
                                 "directory holding a generation_config.json")
    override_generation_config: str | None = opt(None, "a JSON object of sampling defaults on top "
                                                 "of --generation-config, e.g. "
                                                 "'{\"temperature\": 0.5}'")
    max_logprobs: int = opt(20, "most logprobs a request may ask (logprobs, top_logprobs, "
                            "prompt_logprobs; vLLM's flag); -1: the vocabulary size")

    def __post_init__(self):  # vLLM's spellings: --dtype half / float, one served name as a str
        object.__setattr__(self, "dtype", _DTYPE_ALIASES.get(self.dtype, self.dtype))
        names = self.served_model_name
        if isinstance(names, str):
            names = (names,)
        object.__setattr__(self, "served_model_name", tuple(names) if names else None)

    @property
    def served_names(self) -> list[str]:
        """The names the API serves the model under (the first is the one it reports)."""
        return list(self.served_model_name or (self.model,))

    def validate(self):
        names = self.served_model_name or ()
        if any(not isinstance(n, str) or not n.strip() for n in names) or len(set(names)) < len(names):
            raise ConfigError(f"--served-model-name must be distinct non-empty names, got {list(names)!r}")
        _check(self.max_model_len is None or self.max_model_len > 0, "max_model_len", "> 0",
               self.max_model_len)
        _check(-2 ** 63 <= self.seed < 2 ** 64, "seed", "an integer in [-2**63, 2**64) (torch's "
               "seed range)", self.seed)
        _check(self.max_logprobs >= -1, "max_logprobs", ">= 0 (or -1: the vocabulary size)",
               self.max_logprobs)
        if not os.path.isfile(os.path.join(self.model, "config.json")):
            raise ConfigError(f"MODEL {self.model!r} is not a model directory (no config.json); "
                              "pass a Hugging Face checkpoint directory")
        if self.tokenizer is not None and not os.path.isdir(self.tokenizer):
            # (transformers would take it for a hub repo id: a traceback after the model loaded)
            raise ConfigError(f"--tokenizer {self.tokenizer!r} is not a directory; pass the "
                              "tokenizer's directory")
        if self.generation_config not in ("auto", "vllm") and not os.path.isfile(
                os.path.join(self.generation_config, "generation_config.json")):
            raise ConfigError(f"--generation-config {self.generation_config!r}: auto, vllm, or a "
                              "directory holding a generation_config.json")
        from .inputs import generation_overrides
        try:
            generation_overrides(self.override_generation_config)
        except ValueError as e:
            raise ConfigError(str(e)) from None


@dataclass(frozen=True)
class LoadConfig:
    load_format: str = opt("auto", "weights: safetensors from the checkpoint, or random (dummy)",
                           choices=("auto", "safetensors", "dummy"))


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = opt(16, "tokens per KV-cache block", choices=(8, 16, 32, 64, 128))
    gpu_memory_utilization: float = opt(0.9, "fraction of device memory for weights, activations and KV cache")
    num_gpu_blocks_override: int | None = opt(None, "use exactly this many KV blocks (skip profiling)")
    kv_cache_memory_gb: float = opt(1.0, "KV-cache size on CPU (GiB)")
    enable_prefix_caching: bool = opt(True, "reuse KV blocks of shared prompt prefixes")
    prefix_caching_hash_algo: str = opt("sha256", "block hash for prefix caching",
                                        choices=("sha256", "xxhash"))
    kv_cache_dtype: str = opt("auto", "KV-cache storage: auto (the model dtype) or fp8 (= fp8_e4m3: "
                              "e4m3 with per-layer k/v scales, twice the tokens of a 16-bit cache)",
                              choices=("auto", "fp8", "fp8_e4m3"))
    mamba_ssm_cache_dtype: str = opt("float32", "Mamba2 SSM state storage (hybrid models): float32, or "
                                     "auto (the model dtype: half the state memory and traffic)",
                                     choices=("auto", "float32"))

    def validate(self):
        _check(0 < self.gpu_memory_utilization <= 1, "gpu_memory_utilization", "in (0, 1]",
               self.gpu_memory_utilization)
        _check(self.num_gpu_blocks_override is None or self.num_gpu_blocks_override > 0,
               "num_gpu_blocks_override", "> 0", self.num_gpu_blocks_override)
        _check(0 < self.kv_cache_memory_gb < math.inf, "kv_cache_memory_gb", "a finite number > 0",
               self.kv_cache_memory_gb)

    @property
    def fp8_kv(self) -> bool:
        """The KV cache stores e4m3 (torch.float8_e4m3fn) with per-layer scales."""
        return self.kv_cache_dtype in ("fp8", "fp8_e4m3")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = opt(256, "most requests in one step")
    # 4096, not vLLM's 8192: online W1 (H200) keeps its streams ticking (ITL p99 14 vs 30 ms) at
    # the same throughput, and offline W1 measured the same (benchmarks/2026-12-05-h200-s10)
    max_num_batched_tokens: int = opt(4096, "token budget of one step", tokens=True)
    enable_chunked_prefill: bool = opt(True, "split long prompts over several steps")
    policy: str = opt("fcfs", "scheduling policy", alias="scheduling_policy",
                      choices=("fcfs", "priority"))
    async_scheduling: bool | None = opt(None, "schedule step N+1 while step N runs on the GPU "
                                        "(default: on with CUDA and no pipeline parallelism)")
    preemption_mode: str | None = opt(None, "how a preempted request's KV comes back: swap (its full "
                                      "blocks to the host tier, --kv-offload-size, and back) or "
                                      "recompute (default: per request, whichever the cost model "
                                      "says is cheaper; recompute without a host tier)",
                                      choices=("recompute", "swap"))

    def validate(self):
        _check(self.max_num_seqs >= 1, "max_num_seqs", ">= 1", self.max_num_seqs)
        _check(self.max_num_batched_tokens >= 1, "max_num_batched_tokens", ">= 1",
               self.max_num_batched_tokens)


@dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int = opt(1, "tensor-parallel ranks", alias="tp", short="-tp")
    pipeline_parallel_size: int = opt(1, "pipeline stages", alias="pp", short="-pp")
    data_parallel_size: int = opt(1, "engine replicas, each of TP × PP ranks, behind one API "
                                  "(rankserve serve; the job has TP × PP × DP ranks)", alias="dp", short="-dp")
    enable_expert_parallel: bool = opt(False, "shard MoE experts across the TP group (EP = TP)",
                                       short="-ep")

    def validate(self):
        _check(self.tensor_parallel_size >= 1, "tensor_parallel_size", ">= 1",
               self.tensor_parallel_size)
        _check(self.pipeline_parallel_size >= 1, "pipeline_parallel_size", ">= 1",
               self.pipeline_parallel_size)
        _check(self.data_parallel_size >= 1, "data_parallel_size", ">= 1", self.data_parallel_size)
        if self.data_parallel_size > 1 and self.enable_expert_parallel:
            # vLLM's DP + EP ("wide EP") shards experts over all replicas' ranks, so every replica
            # must step in lockstep (dummy batches when idle) for the expert all-to-all; the
            # replicas here are independent engines, so it is refused rather than run as
            # something else. A MoE model runs with DP when each replica holds its experts
            # (sharded over its own TP group).
            raise ConfigError("--data-parallel-size > 1 with --enable-expert-parallel (DP + EP, "
                              "\"wide EP\") is not supported: replicas are independent engines; "
                              "drop --enable-expert-parallel (each replica then holds all experts, "
                              "sharded over its --tp ranks)")

    @property
    def world_size(self) -> int:
        """Ranks of one engine (one data-parallel replica)."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def total_ranks(self) -> int:
        """Ranks of the whole job: every replica's."""
        return self.world_size * self.data_parallel_size


@dataclass(frozen=True)
class CompilationConfig:
    enforce_eager: bool = opt(False, "no torch.compile and no CUDA graphs")
    compilation_level: int = opt(-1, "0: eager, 1: CUDA graphs of the eager model, 2: torch.compile "
                                 "of each decoder layer + CUDA graphs (-1: 1 on CUDA, 0 on CPU; "
                                 "level 1 measured as fast or faster on an H200 and starts sooner)")
    cuda_graph_max_bs: int | None = opt(None, "largest captured batch (default: max_num_seqs, at most 512)")
    cudagraph_mode: str = opt("auto", "decode: CUDA graphs for decode steps; full: also for steps "
                              "with prompt tokens, one graph per token-count bucket (64, 128, 256, "
                              "then multiples of 512), all captured at start-up "
                              "(single-rank engines without recurrent layers); auto: full where "
                              "it can run (and without LoRA or speculative decoding), else decode",
                              choices=("auto", "decode", "full"))
    cache_dir: str = opt(_default_cache_dir(), "compile and autotune caches, model-config snapshots")

    def validate(self):
        _check(self.compilation_level in (-1, 0, 1, 2), "compilation_level", "one of -1, 0, 1, 2",
               self.compilation_level)
        _check(self.cuda_graph_max_bs is None or self.cuda_graph_max_bs >= 1, "cuda_graph_max_bs",
               ">= 1", self.cuda_graph_max_bs)

    def level(self, device_type: str) -> int:
        if self.enforce_eager:
            return 0
        if self.compilation_level >= 0:
            return self.compilation_level
        # every hot op is a custom kernel (attention, fused norm + GEMM, SiLU, MoE) and decode
        # replays CUDA graphs, so Inductor has little left to fuse; level 1 also keeps batch-1
        # decode at one row (compiled graphs pad it to 2), which the skinny GEMMs need
        return 1 if device_type == "cuda" else 0


@dataclass(frozen=True)
class DeviceConfig:
    device: str = opt("auto", "cpu, cuda, or auto", choices=("auto", "cpu", "cuda"))
    device_ids: str | None = opt(None, "physical device per local rank, e.g. 4,5,6,7")

    def validate(self):
        ok = self.device_ids is None or all(x.strip().isdigit() for x in self.device_ids.split(","))
        _check(ok, "device_ids", "a comma-separated list of device numbers", self.device_ids)

    def kind(self) -> str:
        """cpu or cuda: what `resolve` will give (auto is cuda only where CUDA is available)."""
        if self.device == "auto":
            import torch
            return "cuda" if torch.cuda.is_available() else "cpu"
        return self.device

    @property
    def ids(self) -> list[int] | None:
        return [int(x) for x in self.device_ids.split(",")] if self.device_ids else None

    def resolve(self, local_rank: int = 0, env=None) -> str:
        """This rank's torch device string: the one device resolver, for a single process and
        for every rank of an mpirun/srun job."""
        import torch
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ConfigError("--device cuda was given but no CUDA device is available")
        return select_device(local_rank, self.ids, self.device != "cpu" and torch.cuda.is_available(),
                             env)


def select_device(local_rank: int, device_ids: list[int] | None, has_cuda: bool,
                  env=None) -> str:
    """Precedence:
    1. no CUDA (or `--device cpu`): "cpu".
    2. `--device-ids 4,5,6,7`: physical device `device_ids[local_rank]`. When CUDA_VISIBLE_DEVICES
       is also set, the physical id is translated to its index in that list (torch numbers only
       the visible devices). Fewer ids than local ranks is an error naming `--device-ids`.
    3. CUDA_VISIBLE_DEVICES set by the launcher or Slurm: if it lists exactly one device (one GPU
       per task, e.g. `--gpus-per-task=1`) use "cuda:0", else "cuda:<local_rank>" (e.g.
       `--gpus-per-node=8`, where every task sees the whole node).
    4. otherwise "cuda:<local_rank>".
    """
    if not has_cuda:
        if device_ids:
            raise ConfigError(f"--device-ids {','.join(map(str, device_ids))} was given but no "
                              "CUDA device is available (or --device cpu)")
        return "cpu"
    env = os.environ if env is None else env
    cvd = env.get("CUDA_VISIBLE_DEVICES")
    visible = None if cvd is None else [d.strip() for d in cvd.split(",") if d.strip()]
    if device_ids:
        if local_rank >= len(device_ids):
            raise ConfigError(
                f"--device-ids {','.join(map(str, device_ids))} lists {len(device_ids)} device(s) but "
                f"this host runs local rank {local_rank}; give one id per rank on the node")
        phys = device_ids[local_rank]
        if visible is None:
            return f"cuda:{phys}"
        if str(phys) not in visible:
            raise ConfigError(
                f"--device-ids: device {phys} is not in CUDA_VISIBLE_DEVICES={cvd!r}; pass ids from "
                "that list or unset CUDA_VISIBLE_DEVICES")
        return f"cuda:{visible.index(str(phys))}"
    if visible is not None:
        if len(visible) == 1:
            return "cuda:0"
        if local_rank >= len(visible):
            raise ConfigError(
                f"CUDA_VISIBLE_DEVICES={cvd!r} shows {len(visible)} device(s) but this is local rank "
                f"{local_rank}; start fewer ranks per node or pass --device-ids")
    return f"cuda:{local_rank}"


@dataclass(frozen=True)
class OffloadConfig:
    """Host memory: sleep mode (weights to pinned host memory, runtime/sleep.py) and the host
    tier of the prefix cache (runtime/kv_offload.py)."""
    enable_sleep_mode: bool = opt(False, "allow /sleep and /wake_up (LLM.sleep / wake_up): free "
                                  "the device memory of weights and KV cache between uses")
    kv_offload_size: float = opt(0.0, "GiB of pinned host memory (all ranks together) for a host "
                                 "tier of the prefix cache: evicted blocks are kept there and "
                                 "copied back on a hit (0: off)", alias="kv_offloading_size")

    def validate(self):
        _check(0 <= self.kv_offload_size < math.inf, "kv_offload_size", "a finite number >= 0",
               self.kv_offload_size)


@dataclass(frozen=True)
class LoRAConfig:
    """Multi-LoRA serving (runtime/lora.py)."""
    enable_lora: bool = opt(False, "serve LoRA adapters of the base model (PEFT directories)")
    max_loras: int = opt(1, "most adapters in one batch (device slots)")
    max_lora_rank: int = opt(16, "largest adapter rank")
    max_cpu_loras: int | None = opt(None, "adapters kept in host memory (default: --max-loras)")
    lora_modules: tuple[str, ...] | None = opt(
        None, "adapters served from the start: name=path or JSON {\"name\", \"path\", "
        "\"base_model_name\"} (several after one flag, or repeated)", multiple=True)

    def validate(self):
        _check(self.max_loras >= 1, "max_loras", ">= 1", self.max_loras)
        _check(self.max_lora_rank >= 1, "max_lora_rank", ">= 1", self.max_lora_rank)
        _check(self.max_cpu_loras is None or self.max_cpu_loras >= self.max_loras,
               "max_cpu_loras", ">= --max-loras", self.max_cpu_loras)
        if self.lora_modules and not self.enable_lora:
            raise ConfigError("--lora-modules needs --enable-lora")
        if self.lora_modules:  # a bad adapter stops the start, not the first request
            from ..models.lora_config import adapter_rank, read_adapter_config
            from .lora import parse_lora_modules
            try:
                for _name, path, _base in parse_lora_modules(self.lora_modules):
                    r = adapter_rank(read_adapter_config(path))
                    _check(r <= self.max_lora_rank, "max_lora_rank", f">= the rank of {path} ({r})",
                           self.max_lora_rank)
            except ValueError as e:  # (parse errors name the flag already)
                msg = str(e)
                raise ConfigError(msg if msg.startswith("--lora-modules") else
                                  f"--lora-modules: {msg}") from None

    @property
    def cpu_loras(self) -> int:
        return self.max_cpu_loras or self.max_loras


SPEC_METHODS = ("ngram", "draft_model", "eagle", "eagle3", "mtp")
SPEC_ALIASES = {"deepseek_mtp": "mtp", "[ngram]": "ngram"}  # vLLM's older names


@dataclass(frozen=True)
class SpecDecodeParams:
    """The parsed `--speculative-config` (vLLM's keys; runtime/spec_decode.py)."""
    method: str
    num_speculative_tokens: int
    model: str | None = None  # draft checkpoint (draft_model) or EAGLE head (eagle, eagle3)
    prompt_lookup_min: int = 1  # n-gram sizes tried, longest first
    prompt_lookup_max: int = 4
    draft_tensor_parallel_size: int | None = None


_SPEC_KEYS = ("method", "num_speculative_tokens", "model", "prompt_lookup_min",
              "prompt_lookup_max", "draft_tensor_parallel_size")


def parse_speculative_config(value) -> SpecDecodeParams | None:
    """A JSON object (string) or dict with vLLM's keys → SpecDecodeParams; every key or method
    this engine does not implement is refused by name."""
    flag = "--speculative-config"
    value = json_object_flag(value, flag)
    if value is None:
        return None
    unknown = sorted(set(value) - set(_SPEC_KEYS))
    if unknown:
        raise ConfigError(f"{flag}: unsupported key(s) {', '.join(unknown)} (supported: "
                          f"{', '.join(_SPEC_KEYS)})")
    d = dict(value)
    method = d.get("method")
    if method is not None and not isinstance(method, str):
        raise ConfigError(f"{flag}: method must be a string, one of {', '.join(SPEC_METHODS)}; got {method!r}")
    method = SPEC_ALIASES.get(method, method)
    if d.get("model") in ("ngram", "[ngram]"):  # vLLM's older spelling: the method when none is given
        if method not in (None, "ngram"):
            raise ConfigError(f"{flag}: \"model\": {d['model']!r} means method ngram, not {method}")
        method, d["model"] = "ngram", None
    method = method or ("draft_model" if d.get("model") else None)
    if method not in SPEC_METHODS:
        raise ConfigError(f"{flag}: method must be one of {', '.join(SPEC_METHODS)}, got {method!r}")
    k = d.get("num_speculative_tokens")
    if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= 16:
        raise ConfigError(f"{flag}: num_speculative_tokens must be an integer in 1..16, got {k!r}")
    lo, hi = d.get("prompt_lookup_min"), d.get("prompt_lookup_max")
    if method != "ngram" and (lo is not None or hi is not None):
        raise ConfigError(f"{flag}: prompt_lookup_min/max apply to method ngram only")
    lo = lo if lo is not None else (1 if hi is None else hi)
    hi = hi if hi is not None else max(lo, 4)
    for name, v in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
        if not isinstance(v, int) or isinstance(v, bool) or not 1 <= v <= 64:
            raise ConfigError(f"{flag}: {name} must be an integer in 1..64, got {v!r}")
    if lo > hi:
        raise ConfigError(f"{flag}: prompt_lookup_min ({lo}) > prompt_lookup_max ({hi})")
    model = d.get("model")
    if method in ("draft_model", "eagle", "eagle3"):
        what = "a checkpoint directory" if method == "draft_model" else "the head's checkpoint directory"
        if not model or not os.path.isfile(os.path.join(str(model), "config.json")):
            raise ConfigError(f"{flag}: method {method} needs \"model\": {what} "
                              f"(with config.json), got {model!r}")
    elif model is not None:
        raise ConfigError(f"{flag}: \"model\" is for methods draft_model, eagle and eagle3, not {method}"
                          + (" (MTP layers come from the target checkpoint)" if method == "mtp" else ""))
    return SpecDecodeParams(method, k, model, lo, hi, d.get("draft_tensor_parallel_size"))


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (runtime/spec_decode.py)."""
    speculative_config: str | dict | None = opt(
        None, "speculative decoding as a JSON object with vLLM's keys: method (ngram, "
        "draft_model, eagle, eagle3, mtp), num_speculative_tokens, model (draft checkpoint or EAGLE "
        "head), prompt_lookup_min/max, "
        "draft_tensor_parallel_size; e.g. '{\"method\": \"ngram\", \"num_speculative_tokens\": 4}'")

    @property
    def params(self) -> SpecDecodeParams | None:
        return parse_speculative_config(self.speculative_config)

    def validate(self):
        self.params  # noqa: B018 - parse errors name the flag


@dataclass(frozen=True)
class ProfilerConfig:
    """Profiling a running engine (runtime/profiler.py)."""
    profiler_config: str | dict | None = opt(
        None, "profile the engine between POST /start_profile and /stop_profile (LLM.start_profile / "
        "stop_profile), as a JSON object with vLLM's keys: profiler (torch, cuda), torch_profiler_dir, "
        "torch_profiler_with_stack, _with_flops, _use_gzip, _dump_cuda_time_total, _record_shapes, "
        "_with_memory; e.g. '{\"profiler\": \"torch\", \"torch_profiler_dir\": \"./traces\"}'")

    @property
    def params(self):
        from .profiler import parse_profiler_config
        return parse_profiler_config(self.profiler_config)

    def validate(self):
        self.params  # noqa: B018 - parse errors name the flag


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    load: LoadConfig = field(default_factory=LoadConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    compilation: CompilationConfig = field(default_factory=CompilationConfig)
    device: DeviceConfig = field(default_factory=DeviceConfig)
    offload: OffloadConfig = field(default_factory=OffloadConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    profiler: ProfilerConfig = field(default_factory=ProfilerConfig)

    SECTIONS = ("model", "load", "cache", "scheduler", "parallel", "compilation", "device", "offload",
                "lora", "speculative", "profiler")

    @classmethod
    def from_kwargs(cls, **kwargs) -> "EngineConfig":
        """The one builder: flat keyword arguments (`max_num_seqs=8`, `tp=2` ...; None means
        not given) → a frozen, validated config. Unknown names and bad values name the flag."""
        fields: dict[str, dict] = {s: {} for s in cls.SECTIONS}
        for key, value in kwargs.items():
            if value is None:
                continue
            section, name = cls._locate(key)
            fields[section][name] = value
        cfg = cls()
        cfg = dataclasses.replace(cfg, **{
            s: dataclasses.replace(getattr(cfg, s), **kw) for s, kw in fields.items() if kw})
        return cfg.validate()

    @classmethod
    def _locate(cls, key: str) -> tuple[str, str]:
        for section in cls.SECTIONS:
            for f in dataclasses.fields(cls.__dataclass_fields__[section].default_factory):
                if key in (f.name, f.metadata.get("alias")):
                    return section, f.name
        raise ConfigError(f"unknown engine option {key!r}")

    def validate(self) -> "EngineConfig":
        for section in self.SECTIONS:
            sub = getattr(self, section)
            for f in dataclasses.fields(sub):
                choices = f.metadata.get("choices")
                value = getattr(sub, f.name)
                if choices and value is not None and value not in choices:
                    raise ConfigError(f"{_flag(f.name)} must be one of "
                                      f"{', '.join(map(str, choices))}; got {value!r}")
            if hasattr(sub, "validate"):
                sub.validate()
        # combinations no engine can run
        if self.scheduler.async_scheduling and self.parallel.pipeline_parallel_size > 1:
            raise ConfigError("--async-scheduling does not work with --pipeline-parallel-size > 1 "
                              "(pipeline stages already keep one step in flight each); drop one")
        if self.compilation.cudagraph_mode == "full":
            if self.parallel.world_size > 1:  # (data-parallel replicas are engines of their own)
                raise ConfigError("--cudagraph-mode full runs on single-rank engines only (graphs "
                                  "of mixed steps with collectives are not supported yet); drop "
                                  "it, or --tensor/--pipeline-parallel-size (--data-parallel-size "
                                  "replicas of one rank each may use it)")
            if self.compilation.level(self.device.kind()) < 1:
                raise ConfigError("--cudagraph-mode full needs CUDA graphs: a CUDA device, "
                                  "--compilation-level 1 or 2 and no --enforce-eager")
        if self.device.device == "cpu" and self.device.device_ids:
            raise ConfigError("--device-ids selects CUDA devices; it cannot go with --device cpu")
        self._check_speculative()
        if self.lora.lora_modules:  # an adapter of the base model's name would shadow it
            from .lora import parse_lora_modules
            for name, _path, _base in parse_lora_modules(self.lora.lora_modules):
                if name in (self.model.model, *self.model.served_names):
                    raise ConfigError(f"--lora-modules: {name!r} is the base model's name")
        if self.offload.kv_offload_size > 0 and not self.cache.enable_prefix_caching:
            raise ConfigError("--kv-offload-size keeps evicted prefix-cache blocks in host memory: "
                              "it needs --enable-prefix-caching")
        if self.scheduler.preemption_mode == "swap" and not self.offload.kv_offload_size > 0:
            raise ConfigError("--preemption-mode swap copies a preempted request's blocks to the host "
                              "KV tier: it needs --kv-offload-size")
        return self

    @property
    def spec(self) -> SpecDecodeParams | None:
        """The speculative-decoding parameters, or None when it is off."""
        return self.speculative.params

    def _check_speculative(self) -> None:
        spec = self.spec
        if spec is None:
            return
        flag = "--speculative-config"
        if self.parallel.pipeline_parallel_size > 1:
            raise ConfigError(f"{flag} does not work with --pipeline-parallel-size > 1 yet (the "
                              "proposals of a step would need the last stage's tokens on the first)")
        tp = spec.draft_tensor_parallel_size
        if tp is not None and tp != self.parallel.tensor_parallel_size:
            raise ConfigError(f"{flag}: draft_tensor_parallel_size must equal "
                              f"--tensor-parallel-size ({self.parallel.tensor_parallel_size}): the "
                              f"draft model runs on the target's ranks; got {tp}")
        if spec.method in ("draft_model", "eagle", "eagle3") and self.offload.kv_offload_size > 0:
            raise ConfigError(f"{flag} with a draft model or EAGLE head does not work with "
                              "--kv-offload-size (the host tier would not hold its KV)")
        if self.offload.enable_sleep_mode:
            raise ConfigError(f"{flag} does not work with --enable-sleep-mode yet")

    def check_kv_capacity(self, num_blocks: int, max_model_len: int, sliding_window: int = 0,
                          lookahead: int = 0) -> None:
        """A request may grow to max_model_len tokens: a KV cache smaller than that would leave
        it waiting forever, so refuse the configuration (as vLLM does). With a sliding window on
        every layer a request holds at most its window and one step's tokens (as vLLM counts:
        window - 1 + --max-num-batched-tokens, one block more for the window's first straddling
        block, one for the null block), and the `lookahead` slots a drafter writes past them
        (speculative decoding: else a lone request preempted itself for them, again and again)."""
        bs = self.cache.block_size
        usable = num_blocks - (sliding_window > 0)  # (a window reserves the null block)
        capacity = usable * bs
        window = ""
        if sliding_window:
            live = min(max_model_len,
                       sliding_window - 1 + self.scheduler.max_num_batched_tokens + lookahead)
            if num_blocks >= -(-live // bs) + 2:
                return
            window = f" (with the sliding window {sliding_window}: or at least {-(-live // bs) + 2} blocks)"
        if capacity < max_model_len:
            raise ConfigError(
                f"the KV cache holds {capacity} tokens ({usable} usable blocks of "
                f"{self.cache.block_size}), fewer than one request of --max-model-len "
                f"{max_model_len} needs; raise --gpu-memory-utilization (--kv-cache-memory-gb on "
                f"CPU) or --num-gpu-blocks-override, or lower --max-model-len to {capacity} or less"
                + window)

    def summary(self) -> str:
        """One line of every option that differs from its default (logged once at startup)."""
        parts = []
        for section, f in self.flat_fields():
            value = getattr(getattr(self, section), f.name)
            if value != f.default:
                parts.append(f"{f.name}={value}")
        return "config: " + (", ".join(parts) or "defaults")

    def flat_fields(self):
        """(section, dataclasses.Field) for every option, in CLI order."""
        for section in self.SECTIONS:
            for f in dataclasses.fields(getattr(self, section)):
                yield section, f
