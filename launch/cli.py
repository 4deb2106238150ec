"""`rankserve` command line. Engine flags are generated from the EngineConfig dataclasses."""
from __future__ import annotations

import dataclasses
import json
import logging
import sys
import types
import typing

import click

from rankserve.runtime.config import ConfigError, EngineConfig


def _click_type(f: dataclasses.Field):
    choices = f.metadata.get("choices")
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
    for section, f in reversed(list(cfg.flat_fields())):
        if f.metadata.get("positional"):
            func = click.argument("model", required=False)(func)
            continue
        ctype, base = _click_type(f)
        names = ["--" + f.name.replace("_", "-")]
        alias = f.metadata.get("alias")
        if alias:
            names.append(("-" if len(alias) == 1 else "--") + alias.replace("_", "-"))
        help_ = f.metadata.get("doc", "")
        if base is bool:
            func = click.option(names[0] + "/--no-" + f.name.replace("_", "-"), f.name,
                                default=None, help=f"{help_} [default: {f.default}]")(func)
        else:
            func = click.option(*names, f.name, type=ctype, default=None,
                                help=f"{help_} [default: {f.default}]")(func)
    return func


def build_config(kwargs: dict) -> EngineConfig:
    """EngineConfig from CLI kwargs (None means: not given); errors name the flag."""
    given = {k: v for k, v in kwargs.items() if v is not None}
    cfg = EngineConfig()
    for section, f in cfg.flat_fields():
        if f.name in given:
            value = given.pop(f.name)
            ctype, base = _click_type(f)
            if isinstance(ctype, click.Choice) and base is int:
                value = int(value)
            setattr(getattr(cfg, section), f.name, value)
    try:
        return cfg.validate()
    except ConfigError as e:
        raise click.UsageError(str(e)) from None


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
@click.version_option(package_name="rankserve")
def main():
    """rankserve: LLM serving for HPC clusters (launch with mpirun or srun for several ranks)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S")


@main.command()
@engine_options
@click.option("--prompt", "prompts", multiple=True, required=True, help="prompt text (repeatable)")
@click.option("--max-tokens", type=click.IntRange(min=1), default=64, show_default=True)
@click.option("--temperature", type=click.FloatRange(min=0), default=0.0, show_default=True)
@click.option("--top-p", type=click.FloatRange(0, 1, min_open=True), default=1.0)
@click.option("--top-k", type=int, default=0)
@click.option("--sampling-seed", type=int, default=None, help="per-request sampling seed")
@click.option("--ignore-eos", is_flag=True)
@click.option("--json", "as_json", is_flag=True, help="print token ids, text and finish reasons as JSON")
def generate(prompts, max_tokens, temperature, top_p, top_k, sampling_seed, ignore_eos, as_json,
             **kwargs):
    """Generate text offline for one or more prompts."""
    from rankserve.launch.startup import run_on_ranks
    from rankserve.runtime.sampling_params import SamplingParams
    cfg = build_config(kwargs)
    sp = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                        seed=sampling_seed, ignore_eos=ignore_eos)

    def body(llm):
        outs = llm.generate(list(prompts), sp)
        for o in outs:
            c = o.outputs[0]
            if as_json:
                click.echo(json.dumps({"prompt": o.prompt, "text": c.text, "token_ids": c.token_ids,
                                       "finish_reason": c.finish_reason}))
            else:
                click.echo(f"{o.prompt}{c.text}")
    sys.exit(run_on_ranks(cfg, body))


# ---- serve --------------------------------------------------------------------------------------
def server_options(func):
    """One click option per ServerArgs field (host, port, api key, parsers ...)."""
    from rankserve.runtime.serve.args import ServerArgs
    for f in reversed(dataclasses.fields(ServerArgs)):
        ctype, base = _click_type(f)
        name = "--" + f.name.replace("_", "-")
        if base is bool:
            func = click.option(name, f.name, is_flag=True, default=False,
                                help=f.metadata["doc"])(func)
        else:
            func = click.option(name, f.name, type=ctype, default=f.default, show_default=True,
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

    from rankserve.launch.discovery import scrub_launcher_env
    from rankserve.launch.startup import run_multi_rank, start_ranks
    from rankserve.runtime.serve.args import ServerArgs
    from rankserve.runtime.serve.engine_proc import serve_engine
    names = [f.name for f in dataclasses.fields(ServerArgs)]
    try:
        args = ServerArgs(**{n: kwargs.pop(n) for n in names}).validate()
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    cfg = build_config(kwargs)
    env = scrub_launcher_env(os.environ)  # the API child must not take itself for an MPI rank
    started = start_ranks(cfg)
    if started is None:
        from rankserve.runtime.executor import UniprocExecutor
        executor = UniprocExecutor(cfg)
        try:
            sys.exit(serve_engine(cfg, args, executor, api_env=env))
        finally:
            executor.shutdown()
    sys.exit(run_multi_rank(cfg, started, lambda ex: serve_engine(cfg, args, ex, api_env=env)))
