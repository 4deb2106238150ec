"""`rankserve` command line. Engine flags are generated from the EngineConfig dataclasses."""
from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import re
import sys
import types
import typing

import click

from ..runtime.config import ConfigError, EngineConfig


class _TokenCount(click.ParamType):
    """An int, or vLLM's human-readable form: 32k / 1m / 1g / 1t are powers of 1000 (25.6k too),
    32K / 1M / 1G / 1T of 1024 (whole numbers only)."""
    name = "integer"
    SCALE = {"k": 10 ** 3, "m": 10 ** 6, "g": 10 ** 9, "t": 10 ** 12,
             "K": 2 ** 10, "M": 2 ** 20, "G": 2 ** 30, "T": 2 ** 40}

    def convert(self, value, param, ctx):
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        text = str(value).strip()
        suffix = text[-1:] if text[-1:] in self.SCALE else ""
        number = text[:-1] if suffix else text
        try:
            if not suffix:
                return int(number)
            if suffix.isupper():  # binary multiples of whole numbers, as vLLM
                return int(number) * self.SCALE[suffix]
            x = float(number) * self.SCALE[suffix]
            if math.isfinite(x):
                return int(x)
        except ValueError:
            pass
        self.fail(f"{value!r} is not an integer (or one like 32k = 32000, 32K = 32768)",
                  param, ctx)


class _NotNaN(click.FloatRange):
    """A FloatRange that also refuses nan (it passes every comparison)."""

    def convert(self, value, param, ctx):
        x = super().convert(value, param, ctx)
        if math.isnan(x):
            self.fail(f"{value!r} is not a number", param, ctx)
        return x


_TEMPERATURE = _NotNaN(min=0)


def _click_type(f: dataclasses.Field):
    choices = f.metadata.get("choices")
    if f.metadata.get("tokens"):
        return _TokenCount(), int
    hint = f.type if not isinstance(f.type, str) else eval(f.type, vars(typing), {})  # noqa: S307
    base = hint
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        base = next(a for a in typing.get_args(hint) if a is not type(None))
    if choices:
        return click.Choice([str(c) for c in choices]), base
    return {int: click.INT, float: click.FLOAT, str: click.STRING, bool: bool}[base], base


def engine_options(func):
    """Add one click option per EngineConfig field (and the positional MODEL)."""
    cfg = EngineConfig()
    for _section, f in reversed(list(cfg.flat_fields())):
        if f.metadata.get("positional"):
            func = click.argument("model", required=False)(func)
            continue
        if f.metadata.get("multiple"):  # repeatable string flag (a tuple field)
            func = click.option("--" + f.name.replace("_", "-"), f.name, multiple=True,
                                help=f.metadata.get("doc", ""))(func)
            continue
        ctype, base = _click_type(f)
        names = ["--" + f.name.replace("_", "-")]
        alias = f.metadata.get("alias")
        if alias:
            names.append(("-" if len(alias) == 1 else "--") + alias.replace("_", "-"))
        if f.metadata.get("short"):  # vLLM's one-dash forms: -tp, -pp, -dp, -ep
            names.append(f.metadata["short"])
        help_ = f.metadata.get("doc", "")
        if base is bool:
            func = click.option(names[0] + "/--no-" + f.name.replace("_", "-"), *names[1:], f.name,
                                default=None, help=f"{help_} [default: {f.default}]")(func)
        else:
            func = click.option(*names, f.name, type=ctype, default=None,
                                help=f"{help_} [default: {f.default}]")(func)
    return func


def build_config(kwargs: dict) -> EngineConfig:
    """EngineConfig from CLI kwargs (None means: not given); errors name the flag."""
    cfg = EngineConfig()
    given = {}
    for _section, f in cfg.flat_fields():
        value = kwargs.get(f.name)
        if f.metadata.get("multiple"):
            if value:
                given[f.name] = tuple(value)
            continue
        if value is not None:
            ctype, base = _click_type(f)
            given[f.name] = int(value) if isinstance(ctype, click.Choice) and base is int else value
    from .caches import usable_caches
    try:
        cfg = EngineConfig.from_kwargs(**given)
    except ConfigError as e:
        raise click.UsageError(str(e)) from None
    try:
        return usable_caches(cfg, given_cache_dir="cache_dir" in given)
    except ConfigError as e:
        raise click.UsageError(str(e)) from None


# vLLM's `--lora-modules a=P b=Q '{"name": ...}'` (several values after one flag): the values
# that follow it, as long as they look like `name=path` or JSON, each get a flag of their own
# (`bench serve --lora-modules a b`: adapter names, every value up to the next flag); the same
# for `--served-model-name a b org/c`, up to a path (the positional MODEL after the names: a
# directory, or a value starting with / . ~)
_LORA_MODULE = re.compile(r"[^-=/\s][^=\s]*=|\{")
_LORA_NAME = re.compile(r"[^-]")


class _ServedName:
    @staticmethod
    def match(a: str) -> bool:
        return not a.startswith(("-", "/", ".", "~")) and not os.path.isdir(a)


def _spread_values(args: list[str]) -> list[str]:
    lora = _LORA_NAME if args[:2] == ["bench", "serve"] else _LORA_MODULE
    values = {"--lora-modules": lora, "--served-model-name": _ServedName}
    out, taking = [], None
    for prev, a in zip([None, *args], args):
        if prev in values:  # the flag's own value
            taking = prev
        elif taking and values[taking].match(a):
            out.append(taking)
        else:
            taking = next((f for f in values if a.startswith(f + "=")), None)
        out.append(a)
    return out


