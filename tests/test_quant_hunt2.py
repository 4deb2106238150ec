"""Bug hunt, round 2 (issue #14): quantized MoE checkpoints, parallel loading and the FP8 KV
cache. Writers and the reference come from tests/test_quantization.py (formats as published
checkpoints store them; transformers on the dequantized weights)."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rankserve import LLM, SamplingParams

import test_quantization as tq
from conftest import make_checkpoint

MOE = dict(tq.SIZES, moe_intermediate_size=256, head_dim=64)


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("moe"), "Qwen3MoeForCausalLM", **MOE)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("llama"), "LlamaForCausalLM", **tq.SIZES)


def few_tokens(llm):
    out = llm.generate([{"prompt_token_ids": tq.PROMPTS[1]}], SamplingParams(temperature=0, max_tokens=4))
    return out[0].outputs[0].token_ids


def assert_matches_reference(llm, ref, quantized: set[str] | None, fp8_group: int | None | bool):
    """test_quant_edge.assert_matches on two prompts and 6 tokens (this file's time budget):
    `quantized` the reference's parameters whose F.linear quantizes its input (None: every
    linear and expert weight), fp8_group False for 4-bit (exact weights, logits within 1e-5)."""
    import contextlib

    from test_parity import model_logits
    prompts, n = tq.PROMPTS[:2], 6
    fq = contextlib.nullcontext()
    if fp8_group is not False:
        fq = tq.fake_quant_activations(ref, fp8_group)
        if quantized is not None:
            params = dict(ref.named_parameters())
            fq.storages = {params[k].untyped_storage().data_ptr() for k in quantized}
    with fq, torch.no_grad():
        theirs = [ref.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                               max_new_tokens=n, do_sample=False, eos_token_id=None,
                               pad_token_id=0)[0, len(p):].tolist() for p in prompts]
        refs = [ref(torch.tensor([p])).logits[0, -1] for p in prompts]
    ours = [o.outputs[0].token_ids for o in llm.generate(
        [{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))]
    errs = [float((model_logits(llm, p) - r).norm() / r.norm()) for p, r in zip(prompts, refs)]
    assert ours == theirs and max(errs) < (1e-5 if fp8_group is False else tq.LOGIT_TOL), (errs, ours, theirs)


def write(src: str, dst: Path, fmt: str, quantized=tq.is_linear, qc_extra: dict | None = None) -> str:
    """`src` in format `fmt`, quantizing the tensors `quantized(name)` picks (no reference)."""
    writer, qc = tq.FORMATS[fmt]
    dst.mkdir(parents=True)
    out = {}
    for name, t in load_file(str(Path(src) / "model.safetensors")).items():
        if quantized(name):
            tensors, _ = writer(t.float())
            out.update({name[:-len("weight")] + k: v.contiguous() for k, v in tensors.items()})
        else:
            out[name] = t
    tq.write_quantized_dir(src, dst, out, {**qc, **(qc_extra or {})})
    return str(dst)


@pytest.mark.parametrize("fmt", ["fp8-block", "ct-fp8"])
def test_a_quantized_router_is_refused_naming_it(moe, tmp_path, fmt):
    """A checkpoint that quantized the MoE router (`mlp.gate`, a config without it in its ignore
    list) loaded: the router runs dense, so its e4m3 values were cast without their scale and its
    `weight_scale(_inv)` dropped: wrong routing, wrong tokens, no error."""
    path = write(moe, tmp_path / "q", fmt, lambda n: tq.is_linear(n) or n.endswith(".mlp.gate.weight"))
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.gate\.weight: is stored as fp8"):
        LLM(path, dtype="float32", max_num_seqs=2)


def test_a_layer_listed_as_not_converted_but_stored_fp8_is_refused(llama, tmp_path):
    """modules_to_not_convert lists layer 0's MLP, but the checkpoint quantized it anyway: the
    dense layer took the e4m3 weight without its scale (silently wrong); now an error naming it.
    The scale alone (a checkpoint whose weight came in 16 bits elsewhere) is refused too."""
    path = write(llama, tmp_path / "q", "fbgemm_fp8", qc_extra={"modules_to_not_convert": ["layers.0.mlp", "lm_head"]})
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.(gate|up|down)_proj\.weight: is stored as fp8"):
        LLM(path, dtype="float32", max_num_seqs=2)
    from rankserve.models.loader import _check_unused
    with pytest.raises(ValueError, match=r"mlp\.down_proj\.weight_scale: the checkpoint quantizes "
                                         r"model\.layers\.0\.mlp\.down_proj"):
        _check_unused("model.layers.0.mlp.down_proj.weight_scale", "model.layers.0.mlp.down_proj.weight_scale",
                      {"model.layers.0.mlp.down_proj.weight": None})


def test_tp_split_through_expert_blocks_names_the_experts():
    """Qwen3-30B-A3B-FP8 (moe_intermediate_size 768, 128 x 128 blocks) at --tp 4 leaves 192 rows
    of each expert per rank: the error said "expert size vs weight_block_size 128 (192) is not
    divisible by the tensor-parallel size (128)". Now it names the experts, the sizes and the
    way out (expert parallelism keeps experts whole, and loads)."""
    from rankserve.models.moe import FusedExperts
    from rankserve.models.parallel import ParallelInfo
    from rankserve.models.quantization import Fp8Config, building
    qc = Fp8Config(tq.FORMATS["fp8-block"][1])
    with building(qc), pytest.raises(ValueError, match=r"MoE experts \(mlp\.experts\): intermediate size "
                                                       r"768 split over 4 tensor-parallel ranks \(192 per "
                                                       r"rank\) is not a multiple of the checkpoint's "
                                                       r"weight_block_size \[128, 128\]; use --enable-expert-parallel"):
        FusedExperts(8, 256, 768, ParallelInfo(tp_size=4), torch.float32)
    with building(qc):
        ex = FusedExperts(8, 256, 768, ParallelInfo(tp_size=4, enable_expert_parallel=True), torch.float32)
    assert ex.w13_scale.shape == (2, 12, 2) and ex.w2_scale.shape == (2, 2, 6)


def test_online_fp8_moe_matches_the_dequantized_reference(moe, tmp_path):
    """`--quantization fp8` on a 16-bit MoE checkpoint quantizes experts per channel at load time:
    the same tokens as transformers on those per-channel dequantized weights (fbgemm_fp8's
    writer: amax / 448 per row) with per-token activation quantization."""
    ref = tq.quantize_checkpoint(moe, tmp_path / "ref", "fbgemm_fp8")
    llm = LLM(moe, dtype="float32", quantization="fp8", max_num_seqs=4)
    ex = llm.engine.executor.runner.model.model.layers["0"].mlp.experts
    assert ex.w13.dtype == tq.FP8 and ex.w13_scale.shape == (8, 512)
    assert_matches_reference(llm, ref, None, None)  # logits measured within 5e-7


def test_a_16bit_expert_where_fp8_is_expected_names_it(moe, tmp_path):
    """Every expert tensor must be e4m3 where the config says FP8: a 16-bit one beside its scale
    was cast to e4m3 without it (the dense layers already refused this)."""
    from safetensors.torch import save_file
    path = Path(write(moe, tmp_path / "q", "fp8-block"))
    state = load_file(str(path / "model.safetensors"))
    name = "model.layers.1.mlp.experts.3.up_proj.weight"
    state[name] = state[name].float()
    save_file(state, str(path / "model.safetensors"))
    with pytest.raises(ValueError, match=rf"{name}: is float32 in the checkpoint where the quantization "
                                         "config expects float8_e4m3fn"):
        LLM(str(path), dtype="float32", max_num_seqs=2)


def test_new_weights_quantized_differently_are_refused_before_any_copy(moe, tmp_path):
    """update_weights_from_disk of the 16-bit checkpoint into the running block-FP8 one (same
    architecture and shapes): its experts were cast to e4m3 without scales, then the first
    attention weight failed, leaving the engine half updated (its tokens changed). Now the
    quantization configs are compared first and nothing is copied; the reverse likewise."""
    q = write(moe, tmp_path / "q", "fp8-block")
    llm = LLM(q, dtype="float32", max_num_seqs=2)
    want = few_tokens(llm)
    with pytest.raises(ValueError, match=r"is quantized differently from the running model \("
                                         r"quantization_config none: 16-bit; running: \{'quant_method': 'fp8'"):
        llm.update_weights_from_disk(moe)
    assert few_tokens(llm) == want
    from rankserve.runtime.weight_update import check_checkpoint
    with pytest.raises(ValueError, match=r"quantization_config \{'quant_method': 'fp8'.*running: none: 16-bit"):
        check_checkpoint(moe, q)
    check_checkpoint(q, q)  # the same scheme: fine


def test_startup_log_counts_mlas_dequantized_kv_b_proj(checkpoint, tmp_path, caplog):
    """DeepSeek-V3's block FP8: the absorbed attention keeps a dequantized 16-bit copy of each
    FP8 kv_b_proj (V3: 32 MiB a layer, 2 GiB in all): the log's weight bytes left it out."""
    from test_deepseek import _quantize_block_fp8
    fp8, _ = _quantize_block_fp8(checkpoint("DeepseekV3ForCausalLM"), tmp_path)
    with caplog.at_level("INFO", logger="rankserve.runner"):
        llm = LLM(fp8, dtype="float32", max_num_seqs=2)
    m = llm.engine.executor.runner.model
    derived = sum(a.w_kv_b.numel() * 4 for a in m.attention_layers())
    total = sum(p.numel() * p.element_size() for p in m.parameters()) + derived
    assert (f"quantization fp8: weights {total / 2**20:.2f} MiB on this rank ({derived / 2**20:.2f} MiB "
            "of them dequantized at load time); linear layers: 2 x experts fp8 e4m3 (block 16x16), "
            "21 x fp8 e4m3 (block 16x16)") in caplog.text, caplog.text[-2000:]


