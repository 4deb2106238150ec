"""NVIDIA ModelOpt FP8 checkpoints (issue #14: nvidia/Llama-3.1-8B-Instruct-FP8, -70B-, -405B- and
their kind), written in ModelOpt's on-disk format: e4m3 `weight`, scalar fp32 `weight_scale` and
`input_scale` per quantized layer (FP8), or `weight_scale` per output channel
(FP8_PER_CHANNEL_PER_TOKEN); `k_proj.k_scale` / `v_proj.v_scale`; the scheme in
hf_quant_config.json beside a config.json without quantization_config, or in config.json itself;
`exclude_modules` as shell-style wildcards. The reference is transformers on the dequantized
weights with the activations quantized per token as rankserve runs them (test_quantization.py)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from rankserve import LLM

import test_quantization as tq
from conftest import make_checkpoint



@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """Tiny 16-bit checkpoints (test_quantization.py's shapes)."""
    cache = {}

    def get(arch):
        if arch not in cache:
            extra = dict(moe_intermediate_size=256) if arch == "Qwen3MoeForCausalLM" else {}
            cache[arch] = make_checkpoint(tmp_path_factory.mktemp(arch), arch, **tq.SIZES, **extra)
        return cache[arch]
    return get


SIDE = {"producer": {"name": "modelopt", "version": "0.29.0"}}


def write_modelopt(src: str, dst: Path, algo: str, side_file: bool, exclude=("lm_head",),
                   dense=lambda name: False, kv_scales=False):
    """`src` as a ModelOpt export at `dst`; returns (the dequantized transformers reference, the
    names of the weights left dense)."""
    import transformers
    writer = tq.write_fp8_tensor if algo == "FP8" else per_channel
    dst.mkdir(parents=True)
    out, deq, kept = {}, {}, []
    for name, t in load_file(str(Path(src) / "model.safetensors")).items():
        if tq.is_linear(name) and not dense(name):
            tensors, d = writer(t.float())
            base = name[:-len("weight")]
            out.update({base + k: v.contiguous() for k, v in tensors.items()})
            deq[name] = d.to(t.dtype).contiguous()
            if kv_scales and base.endswith(("k_proj.", "v_proj.")):
                out[base + base[-7] + "_scale"] = torch.tensor(0.02)
        else:
            out[name] = deq[name] = t
            kept += [name] if tq.is_linear(name) else []
    quant = {"quant_algo": algo, "kv_cache_quant_algo": "FP8" if kv_scales else None}
    if side_file:
        tq.write_quantized_dir(src, dst, out, {})
        cfg = json.loads((dst / "config.json").read_text())
        del cfg["quantization_config"]
        (dst / "config.json").write_text(json.dumps(cfg))
        (dst / "hf_quant_config.json").write_text(json.dumps(
            {**SIDE, "quantization": {**quant, "exclude_modules": list(exclude)}}))
    else:
        tq.write_quantized_dir(src, dst, out, {"quant_method": "modelopt", **quant, "ignore": list(exclude)})
    ref_dir = dst.parent / (dst.name + "-dequantized")
    shutil.copytree(src, ref_dir)
    save_file(deq, str(ref_dir / "model.safetensors"))
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        ref_dir, dtype=torch.float32, experts_implementation="eager").eval()
    return ref, kept


def per_channel(w):
    """FP8_PER_CHANNEL_PER_TOKEN: `weight_scale` [N] (one per output channel)."""
    t, d = tq.write_fp8_channel(w)
    return {**t, "weight_scale": t["weight_scale"].reshape(-1)}, d


def assert_matches_reference(llm, ref, kept=()):
    from test_parity import model_logits
    fake = tq.fake_quant_activations(ref, None)
    params = dict(ref.named_parameters())
    fake.storages -= {params[n].untyped_storage().data_ptr() for n in kept}  # dense layers: as they are
    with fake:
        theirs = [tq.hf_greedy(ref, p) for p in tq.PROMPTS]
        with torch.no_grad():
            refs = [ref(torch.tensor([p])).logits[0, -1] for p in tq.PROMPTS]
    ours = tq.greedy(llm)
    errs = [float((model_logits(llm, p) - r).norm() / r.norm()) for p, r in zip(tq.PROMPTS, refs)]
    exact = [o == t and e < tq.LOGIT_TOL for o, t, e in zip(ours, theirs, errs)]
    assert sum(exact) >= 2 and max(errs) < tq.LOGIT_TIE_TOL, (errs, ours, theirs)


@pytest.mark.parametrize("algo, side_file", [("FP8", True), ("FP8", False),
                                             ("FP8_PER_CHANNEL_PER_TOKEN", True)])
def test_modelopt_fp8_llama_matches_dequantized_reference(base, tmp_path, algo, side_file, caplog):
    ref, _ = write_modelopt(base("LlamaForCausalLM"), tmp_path / "q", algo, side_file, kv_scales=True)
    with caplog.at_level("INFO"):
        llm = LLM(str(tmp_path / "q"), dtype="float32", max_num_seqs=4)
    m = llm.engine.executor.runner.model
    assert m.model.layers["0"].self_attn.qkv_proj.weight.dtype == tq.FP8
    assert m.lm_head.weight.dtype == torch.float32  # excluded: stays dense
    kind = "per-tensor; static input_scale unused" if algo == "FP8" else "per-channel"
    assert kind in caplog.text
    assert_matches_reference(llm, ref)


