"""Start-up: the per-phase account adds up to the process age, and the start path does not
import what it does not need (each of these cost seconds on the GPU machine: issue #21)."""
import json
import os
import re
import shutil
import subprocess
import sys
import warnings

import pytest

from conftest import REPO, STORIES_EMBEDDED

from rankserve.runtime import startup_clock

# never needed to build an engine and run it offline: sklearn / scipy (pulled by transformers'
# generation and modeling code), transformers' model code, the API server and the hf backend
NOT_ON_START_PATH = ("sklearn", "scipy", "transformers.modeling_utils", "transformers.generation.utils",
                     "fastapi", "uvicorn", "xgrammar", "mistral_common", "rankserve.runtime.serve",
                     "rankserve.runtime.bench.hf_backend")
# a Llama-family start imports its own family only: the others' modules and kernels (MLA, MoE,
# Mamba; Triton kernels and custom ops to define) were imported by every start (issue #21)
OTHER_FAMILIES = ("rankserve.models.deepseek", "rankserve.models.nemotron_h", "rankserve.models.gemma3",
                  "rankserve.models.moe", "rankserve.models.eagle", "rankserve.kernels.mla",
                  "rankserve.kernels.mamba", "rankserve.kernels.moe")
# nor the API server's packages, plots or images, which the CLI's own modules must not pull in
SERVER_ONLY = ("fastapi", "pydantic", "uvicorn", "starlette", "prometheus_client", "jinja2", "PIL",
               "matplotlib")

_SCRIPT = """
import json, sys
from rankserve.runtime.llm import LLM
llm = LLM({model!r}, max_num_seqs=4, max_model_len=64, kv_cache_memory_gb=0.01, load_format="dummy",
          cache_dir={cache!r})
out = llm.generate([[1, 2, 3]])
print(json.dumps(dict(account=llm.engine.startup, modules=sorted(sys.modules))))
"""


@pytest.fixture(scope="module")
def starts(tmp_path_factory):
    """Two fresh processes (cold, then warm: same cache dir) that build an LLM on stories260K's
    config (no tokenizer, as a dummy-weight benchmark) and generate once."""
    model, cache = tmp_path_factory.mktemp("model"), tmp_path_factory.mktemp("cache")
    shutil.copy(STORIES_EMBEDDED / "config.json", model / "config.json")
    out = []
    for _ in range(2):
        r = subprocess.run([sys.executable, "-c", _SCRIPT.format(model=str(model), cache=str(cache))],
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr[-3000:]
        out.append(json.loads(r.stdout.strip().splitlines()[-1]))
    return out


@pytest.fixture(scope="module")
def started(starts):
    return starts[1]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="process age from /proc")
def test_account_adds_up_to_process_age(started):
    a = started["account"]
    assert list(a["pre_engine"]) == ["imports", "tokenizer", "before_engine"]
    assert list(a["engine"])[:1] == ["load"]
    total = sum(a["pre_engine"].values()) + sum(a["engine"].values()) + a["other_s"]
    assert a["ready_after_s"] == pytest.approx(total, abs=0.05)
    assert a["pre_engine"]["imports"] > 0.1  # at least torch's import


def test_start_path_imports(starts):
    for run in starts:
        pulled = [m for m in NOT_ON_START_PATH + OTHER_FAMILIES if m in run["modules"]]
        assert not pulled, f"the start path imports {pulled}"
    for modules in (set(r["modules"]) for r in starts):
        # cold too: a shipped family's config has its own reader (models/config_readers.py);
        # nothing else needs transformers without a tokenizer
        assert not [m for m in modules if m.split(".")[0] in ("transformers", "accelerate")]
        # level 0/1 never compiles: no dynamo, no sympy (the custom ops' first call imported both)
        assert not [m for m in modules if m.split(".")[0] == "sympy" or m.startswith("torch._dynamo")]


