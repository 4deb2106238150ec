"""The frontend CPU benchmark (runtime/bench/frontend.py) end to end at a tiny size: the real API
process against the fake engine core, every token delivered and counted."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from rankserve.runtime.bench import frontend

QWEN3 = Path(__file__).resolve().parents[1].parent / "shared" / "tokenizers" / "qwen3"


def test_frontend_bench_small(tmp_path):
    out = tmp_path / "f.json"
    args = ["--tokenizer", str(QWEN3), "--concurrency", "4", "--num-requests", "8",
            "--output-len", "5", "20", "--input-len", "3", "9", "--steps", "5",
            "--output-json", str(out)]
    assert frontend.main(args) == 0
    stages, e2e = json.loads(out.read_text())
    assert stages["app_chunks_per_token"] > 0 and stages["detokenize_us_per_token"] > 0
    rng = np.random.default_rng(0)
    expected = sum(frontend._lengths(rng, 8, 5, 20))  # the lengths the bodies asked for
    assert e2e["output_tokens"] == expected and 0 < e2e["fraction_of_ideal"] <= 1.1
    assert e2e["chunks"] <= expected and e2e["api_cpu_us_per_token"] > 0