def _config_path(args: list[str]) -> str | None:
    """The value of `--config FILE` / `--config=FILE` on the command line (the last one)."""
    path = None
    for prev, a in zip([None, *args], args):
        if prev == "--config":
            path = a
        elif a.startswith("--config="):
            path = a.split("=", 1)[1]
    return path


def read_config_file(path: str, command: click.Command) -> dict:
    """vLLM's `--config config.yaml`: a YAML mapping of long flag names (`max-model-len: 4096`,
    `max_model_len` too; `model:` is MODEL) → click's default map of the command, so a flag
    given on the command line wins over the file, and the file over the defaults. Values are
    checked by the flag's own type (errors name it); a key that is no flag of this command is
    an error naming it. JSON-valued flags may be YAML mappings or lists."""
    import yaml
    flag = f"--config {path}"
    try:
        with open(path) as f:
            data = yaml.safe_load(f)
    except OSError as e:
        raise click.UsageError(f"{flag}: {e.strerror or e}") from None
    except yaml.YAMLError as e:
        raise click.UsageError(f"{flag} is not valid YAML: {e}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise click.UsageError(f"{flag} must be a YAML mapping of flag names to values "
                               f"(e.g. `max-model-len: 4096`), got {type(data).__name__}")
    params = {p.name: p for p in command.params if p.name and p.name != "config"}
    by_key = {}
    for p in params.values():
        names = [o for o in p.opts if o.startswith("--")] if isinstance(p, click.Option) else []
        for n in [*names, *getattr(p, "secondary_opts", ()), p.name]:
            by_key[n.lstrip("-").replace("_", "-")] = p
    out = {}
    for key, value in data.items():
        p = by_key.get(str(key).lstrip("-").replace("_", "-"))
        if p is None or p.name == "help":
            raise click.UsageError(f"{flag}: {key!r} is not a flag of `{command.name}`"
                                   + (" (a config file cannot name another one)"
                                      if str(key).lstrip("-") == "config" else ""))
        if value is None:
            continue
        if str(key).lstrip("-").startswith("no-") and isinstance(value, bool):
            value = not value  # `no-enable-prefix-caching: true`
        if p.multiple or p.nargs != 1:  # repeatable, or several values (`input-len: [128, 256]`)
            if not isinstance(value, list):  # (`input-len: 128`: 128 128, as on the command line)
                value = [value] * (p.nargs if p.name in getattr(command, "PAIRS", ()) else 1)
            value = [_config_value(v) for v in value]
        elif isinstance(value, bool) and not getattr(p, "is_bool_flag", False):
            raise click.UsageError(f"{flag}: {key}: true/false is for on/off flags; "
                                   f"--{p.name.replace('_', '-')} takes a value")
        else:
            value = _config_value(value)
        out[p.name] = value
    return out


def _config_value(v):
    if isinstance(v, (dict, list)):  # --speculative-config, --allowed-origins ...: JSON text
        return json.dumps(v)
    return v if isinstance(v, bool) else str(v)


class _Command(click.Command):
    """A subcommand that also reads its flags from `--config config.yaml` (as vLLM's)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.params.append(click.Option(
            ["--config"], type=click.Path(dir_okay=False), expose_value=False,
            help="read flags from a YAML file (vLLM's): long flag names as keys, e.g. "
                 "`max-model-len: 4096`, `model: DIR`; flags given here win over it"))

    def parse_args(self, ctx, args):
        path = _config_path(args)
        if path is not None:
            ctx.default_map = {**(ctx.default_map or {}), **read_config_file(path, self)}
        return super().parse_args(ctx, args)


class _Bench(click.Group):
    command_class = _Command


class _Group(click.Group):
    """Startup errors of a single process (bad model path, context too long...) are reported
    like flag errors, without a traceback. Under mpirun the failure handlers take the job down
    with the rank's name instead."""
    command_class = _Command
    group_class = _Bench

    def parse_args(self, ctx, args):
        return super().parse_args(ctx, _spread_values(list(args)))

    def invoke(self, ctx):
        from .preflight import LaunchError, report
        try:
            try:
                return super().invoke(ctx)
            except (click.ClickException, LaunchError, ValueError) as e:
                _tell_the_other_ranks(e)
                raise
        except LaunchError as e:  # the same on every rank: one line, from one rank
            sys.exit(report(e))
        except ValueError as e:
            from .discovery import detect_launcher
            if detect_launcher(os.environ) != "single":
                raise
            raise click.ClickException(str(e)) from None


_STARTS_RANKS = ("serve", "generate", "bench throughput", "bench latency", "bench sleep",
                 "bench multiturn", "bench comm")


def _tell_the_other_ranks(e: Exception) -> None:
    """A rank of an MPI or plain srun job whose command failed before the rendezvous (a flag
    error, or a model directory missing on its node): the others would wait for it in MPI_Init
    or the rendezvous (600 s, or forever). It joins their startup agreement with its error
    instead (under srun: the rendezvous), which raises a LaunchError (rank 0 prints it, naming
    this rank) on every rank."""
    from .discovery import detect_launcher, discover
    from .preflight import _agreed, agree
    words = [a for a in sys.argv[1:] if not a.startswith("-")][:2]
    command = " ".join(words[:2] if words[:1] == ["bench"] else words[:1])
    if _agreed or command not in _STARTS_RANKS or detect_launcher(os.environ) not in ("mpi", "slurm"):
        return
    message = e.format_message() if isinstance(e, click.ClickException) else str(e)
    if isinstance(e, click.UsageError) and e.ctx is not None:
        message = f"{e.ctx.command_path}: {message}"
    agree(discover(), message)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
