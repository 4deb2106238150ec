"""Strong scaling across runs: `rankserve bench scaling DIR|FILE.json ...`.

Reads the JSON records of `rankserve bench throughput|latency --output-json` (e.g. the
`throughput-tpN.json` files of `slurm/scaling.sbatch`) and of `rankserve bench serve
--save-result` (online runs; the GPU count comes from `--metadata gpus=N`, or tp × pp × dp given
the same way), groups them by (kind, model, workload)
and compares each run's rankserve tokens/s with the run on the fewest GPUs of its group:

    speedup    = tok/s ÷ baseline tok/s
    efficiency = speedup ÷ (GPUs ÷ baseline GPUs)       (1.0 = perfect strong scaling)

GPUs is the engine's world size (TP × PP, `results.rankserve.num_devices`). Tokens/s is output
tok/s for throughput and serve records and decode tok/s for latency records. Writes scaling.md (a table to
paste into a README), scaling.json and, with matplotlib, scaling.png. No torch import: this runs
on a login node.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

METRIC = {"throughput": "output_tokens_per_s", "latency": "decode_tokens_per_s",
          "serve": "output_throughput"}
METRIC_LABEL = {"throughput": "output tok/s", "latency": "decode tok/s", "serve": "output tok/s"}


# ---- reading --------------------------------------------------------------------------------
def json_files(paths) -> list[Path]:
    """Every *.json of the directories plus the files given, once each, in a stable order."""
    files: dict[Path, None] = {}
    for p in map(Path, paths):
        for f in sorted(p.glob("*.json")) if p.is_dir() else [p]:
            files.setdefault(f.resolve(), None)
    return list(files)


def _split_from_argv(argv: list[str]) -> dict:
    """TP/PP of records written before they carried `parallel`: read the flags of the command."""
    names = {"--tp": "tp", "--tensor-parallel-size": "tp", "--pp": "pp",
             "--pipeline-parallel-size": "pp"}
    if not argv:
        return {}
    out = {"tp": 1, "pp": 1}  # the engine defaults
    for i, a in enumerate(argv):
        flag, eq, value = a.partition("=")
        if flag in names and (eq or i + 1 < len(argv)):
            try:
                out[names[flag]] = int(value if eq else argv[i + 1])
            except ValueError:
                pass
    return out


def read_record(path: Path) -> tuple[dict | None, str | None]:
    """(run, None) for a usable rankserve record, (None, why) for anything else (None, None for
    our own scaling.json, which sits in the same directory on a second run)."""
    try:
        rec = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        return None, f"not JSON ({e})"
    if not isinstance(rec, dict) or rec.get("kind") not in METRIC:
        return None, (None if isinstance(rec, dict) and rec.get("kind") == "scaling"
                      else "not a rankserve bench throughput/latency/serve record")
    if rec["kind"] == "serve":
        return read_serve_record(path, rec)
    r = (rec.get("results") or {}).get("rankserve")
    metric = METRIC[rec["kind"]]
    if not isinstance(r, dict) or metric not in r or "num_devices" not in r:
        return None, "no rankserve result in it (a --backend hf run?)"
    env, model = rec.get("env") or {}, rec.get("model") or {}
    split = rec.get("parallel") or _split_from_argv(env.get("argv") or [])
    return dict(
        path=str(path), kind=rec["kind"],
        model=model.get("name") or os.path.basename(str(model.get("path") or "").rstrip("/")) or "?",
        workload=rec.get("workload") or {}, gpus=int(r["num_devices"]),
        tp=split.get("tp"), pp=split.get("pp"), ep=split.get("ep"),
        tokens_per_s=float(r[metric]), total_tokens_per_s=r.get("total_tokens_per_s"),
        latency_s=r.get("latency_s"), date=env.get("date"),
        # CPU runs have no GPU name; the ceilings name the device instead
        gpu=env.get("gpu") or (rec.get("ceilings") or {}).get("device"),
        command=env.get("command")), None


def read_serve_record(path: Path, rec: dict) -> tuple[dict | None, str | None]:
    """A `bench serve --save-result` record: the server's GPUs are not visible to the client,
    so they come from its --metadata (gpus=N, or tp/pp/dp)."""
    meta = rec.get("metadata") or {}
    split = {k: int(meta[k]) for k in ("tp", "pp", "dp") if str(meta.get(k, "")).isdigit()}
    gpus = meta.get("gpus")
    if gpus is None and split:
        gpus = split.get("tp", 1) * split.get("pp", 1) * split.get("dp", 1)
    if gpus is None or not str(gpus).isdigit():
        return None, "a bench serve record without its GPU count: run it with --metadata gpus=N"
    if rec.get("failed"):
        return None, f"{rec['failed']} request(s) failed in this run"
    env = rec.get("env") or {}
    return dict(
        path=str(path), kind="serve", model=meta.get("model") or rec.get("model_id") or "?",
        workload=rec.get("workload") or {}, gpus=int(gpus), tp=split.get("tp"), pp=split.get("pp"),
        ep=None, dp=split.get("dp"), tokens_per_s=float(rec["output_throughput"]),
        total_tokens_per_s=rec.get("total_token_throughput"), latency_s=rec.get("duration"),
        date=env.get("date"), gpu=meta.get("gpu"), command=env.get("command")), None


def workload_label(kind: str, w: dict) -> str:
    if kind == "serve":
        rate = w.get("request_rate")
        how = (f"max concurrency {w['max_concurrency']}" if w.get("max_concurrency") else "") + (
            "" if rate in (None, float("inf"), "inf") else f"{', ' if w.get('max_concurrency') else ''}{rate:g} req/s")
        return f"{w.get('num_prompts')} {w.get('dataset')} requests online, {how or 'all at once'}"
    if kind == "latency":
        return f"batch {w.get('batch_size')}, {w.get('input_len')} in / {w.get('output_len')} out"
    i, o = w.get("input_len") or ["?", "?"], w.get("output_len") or ["?", "?"]
    return f"{w.get('num_requests')} requests, prompts {i[0]}-{i[1]}, outputs {o[0]}-{o[1]}"


# ---- scaling --------------------------------------------------------------------------------
def scaling_groups(runs: list[dict]) -> list[dict]:
    """One group per (kind, model, workload), runs sorted by GPUs; the baseline is the first run
    on the fewest GPUs (a 70B model may only fit from 4 GPUs on)."""
    groups: dict[tuple, list[dict]] = {}
    for run in runs:  # the whole workload dict is the key: same seed and lengths, same requests
        key = (run["kind"], run["model"], json.dumps(run["workload"], sort_keys=True))
        groups.setdefault(key, []).append(run)
    out = []
    for (kind, model, _), members in sorted(groups.items()):
        members = sorted(members, key=lambda r: (r["gpus"], r["tp"] or 0, r["path"]))
        base = members[0]
        for r in members:
            r["speedup"] = r["tokens_per_s"] / base["tokens_per_s"]
            r["efficiency"] = r["speedup"] / (r["gpus"] / base["gpus"])
        out.append(dict(kind=kind, model=model, workload=members[0]["workload"],
                        label=f"{model}, {kind}: {workload_label(kind, members[0]['workload'])}",
                        metric=METRIC[kind], baseline_gpus=base["gpus"], runs=members))
    return out


# ---- output ---------------------------------------------------------------------------------
def _num(v) -> str:
    return "-" if v is None else str(v)


def _cell(v) -> str:
    return "-" if not v else str(v).replace("|", "\\|")  # a pipe would end the table cell


def text_table(groups: list[dict]) -> str:
    lines = []
    for g in groups:
        lines += [g["label"], (f"  {'GPUs':>5} {'TP':>3} {'PP':>3} {METRIC_LABEL[g['kind']]:>14} "
                               f"{'speedup':>8} {'efficiency':>10}  file")]
        for r in g["runs"]:
            lines.append(f"  {r['gpus']:>5} {_num(r['tp']):>3} {_num(r['pp']):>3} "
                         f"{r['tokens_per_s']:>14.1f} {r['speedup']:>7.2f}x {100 * r['efficiency']:>9.1f}%"
                         f"  {os.path.basename(r['path'])}")
    return "\n".join(lines)


def markdown(groups: list[dict]) -> str:
    out = [("Strong scaling (`rankserve bench scaling`): speedup = tok/s ÷ baseline tok/s, "
            "efficiency = speedup ÷ (GPUs ÷ baseline GPUs); the baseline is the run on the fewest GPUs.")]
    for g in groups:
        out += ["", f"### {g['label']}", "",
                f"| GPUs | TP | PP | {METRIC_LABEL[g['kind']]} | speedup | efficiency | date | GPU | command |",
                "|---:|---:|---:|---:|---:|---:|---|---|---|"]
        for r in g["runs"]:
            date = (r["date"] or "")[:16].replace("T", " ")  # minutes are enough to tell runs apart
            out.append(f"| {r['gpus']} | {_num(r['tp'])} | {_num(r['pp'])} | {r['tokens_per_s']:.1f} "
                       f"| {r['speedup']:.2f}× | {100 * r['efficiency']:.1f}% | {_cell(date)} "
                       f"| {_cell(r['gpu'])} | {'`' + _cell(r['command']) + '`' if r['command'] else '-'} |")
    return "\n".join(out) + "\n"


def plot(groups: list[dict], path: str) -> bool:
    """tok/s and efficiency vs GPUs, one line per group; False when matplotlib is missing."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import NullLocator
    except ImportError:
        return False
    legend_h = 0.18 * len(groups) + 0.1  # inches below the panels, one legend line per group
    fig, (ax_t, ax_e) = plt.subplots(1, 2, figsize=(10, 4 + legend_h))
    for i, g in enumerate(groups):
        color = f"C{i % 10}"
        gpus = [r["gpus"] for r in g["runs"]]
        base = g["runs"][0]
        ax_t.plot(gpus, [r["tokens_per_s"] for r in g["runs"]], "o-", color=color, label=g["label"])
        # perfect scaling from the baseline, for the eye
        ax_t.plot(gpus, [base["tokens_per_s"] * n / base["gpus"] for n in gpus], "--", color=color,
                  alpha=0.4, lw=1)
        ax_e.plot(gpus, [100 * r["efficiency"] for r in g["runs"]], "o-", color=color)
    ticks = sorted({r["gpus"] for g in groups for r in g["runs"]})
    for ax in (ax_t, ax_e):
        ax.set_xscale("log", base=2)
        ax.set_xticks(ticks, [str(t) for t in ticks])
        ax.xaxis.set_minor_locator(NullLocator())
        ax.set_xlabel("GPUs (TP × PP)")
        ax.grid(alpha=0.3)
    ax_t.set_ylim(bottom=0)
    ax_t.set_ylabel("tokens/s (throughput: output, latency: decode)")
    ax_t.set_title("tokens/s (dashed: perfect scaling)", fontsize=9)
    ax_e.axhline(100, color="gray", lw=0.8)
    ax_e.set_ylim(0, max(110, *(100 * r["efficiency"] + 10 for g in groups for r in g["runs"])))
    ax_e.set_ylabel("strong-scaling efficiency (%)")
    ax_e.set_title("efficiency vs the fewest GPUs", fontsize=9)
    fig.legend(loc="lower center", ncol=1, fontsize=7, frameon=False)
    fig.tight_layout(rect=(0, legend_h / (4 + legend_h), 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def run(paths, output_dir: str | None = None, make_plot: bool = True) -> list[dict]:
    """Read, print the table, write scaling.md/.json(/.png); ValueError when nothing is usable."""
    files = json_files(paths)
    where = ", ".join(map(str, paths))
    if not files:
        raise ValueError(f"no JSON files in {where}")
    runs, skipped = [], []
    for f in files:
        rec, why = read_record(f)
        if rec:
            runs.append(rec)
        elif why:
            skipped.append(dict(path=str(f), reason=why))
            print(f"warning: skipping {f}: {why}", file=sys.stderr)
    if not runs:
        raise ValueError(f"no rankserve bench throughput/latency records in {where} "
                         f"({len(files)} JSON file(s) read)")
    groups = scaling_groups(runs)
    print(text_table(groups))
    if output_dir is None:  # next to the results when they are one directory
        output_dir = str(paths[0]) if len(paths) == 1 and os.path.isdir(paths[0]) else os.getcwd()
    os.makedirs(output_dir, exist_ok=True)
    out = Path(output_dir)
    (out / "scaling.md").write_text(markdown(groups))
    (out / "scaling.json").write_text(json.dumps(dict(kind="scaling", groups=groups, skipped=skipped),
                                                 indent=2))
    written = [out / "scaling.md", out / "scaling.json"]
    if make_plot:
        if plot(groups, str(out / "scaling.png")):
            written.append(out / "scaling.png")
        else:
            print("matplotlib is not installed (pip install 'rankserve[bench]'); no scaling.png")
    print("wrote " + ", ".join(map(str, written)))
    return groups
