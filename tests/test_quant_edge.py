"""Quantized checkpoints at the edges of their formats (models/quantization.py): the fields that
published configs carry besides the common ones, layers left unquantized by name, and shapes
that tensor parallelism cuts oddly. Writers and the reference come from tests/test_quantization.py
(transformers on the dequantized weights, with FP8's activation quantization around the quantized
layers only)."""
from __future__ import annotations

import contextlib
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from rankserve import LLM, SamplingParams

import test_quantization as tq
from conftest import make_checkpoint

CT_CHANNEL = tq.FORMATS["ct-fp8"][1]


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("llama"), "LlamaForCausalLM", **tq.SIZES)


def write_checkpoint(src: str, dst: Path, writer, qc: dict, dense=lambda name: False, reference=True):
    """`src` with every linear weight written by `writer` except those `dense(name)` keeps as
    they are; returns (reference transformers model or None, the parameters it quantized)."""
    import transformers
    dst.mkdir(parents=True)
    out, deq, quantized = {}, {}, set()
    for name, t in load_file(str(Path(src) / "model.safetensors")).items():
        if tq.is_linear(name) and not dense(name):
            tensors, d = writer(t.float())
            out.update({name[:-len("weight")] + k: v.contiguous() for k, v in tensors.items()})
            deq[name] = d.to(t.dtype).contiguous()
            quantized.add(name)
        else:
            out[name] = deq[name] = t
    tq.write_quantized_dir(src, dst, out, qc)
    if not reference:
        return None, quantized
    ref_dir = dst.parent / (dst.name + "-dequantized")
    shutil.copytree(src, ref_dir)
    save_file(deq, str(ref_dir / "model.safetensors"))
    ref = transformers.AutoModelForCausalLM.from_pretrained(ref_dir, dtype=torch.float32).eval()
    return ref, quantized


def assert_matches(llm, ref, quantized: set[str], fp8_group: int | None | bool):
    """Greedy tokens and logits against the reference; fp8_group False: 4-bit (exact weights,
    no activation quantization), else FP8 with per-token (None) or per-group activations."""
    from test_parity import model_logits
    fq = contextlib.nullcontext()
    if fp8_group is not False:
        fq = tq.fake_quant_activations(ref, fp8_group)
        params = dict(ref.named_parameters())
        fq.storages = {params[n].untyped_storage().data_ptr() for n in quantized}
    with fq:
        theirs = [tq.hf_greedy(ref, p) for p in tq.PROMPTS]
        with torch.no_grad():
            refs = [ref(torch.tensor([p])).logits[0, -1] for p in tq.PROMPTS]
    ours = tq.greedy(llm)
    errs = [float((model_logits(llm, p) - r).norm() / r.norm()) for p, r in zip(tq.PROMPTS, refs)]
    if fp8_group is False:
        assert ours == theirs and max(errs) < 1e-5, errs
    else:  # as tests/test_quantization.py: most prompts exact, every prompt close
        exact = [o == t and e < tq.LOGIT_TOL for o, t, e in zip(ours, theirs, errs)]
        assert sum(exact) >= 2 and max(errs) < tq.LOGIT_TIE_TOL, (errs, ours, theirs)


def linears(llm):
    m = llm.engine.executor.runner.model
    return {n: mod for n, mod in m.named_modules() if hasattr(mod, "set_method")}


# Llama-3.1-405B-FP8 (fbgemm_fp8) leaves layers 0 and 125 in bf16 and lists them by their
# unfused names; llm-compressor's `ignore` takes "re:" patterns; GPTQModel's `dynamic` skips
# modules with "-:" patterns
LAYER0 = [f"model.layers.0.{m}" for m in ("mlp.down_proj", "mlp.gate_proj", "mlp.up_proj", "self_attn.k_proj",
                                          "self_attn.o_proj", "self_attn.q_proj", "self_attn.v_proj")]