def test_mark_books_each_phase_once(monkeypatch):
    ages = iter([1.0, 3.0, 4.5, 9.0])
    monkeypatch.setattr(startup_clock, "process_age", lambda: next(ages))
    monkeypatch.setattr(startup_clock, "_phases", {})
    monkeypatch.setattr(startup_clock, "_last", 0.0)
    startup_clock.mark("imports")
    startup_clock.mark("tokenizer")
    startup_clock.mark("imports")  # a second engine in the process: not booked again
    assert startup_clock.pre_engine_phases() == {"imports": 1.0, "tokenizer": 2.0}
    a = startup_clock.account({"load": 1.0})
    assert a == dict(pre_engine={"imports": 1.0, "tokenizer": 2.0}, engine={"load": 1.0},
                     other_s=9.0 - 4.0, ready_after_s=9.0)


def test_importtime_summary():
    from rankserve.runtime.bench import importtime
    log = ["import time: self [us] | cumulative | imported package",
           "import time:       100 |        100 |     b.c",
           "import time:       200 |        300 |   b",
           "import time:       400 |        700 | a",
           "import time:        50 |         50 | b.d",
           "something else on stderr"]
    rows = importtime.parse(log)
    assert rows[2] == (0.0007, 0.0004, 0, "a") and rows[0][2] == 2
    assert importtime.by_package(rows) == {"a": 0.0007, "b": 0.00005}


SHIPPED = sorted(p.stem for p in (REPO / "runtime" / "bench" / "configs").glob("*.json"))


@pytest.mark.parametrize("name", SHIPPED)
def test_config_snapshot_answers_as_transformers(tmp_path, name):
    """The snapshot a warm start reads answers every attribute as transformers' config does, and
    builds the same model (meta device: names, shapes, dtypes)."""
    import torch

    from rankserve.models import config_snapshot
    from rankserve.models.loader import build_model, load_hf_config
    from rankserve.models.parallel import ParallelInfo
    from rankserve.runtime.bench.common import resolve_model

    model_dir = resolve_model(name)[0]
    real = load_hf_config(model_dir)  # through transformers
    data = open(f"{model_dir}/config.json", "rb").read()
    assert config_snapshot.load(str(tmp_path), data, model_dir) is None
    config_snapshot.save(str(tmp_path), data, real)  # a cold start of a family without a reader
    snap = config_snapshot.load(str(tmp_path), data, model_dir)  # warm: from the snapshot
    assert isinstance(snap, config_snapshot.ConfigSnapshot)
    attrs = config_snapshot.attributes(real)
    assert attrs is not None and attrs.keys() >= {k for k in vars(real) if not k.startswith("_")}
    assert snap.name_or_path == model_dir
    for k in dir(real):  # every public plain-data attribute answers alike
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            v = None if k.startswith("_") else getattr(real, k, None)
        if v is not None and not callable(v) and config_snapshot._plain(v):
            assert getattr(snap, k) == v, k

    def params(cfg):
        m = build_model(cfg, ParallelInfo(), torch.bfloat16, torch.device("meta"))
        return [(n, tuple(p.shape), p.dtype) for n, p in m.named_parameters()]
    if "70b" in name:  # the same family as llama-3.1-8b; its meta build is the slowest
        return
    try:
        expected = params(real)
    except ValueError as e:  # EAGLE drafts are no main model: refused alike
        with pytest.raises(ValueError, match=re.escape(str(e))):
            params(snap)
        return
    assert params(snap) == expected