def test_bench_floor_counts_mlas_dequantized_kv_b_proj(checkpoint, tmp_path):
    """The floor's bytes per linear weight (`byte_widths`) read the FP8 kv_b_proj at 1 byte a
    weight, but the absorbed attention streams its dequantized 16-bit copy every step."""
    from rankserve.runtime.bench.common import byte_widths
    from test_deepseek import _quantize_block_fp8
    fp8, _ = _quantize_block_fp8(checkpoint("DeepseekV3ForCausalLM"), tmp_path)
    runner = LLM(fp8, dtype="float32", max_num_seqs=2).engine.executor.runner
    nbytes = logical = 0
    for mod in runner.model.modules():
        if getattr(mod, "quant", None) is None:
            continue
        own = sum(p.numel() * p.element_size() for n, p in mod.named_parameters(recurse=False) if n != "bias")
        dense = [a.w_kv_b for a in runner.model.attention_layers() if a.kv_b_proj is mod]
        nbytes += dense[0].numel() * dense[0].element_size() if dense else own
        logical += mod.weight_shape[0] * mod.weight_shape[1] if hasattr(mod, "weight_shape") else (
            mod.w13.numel() + mod.w2.numel())  # (FusedExperts.weight_numel, checked the long way)
    assert byte_widths(runner)["linear"] == pytest.approx(nbytes / logical)