@click.version_option(package_name="rankserve")
def main():
    """rankserve: LLM serving for HPC clusters (launch with mpirun or srun for several ranks)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S")
    if click.get_current_context().invoked_subcommand in ("serve", "generate", "bench"):
        from .caches import hash_triton_early
        hash_triton_early()
    from ..runtime import envs
    try:
        envs.check()  # a bad RANKSERVE_* value is a start-up error naming it, not a late failure
    except ValueError as e:
        from .discovery import detect_launcher
        if detect_launcher(os.environ) != "single":  # every rank sees it: one line, from rank 0
            from .preflight import LaunchError
            rank = next((os.environ[k] for k in ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK",
                                                 "SLURM_PROCID", "RANK") if k in os.environ), "0")
            raise LaunchError(str(e), report=rank == "0") from None
        raise


@main.command()
@engine_options
@click.option("--prompt", "prompts", multiple=True, required=True, help="prompt text (repeatable)")
@click.option("--max-tokens", type=click.IntRange(min=1), default=None,
              help="default: the generation config's max_new_tokens, else 64")
@click.option("--temperature", type=_TEMPERATURE, default=None,
              help="default: the generation config's, else 0 (greedy)")
@click.option("--top-p", type=click.FloatRange(0, 1, min_open=True), default=None,
              help="default: the generation config's, else 1")
@click.option("--top-k", type=click.IntRange(min=-1), default=None,
              help="default: the generation config's, else 0 (off; -1 too)")
@click.option("--sampling-seed", type=int, default=None, help="per-request sampling seed")
@click.option("--ignore-eos", is_flag=True)
@click.option("--json", "as_json", is_flag=True, help="print token ids, text and finish reasons as JSON")
@click.option("--regex", default=None, help="constrain the output to this regular expression")
@click.option("--json-schema", default=None, help="constrain the output to this JSON schema (JSON text)")
@click.option("--lora", "lora_names", multiple=True,
              help="adapter of --lora-modules for the prompts: one for all, or one per --prompt "
                   "(`base`: none)")
def generate(prompts, max_tokens, temperature, top_p, top_k, sampling_seed, ignore_eos, as_json,
             regex, json_schema, lora_names, **kwargs):
    """Generate text offline for one or more prompts."""
    from .startup import run_on_ranks
    from ..runtime.sampling_params import SamplingParams, StructuredOutputsParams
    cfg = build_config(kwargs)
    so = None
    if regex is not None or json_schema is not None:
        so = StructuredOutputsParams(regex=regex, json=json_schema)
        try:
            so.kind  # noqa: B018 - raises unless exactly one is given
        except ValueError:
            raise click.UsageError("give --regex or --json-schema, not both") from None
    # the fields these flags leave out: --generation-config / --override-generation-config
    # (the model's generation_config.json by default), as LLM.generate and the server take them
    from ..runtime.inputs import sampling_defaults
    m = cfg.model
    given = dict(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k)
    sp = SamplingParams(**{"max_tokens": 64, "temperature": 0.0,
                           **sampling_defaults(m.model, m.generation_config,
                                               m.override_generation_config),
                           **{k: v for k, v in given.items() if v is not None}},
                        seed=sampling_seed, ignore_eos=ignore_eos, structured_outputs=so)
    # checked before the model loads, naming the flag (were errors after it, naming fields)
    flags = {"top_k": "--top-k", "seed": "--sampling-seed", "max_tokens": "--max-tokens",
             "temperature": "--temperature", "top_p": "--top-p"}
    try:
        sp.validate()
    except ValueError as e:
        field = getattr(e, "param", None) or str(e).split(" ", 1)[0]
        source = (flags[field] if field in flags and (given.get(field) is not None or field == "seed")
                  else "the generation config's sampling defaults (--generation-config)")
        raise click.UsageError(f"{source}: {e}") from None
    if so is not None:
        from ..runtime.structured_output import parse_grammar
        try:
            parse_grammar(so)
        except ValueError as e:
            flag = "--regex" if regex is not None else "--json-schema"
            raise click.UsageError(f"{flag}: {e}") from None

    loras = None
    if lora_names:
        from ..runtime.lora import LoRATable, parse_lora_modules
        table = LoRATable(cfg.lora.max_lora_rank)
        try:
            for name, path, base in parse_lora_modules(cfg.lora.lora_modules):
                table.add(name, path, base)
        except ValueError as e:
            raise click.UsageError(str(e)) from None
        names = list(lora_names) * len(prompts) if len(lora_names) == 1 else list(lora_names)
        if len(names) != len(prompts) or any(n != "base" and n not in table.adapters for n in names):
            raise click.UsageError("--lora: give one name of --lora-modules (or base) for all "
                                   "prompts or one per --prompt")
        loras = [None if n == "base" else table.adapters[n] for n in names]

    def body(llm):
        profiling = cfg.profiler.params is not None  # --profiler-config: the whole generation
        if profiling:
            llm.start_profile()
        outs = llm.generate(list(prompts), sp, lora_request=loras)
        if profiling:
            for t in llm.stop_profile()["traces"]:
                click.echo(f"trace: {t}", err=True)
        for o in outs:
            c = o.outputs[0]
            if as_json:
                click.echo(json.dumps({"prompt": o.prompt, "text": c.text, "token_ids": c.token_ids,
                                       "finish_reason": c.finish_reason}))
            else:
                click.echo(f"{o.prompt}{c.text}")
    sys.exit(run_on_ranks(cfg, body))


# ---- bench: offline throughput, latency, collectives ----------------------------------------
@main.group()
def bench():
    """Benchmarks that print and save numbers (JSON, plots) with the device's physical floor."""


