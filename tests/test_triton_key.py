"""The Triton cache key (a sha256 of libtriton, ~0.6 s) is computed on a thread at start-up where
a GPU is likely, so a warm start's first kernel finds it (launch/caches.py)."""
from __future__ import annotations

import subprocess
import sys


def test_key_is_ready_after_the_thread(tmp_path):
    code = f"""
from rankserve.launch.caches import hash_triton_early
from triton.runtime.cache import triton_key
hint = {str(tmp_path / "nvidiactl")!r}
assert hash_triton_early(hint) is None  # no GPU hint: nothing started
open(hint, "w").close()
t = hash_triton_early(hint)
t.join(60)
assert triton_key.cache_info().currsize == 1, triton_key.cache_info()
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]


def test_interpreter_runs_start_nothing(tmp_path, monkeypatch):
    from rankserve.launch.caches import hash_triton_early
    (tmp_path / "nvidiactl").touch()
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert hash_triton_early(str(tmp_path / "nvidiactl")) is None