def bin_checkpoint(tmp_path, file_name: str, extra: dict | None = None):
    """stories260K with its weights (and `extra` tensors) in one torch .bin file."""
    from conftest import STORIES_EMBEDDED
    path = tmp_path / "bin"
    path.mkdir()
    for f in STORIES_EMBEDDED.iterdir():
        if not f.name.endswith(".safetensors"):
            shutil.copy(f, path / f.name)
    state = {}
    for f in STORIES_EMBEDDED.glob("*.safetensors"):
        state.update(load_file(str(f)))
    torch.save({**state, **(extra or {})}, path / file_name)
    return path


def test_kv_scales_of_a_bin_checkpoint_are_loaded(tmp_path):
    """Weights load from pytorch_model*.bin where a checkpoint has no safetensors, but the fp8
    cache's k/v scales were looked for in *.safetensors only: 1.0 silently took their place."""
    path = bin_checkpoint(tmp_path, "pytorch_model.bin",
                          {"model.layers.0.self_attn.k_scale": torch.tensor(0.5),
                           "model.layers.1.self_attn.v_scale": torch.tensor(0.25)})
    llm = LLM(str(path), kv_cache_dtype="fp8", max_num_seqs=2, kv_cache_memory_gb=0.01)
    got = [(float(a.k_scale), float(a.v_scale)) for a in llm.engine.executor.runner.model.attention_layers()]
    assert got[:3] == [(0.5, 1.0), (1.0, 0.25), (1.0, 1.0)]