def test_custom_op_defers_dynamo_until_imported(monkeypatch):
    """Before torch._dynamo is imported the kernel runs as is; once it is (a compile), through
    torch's dynamo-disabling wrapper, as torch does (the dispatcher's path: an eager call of
    the op object runs the function itself, tests/test_custom_op.py)."""
    import torch

    from rankserve.kernels import custom_op as co
    calls = []

    @co.custom_op("rankserve_test::twice", mutates_args=())
    def twice(x: torch.Tensor) -> torch.Tensor:
        calls.append(torch.compiler.is_dynamo_compiling())
        return x * 2

    guarded = []
    kw = twice._backend_fns[None].__kwdefaults__
    real = kw["_guarded"]
    monkeypatch.setitem(kw, "_guarded", lambda *a, **k: guarded.append(1) or real(*a, **k))
    monkeypatch.setattr(co, "dynamo_imported", lambda: False)
    op = torch.ops.rankserve_test.twice
    assert torch.equal(op(torch.ones(3)), torch.full((3,), 2.0)) and not guarded
    monkeypatch.setattr(co, "dynamo_imported", lambda: True)
    assert torch.equal(op(torch.ones(2)), torch.full((2,), 2.0)) and guarded == [1]
    assert calls == [False, False]


_META_SCRIPT = """
import json, sys
from rankserve.models.loader import load_hf_config
from rankserve.runtime.bench.common import model_stats, resolve_model
stats = {}
for name in sys.argv[2:]:
    try:
        stats[name] = model_stats(load_hf_config(resolve_model(name)[0], sys.argv[1])).num_params
    except ValueError:  # an EAGLE head: no main model
        pass
print(json.dumps(dict(stats=stats, modules=sorted(sys.modules))))
"""