def _bench_config(kwargs: dict):
    """EngineConfig for a bench: MODEL may also name a shipped config (dummy weights implied)."""
    from ..runtime.bench.common import resolve_model
    try:
        path, named = resolve_model(kwargs.get("model"))
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    name = kwargs.get("model") if named else None
    for key, flag in (("generation_config", "--generation-config"),
                      ("override_generation_config", "--override-generation-config")):
        if kwargs.get(key) not in (None, "auto"):  # never silently ignored
            raise click.UsageError(f"{flag}: a bench's requests set their own sampling; the "
                                   "generation config's defaults apply to generate and serve")
    if kwargs.get("profiler_config"):  # never silently ignored
        raise click.UsageError("--profiler-config profiles a server (POST /start_profile) or "
                               "`generate`; a bench profiles its own run with --profile-dir")
    kwargs = dict(kwargs, model=path)
    spec = kwargs.get("speculative_config")
    if spec:  # a draft model may name a shipped config too (dummy weights, like MODEL)
        import json
        try:
            d = json.loads(spec)
            if isinstance(d, dict) and d.get("model") and d["model"] not in ("ngram", "[ngram]"):
                d["model"] = resolve_model(d["model"])[0]
                kwargs["speculative_config"] = json.dumps(d)
        except (ValueError, TypeError) as e:
            raise click.UsageError(f"--speculative-config: {e}") from None
    if named and kwargs.get("load_format") is None:
        kwargs["load_format"] = "dummy"
    return build_config(kwargs), name


def _multi_process() -> bool:
    from .discovery import discover
    return discover().world_size > 1


def _writable(ctx, param, value):
    """Output paths are checked before the run (one that cannot be written lost the run)."""
    if value is not None:
        from ..runtime.bench.common import check_writable
        try:
            check_writable(value, param.opts[0], directory=param.name.endswith("_dir"))
        except ValueError as e:
            raise click.BadParameter(str(e).removeprefix(param.opts[0] + " ")) from None
    return value


def _bench_outputs(func):
    for deco in reversed([
        click.option("--backend", "backends", type=click.Choice(["rankserve", "hf"]), multiple=True,
                     default=("rankserve",), show_default=True,
                     help="engine(s) to run, repeatable: --backend rankserve --backend hf"),
        click.option("--hf-compile", is_flag=True,
                     help="let transformers torch.compile generate()'s decode step (static cache, CUDA)"),
        click.option("--output-json", type=click.Path(dir_okay=False), callback=_writable,
                     help="write metrics + environment"),
        click.option("--plot", type=click.Path(dir_okay=False), callback=_writable,
                     help="bar chart PNG (needs matplotlib)"),
        click.option("--profile-dir", type=click.Path(file_okay=False), callback=_writable,
                     help="after the timed run, run again under torch.profiler: print the busiest "
                          "kernels of a window of steady-state steps and write its trace here"),
        click.option("--profile-steps", type=(click.IntRange(min=1), click.IntRange(min=1)), default=None,
                     metavar="START COUNT", help="with --profile-dir: the window of engine steps to "
                     "record (e.g. 1 20: the prefill ramp; a window past the run's end is cut to fit) "
                     "[default: 40 steps from a quarter of the way]"),
    ]):
        func = deco(func)
    return func


def _check_profile(args) -> None:
    """--profile-steps picks the window of --profile-dir's run, which profiles the rankserve
    backend: either alone would be silently ignored."""
    if args.profile_steps and not args.profile_dir:
        raise click.UsageError("--profile-steps picks the window of a profiled run: add --profile-dir DIR")
    if args.profile_dir and "rankserve" not in args.backends:
        raise click.UsageError("--profile-dir profiles the rankserve backend: add --backend rankserve")


def _run_bench(module, cfg, args) -> None:
    from .startup import run_on_ranks
    _check_profile(args)
    try:
        sys.exit(module.run(cfg, args, run_on_ranks, _multi_process()))
    except (ValueError, ConfigError) as e:
        raise click.ClickException(str(e)) from None


class _LengthRanges(_Command):
    """--input-len / --output-len take LO HI, or one N for a fixed length (vLLM's form): a lone
    N becomes N N before click reads the two values."""
    FLAGS = ("--input-len", "--output-len")
    PAIRS = ("input_len", "output_len")

    def parse_args(self, ctx, args):
        def is_int(a):
            return a.lstrip("-").isdigit()
        out = []
        for i, a in enumerate(args):
            out.append(a)
            if i > 0 and args[i - 1] in self.FLAGS and is_int(a) \
                    and not (i + 1 < len(args) and is_int(args[i + 1])):
                out.append(a)
        return super().parse_args(ctx, out)