def test_bin_weight_files_of_any_name_load(tmp_path):
    """AutoGPTQ's older checkpoints name their weights gptq_model-4bit-128g.bin: only
    pytorch_model*.bin was looked for (vLLM loads any *.bin but a trainer's own files)."""
    from conftest import STORIES_EMBEDDED
    from rankserve.models.loader import checkpoint_files
    path = bin_checkpoint(tmp_path, "gptq_model-4bit-128g.bin")
    for junk in ("training_args.bin", "optimizer.bin", "scheduler.bin", "rng_state_0.bin"):
        (path / junk).write_bytes(b"not weights")  # a trainer's files beside them: never read
    assert checkpoint_files(str(path)) == [str(path / "gptq_model-4bit-128g.bin")]
    got = LLM(str(path), max_num_seqs=2).generate(["Once upon"], SamplingParams(max_tokens=4))
    ref = LLM(str(STORIES_EMBEDDED), max_num_seqs=2).generate(["Once upon"], SamplingParams(max_tokens=4))
    assert got[0].outputs[0].token_ids == ref[0].outputs[0].token_ids


def test_expert_parallelism_on_a_dense_model_is_refused(llama):
    """--enable-expert-parallel on a model without MoE experts changed nothing, silently."""
    with pytest.raises(ValueError, match=r"--enable-expert-parallel: LlamaForCausalLM has no MoE experts"):
        LLM(llama, dtype="float32", enable_expert_parallel=True, max_num_seqs=2)


def test_weights_from_a_trainer_into_a_checkpoint_quantized_model_are_refused_up_front(llama, tmp_path):
    """A trainer's (16-bit) tensors into a model whose checkpoint is FP8: the first quantized
    layer failed part way through the broadcasts, leaving the model half updated and the trainer
    broadcasting to no one. Refused before any broadcast now (a model quantized at load time
    takes them: tests/test_fp8_kv_edge.py)."""
    llm = LLM(write(llama, tmp_path / "q", "fp8-block"), dtype="float32", max_num_seqs=2)
    with pytest.raises(ValueError, match=r"quantized in its checkpoint \(fp8\), which a trainer's 16-bit"):
        llm.update_weights_from_distributed(["model.embed_tokens.weight"], ["float32"], [[512, 256]])