def test_modelopt_fp8_kv_scales_reach_an_fp8_kv_cache(base, tmp_path):
    write_modelopt(base("LlamaForCausalLM"), tmp_path / "q", "FP8", True, kv_scales=True)
    llm = LLM(str(tmp_path / "q"), dtype="float32", max_num_seqs=4, kv_cache_dtype="fp8")
    attn = llm.engine.executor.runner.model.model.layers["1"].self_attn
    assert float(attn.k_scale) == pytest.approx(0.02) and float(attn.v_scale) == pytest.approx(0.02)


def test_modelopt_exclude_modules_are_wildcards(base, tmp_path):
    """`model.layers.0.self_attn*` leaves layer 0's attention in 16 bits (its tensors are stored
    dense), the router `*mlp.gate` too; the rest is FP8."""
    excluded = lambda n: n.startswith("model.layers.0.self_attn.")  # noqa: E731
    ref, kept = write_modelopt(base("Qwen3MoeForCausalLM"), tmp_path / "q", "FP8", True,
                               exclude=("lm_head", "model.layers.0.self_attn*", "*mlp.gate"),
                               dense=excluded)
    assert len(kept) == 4
    llm = LLM(str(tmp_path / "q"), dtype="float32", max_num_seqs=4)
    layers = llm.engine.executor.runner.model.model.layers
    assert layers["0"].self_attn.qkv_proj.weight.dtype == torch.float32
    assert layers["1"].self_attn.qkv_proj.weight.dtype == tq.FP8
    assert layers["0"].mlp.experts.w13.dtype == tq.FP8
    assert_matches_reference(llm, ref, kept)


def test_modelopt_unlisted_dense_layer_is_named(base, tmp_path):
    """A 16-bit layer the exclude list does not name: the error names the tensor."""
    write_modelopt(base("LlamaForCausalLM"), tmp_path / "q", "FP8", True,
                   dense=lambda n: n.startswith("model.layers.1.mlp."))
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.\w+\.weight.*float8_e4m3fn"):
        LLM(str(tmp_path / "q"), dtype="float32")


@pytest.mark.parametrize("qc, words", [
    ({"quant_method": "modelopt", "quant_algo": "NVFP4"}, r"quant_algo 'NVFP4' \(from config\.json\)"),
    ({"quant_method": "modelopt", "quantization": {"quant_algo": "FP8_PB_WO"}}, "quant_algo 'FP8_PB_WO'"),
    ({"quant_method": "modelopt", "quant_algo": "W4A8_AWQ"}, "quant_algo 'W4A8_AWQ'"),
    ({"quant_method": "modelopt", "quant_algo": "FP8", "kv_cache_quant_algo": "NVFP4"},
     "KV cache quantization 'NVFP4'"),
    # config.json as ModelOpt converts it: a kv_cache_quant_algo other than FP8 kept as a string
    ({"quant_method": "modelopt", "quant_algo": "FP8", "kv_cache_scheme": "NVFP4"},
     "KV cache quantization 'NVFP4'"),
    ({"quant_method": "modelopt", "quant_algo": "FP8", "kv_cache_scheme": {"type": "int", "num_bits": 8}},
     "KV cache quantization"),
])
def test_other_modelopt_schemes_are_named(tmp_path, qc, words):
    tq.assert_config_refused(tmp_path, qc, words)


def test_modelopt_kv_cache_scheme_fp8_string_loads(base, tmp_path):
    """ModelOpt's config.json conversion documents `"kv_cache_scheme": "FP8"` (a string) as well
    as the dict form: both are FP8 k/v scales."""
    write_modelopt(base("LlamaForCausalLM"), tmp_path / "q", "FP8", False, kv_scales=True)
    cfg = json.loads((tmp_path / "q" / "config.json").read_text())
    cfg["quantization_config"]["kv_cache_scheme"] = "FP8"
    (tmp_path / "q" / "config.json").write_text(json.dumps(cfg))
    llm = LLM(str(tmp_path / "q"), dtype="float32", max_num_seqs=4, kv_cache_dtype="fp8")
    assert float(llm.engine.executor.runner.model.model.layers["0"].self_attn.v_scale) == pytest.approx(0.02)


def test_modelopt_config_json_without_algo_reads_the_side_file(base, tmp_path):
    """A config.json whose quantization_config only names the method ({"quant_method":
    "modelopt"}, added so that tools detect the checkpoint) beside ModelOpt's
    hf_quant_config.json: the scheme, exclude list and KV algo come from the side file (was
    refused as quant_algo None)."""
    ref, _ = write_modelopt(base("LlamaForCausalLM"), tmp_path / "q", "FP8", True, kv_scales=True)
    cfg = json.loads((tmp_path / "q" / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "modelopt"}
    (tmp_path / "q" / "config.json").write_text(json.dumps(cfg))
    llm = LLM(str(tmp_path / "q"), dtype="float32", max_num_seqs=4)
    m = llm.engine.executor.runner.model
    assert m.lm_head.weight.dtype == torch.float32  # the side file's exclude_modules
    assert_matches_reference(llm, ref)


def test_modelopt_fp8_layer_without_input_scale_loads(base, tmp_path):
    """A layer exported with its input quantizer off has no `input_scale`; rankserve quantizes
    activations per token and never reads it, so the checkpoint loads (was 'lacks weights')."""
    ref, _ = write_modelopt(base("LlamaForCausalLM"), tmp_path / "q", "FP8", True)
    path = tmp_path / "q" / "model.safetensors"
    tensors = load_file(str(path))
    del tensors["model.layers.1.self_attn.o_proj.input_scale"]
    save_file(tensors, str(path))
    llm = LLM(str(tmp_path / "q"), dtype="float32", max_num_seqs=4)
    assert_matches_reference(llm, ref)