@bench.command("throughput", cls=_LengthRanges)
@engine_options
@click.option("--workload", type=click.Choice(["w1", "w2"]), default=None,
              help="preset: w1 = 256 requests, lengths uniform in [100, 1024]; w2 = 1 request, "
                   "128 in / 256 out [default: w1]; the flags below override it")
@click.option("--num-prompts", type=click.IntRange(min=1), default=None)
@click.option("--input-len", type=(click.IntRange(min=1), click.IntRange(min=1)), default=None,
              metavar="N | LO HI", help="prompt length: N, or uniform in [LO, HI]")
@click.option("--output-len", type=(click.IntRange(min=1), click.IntRange(min=1)), default=None,
              metavar="N | LO HI", help="output tokens: N, or uniform in [LO, HI] (EOS ignored)")
@click.option("--structured-output", type=click.Choice(["none", "json"]), default="none",
              show_default=True, help="json: every request constrained to one of a set of JSON "
                                      "schemas (xgrammar; needs a tokenizer: --tokenizer DIR)")
@click.option("--num-loras", type=click.IntRange(min=0), default=0, show_default=True,
              help="spread the requests round-robin over this many random LoRA adapters of rank "
                   "--max-lora-rank (needs --enable-lora --max-loras)")
@_bench_outputs
def bench_throughput(workload, num_prompts, input_len, output_len, structured_output, num_loras,
                     backends, hf_compile, output_json, plot, profile_dir, profile_steps, **kwargs):
    """Offline throughput: all requests at once; req/s, tok/s and the physical floor.

    MODEL is a checkpoint directory or a shipped config (qwen3-0.6b, llama-3.1-8b, llama-3.1-70b,
    qwen3-30b-a3b) run with dummy weights; the workload seed is --seed."""
    from ..runtime.bench import throughput
    from ..runtime.bench.common import WORKLOADS
    cfg, name = _bench_config(kwargs)
    preset = WORKLOADS[workload or "w1"]
    for flag, v in (("--input-len", input_len), ("--output-len", output_len)):
        if v and v[0] > v[1]:
            raise click.UsageError(f"{flag} LO HI needs LO <= HI, got {v[0]} {v[1]}")
    args = throughput.ThroughputArgs(
        num_prompts=num_prompts or preset["num_prompts"], input_len=input_len or preset["input_len"],
        output_len=output_len or preset["output_len"], seed=cfg.model.seed,
        backends=tuple(dict.fromkeys(backends)), output_json=output_json, plot=plot,
        profile_dir=profile_dir, profile_steps=profile_steps,
        hf_compile=hf_compile, model_name=name, structured_output=structured_output,
        num_loras=num_loras)
    if structured_output != "none" and "hf" in args.backends:
        raise click.UsageError("--structured-output runs on the rankserve backend only")
    if num_loras and "hf" in args.backends:
        raise click.UsageError("--num-loras runs on the rankserve backend only")
    from .caches import writable
    if num_loras and not writable(cfg.compilation.cache_dir):
        raise click.UsageError(f"--num-loras writes its random adapters under --cache-dir "
                               f"{cfg.compilation.cache_dir}, which cannot be written")
    _run_bench(throughput, cfg, args)


@bench.command("latency")
@engine_options
@click.option("--batch-size", type=click.IntRange(min=1), default=1, show_default=True)
@click.option("--input-len", type=click.IntRange(min=1), default=128, show_default=True)
@click.option("--output-len", type=click.IntRange(min=1), default=256, show_default=True)
@click.option("--num-iters", type=click.IntRange(min=1), default=5, show_default=True)
@click.option("--num-iters-warmup", type=click.IntRange(min=0), default=1, show_default=True)
@click.option("--prompt-kind", type=click.Choice(["random", "repeat"]), default="random",
              show_default=True, help="repeat: each prompt tiles a random 16-token segment, a text "
              "the answer can copy from (n-gram speculative decoding)")
@click.option("--temperature", type=_TEMPERATURE, default=0.0, show_default=True,
              help="sampling temperature of every request (0: greedy; rankserve backend only)")
@_bench_outputs
def bench_latency(batch_size, input_len, output_len, num_iters, num_iters_warmup, prompt_kind,
                  temperature, backends, hf_compile, output_json, plot, profile_dir, profile_steps,
                  **kwargs):
    """One batch end to end: latency, TTFT (prefill alone), decode tok/s; medians and the floor."""
    from ..runtime.bench import latency
    cfg, name = _bench_config(kwargs)
    args = latency.LatencyArgs(batch_size=batch_size, input_len=input_len, output_len=output_len,
                               num_iters=num_iters, num_iters_warmup=num_iters_warmup,
                               seed=cfg.model.seed, backends=tuple(dict.fromkeys(backends)),
                               output_json=output_json, plot=plot, hf_compile=hf_compile,
                               profile_dir=profile_dir, profile_steps=profile_steps,
                               model_name=name, prompt_kind=prompt_kind, temperature=temperature)
    if temperature and "hf" in args.backends:
        raise click.UsageError("--temperature > 0 runs on the rankserve backend only (hf is greedy)")
    _run_bench(latency, cfg, args)