SKIPPED = {  # kind: (writer, config, FP8 activation group or False for 4-bit, dense(layer, "self_attn" / "mlp"))
    "fbgemm": (tq.write_fp8_channel, {"activation_scale_ub": 1200.0, "quant_method": "fbgemm_fp8",
                                      "modules_to_not_convert": [*LAYER0, "lm_head"]}, None, lambda i, b: i == 0),
    "ct-regex": (tq.write_fp8_channel, {**CT_CHANNEL, "ignore": ["lm_head", r"re:.*layers\.0\.self_attn\..*",
                                                                 "re:.*mlp.gate$"],
                                        "quantization_status": "compressed", "kv_cache_scheme": None,
                                        "sparsity_config": {"format": "dense", "sparsity_structure": "unstructured",
                                                            "global_sparsity": 0.0}}, None,
                 lambda i, b: i == 0 and b == "self_attn"),
    "gptq-dynamic": (tq.write_gptq, {**tq.FORMATS["gptq-sym"][1], "lm_head": False, "pack_dtype": "int32",
                                     "dynamic": {r"-:.*layers\.0\.mlp\..*": {}}}, False,
                     lambda i, b: i == 0 and b == "mlp"),
    # transformers / optimum: only the modules listed are quantized
    "gptq-in-block": (tq.write_gptq, {**tq.FORMATS["gptq-sym"][1], "modules_in_block_to_quantize": [
        ["self_attn.k_proj", "self_attn.v_proj", "self_attn.q_proj"], ["self_attn.o_proj"]]}, False,
        lambda i, b: b == "mlp"),
}


@pytest.mark.parametrize("kind", SKIPPED)
def test_layers_left_unquantized_by_name_are_dense(llama, tmp_path, caplog, kind):
    """A fused layer (qkv_proj, gate_up_proj) is dense when the config names all its parts by
    their checkpoint names (or a pattern matches them); the other layers stay quantized, and the
    startup log counts both kinds and the weight bytes."""
    writer, qc, group, dense = SKIPPED[kind]
    kept = lambda n: dense(int(n.split(".")[2]), n.split(".")[3])  # noqa: E731  model.layers.<i>.<block>.
    ref, quantized = write_checkpoint(llama, tmp_path / "q", writer, qc, dense=kept)
    with caplog.at_level("INFO", logger="rankserve.runner"):
        llm = LLM(str(tmp_path / "q"), dtype="float32", max_num_seqs=4)
    lin = linears(llm)
    for name, mod in lin.items():
        assert mod.quant.dense == kept(name), (name, mod.quant.describe())
    n_dense = sum(kept(n) for n in lin)
    nbytes = sum(p.numel() * p.element_size() for p in llm.engine.executor.runner.model.parameters())
    assert (f"quantization {qc['quant_method']}: weights {nbytes / 2**20:.2f} MiB on this rank; linear layers: "
            f"{n_dense} x dense, {len(lin) - n_dense} x ") in caplog.text
    assert_matches(llm, ref, quantized, group)


def test_some_but_not_all_parts_of_a_fused_layer_skipped_is_an_error(llama, tmp_path):
    qc = {"quant_method": "fbgemm_fp8", "modules_to_not_convert": ["model.layers.0.self_attn.q_proj"]}
    write_checkpoint(llama, tmp_path / "q", tq.write_fp8_channel, qc, dense=lambda n: ".0.self_attn.q_proj" in n,
                     reference=False)
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.qkv_proj.*q_proj.*k_proj"):
        LLM(str(tmp_path / "q"), dtype="float32")


def test_ignored_layers_are_built_on_the_model_device(llama):
    """Layers the config leaves dense are rebuilt after the model: on its device, not the CPU
    (on a GPU a CPU weight there fails at the first step)."""
    from rankserve.models.loader import build_model, load_hf_config
    from rankserve.models.parallel import ParallelInfo
    cfg = load_hf_config(llama)
    cfg.quantization_config = {"quant_method": "fp8", "weight_block_size": [128, 128],
                               "modules_to_not_convert": ["model.layers.0.mlp.down_proj"]}
    model = build_model(cfg, ParallelInfo(), torch.float32, torch.device("meta"))
    assert model.model.layers["0"].mlp.down_proj.quant.dense
    assert {p.device.type for p in model.parameters()} == {"meta"}


