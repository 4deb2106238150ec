"""The serving processes freeze their start-up heap (engine_core.freeze_gc_heap): no full garbage
collection walks it mid-step; sleep mode thaws it so that cycles holding released weights go."""
from __future__ import annotations

import gc
import weakref

import torch
import zmq

from rankserve.runtime.serve.engine_proc import EngineServer
from rankserve.runtime.sleep import _return_memory


def test_engine_server_freezes_the_heap():
    gc.unfreeze()
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    try:
        assert gc.get_freeze_count() == 0
        EngineServer(core=None, cfg=None, bound=(ctx, sock))
        assert gc.get_freeze_count() > 1000  # (this test process's whole heap)
    finally:
        gc.unfreeze()
        sock.close(0)
        ctx.term()


def test_sleep_collects_cycles_in_a_frozen_heap():
    class Holder:
        pass

    a, b = Holder(), Holder()
    a.other, b.other, a.weight = b, a, torch.zeros(1024)
    ref = weakref.ref(a)
    gc.collect()
    gc.freeze()
    try:
        del a, b
        gc.collect()
        assert ref() is not None  # frozen: a full collection does not see the cycle
        _return_memory(torch.device("cpu"))
        assert ref() is None
        assert gc.get_freeze_count() > 0  # frozen again afterwards
    finally:
        gc.unfreeze()


def test_step_log_that_cannot_be_written_is_a_clear_error(monkeypatch, tmp_path):
    import pytest

    from rankserve.runtime.config import ConfigError
    monkeypatch.setenv("RANKSERVE_STEP_LOG", str(tmp_path / "missing" / "steps.csv"))
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    try:
        with pytest.raises(ConfigError, match="RANKSERVE_STEP_LOG=.*cannot write it"):
            EngineServer(core=None, cfg=None, bound=(ctx, sock))
    finally:
        gc.unfreeze()
        sock.close(0)
        ctx.term()