@bench.command("sleep")
@engine_options
@click.option("--num-prompts", type=click.IntRange(min=1), default=8, show_default=True)
@click.option("--input-len", type=click.IntRange(min=1), default=128, show_default=True)
@click.option("--output-len", type=click.IntRange(min=1), default=32, show_default=True)
@click.option("--output-json", type=click.Path(dir_okay=False), callback=_writable,
              help="write the numbers + environment")
def bench_sleep(num_prompts, input_len, output_len, output_json, **kwargs):
    """Sleep mode: device memory before / after sleep level 1 and 2, time to sleep and to wake
    up, and the same greedy tokens after waking (sleep mode is switched on)."""
    from .startup import run_on_ranks
    from ..runtime.bench.sleep import SleepArgs, run_sleep
    cfg, name = _bench_config(kwargs)
    try:
        sys.exit(run_sleep(cfg, SleepArgs(num_prompts, input_len, output_len, output_json, name),
                           run_on_ranks))
    except (ValueError, ConfigError) as e:
        raise click.ClickException(str(e)) from None


@bench.command("multiturn")
@engine_options
@click.option("--num-conversations", type=click.IntRange(min=1), default=32, show_default=True)
@click.option("--prefix-len", type=click.IntRange(min=1), default=2048, show_default=True,
              help="tokens of each conversation's own prefix")
@click.option("--turns", type=click.IntRange(min=1), default=4, show_default=True)
@click.option("--turn-len", type=click.IntRange(min=1), default=64, show_default=True,
              help="new user tokens per turn")
@click.option("--output-len", type=click.IntRange(min=1), default=64, show_default=True)
@click.option("--concurrency", type=click.IntRange(min=1), default=4, show_default=True,
              help="conversations in flight at a time")
@click.option("--output-json", type=click.Path(dir_okay=False), callback=_writable,
              help="write the numbers + environment")
def bench_multiturn(num_conversations, prefix_len, turns, turn_len, output_len, concurrency,
                    output_json, **kwargs):
    """Multi-turn conversations with long prefixes of their own, more than the device KV cache
    holds: TTFT and throughput, prefix hits per tier. Compare with and without --kv-offload-size
    (and a small --num-gpu-blocks-override)."""
    from .startup import run_on_ranks
    from ..runtime.bench.sleep import MultiTurnArgs, run_multiturn
    cfg, name = _bench_config(kwargs)
    args = MultiTurnArgs(num_conversations, prefix_len, turns, turn_len, output_len, concurrency,
                         cfg.model.seed, output_json, name)
    try:
        sys.exit(run_multiturn(cfg, args, run_on_ranks))
    except (ValueError, ConfigError) as e:
        raise click.ClickException(str(e)) from None


@bench.command("serve")
@click.option("--base-url", default=None, help="the server (rankserve or any OpenAI-compatible one) "
              "[default: http://HOST:PORT]")
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", type=click.IntRange(1, 65535), default=8000, show_default=True)
@click.option("--endpoint", default="/v1/completions", show_default=True,
              help="/v1/completions or /v1/chat/completions (chat: prompts sent as a user message)")
@click.option("--model", default=None, help="the requests' model field [default: the server's first model]")
@click.option("--tokenizer", default=None, help="tokenizer directory: token ids for random prompts, "
              "text from them, ShareGPT lengths")
@click.option("--dataset-name", type=click.Choice(["random", "sharegpt", "prefix_repetition"]),
              default="random", show_default=True)
@click.option("--dataset-path", type=click.Path(exists=True, dir_okay=False), default=None,
              help="ShareGPT-format JSON or JSONL")
@click.option("--num-prompts", type=click.IntRange(min=1), default=1000, show_default=True)
@click.option("--num-warmups", type=click.IntRange(min=0), default=0, show_default=True,
              help="requests sent before the measured run (all at once, under --max-concurrency; "
              "prompts drawn from another seed), left out of its numbers")
@click.option("--request-rate", type=float, default=float("inf"), show_default=True,
              help="requests/s (inf: all at once)")
@click.option("--burstiness", type=float, default=1.0, show_default=True,
              help="gamma shape of the gaps between arrivals: 1 Poisson, < 1 burstier")
@click.option("--max-concurrency", type=click.IntRange(min=1), default=None,
              help="most requests in flight")
@click.option("--random-input-len", type=click.IntRange(min=1), default=1024, show_default=True)
@click.option("--random-output-len", type=click.IntRange(min=1), default=128, show_default=True)
@click.option("--random-range-ratio", type=float, default=0.0, show_default=True,
              help="lengths uniform in [len*(1-r), len*(1+r)]")
@click.option("--random-prefix-len", type=click.IntRange(min=0), default=0, show_default=True,
              help="random tokens every random prompt starts with")
@click.option("--random-vocab-size", type=click.IntRange(min=1), default=None,
              help="draw token ids below this [default: the tokenizer's size]")
@click.option("--random-prompt-format", type=click.Choice(["ids", "text"]), default="ids", show_default=True,
              help="send random prompts as token ids, or as their decoded text (chat: always text)")
@click.option("--sharegpt-output-len", type=click.IntRange(min=1), default=None,
              help="output length of every ShareGPT request [default: the reply's length]")
