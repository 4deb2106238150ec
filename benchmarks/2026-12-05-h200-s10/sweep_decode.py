"""Split-KV decode attention tiles on W1 (the decode steps are mostly attention): for each
(DECODE_BLOCK_N, DECODE_STAGES, DECODE_PROGRAMS_PER_SM) of kernels/triton_attention.py, one
`rankserve bench throughput qwen3-0.6b --workload w1` in its own process; a table at the end.
`--w2`: W2 instead (`bench latency llama-3.1-8b`, batch 1, 128 in / 256 out: split-KV decode of
one request, the reduce kernel's case).

    python benchmarks/2026-12-05-h200-s10/sweep_decode.py [--w2] [--cache-dir DIR] [CONFIG ...]

CONFIG is BLOCK_N,STAGES,PPSM[,WARPS] (default: the current constants first, then a few
neighbours); a config may repeat (run-to-run noise). Other arguments go to the bench command
(e.g. `--kv-cache-dtype fp8`: W1 with an fp8 KV cache measured no faster than bf16 in session 12,
so the kernel is not bound by the bytes it reads)."""
from __future__ import annotations

import re
import subprocess
import sys

W1 = ["bench", "throughput", "qwen3-0.6b", "--workload", "w1", "--max-num-seqs", "256"]
W2 = ["bench", "latency", "llama-3.1-8b", "--batch-size", "1", "--input-len", "128", "--output-len",
      "256", "--num-iters", "3", "--max-num-seqs", "8"]
DEFAULT = ["64,2,8", "64,2,16", "64,2,32", "64,3,8", "128,2,8", "32,2,16"]


def one(cfg: str, rest: list[str]) -> None:
    workload = W2 if "--w2" in rest else W1
    rest = [a for a in rest if a != "--w2"]
    from rankserve.kernels import triton_attention as ta
    vals = list(map(int, cfg.split(",")))
    ta.DECODE_BLOCK_N, ta.DECODE_STAGES, ta.DECODE_PROGRAMS_PER_SM = vals[:3]
    ta.DECODE_WARPS = vals[3] if len(vals) > 3 else ta.DECODE_WARPS
    from rankserve.launch.cli import main
    sys.argv = ["rankserve", *workload, *rest]
    main()


def sweep(cfgs: list[str], rest: list[str]) -> None:
    rows = []
    for cfg in cfgs:
        p = subprocess.run([sys.executable, __file__, "--one", cfg, *rest], capture_output=True,
                           text=True, timeout=300)
        m = re.search(r"([\d.]+) (?:output tok/s|tok/s \(median)", p.stdout)
        f = re.search(r"achieved ([\d.]+)% of the floor", p.stdout)
        rows.append((cfg, m.group(1) if m else f"failed rc={p.returncode}", f.group(1) if f else "-"))
        if not m:
            print(p.stdout[-1500:], p.stderr[-1500:])
        print(f"{cfg:>10}  {rows[-1][1]:>10} tok/s  {rows[-1][2]:>5}% of floor", flush=True)
    print("BLOCK_N,STAGES,PPSM[,WARPS]  tok/s (W1 output / W2 decode)  % of floor")
    for r in rows:
        print(f"{r[0]:>19}  {r[1]:>12}  {r[2]:>10}")


if __name__ == "__main__":
    args = sys.argv[1:]
    if args[:1] == ["--one"]:
        one(args[1], args[2:])
    else:
        cfgs = [a for a in args if re.fullmatch(r"\d+,\d+,\d+(,\d+)?", a)]
        rest = [a for a in args if a not in cfgs]
        sweep(cfgs or DEFAULT, rest)
