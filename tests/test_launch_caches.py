"""Cache directories on nodes whose HOME is read-only (launch/caches.py); a whole run with an
unwritable HOME is in test_slurm.py."""
from rankserve.launch.caches import fallback_root, usable_caches, writable
from rankserve.runtime.config import EngineConfig

UNWRITABLE = "/dev/null/home"  # not a directory: unwritable even for root


def test_unwritable_defaults_move_to_tmp(tmp_path):
    env = {"HOME": UNWRITABLE}
    cfg = EngineConfig.from_kwargs(cache_dir=f"{UNWRITABLE}/.cache/rankserve")
    out = usable_caches(cfg, given_cache_dir=False, env=env)
    assert out.compilation.cache_dir.startswith(fallback_root()) and writable(out.compilation.cache_dir)
    assert env["TRITON_CACHE_DIR"].startswith(fallback_root())


def test_explicit_choices_are_kept(tmp_path):
    env = {"HOME": UNWRITABLE, "TRITON_CACHE_DIR": str(tmp_path)}
    cfg = EngineConfig.from_kwargs(cache_dir=f"{UNWRITABLE}/x")
    assert usable_caches(cfg, given_cache_dir=True, env=env).compilation.cache_dir == f"{UNWRITABLE}/x"
    assert env["TRITON_CACHE_DIR"] == str(tmp_path)

