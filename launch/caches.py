"""Cache directories that work where HOME is read-only (common on compute nodes).

`--cache-dir` (Inductor and autotune caches) defaults to ~/.cache/rankserve and Triton keeps its
kernels in ~/.triton; on a node whose HOME is read-only (or absent) the first compiled kernel
would fail. When a default cannot be written, it moves to a per-user directory under the node's
temporary directory (`$TMPDIR`, else /tmp), with one notice. A --cache-dir given explicitly, or
a TRITON_CACHE_DIR set by the user, is never moved (an unwritable --cache-dir is a start-up error
where torch.compile would write to it, else a warning; a relative one is made absolute).
"""
from __future__ import annotations

import dataclasses
import logging
import os
import tempfile

log = logging.getLogger(__name__)


def writable(path: str) -> bool:
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path):
            return True
    except OSError:
        return False


def fallback_root() -> str:
    return os.path.join(tempfile.gettempdir(), f"rankserve-cache-{os.getuid()}")


def usable_caches(cfg, given_cache_dir: bool, env=None):
    """`cfg` with a writable --cache-dir; sets TRITON_CACHE_DIR when Triton's default is not
    writable (Triton reads only that variable). Returns the (possibly new) config."""
    env = os.environ if env is None else env
    comp = cfg.compilation
    if given_cache_dir:
        # absolute: Inductor and Triton get it through the environment, where a relative path
        # would mean another directory to a process started elsewhere
        path = os.path.abspath(os.path.expanduser(comp.cache_dir))
        if not writable(path):
            if comp.compilation_level >= 2 and not comp.enforce_eager:
                from ..runtime.config import ConfigError
                raise ConfigError(f"--cache-dir {comp.cache_dir} is not a writable directory: "
                                  "--compilation-level 2 keeps its compiled kernels there")
            log.warning("--cache-dir %s is not writable: model-config snapshots are read from it "
                        "but none is saved", comp.cache_dir)
        cfg = dataclasses.replace(cfg, compilation=dataclasses.replace(comp, cache_dir=path))
    elif not writable(comp.cache_dir):
        new = os.path.join(fallback_root(), "rankserve")
        log.warning("cache directory %s is not writable (read-only HOME?); using %s",
                    comp.cache_dir, new)
        cfg = dataclasses.replace(cfg, compilation=dataclasses.replace(comp, cache_dir=new))
    if "TRITON_CACHE_DIR" not in env:
        home = env.get("TRITON_HOME") or env.get("HOME") or os.path.expanduser("~")
        triton_default = os.path.join(home, ".triton", "cache")
        if not writable(triton_default):
            env["TRITON_CACHE_DIR"] = os.path.join(fallback_root(), "triton")
            log.warning("Triton's cache %s is not writable; using %s", triton_default,
                        env["TRITON_CACHE_DIR"])
    return cfg


def hash_triton_early(gpu_hint: str = "/dev/nvidiactl"):
    """Triton keys its on-disk kernel cache with a sha256 of its own ~500 MB libtriton, once a
    process, at the first kernel it compiles or loads: 0.6 s on this project's CPU machine, paid
    inside a warm start's precompile. Started with the command, a thread computes that key
    (Triton's lru_cache keeps it) beside the imports and the load (hashlib releases the GIL).
    Only where a GPU is likely (no Triton kernel runs on CPU outside the interpreter). Returns
    the thread, or None."""
    import threading
    if not os.path.exists(gpu_hint) or os.environ.get("TRITON_INTERPRET") == "1":
        return None

    def run():
        try:
            from triton.runtime.cache import triton_key
            triton_key()
        except Exception as e:  # noqa: BLE001 (the first kernel computes it, as before)
            log.debug("early Triton cache key: %r", e)
    thread = threading.Thread(target=run, name="triton-key", daemon=True)
    thread.start()
    return thread
