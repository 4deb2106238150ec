"""Our config readers (models/config_readers.py) answer as transformers' config classes do, for
every shipped config and for configs that lean on the classes' defaults: every attribute they
give, every attribute the start path reads (model build, dtype, sliding window, quantization,
the bench's parameter counts), and the model built from them."""
import json
import warnings

import pytest
import torch

from conftest import REPO

from rankserve.models import config_readers
from rankserve.models.config_snapshot import ConfigSnapshot
from rankserve.models.llama import kv_sliding_window
from rankserve.models.loader import _read_hf_config, build_model, load_hf_config, model_class, resolve_dtype
from rankserve.models.parallel import ParallelInfo
from rankserve.models.quantization import quant_config_of

CONFIGS = REPO / "runtime" / "bench" / "configs"
SHIPPED = sorted(p.stem for p in CONFIGS.glob("*.json"))
_MISSING = object()
_OWN = {"name_or_path", "snapshot_of"}  # where it was read, which reader: not transformers'

# configs that leave most fields to the class defaults, and the paths of __post_init__
VARIANTS = {
    "llama-bare": dict(model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=64,
                       num_attention_heads=4, num_hidden_layers=2, intermediate_size=96, vocab_size=128),
    "llama-llama3-rope-torch_dtype": dict(
        model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=64, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, num_hidden_layers=2, rope_theta=123.0, torch_dtype="float16",
        rope_scaling=dict(type="llama3", factor=4.0, low_freq_factor=1.0, high_freq_factor=4.0),
        max_position_embeddings=512),
    "qwen3-sliding": dict(model_type="qwen3", architectures=["Qwen3ForCausalLM"], hidden_size=64,
                          num_attention_heads=4, num_key_value_heads=None, num_hidden_layers=4,
                          use_sliding_window=True, sliding_window=32, max_window_layers=2, dtype="bfloat16"),
    "qwen3-moe-aliases": dict(model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], hidden_size=64,
                              num_attention_heads=4, num_hidden_layers=2, num_experts=4, num_experts_per_tok=2,
                              moe_intermediate_size=32, head_dim=16, vocab_size=128),
    "deepseek-v3-defaults": dict(model_type="deepseek_v3", architectures=["DeepseekV3ForCausalLM"],
                                 hidden_size=64, num_attention_heads=4, num_hidden_layers=3, vocab_size=128,
                                 n_routed_experts=4, num_experts_per_tok=2, n_group=2, topk_group=1,
                                 first_k_dense_replace=1, intermediate_size=96, moe_intermediate_size=32,
                                 q_lora_rank=None, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
                                 v_head_dim=8),
    "llama-extra-fields": dict(model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=64,
                               num_attention_heads=4, num_hidden_layers=2, transformers_version="4.43.0",
                               _name_or_path="org/model", id2label={"0": "A"}, custom_field=5, use_cache=False,
                               auto_map={"AutoConfig": "remote.Config"}),
    "nemotron-h-renamed": dict(model_type="nemotron_h", architectures=["NemotronHForCausalLM"], hidden_size=64,
                               num_attention_heads=4, head_dim=16, vocab_size=128,
                               hybrid_override_pattern="M-*M", mamba_num_heads=8, mamba_head_dim=16,
                               ssm_state_size=16, mamba_n_groups=2, mamba_d_conv=3, mamba_conv_bias=False,
                               intermediate_size=96, num_hidden_layers=7),
}


def _quiet_get(obj, k):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            return getattr(obj, k, _MISSING)
        except Exception:
            return _MISSING


def _start_path_reads(cfg, with_params: bool) -> tuple[set, list]:
    """The attributes the start path reads from `cfg`, and the meta-device model's parameters."""
    seen: set = set()

    class Recording(ConfigSnapshot):
        def __getattribute__(self, k):
            if not k.startswith("__"):
                seen.add(k)
            return object.__getattribute__(self, k)

    rec = Recording(**vars(cfg))
    resolve_dtype("auto", rec, "cuda")
    kv_sliding_window(rec)
    quant_config_of(rec, None)
    params = None
    try:
        model_class(rec)
    except ValueError:  # an EAGLE head: no main model
        return seen - {"to_dict"}, params
    if with_params:
        from rankserve.runtime.bench.common import model_stats
        model_stats(rec)  # the bench's counts: builds the main model (MTP layers dropped)
        m = build_model(rec, ParallelInfo(), torch.bfloat16, torch.device("meta"))
        params = [(n, tuple(p.shape), p.dtype) for n, p in m.named_parameters()]
    return seen - {"to_dict"}, params


def _check(model_dir: str, raw: dict, with_params: bool = True):
    real = _read_hf_config(model_dir, json.dumps(raw).encode())
    ours = config_readers.read(raw, model_dir)
    assert isinstance(ours, ConfigSnapshot)
    for k, v in vars(ours).items():  # everything we answer, transformers answers alike
        if k not in _OWN:
            assert _quiet_get(real, k) == v, k
    read, params = _start_path_reads(ours, with_params)
    assert read, "the start path read nothing"
    for k in read - _OWN:  # and nothing the start path asks for is missing (or defaulted otherwise)
        assert _quiet_get(ours, k) == _quiet_get(real, k), k
    if params is not None:
        expected = [(n, tuple(p.shape), p.dtype) for n, p in
                    build_model(real, ParallelInfo(), torch.bfloat16, torch.device("meta")).named_parameters()]
        assert params == expected


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_config_reads_as_transformers(tmp_path, name):
    raw = json.loads((CONFIGS / f"{name}.json").read_text())
    if raw["model_type"] not in config_readers.READERS:
        assert config_readers.read(raw, str(tmp_path)) is None  # read through transformers
        return
    (tmp_path / "config.json").write_text(json.dumps(raw))
    _check(str(tmp_path), raw, with_params="70b" not in name)  # 70b: llama-3.1-8b's family, slowest build


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_defaults_read_as_transformers(tmp_path, name):
    raw = VARIANTS[name]
    (tmp_path / "config.json").write_text(json.dumps(raw))
    _check(str(tmp_path), raw)


def test_start_path_uses_the_reader_and_leaves_the_rest_to_transformers(tmp_path):
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text((CONFIGS / "qwen3-0.6b.json").read_text())
    cfg = load_hf_config(str(model), str(tmp_path / "cache"))
    assert cfg.snapshot_of == "rankserve.models.config_readers.qwen3" and cfg.name_or_path == str(model)
    assert not (tmp_path / "cache").exists()  # nothing to keep: the next start reads it alike
    nested = dict(json.loads((CONFIGS / "llama-3.1-8b.json").read_text()), rope_scaling=None,
                  rope_parameters={"full_attention": {"rope_type": "default"}})
    assert config_readers.read(nested, str(model)) is None
    assert config_readers.read(dict(nested, model_type="kimi_k2"), str(model)) is None


def test_tp_size_that_does_not_divide_the_heads_names_them():
    """`mpiexec -n 3 ... --tp 3` on a 4-head model: the error names the heads and the flag (as
    vLLM's does), not the first layer that happened to fail ("output size (128)")."""
    import transformers
    hf = transformers.LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128,
                                  num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2)
    hf.architectures = ["LlamaForCausalLM"]
    with pytest.raises(ValueError, match=r"num_attention_heads \(4\) .*--tensor-parallel-size 3"):
        build_model(hf, ParallelInfo(tp_size=3), torch.float32, torch.device("meta"))