def write_gptq_v2(w, group=128):
    """GPTQModel's v2 format: the zero points stored as they are (v1 stores zero - 1)."""
    W = w.T.contiguous()
    q, scales, zeros, deq = tq._quant_groups(W, torch.arange(W.shape[0]) // group, W.shape[0] // group, sym=False)
    return {"qweight": tq._pack_rows(q), "qzeros": tq._pack_cols(zeros), "scales": scales.half(),
            "g_idx": (torch.arange(W.shape[0]) // group).to(torch.int32)}, deq.T


def test_gptqmodel_format_field(llama, tmp_path):
    """GPTQModel writes `format` (older: `checkpoint_format`): gptq_v2 zero points are read as v2."""
    qc = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": False,
          "lm_head": False, "format": "gptq_v2", "pack_dtype": "int32", "meta": {"quantizer": ["gptqmodel:4.0.0"]}}
    ref, quantized = write_checkpoint(llama, tmp_path / "q", write_gptq_v2, qc)
    assert_matches(LLM(str(tmp_path / "q"), dtype="float32", max_num_seqs=4), ref, quantized, False)


@pytest.mark.parametrize("side_file, side, fmt", [
    ("quantize_config.json", {"bits": 4, "group_size": 128, "damp_percent": 0.01, "desc_act": False,
                              "static_groups": False, "sym": True, "true_sequential": True,
                              "model_name_or_path": None, "model_file_base_name": "model"}, "gptq-sym"),
    ("quant_config.json", {"zero_point": True, "q_group_size": 128, "w_bit": 4, "version": "GEMM"}, "awq"),
])
def test_scheme_in_a_side_file(llama, tmp_path, side_file, side, fmt):
    """Older AutoGPTQ / AutoAWQ checkpoints keep the scheme in quantize_config.json /
    quant_config.json (no quant_method there), not in config.json."""
    ref, quantized = write_checkpoint(llama, tmp_path / "q", tq.FORMATS[fmt][0], {})
    cfg = json.loads((tmp_path / "q" / "config.json").read_text())
    del cfg["quantization_config"]
    (tmp_path / "q" / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "q" / side_file).write_text(json.dumps(side))
    assert_matches(LLM(str(tmp_path / "q"), dtype="float32", max_num_seqs=4), ref, quantized, False)


CT = {"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
      "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
          "num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True, "dynamic": False},
          "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True}}}}
GPTQ = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True}


@pytest.mark.parametrize("qc, words", [
    ({**GPTQ, "lm_head": True}, "gptq lm_head: true"),
    ({**GPTQ, "pack_dtype": "int16"}, "gptq pack_dtype 'int16'"),
    ({**GPTQ, "format": "marlin"}, "gptq format 'marlin'"),
    ({**GPTQ, "checkpoint_format": "gptq", "format": "gptq_v2"}, "disagree"),
    ({**GPTQ, "is_marlin_format": True}, "is_marlin_format"),
    ({**GPTQ, "dynamic": {r"+:.*down_proj": {"bits": 8}}}, r"gptq dynamic override '\+:\.\*down_proj'"),
    ({**CT, "format": "dense"}, "compressed-tensors format 'dense'"),
    ({**CT, "config_groups": {"group_0": {**CT["config_groups"]["group_0"], "output_activations": {
        "num_bits": 8, "type": "float"}}}}, "output_activations"),
    ({**CT, "sparsity_config": {"format": "sparse-24-bitmask", "sparsity_structure": "2:4"}}, "sparsity_config"),
    ({**CT, "transform_config": {"config_groups": {"u": {"type": "hadamard"}}}}, "transform_config"),
])
def test_unsupported_fields_are_clear_errors(tmp_path, qc, words):
    tq.assert_config_refused(tmp_path, qc, words)


def test_a_16bit_tensor_where_fp8_is_expected_names_it(llama, tmp_path):
    """An unlisted dense layer in an FP8 checkpoint: the error names the tensor, not a missing scale."""
    write_checkpoint(llama, tmp_path / "q", tq.write_fp8_block, tq.FORMATS["fp8-block"][1],
                     dense=lambda n: n == "model.layers.1.mlp.down_proj.weight", reference=False)
    with pytest.raises(ValueError, match=re.escape("model.layers.1.mlp.down_proj.weight") + ".*float32.*float8"):
        LLM(str(tmp_path / "q"), dtype="float32")


@pytest.mark.mpi
@pytest.mark.skipif(shutil.which("mpiexec") is None, reason="mpiexec not on PATH")
def test_gptq_one_group_per_column_tp2(llama, tmp_path):
    """group_size -1 (one group over all of K): a row-parallel layer's ranks share that group.
    Same tokens as the reference on one rank, and under mpiexec -n 2 --tp 2."""
    qc = {"quant_method": "gptq", "bits": 4, "group_size": -1, "desc_act": False, "sym": False}
    per_column = lambda w: tq.write_gptq(w, group=w.shape[1], sym=False)  # noqa: E731
    ref, quantized = write_checkpoint(llama, tmp_path / "q", per_column, qc)
    llm = LLM(str(tmp_path / "q"), dtype="float32", max_num_seqs=4)
    assert_matches(llm, ref, quantized, False)
    prompts = ["Once upon a time", "The little dog ran"]
    cmd = ["mpiexec", "-n", "2", sys.executable, "-m", "rankserve.launch", "generate", str(tmp_path / "q"),
           "--tp", "2", "--dtype", "float32", "--max-tokens", "10", "--ignore-eos", "--json"]
    for p in prompts:
        cmd += ["--prompt", p]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    tp = [json.loads(x)["token_ids"] for x in r.stdout.splitlines() if x.startswith("{")]
    one = [o.outputs[0].token_ids for o in llm.generate(prompts, SamplingParams(temperature=0, max_tokens=10,
                                                                                 ignore_eos=True))]
    assert tp == one


GPU_CASES = {  # kind: (writer, config, dense(layer, block))
    **{k: (w, qc, d) for k, (w, qc, _, d) in SKIPPED.items() if k in ("fbgemm", "gptq-in-block")},
    "gptq-group-1": (lambda w: tq.write_gptq(w, group=w.shape[1], sym=False), {
        "quant_method": "gptq", "bits": 4, "group_size": -1, "desc_act": False, "sym": False}, lambda i, b: False),
    "gptq-v2": (write_gptq_v2, {**GPTQ, "sym": False, "format": "gptq_v2"}, lambda i, b: False),
}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kind", GPU_CASES)
def test_gpu_matches_cpu(llama, tmp_path, kind):
    """These checkpoints on CUDA (float32, the Triton kernels): every weight on the GPU (dense
    layers are rebuilt after the model), greedy tokens of most prompts and logits as on the CPU."""
    from test_deepseek import _device_logits
    from test_parity import model_logits
    writer, qc, dense = GPU_CASES[kind]
    write_checkpoint(llama, tmp_path / "q", writer, qc, dense=lambda n: dense(int(n.split(".")[2]), n.split(".")[3]),
                     reference=False)
    gpu = LLM(str(tmp_path / "q"), dtype="float32", max_num_seqs=4, gpu_memory_utilization=0.3)
    assert {p.device.type for p in gpu.engine.executor.runner.model.parameters()} == {"cuda"}
    cpu = LLM(str(tmp_path / "q"), dtype="float32", max_num_seqs=4, device="cpu")
    same = [a == b for a, b in zip(tq.greedy(gpu), tq.greedy(cpu))]
    errs = [float((_device_logits(gpu, p).cpu() - model_logits(cpu, p)).norm() / model_logits(cpu, p).norm())
            for p in tq.PROMPTS]
    assert sum(same) >= 2 and max(errs) < tq.LOGIT_TIE_TOL, (same, errs)


@pytest.fixture(scope="module")
def llama384(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("llama384"), "LlamaForCausalLM",
                           **{**tq.SIZES, "intermediate_size": 384, "num_key_value_heads": 4})


@pytest.mark.parametrize("fmt", ["fp8-block", "gptq-sym", "awq"])
def test_tp_cut_through_a_block_or_group_names_the_tensor(llama384, tmp_path, fmt):
    """intermediate 384 at TP 2: each rank's 192 input columns of down_proj end mid-way through a
    128 block / group. Loading rank 1 (no collectives needed) is an error naming the tensor."""
    from rankserve.models.loader import build_model, load_hf_config, load_weights
    from rankserve.models.parallel import ParallelInfo
    write_checkpoint(llama384, tmp_path / fmt, *tq.FORMATS[fmt], reference=False)
    cfg = load_hf_config(str(tmp_path / fmt))
    model = build_model(cfg, ParallelInfo(tp_rank=1, tp_size=2), torch.float32, torch.device("cpu"))
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.down_proj\.\w+: input shard \w+ \(192\) is not "
                                         r"a multiple of 128"):
        load_weights(model, str(tmp_path / fmt), progress=False)