@click.option("--prefix-repetition-prefix-len", type=click.IntRange(min=1), default=256, show_default=True)
@click.option("--prefix-repetition-suffix-len", type=click.IntRange(min=1), default=256, show_default=True)
@click.option("--prefix-repetition-num-prefixes", type=click.IntRange(min=1), default=10, show_default=True)
@click.option("--prefix-repetition-output-len", type=click.IntRange(min=1), default=128, show_default=True)
@click.option("--ignore-eos", is_flag=True, help="ask for exactly the output length (checked)")
@click.option("--temperature", type=_TEMPERATURE, default=0.0, show_default=True)
@click.option("--percentile-metrics", default="ttft,tpot,itl", show_default=True,
              help="comma-separated: ttft, tpot, itl, e2el")
@click.option("--metric-percentiles", default="99", show_default=True, help="comma-separated, e.g. 50,90,99")
@click.option("--goodput", multiple=True, help='SLOs in ms, e.g. --goodput "ttft:500 tpot:50" (ttft, tpot, '
              "itl, e2el)")
@click.option("--seed", type=click.IntRange(min=0), default=0, show_default=True)
@click.option("--save-result", is_flag=True, help="write the JSON record (to --result-dir)")
@click.option("--result-dir", type=click.Path(file_okay=False), default=None)
@click.option("--result-filename", default=None)
@click.option("--metadata", multiple=True, help="KEY=VALUE added to the JSON (e.g. gpus=8 tp=8 for "
              "bench scaling), repeatable")
@click.option("--plot", type=click.Path(dir_okay=False), default=None,
              help="histograms and tok/s over time, PNG (needs matplotlib)")
@click.option("--profile", is_flag=True, help="profile the server during the measured run (POST "
              "/start_profile, /stop_profile: a server started with --profiler-config)")
@click.option("--lora-modules", multiple=True, help="adapter names the server serves "
              "(`--lora-modules a b`): each request asks for one of them, drawn at random (--seed)")
@click.option("--disable-tqdm", is_flag=True)
def bench_serve(goodput, percentile_metrics, metric_percentiles, metadata, host, port, lora_modules,
                **kwargs):
    """Online benchmark against a running server: Poisson (bursty) arrivals or fixed concurrency;
    throughput, goodput, TTFT / TPOT / ITL / E2E percentiles; every request's tokens checked.
    Exits with 1 if a request failed or lost tokens. The API key comes from OPENAI_API_KEY."""
    from ..runtime.bench import serve
    try:
        meta = dict(m.split("=", 1) for m in metadata)
    except ValueError:
        raise click.UsageError("--metadata takes KEY=VALUE") from None
    try:
        kwargs["base_url"] = kwargs["base_url"] or f"http://{host}:{port}"
        args = serve.ServeBenchArgs(
            **kwargs, goodput=serve.parse_goodput(goodput), metadata=meta,
            percentile_metrics=tuple(m.strip() for m in percentile_metrics.split(",") if m.strip()),
            metric_percentiles=serve.parse_percentiles(metric_percentiles),
            lora_modules=tuple(lora_modules), api_key=os.environ.get("OPENAI_API_KEY"))
        sys.exit(serve.run(args))
    except ValueError as e:
        raise click.ClickException(str(e)) from None


@bench.command("scaling")
@click.argument("paths", nargs=-1, required=True, type=click.Path(exists=True))
@click.option("--output-dir", type=click.Path(file_okay=False), default=None,
              help="where scaling.md/.json/.png go [default: the directory given, if just one; else .]")
@click.option("--plot/--no-plot", default=True,
              help="write scaling.png (needs matplotlib: pip install 'rankserve[bench]') [default: --plot]")
def bench_scaling(paths, output_dir, plot):
    """Strong scaling over runs of bench throughput/latency: tok/s, speedup and efficiency vs GPUs.

    PATHS are directories (every *.json in them, e.g. the output of slurm/scaling.sbatch) or
    --output-json files. Runs are grouped by kind, model and workload; the baseline of a group is
    its run on the fewest GPUs. Prints a table and writes scaling.md, scaling.json, scaling.png."""
    from ..runtime.bench import scaling
    try:
        scaling.run(paths, output_dir, plot)
    except ValueError as e:
        raise click.ClickException(str(e)) from None


def _parse_size(text: str) -> int:
    units = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30}
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    num, unit = (t[:-1], t[-1]) if t and t[-1] in units else (t, "")
    try:
        n = int(float(num) * units[unit])
    except (ValueError, OverflowError):
        n = 0
    if n < 1:
        raise click.UsageError(f"--sizes: {text!r} is not a size like 4096, 64K, 16M or 1G")
    return n


@bench.command("comm")
@engine_options
@click.option("--sizes", default=None, help="comma-separated message sizes in bytes (64K, 16M, 1G); "
              "default: the sizes MODEL's TP/EP layers send for 1, 64 and 8192 tokens")
@click.option("--ops", default=None, help="comma-separated, from all_reduce, all_gather, all_to_all "
              "[default: all three with --sizes; else the ones MODEL's layers send]")
@click.option("--iters", type=click.IntRange(min=1), default=20, show_default=True)
@click.option("--warmup", type=click.IntRange(min=0), default=5, show_default=True)
@click.option("--json", "json_path", type=click.Path(dir_okay=False), callback=_writable,
              help="write results (rank 0)")
