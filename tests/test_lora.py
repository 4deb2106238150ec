"""Multi-LoRA serving (#17): greedy tokens with PEFT adapters equal transformers + PEFT merged
(fp32, CPU), with several adapters and the base model mixed in one batch; --max-loras."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch

from rankserve import LLM, LoRARequest, SamplingParams
from lora_utils import ADAPTERS, NEW, PROMPTS, make_adapter, merged_greedy


@pytest.fixture(scope="module", params=["LlamaForCausalLM", "Qwen3ForCausalLM"])
def setup(request, checkpoint, tmp_path_factory):
    base = checkpoint(request.param)
    d = tmp_path_factory.mktemp("lora-" + request.param)
    adapters = [LoRARequest(name, i + 1, make_adapter(base, d / name, r, a, rs, t, seed=i))
                for i, (name, r, a, rs, t) in enumerate(ADAPTERS)]
    # per (adapter or base) and prompt: the merged model's greedy tokens
    refs = {None: merged_greedy(base, None, PROMPTS)}
    for lr in adapters:
        refs[lr.lora_int_id] = merged_greedy(base, lr.lora_path, PROMPTS)
    return base, adapters, refs


def _run(llm, adapters, refs):
    """Every prompt with every adapter and with none, all in one generate call."""
    choices = [None, *adapters]
    prompts, loras = [], []
    for i, p in enumerate(PROMPTS):
        for j in range(len(choices)):
            prompts.append({"prompt_token_ids": p})
            loras.append(choices[(i + j) % len(choices)])
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True),
                        lora_request=loras)
    for k, (o, lr) in enumerate(zip(outs, loras)):
        want = refs[lr.lora_int_id if lr else None][k // len(choices)]
        assert o.outputs[0].token_ids == want, f"prompt {k // len(choices)}, adapter {lr}"


@pytest.mark.parametrize("folded", [True, False])
def test_mixed_batch_matches_peft(setup, folded, monkeypatch):
    """Both ways of computing x A^T: every slot's A folded into the base weight (the dense
    default; the fused norm / SiLU + GEMM paths kept), and a shrink kernel of its own."""
    from rankserve.models import lora as ml
    base, adapters, refs = setup
    assert all(refs[lr.lora_int_id] != refs[None] for lr in adapters), "adapters change nothing"
    monkeypatch.setattr(ml, "FOLD_MAX", float("inf") if folded else 0.0)
    llm = LLM(base, dtype="float32", enable_lora=True, max_loras=3, max_lora_rank=16,
              max_num_seqs=16)
    layers = llm.engine.executor.runner.lora.layers
    assert all(m.quant.folded == folded and m.quant.dense == folded for m in layers.values())
    if folded:  # `weight` is the wide weight's first rows: loaders and updates still reach it
        m = layers["model.layers.0.self_attn.qkv_proj"]
        assert m.weight.data_ptr() == m.lora_weight.data_ptr()
    _run(llm, adapters, refs)


def test_max_loras_smaller_than_adapters(setup):
    """One slot for three adapters: all requests complete, each with its own adapter."""
    base, adapters, refs = setup
    if "Qwen3" in base:
        pytest.skip("the scheduler's rule does not depend on the family")
    llm = LLM(base, dtype="float32", enable_lora=True, max_loras=1, max_lora_rank=16,
              max_cpu_loras=2, max_num_seqs=16, max_num_batched_tokens=64)
    sched = llm.engine.scheduler
    seen = []
    orig = sched.schedule

    def schedule():
        plan = orig()
        seen.append({r.lora_request.lora_int_id for r in sched.running if r.lora_request})
        return plan
    sched.schedule = schedule
    _run(llm, adapters, refs)
    assert max(len(s) for s in seen) == 1


def test_lora_errors(setup, tmp_path):
    base, adapters, _ = setup
    if "Qwen3" in base:
        pytest.skip("one family suffices")
    llm = LLM(base, dtype="float32", enable_lora=True, max_lora_rank=8)
    sp = SamplingParams(max_tokens=2)
    with pytest.raises(ValueError, match="max-lora-rank"):
        llm.generate([[1, 2, 3]], sp, lora_request=adapters[2])  # rank 16
    with pytest.raises(ValueError, match="adapter_config"):
        llm.generate([[1, 2, 3]], sp, lora_request=LoRARequest("x", 9, str(tmp_path)))
    with pytest.raises(ValueError, match="lora-modules"):
        LLM(base, enable_lora=True, lora_modules=(f"x={tmp_path}",))
    with pytest.raises(ValueError, match="max-lora-rank"):
        LLM(base, enable_lora=True, max_lora_rank=8, lora_modules=(f"c={adapters[2].lora_path}",))
    a = adapters[0].lora_path
    for modules, why in (((f"a={a}", f"a={a}"), "'a' twice"),
                         (('{"name": "a", "path": "%s", "base_model": "m"}' % a,), "base_model"),
                         (('{"name": null, "path": "%s"}' % a,), "name and path"),
                         ((f"m={a}",), "'m' is the base model's name")):  # (it would shadow it)
        with pytest.raises(ValueError, match=f"--lora-modules.*{why}"):
            LLM(base, enable_lora=True, lora_modules=modules, served_model_name="m")
    # one id, two adapters: the engine keys its caches (host, slots, prefix blocks) by the id
    llm.generate([[1, 2, 3]], sp, lora_request=LoRARequest("a", 5, adapters[0].lora_path))
    with pytest.raises(ValueError, match="lora_int_id 5 is already adapter 'a'"):
        llm.generate([[1, 2, 3]], sp, lora_request=LoRARequest("b", 5, adapters[1].lora_path))
    # an adapter used once, its directory gone, then pushed out of the slot and host cache by
    # another: the next request naming it is refused, and the engine serves on (its step failed
    # reading the files again: a 503 for every client, or offline the next generate hung)
    for i, (what, remove) in enumerate((("adapter_config.json", shutil.rmtree),
                                        ("adapter_model", lambda d: os.remove(d / "adapter_model.safetensors")))):
        gone = LoRARequest("gone", 20 + i, str(shutil.copytree(adapters[0].lora_path, tmp_path / f"gone{i}")))
        llm.generate([[1, 2, 3]], sp, lora_request=gone)
        remove(tmp_path / f"gone{i}")
        llm.generate([[1, 2, 3]], sp, lora_request=adapters[1])
        with pytest.raises(ValueError, match=f"gone{i}.* has no {what}"):
            llm.generate([[1, 2, 3]], sp, lora_request=gone)
        assert llm.generate([[1, 2, 3]], sp, lora_request=adapters[1])[0].outputs[0].token_ids
    # a regex over module names that takes in the embeddings: their tensors are refused, by name
    emb = make_adapter(base, tmp_path / "emb", 4, 8, False, r".*\.(embed_tokens|q_proj)", 0)
    with pytest.raises(ValueError, match="tensor .*embed_tokens.* is not supported"):
        llm.generate([[1, 2, 3]], sp, lora_request=LoRARequest("e", 7, emb))
    # options that change the adapter's forward (not a plain x A^T B^T) are refused, named
    for key, value in (("modules_to_save", ["lm_head"]), ("target_parameters", ["down_proj"]),
                       ("layer_replication", [[0, 2], [1, 2]]), ("alora_invocation_tokens", [5]),
                       ("lora_bias", True)):
        shutil.copytree(adapters[1].lora_path, tmp_path / key)  # (an adapter that runs)
        cfg = json.loads((tmp_path / key / "adapter_config.json").read_text())
        (tmp_path / key / "adapter_config.json").write_text(json.dumps({**cfg, key: value}))
        with pytest.raises(ValueError, match=f"{key} .* not supported"):
            llm.generate([[1, 2, 3]], sp, lora_request=LoRARequest(key, 8, str(tmp_path / key)))
    plain = LLM(base, dtype="float32")
    with pytest.raises(ValueError, match="enable-lora"):
        plain.generate([[1, 2, 3]], sp, lora_request=adapters[0])



def test_lora_modules_as_vllm_writes_them(setup, tmp_path, monkeypatch):
    """vLLM's `--lora-modules` takes several adapters after one flag (`{"name": ...} org/a=P`), a
    path may start with `~`, and a PEFT `target_modules` regex (a string) is served like a list
    (the tensors say which layers the adapter has): tokens as the merged PEFT model."""
    from click.testing import CliRunner
    from rankserve.launch.cli import main
    base, adapters, refs = setup
    if "Qwen3" in base:
        pytest.skip("one family suffices")
    regex = make_adapter(base, tmp_path / "home" / "rx", 4, 8, False, r".*\.(q_proj|down_proj)", 7)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    b = json.dumps({"name": "b", "path": "~/rx"})
    r = CliRunner().invoke(main, [
        "generate", base, "--dtype", "float32", "--enable-lora", "--max-loras", "2",
        "--max-lora-rank", "16", "--lora-modules", b, f"org/a={adapters[0].lora_path}", "--lora", "org/a",
        "--lora", "b", "--prompt", "Once upon", "--prompt", "Once upon", "--max-tokens", "6",
        "--ignore-eos", "--json"])
    assert r.exit_code == 0, r.output[-2000:] + repr(r.exception)
    outs = [json.loads(x) for x in re.findall(r'\{"prompt".*\}', r.output)]  # (a progress bar
    # may share the first line)
    import transformers
    ids = transformers.AutoTokenizer.from_pretrained(base)("Once upon")["input_ids"]
    assert [o["token_ids"] for o in outs] == [
        merged_greedy(base, p, [ids], 6)[0] for p in (adapters[0].lora_path, regex)]


def test_adapter_of_another_model_is_refused(setup, checkpoint, tmp_path):
    """An adapter trained on another base (other projection sizes) is a ValueError naming the
    module and shapes, never a crash in the step or silently truncated B rows; the engine
    serves on."""
    base, adapters, refs = setup
    if "Qwen3" in base:
        pytest.skip("one family suffices")
    wider = make_adapter(checkpoint("Qwen3ForCausalLM"), tmp_path / "wider", 8, 16, False,
                         ["q_proj", "v_proj"], seed=0)  # q: 128 output rows against 64
    narrower = make_adapter(checkpoint("LlamaForCausalLM", hidden_size=32, num_attention_heads=2,
                                       num_key_value_heads=1), tmp_path / "narrower", 8, 16,
                            False, ["q_proj"], seed=0)  # A: 32 input columns against 64
    llm = LLM(base, dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=16)
    sp = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
    for i, path in enumerate((wider, narrower)):
        with pytest.raises(ValueError, match=r"q_proj.*lora_[AB] \[.*another base model"):
            llm.generate([{"prompt_token_ids": PROMPTS[0]}], sp,
                         lora_request=LoRARequest(f"other{i}", 50 + i, path))
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], sp, lora_request=adapters[0])
    assert [o.outputs[0].token_ids for o in outs] == refs[adapters[0].lora_int_id]
    with pytest.raises(ValueError, match="--lora-modules: .*another base model"):  # at start
        LLM(base, dtype="float32", enable_lora=True, lora_modules=(f"w={wider}",))

@pytest.mark.mpi
@pytest.mark.skipif(shutil.which("mpiexec") is None, reason="mpiexec not on PATH")
def test_tp2_matches_single_rank(checkpoint, tmp_path, monkeypatch):
    """Adapters sharded like their layers: TP 2 under mpiexec gives the single-rank tokens (A
    folded into the base weights, as on a dense GPU deployment; both sides)."""
    from rankserve.models import lora as ml
    monkeypatch.setattr(ml, "FOLD_MAX", float("inf"))
    fold = ("import rankserve.models.lora as m; m.FOLD_MAX = float('inf'); "
            "from rankserve.launch.cli import main; main()")
    base = checkpoint("LlamaForCausalLM")
    paths = [make_adapter(base, tmp_path / name, r, a, rs, t, seed=i)
             for i, (name, r, a, rs, t) in enumerate(ADAPTERS[:2])]
    flags = ["--enable-lora", "--max-loras", "2", "--dtype", "float32",
             "--lora-modules", f"a={paths[0]}", "--lora-modules", json.dumps({"name": "b", "path": paths[1]})]
    prompts = ["Once upon a time", "The dog ran", "Lily and Tom were"]
    cmd = ["mpiexec", "-n", "2", sys.executable, "-c", fold, "generate", base,
           "--max-tokens", "8", "--ignore-eos", "--json", "--tp", "2", *flags,
           "--lora", "a", "--lora", "base", "--lora", "b"]
    for p in prompts:
        cmd += ["--prompt", p]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, RANKSERVE_HEARTBEAT_TIMEOUT="30"))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    got = [json.loads(x)["token_ids"] for x in r.stdout.splitlines() if x.startswith("{")]
    llm = LLM(base, dtype="float32", enable_lora=True, max_loras=2)
    loras = [LoRARequest("a", 1, paths[0]), None, LoRARequest("b", 2, paths[1])]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                        lora_request=loras)
    want = [o.outputs[0].token_ids for o in outs]
    assert got == want
    assert merged_greedy(base, paths[0], [outs[0].prompt_token_ids], 8)[0] == want[0]


def triton_case(base: str, paths: list[str], fold: float) -> list[list[int]]:
    """In the Triton-interpreter worker: the LoRA kernels run through the engine as on a GPU
    (the expand; with FOLD_MAX 0 also the shrinks: BGMV for decode steps, SGMV for prefill and
    mixed ones)."""
    from rankserve.kernels import lora as kl
    from rankserve.models import lora as ml
    assert kl._INTERPRET
    ml.FOLD_MAX = fold  # (a worker of its own)
    llm = LLM(base, dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=16,
              max_num_seqs=4, max_num_batched_tokens=32, kv_cache_memory_gb=0.01)
    loras = [LoRARequest("a", 1, paths[0]), None, LoRARequest("b", 2, paths[1])]
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS[:3]],
                        SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                        lora_request=loras)
    return [o.outputs[0].token_ids for o in outs]


def test_triton_kernels_in_engine_match_peft(setup, interp):
    base, adapters, refs = setup
    if "Qwen3" in base:
        pytest.skip("one family suffices for the kernel path")
    ids = [adapters[0].lora_int_id, None, adapters[1].lora_int_id]
    for fold in (float("inf"), 0.0):  # A in the base GEMM (dense default), shrink kernels
        got = interp(triton_case, base, [adapters[0].lora_path, adapters[1].lora_path], fold)
        assert got == [refs[i][k][:4] for k, i in enumerate(ids)], fold


def test_compiled_level2_matches_peft(setup, monkeypatch):
    """torch.compile (level 2, one graph per layer and mode): slot indices are tensors, so
    steps with other adapters reuse the graphs; tokens equal the merged references. (A folded
    into the base weights, as on a dense GPU deployment.)"""
    import torch
    import torch._dynamo.utils as dynamo_utils
    from rankserve.models import lora as ml
    base, adapters, refs = setup
    if "Qwen3" in base:
        pytest.skip("one family suffices for the compiled path")
    monkeypatch.setattr(ml, "FOLD_MAX", float("inf"))
    torch._dynamo.reset()
    dynamo_utils.counters.clear()
    llm = LLM(base, dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=16,
              compilation_level=2, max_num_seqs=4, max_num_batched_tokens=32,
              kv_cache_memory_gb=0.01)
    graphs = dynamo_utils.counters["stats"]["unique_graphs"]
    loras = [adapters[0], None, adapters[1], adapters[2]]
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                        SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                        lora_request=loras)
    assert dynamo_utils.counters["stats"]["unique_graphs"] == graphs  # no step recompiled
    for k, (o, lr) in enumerate(zip(outs, loras)):
        assert o.outputs[0].token_ids == refs[lr.lora_int_id if lr else None][k][:4]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("fold,level", [(True, 1), (False, 1), (True, 2)])
def test_gpu_graphs_match_eager(setup, fold, level, monkeypatch):
    """On CUDA: the LoRA kernels in CUDA graphs (decode, with new slot indices each replay) and
    under torch.compile (level 2) give the eager GPU run's tokens for a mixed batch (every
    prompt with every adapter and the base model), A folded into the base weights or with the
    shrink kernels. (Kernels vs references: test_lora_kernels.py; eager vs PEFT: the CPU
    tests; fp32 Triton attention uses TF32, so GPU tokens are compared with GPU tokens.)"""
    from rankserve.models import lora as ml
    base, adapters, _ = setup
    if "Qwen3" in base:
        pytest.skip("one family suffices")
    monkeypatch.setattr(ml, "FOLD_MAX", float("inf") if fold else 0.0)
    common = dict(dtype="float32", enable_lora=True, max_loras=3, max_lora_rank=16,
                  max_num_seqs=16, gpu_memory_utilization=0.3)
    choices = [None, *adapters]
    prompts = [{"prompt_token_ids": p} for p in PROMPTS for _ in choices]
    loras = [choices[(i + j) % len(choices)] for i in range(len(PROMPTS)) for j in range(len(choices))]
    sp = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
    runs = []
    for kw in (dict(enforce_eager=True), dict(compilation_level=level)):
        llm = LLM(base, **common, **kw)
        runner = llm.engine.executor.runner
        assert all(m.quant.folded == fold for m in runner.lora.layers.values())
        assert bool(runner.compiled_model.graphs) == ("compilation_level" in kw)
        runs.append([o.outputs[0].token_ids for o in llm.generate(prompts, sp, lora_request=loras)])
        del llm, runner
    assert runs[0] == runs[1]


def test_quantized_base_gets_the_same_update(setup):
    """On an FP8 base (quantized at load time) the LoRA method wraps the FP8 GEMM: each layer's
    update equals the one on the dense base."""
    import torch
    base, adapters, _ = setup
    if "Qwen3" in base:
        pytest.skip("one family suffices")
    sp = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    deltas = []
    for q in (None, "fp8"):
        llm = LLM(base, dtype="float32", quantization=q, enable_lora=True, max_lora_rank=16)
        llm.generate([PROMPTS[0]], sp, lora_request=adapters[0])  # loads it into slot 0
        runner = llm.engine.executor.runner
        layer = runner.model.model.layers["1"].mlp.gate_up_proj
        assert layer.quant.describe().endswith("+LoRA") and (q is None) == layer.quant.base.dense
        x = torch.randn(5, layer.full_in, generator=torch.Generator().manual_seed(0))
        runner.lora.ctx.token_slot[:5] = 0
        runner.lora.ctx.sgmv.fill_(True)
        with torch.inference_mode():
            deltas.append(layer.quant.apply(layer, x, None) - layer.quant.base.apply(layer, x, None))
    assert deltas[0].abs().max() > 1e-3
    torch.testing.assert_close(deltas[1], deltas[0], atol=1e-5, rtol=1e-5)


def test_sleep_and_weight_updates_keep_adapters(setup, tmp_path, monkeypatch):
    """A folded into the base weights (`weight` a view of the wide weight): sleep level 1 brings
    both back; level 2 plus new weights from disk serves the new base with the adapter loaded
    again (its rows came back as zeros)."""
    from rankserve.models import lora as ml
    from test_sleep import perturbed_copy
    base, adapters, refs = setup
    if "Qwen3" in base:
        pytest.skip("one family suffices")
    monkeypatch.setattr(ml, "FOLD_MAX", float("inf"))
    other = perturbed_copy(base, tmp_path / "other")
    llm = LLM(base, dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=16,
              enable_sleep_mode=True, num_gpu_blocks_override=64, max_model_len=256)
    lr = adapters[0]
    sp = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)

    def run():
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], sp, lora_request=lr)
        return [o.outputs[0].token_ids for o in outs]
    assert run() == refs[lr.lora_int_id]
    llm.sleep(1)
    llm.wake_up()
    assert run() == refs[lr.lora_int_id]
    llm.sleep(2)
    llm.wake_up(["weights"])
    llm.update_weights_from_disk(other)
    llm.wake_up(["kv_cache"])
    assert run() == merged_greedy(other, lr.lora_path, PROMPTS)


def test_folded_layer_with_bias_and_fused_prologue(monkeypatch):
    """A column-parallel layer with a bias (Qwen2's qkv): the folded GEMM (its bias widened with
    zeros for A's rows) on the fused add + RMSNorm path, the same unfused, and the shrink path
    all give base(x) + B A x per token's slot, slice by slice."""
    import torch.nn as nn
    import torch.nn.functional as F
    from rankserve.models import lora as ml
    from rankserve.models.fused import add_norm_then
    from rankserve.models.layers import QKVParallelLinear, RMSNorm
    from rankserve.models.parallel import ParallelInfo

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv_proj = QKVParallelLinear(32, 8, 4, 2, True, ParallelInfo(), torch.float32)

        @property
        def in_proj(self):
            return self.qkv_proj

        def from_in_proj(self, y):
            return y

        def forward(self, x):
            return self.qkv_proj(x)

    g = torch.Generator().manual_seed(0)
    h, delta = torch.randn(5, 32, generator=g), torch.randn(5, 32, generator=g)
    norm = RMSNorm(32, 1e-5, torch.float32)
    norm.weight.data = torch.rand(32, generator=g) + 0.5
    slots = torch.tensor([0, 1, -1, 1, 0], dtype=torch.int32)
    W, b = torch.randn(64, 32, generator=g), torch.randn(64, generator=g)
    A, B = torch.randn(2, 12, 32, generator=g), torch.randn(2, 64, 4, generator=g)
    x = norm(h + delta)
    want = F.linear(x, W, b)
    for t, sl in enumerate(slots.tolist()):
        for i, (lo, hi) in enumerate([(0, 32), (32, 48), (48, 64)]) if sl >= 0 else ():
            want[t, lo:hi] += B[sl, lo:hi] @ (A[sl, 4 * i:4 * i + 4] @ x[t])
    for fold in (True, False):
        monkeypatch.setattr(ml, "FOLD_MAX", float("inf") if fold else 0.0)
        block = Block()
        block.qkv_proj.weight.data.copy_(W)
        block.qkv_proj.bias.data.copy_(b)
        ctx = ml.LoRAContext(8, 8, "cpu")
        m = ml.wrap_model(block, ctx, 2, 4, torch.float32, "cpu")["qkv_proj"]
        assert m.quant.folded == fold and torch.equal(m.weight, W) and torch.equal(m.bias, b)
        for sl in range(2):
            ml.slot_a(m, sl).copy_(A[sl])
            m.lora_b[sl].copy_(B[sl])
        ctx.token_slot[:5] = slots
        with torch.inference_mode():
            fused, h_new = add_norm_then(block, h, delta, norm)
            plain = block(x)
        torch.testing.assert_close(fused, want, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(plain, want, atol=1e-4, rtol=1e-4)


def test_prefix_hashes_include_the_adapter():
    from rankserve.runtime.kv_cache import KVCacheManager
    from rankserve.runtime.messages import EngineCoreRequest
    from rankserve.runtime.request import Request
    kv = KVCacheManager(num_blocks=8, block_size=4)
    ids = list(range(1, 10))

    def hashes(lr):
        r = Request(EngineCoreRequest("r", ids, SamplingParams(max_tokens=1), lora_request=lr), 64)
        kv.update_hashes(r)
        return r.block_hashes
    a, b = LoRARequest("a", 1, "/x"), LoRARequest("b", 2, "/x")
    assert hashes(a) == hashes(LoRARequest("a", 1, "/y"))
    assert len({hashes(None)[0], hashes(a)[0], hashes(b)[0]}) == 3
    assert len({hashes(None)[1], hashes(a)[1]}) == 2  # the chain carries it on


def test_bench_throughput_with_random_adapters(tmp_path):
    """`bench throughput --num-loras`: requests spread over random adapters (the W1/W2 LoRA
    measurements of the README, here on stories260K on the CPU)."""
    from test_bench import STORIES, invoke_cli
    out = tmp_path / "l.json"
    invoke_cli("throughput", STORIES, "--num-prompts", "4", "--input-len", "8", "16",
               "--output-len", "4", "8", "--enable-lora", "--max-loras", "2", "--max-lora-rank",
               "8", "--num-loras", "3", "--cache-dir", str(tmp_path), "--output-json", str(out))
    rec = json.loads(out.read_text())
    assert rec["workload"]["num_loras"] == 3 and rec["results"]["rankserve"]["output_tokens"] > 0
    assert len(os.listdir(tmp_path / "lora-bench" / "stories260K-r8")) == 3


def test_hybrid_nemotron_h_adapter_matches_peft(checkpoint, tmp_path):
    """Nemotron-H: attention projections and the gate-less MLP's up_proj / down_proj take an
    adapter (its Mamba2 mixers keep running without one), as transformers + PEFT merged."""
    base = checkpoint("NemotronHForCausalLM")
    path = make_adapter(base, tmp_path / "nemo", 8, 16, False,
                        ["q_proj", "v_proj", "o_proj", "up_proj", "down_proj"], seed=1)
    want = merged_greedy(base, path, PROMPTS[:2])
    assert want != merged_greedy(base, None, PROMPTS[:2])
    llm = LLM(base, dtype="float32", enable_lora=True, max_lora_rank=16)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS[:2]],
                        SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True),
                        lora_request=LoRARequest("nemo", 1, path))
    assert [o.outputs[0].token_ids for o in outs] == want