def test_bench_config_phase_imports(tmp_path):
    """The bench's config phase (read every shipped config, count its parameters on the meta
    device) in a fresh process: neither transformers (every shipped family has a reader), nor dynamo or
    sympy (torch's reference ops of meta tensors import both)."""
    r = subprocess.run([sys.executable, "-c", _META_SCRIPT, str(tmp_path), *SHIPPED],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["stats"]["llama-3.1-8b"] == 8_030_261_248
    pulled = [m for m in out["modules"] if m.split(".")[0] in ("transformers", "sympy")
              or m.startswith("torch._dynamo")]
    assert not pulled, pulled[:5]


_GPU_SCRIPT = """
import importlib.abc, json, sys, traceback
first = dict()
class Watch(importlib.abc.MetaPathFinder):  # who imports these first: the failure names it
    def find_spec(self, name, path, target=None):
        if name in ("torch._dynamo", "sympy", "transformers") and name not in first:
            first[name] = "".join(traceback.format_stack(limit=25)[:-1])
sys.meta_path.insert(0, Watch())
from rankserve.runtime.llm import LLM
llm = LLM({model!r}, max_num_seqs=4, max_model_len=256, load_format="dummy", cache_dir={cache!r},
          compilation_level=1, num_gpu_blocks_override=64)
llm.generate([[1, 2, 3]])
print(json.dumps(dict(account=llm.engine.startup, first=first)))
"""


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs CUDA")
def test_cuda_level1_start_imports_no_dynamo(tmp_path):
    """A level-1 engine on CUDA (memory profile, Triton warm-up, graph capture) of a shipped
    family's config, cold then warm: no torch._dynamo, sympy or transformers on the way."""
    shutil.copy(STORIES_EMBEDDED / "config.json", tmp_path / "config.json")
    for run in ("cold", "warm"):
        r = subprocess.run([sys.executable, "-c", _GPU_SCRIPT.format(model=str(tmp_path),
                            cache=str(tmp_path / "cache"))], capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-3000:]
        out = json.loads(r.stdout.strip().splitlines()[-1])
        print(run, startup_clock.format_account(out["account"]))
        assert not out["first"], "\n".join(f"{run}: {m} imported from\n{s}" for m, s in out["first"].items())


def test_every_kernel_op_defers_dynamo():
    """Each of our custom ops is declared through kernels/custom_op.py (a new one declared with
    torch.library.custom_op directly would bring the dynamo import back onto the start path)."""
    import importlib
    import pkgutil

    from torch._library.custom_ops import CustomOpDef

    import rankserve.kernels as kernels
    ops = []
    for mod in pkgutil.iter_modules(kernels.__path__):
        m = importlib.import_module(f"rankserve.kernels.{mod.name}")
        ops += [v for v in vars(m).values() if isinstance(v, CustomOpDef)]
    assert len(ops) >= 10
    plain = [op._name for op in ops if any("lazy_dynamo_import" not in f.__qualname__
                                           for f in op._backend_fns.values())]
    assert not plain, f"declare these with kernels.custom_op.custom_op: {plain}"


_PRECOMPILE_SCRIPT = """
import json, sys
import triton
compiled = []  # every Triton variant compiled in this process, in order
triton.knobs.runtime.jit_post_compile_hook = lambda *a, **k: compiled.append(k.get("repr"))
from rankserve.runtime import compilation
marks = []
pre = compilation.CompiledModel.precompile
def precompile(self, step):
    seconds = pre(self, step)
    marks.append(len(compiled))
    return seconds
compilation.CompiledModel.precompile = precompile
from rankserve.runtime.llm import LLM
llm = LLM({model!r}, max_num_seqs=8, max_model_len=256, load_format="dummy", cache_dir={cache!r},
          compilation_level=1, speculative_config={{"method": "ngram", "num_speculative_tokens": 3}})
ready = len(compiled)
from rankserve import SamplingParams
out = llm.generate([[1, 2, 3, 1, 2, 3, 1, 2]], SamplingParams(temperature=0, max_tokens=24))
print(json.dumps(dict(account=llm.engine.startup, marks=marks, ready=ready, names=compiled,
                      tokens=[o.outputs[0].token_ids for o in out])))
"""


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs CUDA")
def test_precompile_leaves_nothing_to_compile(tmp_path):
    """Cold starts with and without the concurrent precompile (kernels/precompile.py): with it,
    the memory profile, warm-up and graph capture (decode and verify graphs) compile no Triton
    variant of their own; both give the same greedy tokens."""
    shutil.copy(STORIES_EMBEDDED / "config.json", tmp_path / "config.json")
    res = {}
    for knob in ("1", "0"):
        env = dict(os.environ, RANKSERVE_PRECOMPILE=knob, TRITON_CACHE_DIR=str(tmp_path / f"triton{knob}"))
        r = subprocess.run([sys.executable, "-c", _PRECOMPILE_SCRIPT.format(
            model=str(tmp_path), cache=str(tmp_path / f"cache{knob}"))], capture_output=True,
            text=True, timeout=300, env=env)
        assert r.returncode == 0, r.stderr[-3000:]
        res[knob] = json.loads(r.stdout.strip().splitlines()[-1])
        print(knob, startup_clock.format_account(res[knob]["account"]))
    on, off = res["1"], res["0"]
    assert "precompile" in on["account"]["engine"] and "precompile" not in off["account"]["engine"]
    assert on["marks"] and on["marks"][0] > 0, "the precompile compiled nothing"
    assert on["ready"] == on["marks"][0], on["names"][on["marks"][0]:on["ready"]]
    assert on["tokens"] == off["tokens"]


def test_checkout_does_not_shadow_top_level_packages():
    """`python -m` / `-c` in the checkout: after `import rankserve`, the checkout's kernels/
    folder is not the top-level `kernels` (Hugging Face's package, which transformers >= 5.2x
    imports with every model config; ours broke LlamaConfig)."""
    code = ("import importlib.util as u, rankserve; s = u.find_spec('kernels'); "
            "print(s.origin if s else None)")
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert not r.stdout.strip().startswith(str(REPO)), r.stdout


def test_compile_only_restores_everything_on_error():
    """kernels/precompile.py's dry-pass mode: inside, Triton launches compile instead of running
    and torch.empty / empty_like / new_empty and F.linear give zeros; after it (an error included) all of it
    is as before, and no AsyncCompileMode stays active."""
    import torch
    from triton.runtime import _async_compile
    from triton.runtime.jit import JITFunction

    from rankserve.kernels import precompile

    import torch.nn.functional as F
    saved = JITFunction.run, torch.empty, torch.empty_like, torch.Tensor.new_empty, F.linear
    with pytest.raises(RuntimeError, match="boom"):
        with precompile.compile_only(torch.device("cpu"), workers=1):
            assert JITFunction.run is not saved[0] and _async_compile.active_mode.get() is not None
            assert torch.empty(4096).eq(0).all() and torch.empty_like(torch.ones(64)).eq(0).all()
            assert torch.ones(2).new_empty(4096).eq(0).all()
            # the dry steps' GEMMs: zeros of the output's shape and dtype, no matmul
            y = F.linear(torch.ones(3, 5, 8, dtype=torch.bfloat16), torch.ones(16, 8, dtype=torch.bfloat16))
            assert y.shape == (3, 5, 16) and y.dtype == torch.bfloat16 and not y.any()
            raise RuntimeError("boom")
    assert (JITFunction.run, torch.empty, torch.empty_like, torch.Tensor.new_empty, F.linear) == saved
    assert F.linear(torch.ones(1, 2), torch.ones(3, 2)).eq(2).all()
    assert _async_compile.active_mode.get() is None


_CLI_SCRIPT = """
import json, runpy, sys
from rankserve.runtime import startup_clock
seen = dict()
mark = startup_clock.mark
def watch(phase):  # the modules loaded when each phase ends
    mark(phase)
    seen.setdefault(phase, sorted(sys.modules))
startup_clock.mark = watch
sys.argv = ["rankserve", *sys.argv[1:]]
try:
    runpy.run_module("rankserve.launch", run_name="__main__")
finally:
    seen["end"] = sorted(sys.modules)
    print(json.dumps(seen))
"""


def test_bench_latency_cli_start_path_imports(tmp_path):
    """W2's command (`bench latency`, dummy weights) of a Llama-family config in a fresh process:
    up to the engine, and to its end, neither the other families, nor transformers, dynamo or
    sympy, nor the API server's packages."""
    shutil.copy(STORIES_EMBEDDED / "config.json", tmp_path / "config.json")
    r = subprocess.run([sys.executable, "-c", _CLI_SCRIPT, "bench", "latency", str(tmp_path),
                        "--load-format", "dummy", "--batch-size", "1", "--input-len", "8", "--output-len", "4",
                        "--num-iters", "1", "--num-iters-warmup", "0", "--max-num-seqs", "8",
                        "--cache-dir", str(tmp_path / "cache")], capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stderr[-3000:]
    seen = json.loads(r.stdout.strip().splitlines()[-1])
    assert {"imports", "config", "bench_setup", "tokenizer", "before_engine", "end"} <= seen.keys()
    # the CLI builds `serve`'s flags from ServerArgs (serve/args.py, a dataclass): that and its
    # package's __init__ only, none of the server's own modules
    cli_flags = ("rankserve.runtime.serve", "rankserve.runtime.serve.args")
    for phase, modules in seen.items():
        pulled = [m for m in modules if m not in cli_flags and (
            m in NOT_ON_START_PATH + OTHER_FAMILIES + SERVER_ONLY or m.startswith("rankserve.runtime.serve.")
            or m.split(".")[0] in ("transformers", "sympy") or m.startswith("torch._dynamo"))]
        assert not pulled, f"{phase}: {pulled}"


def test_family_table_names_every_architecture():
    """models/loader.py imports a family's module by its architecture's name: every architecture
    the family modules register is in that table, under its own module (else its start would go
    back to importing every family)."""
    import importlib

    from rankserve.models import loader
    from rankserve.models.registry import MODELS
    for mod in set(loader.FAMILIES.values()):
        importlib.import_module(f"rankserve.models.{mod}")
    registered = {n: MODELS.get(n).__module__ for n in MODELS.names()}
    assert {n: f"rankserve.models.{m}" for n, m in loader.FAMILIES.items()} == {
        n: m for n, m in registered.items() if m != "rankserve.models.eagle"}  # drafts: spec_decode.py