def bench_comm(sizes, ops, iters, warmup, json_path, **kwargs):
    """Collective bandwidth across the ranks of an mpirun/srun job (nccl-tests conventions).

    Without --tp/--pp every rank joins one TP group."""
    import torch

    from .discovery import discover
    from .preflight import LaunchError
    from .startup import start_ranks
    from ..runtime.bench.comm import OPS, model_message_sizes, run_comm_bench, select_model_ops
    if kwargs.get("tensor_parallel_size") is None and kwargs.get("pipeline_parallel_size") is None:
        kwargs["tensor_parallel_size"] = discover().world_size
    cfg, _ = _bench_config(kwargs)
    op_list = [o.strip() for o in ops.split(",") if o.strip()] if ops else None
    if op_list is not None and set(op_list) - set(OPS):
        raise click.UsageError(f"--ops: choose from {', '.join(OPS)}")

    def model_sizes(dtype_bytes: int) -> dict[str, list[int]]:
        from ..models.loader import load_hf_config
        hf = load_hf_config(cfg.model.model)
        topk = getattr(hf, "num_experts_per_tok", None) if cfg.parallel.enable_expert_parallel else None
        return model_message_sizes(hf.hidden_size, [1, 64, 8192], dtype_bytes,
                                   cfg.parallel.tensor_parallel_size, topk, hf.vocab_size)
    notice = None
    if sizes:
        size_list = [_parse_size(x) for x in sizes.split(",")]  # checked before the rendezvous
        op_list = op_list or list(OPS)
    else:  # checked before the rendezvous: the same answer on every rank
        try:
            op_list, notice = select_model_ops(op_list, model_sizes(1))
        except ValueError as e:
            raise LaunchError(str(e), report=discover().rank == 0) from None
    started = start_ranks(cfg)
    if started is None:
        raise click.UsageError("bench comm needs several ranks: mpirun -np N rankserve bench comm ...")
    info, control, pi, device = started
    if notice and info.rank == 0:
        click.echo(f"bench comm: {notice}", err=True)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32  # what the model sends
    if sizes:
        per_op = {op: size_list for op in op_list}
    else:
        per_op = {op: s for op, s in model_sizes(dtype.itemsize).items() if op in op_list}
    if sizes:  # the same sizes for every op: one table
        rows = run_comm_bench(per_op[op_list[0]], ops=tuple(op_list), dtype=dtype, iters=iters,
                              warmup=warmup, device=device)
    else:
        rows = []
        for op, op_sizes in per_op.items():
            rows += run_comm_bench(op_sizes, ops=(op,), dtype=dtype, iters=iters, warmup=warmup,
                                   device=device)
    if info.rank == 0 and json_path:
        from ..runtime.bench.common import environment, write_json
        write_json(json_path, {"env": environment(), "world_size": info.world_size, "results": rows})
        click.echo(f"wrote {json_path}")
    control.barrier()


# ---- serve --------------------------------------------------------------------------------------
def server_options(func):
    """One click option per ServerArgs field (host, port, api key, parsers ...)."""
    from ..runtime.serve.args import ServerArgs
    for f in reversed(dataclasses.fields(ServerArgs)):
        ctype, base = _click_type(f)
        names = ["--" + f.name.replace("_", "-"), *filter(None, [f.metadata.get("short")])]
        if base is bool:
            func = click.option(*names, f.name, is_flag=True, default=False,
                                help=f.metadata["doc"])(func)
        else:
            func = click.option(*names, f.name, type=ctype, default=f.default, show_default=True,
                                help=f.metadata["doc"])(func)
    return func


@main.command()
@engine_options
@server_options
def serve(**kwargs):
    """Serve MODEL over HTTP: OpenAI (/v1/completions, /v1/chat/completions), Anthropic
    (/v1/messages) and Responses (/v1/responses) APIs, /metrics. Under mpirun/srun rank 0 serves
    and the other ranks run the model with it."""
    import os

    from .discovery import scrub_launcher_env
    from .startup import run_multi_rank, start_ranks
    from ..runtime.serve.args import ServerArgs
    from ..runtime.serve.engine_proc import serve_engine
    names = [f.name for f in dataclasses.fields(ServerArgs)]
    try:
        args = ServerArgs(**{n: kwargs.pop(n) for n in names}).validate().resolve_api_key()
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    cfg = build_config(kwargs)
    env = scrub_launcher_env(os.environ)  # the API child must not take itself for an MPI rank
    started = start_ranks(cfg)
    if started is None or started[0].rank == 0:  # (the rank whose API process binds it)
        try:
            args.check_port()
        except ValueError as e:
            if started is None:
                raise click.UsageError(str(e)) from None
            from .failure import abort
            abort(str(e))  # the whole job, with the message, before any rank loads weights
    if started is None:
        from ..runtime import executor as executors
        executor = executors.UniprocExecutor(cfg)
        try:
            sys.exit(serve_engine(cfg, args, executor, api_env=env))
        finally:
            executor.shutdown()
    from . import failure
    from ..runtime.serve.engine_proc import DRAIN_MARGIN_S, serve_replica
    # a signal drains (rank 0 finishes the requests in flight, then stops the workers) rather
    # than ending every rank at once; a rank still there this much later shuts down anyway
    failure.drain_on_signal(args.shutdown_timeout + 2 * DRAIN_MARGIN_S + 10)
    sys.exit(run_multi_rank(cfg, started,
                            lambda ex: serve_engine(cfg, args, ex, api_env=env, on_drain=failure.on_drain),
                            lambda ex: serve_replica(cfg, ex)))