@pytest.mark.mpi
@pytest.mark.skipif(shutil.which("mpiexec") is None, reason="mpiexec not on PATH")
def test_tp2_cut_through_expert_blocks_is_a_clear_error_under_mpiexec(tmp_path_factory, tmp_path):
    """The real launch: 128-row experts of a 128 x 128 block-FP8 checkpoint at --tp 2 stop with
    the experts' message (each rank 64 rows), not a garbled divisibility error."""
    src = make_checkpoint(tmp_path_factory.mktemp("moe128"), "Qwen3MoeForCausalLM",
                          **{**MOE, "moe_intermediate_size": 128})
    path = write(src, tmp_path / "q", "fp8-block")
    r = subprocess.run(["mpiexec", "-n", "2", sys.executable, "-m", "rankserve.launch", "generate", path,
                        "--tp", "2", "--dtype", "float32", "--max-tokens", "2", "--prompt", "Once"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    want = ("intermediate size 128 split over 2 tensor-parallel ranks (64 per rank) is not a multiple "
            "of the checkpoint's weight_block_size [128, 128]; use --enable-expert-parallel")
    assert want in r.stderr, r.stderr[-3000:]


@pytest.mark.parametrize("fmt, entry", [("fp8-block", "re:.*mlp[.]experts[.].*"), ("fbgemm_fp8", "mlp.experts")])
def test_experts_the_config_leaves_unquantized_run_dense(moe, tmp_path, fmt, entry):
    """A checkpoint that quantized attention but kept the experts 16-bit, its ignore list naming
    them (as vLLM skips such a layer): the experts were built quantized whatever the list said
    (FP8: "lacks weights for ...w13_scale"; GPTQ / AWQ: "does not support MoE experts", as in
    the next test). Now they run dense, with the dequantized reference's tokens."""
    import test_quant_edge as te
    writer, qc = tq.FORMATS[fmt]
    qc = {**qc, "modules_to_not_convert": ["lm_head", entry]}
    ref, quantized = te.write_checkpoint(moe, tmp_path / "q", writer, qc, dense=lambda n: ".experts." in n)
    llm = LLM(str(tmp_path / "q"), dtype="float32", max_num_seqs=4)
    ex = llm.engine.executor.runner.model.model.layers["0"].mlp.experts
    assert ex.w13.dtype == torch.float32 and ex.quant.describe() == "experts (dense)"
    assert_matches_reference(llm, ref, quantized, 128 if fmt == "fp8-block" else None)


def test_gptq_modules_in_block_to_quantize_without_experts_keeps_them_dense(moe, tmp_path):
    """optimum's allow list naming attention only: the experts are not quantized (dense in the
    checkpoint), which the GPTQ config refused as "does not support MoE experts"."""
    writer, qc = tq.FORMATS["gptq-sym"]
    qc = {**qc, "modules_in_block_to_quantize": [["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"],
                                                 ["self_attn.o_proj"]]}
    import test_quant_edge as te
    ref, _ = te.write_checkpoint(moe, tmp_path / "q", writer, qc, dense=lambda n: ".self_attn." not in n)
    llm = LLM(str(tmp_path / "q"), dtype="float32", max_num_seqs=2)
    layer = llm.engine.executor.runner.model.model.layers["0"]
    assert layer.mlp.experts.quant.describe() == "experts (dense)" and not layer.self_attn.qkv_proj.quant.dense
    assert_matches_reference(llm, ref, None, False)  # 4-bit attention: exact weights


@pytest.mark.parametrize("name", ["model.layers.1.mlp.experts.3.up_proj.weight_scale_inv",
                                  "model.layers.1.mlp.experts.3.down_proj.weight_scale_inv"])
def test_a_block_scale_of_the_wrong_shape_is_refused_naming_it(moe, tmp_path, name):
    """A block-FP8 scale must be [ceil(out / bn), ceil(in / bk)]: one row of it was broadcast
    over the expert's every block row."""
    from safetensors.torch import save_file
    path = Path(write(moe, tmp_path / "q", "fp8-block"))
    state = load_file(str(path / "model.safetensors"))
    good = tuple(state[name].shape)
    state[name] = state[name][:1].contiguous()
    save_file(state, str(path / "model.safetensors"))
    with pytest.raises(ValueError, match=rf"{name}: .*shape \[1, {good[1]}\].*\[{good[0]}, {good[1]}\]"):
        LLM(str(path), dtype="float32", max_num_seqs=2)


def test_a_dense_block_scale_of_the_wrong_shape_is_refused_naming_it(llama, tmp_path):
    from safetensors.torch import save_file
    path = Path(write(llama, tmp_path / "q", "fp8-block"))
    state = load_file(str(path / "model.safetensors"))
    name = "model.layers.1.mlp.up_proj.weight_scale_inv"
    good = tuple(state[name].shape)
    state[name] = state[name][:1].contiguous()
    save_file(state, str(path / "model.safetensors"))
    with pytest.raises(ValueError, match=rf"{name}: .*shape \[1, {good[1]}\].*\[{good[0]}, {good[1]}\]"):
        LLM(str(path), dtype="float32", max_num_seqs=2)


@pytest.mark.parametrize("model, name", [
    ("llama", "model.layers.1.mlp.up_proj.weight_scale"),
    ("moe", "model.layers.1.mlp.experts.3.up_proj.weight_scale"),
    ("moe", "model.layers.1.mlp.experts.3.down_proj.weight_scale")])
def test_a_channel_scale_of_the_wrong_length_is_refused_naming_it(request, tmp_path, model, name):
    """A per-channel scale has one entry per output row (or one for the tensor): a shorter one
    was a torch shape error without the tensor's name, or a silent broadcast."""
    from safetensors.torch import save_file
    path = Path(write(request.getfixturevalue(model), tmp_path / "q", "fbgemm_fp8"))
    state = load_file(str(path / "model.safetensors"))
    n = state[name].shape[0]
    state[name] = state[name][: n // 2].contiguous()
    save_file(state, str(path / "model.safetensors"))
    with pytest.raises(ValueError, match=rf"{name}: .*{n // 2}.*{n}"):
        LLM(str(path), dtype="float32", max_num_seqs=2)
