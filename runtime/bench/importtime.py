"""Summarise a `python -X importtime` log: the imports with the largest cumulative time, and the
total per top-level package. `python -m rankserve.runtime.bench.importtime LOG [N]` (gpu_session.sh
stage w2importtime). Cumulative times of nested imports overlap; the per-package totals (what the program's own
imports of each package cost, everything they pulled included) do not."""
from __future__ import annotations

import re
import sys

_LINE = re.compile(r"import time:\s+(\d+) \|\s+(\d+) \|( *)(\S+)")


def parse(lines) -> list[tuple[float, float, int, str]]:
    """(cumulative s, self s, depth, module) per import (depth 0: imported by the program itself)."""
    rows = []
    for line in lines:
        m = _LINE.match(line)
        if m:
            rows.append((int(m.group(2)) / 1e6, int(m.group(1)) / 1e6, (len(m.group(3)) - 1) // 2, m.group(4)))
    return rows


def by_package(rows) -> dict[str, float]:
    """Per top-level package, the cumulative time of the imports the program itself made of it
    (depth 0): what importing `transformers` cost, including the torch modules it pulled."""
    out: dict[str, float] = {}
    for cum, _, depth, mod in rows:
        if depth == 0:
            out[mod.split(".")[0]] = out.get(mod.split(".")[0], 0.0) + cum
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def main(argv: list[str]) -> None:
    with open(argv[0]) as f:
        rows = parse(f)
    n = int(argv[1]) if len(argv) > 1 else 30
    print(f"imports: {len(rows)}, total {sum(r[1] for r in rows):.2f} s (self times summed)")
    print(f"top {n} by cumulative time:")
    for cum, self_s, depth, mod in sorted(rows, reverse=True)[:n]:
        print(f"  {cum:7.3f} s  (self {self_s:.3f})  {'  ' * min(depth, 8)}{mod}")
    print("per package, its imports by the program (what they pulled included):")
    for pkg, s in list(by_package(rows).items())[:15]:
        print(f"  {s:7.3f} s  {pkg}")


if __name__ == "__main__":
    main(sys.argv[1:])
