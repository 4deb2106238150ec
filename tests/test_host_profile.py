"""RANKSERVE_HOST_PROFILE: the serving engine's host loop under cProfile, one report per burst of
work (the first STEPS steps after an idle turn), so that a cold burst's host time can be told
from a warm one's."""
from __future__ import annotations

import time

import zmq

import pytest

from rankserve.runtime.config import ConfigError
from rankserve.runtime.messages import EngineCoreOutputs
from rankserve.runtime.serve.engine_proc import EngineServer, HostProfile


def slow_step():
    time.sleep(0.002)


def test_one_report_per_burst_each_with_its_steps(tmp_path):
    prof = HostProfile(str(tmp_path / "host"))
    prof.STEPS = 5
    for steps in (8, 3, 2, 2):  # bursts: cut at STEPS; ended by an idle turn; at most BURSTS
        for _ in range(steps):
            prof.before_step()
            slow_step()
            prof.after_step()
        prof.on_idle()
        prof.on_idle()  # idle turns in a row change nothing
    reports = sorted(p.name for p in tmp_path.iterdir())
    assert reports == ["host.1", "host.2", "host.3"]
    texts = [(tmp_path / r).read_text() for r in reports]
    assert [t.splitlines()[0] for t in texts] == [
        "host profile of burst 1: 5 engine steps", "host profile of burst 2: 3 engine steps",
        "host profile of burst 3: 2 engine steps"]
    assert all("slow_step" in t and "cumulative" in t for t in texts)


class FakeCore:
    def __init__(self, work: int):
        self.work = work
        self.last_phases = (0.0, 0.0, 0.0, 0.0)

    @property
    def has_work(self):
        return self.work > 0

    def step(self):
        self.work -= 1
        slow_step()
        return EngineCoreOutputs(timestamp=time.monotonic())


def test_the_engine_loop_profiles_when_the_knob_is_set(tmp_path, monkeypatch):
    monkeypatch.setenv("RANKSERVE_HOST_PROFILE", str(tmp_path / "host"))
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    try:
        server = EngineServer(core=FakeCore(3), cfg=None, bound=(ctx, sock))
        for _ in range(3):
            server.turn()
        assert not (tmp_path / "host.1").exists()  # the burst goes on
        server.turn()  # idle: the report is written
        text = (tmp_path / "host.1").read_text()
        assert text.startswith("host profile of burst 1: 3 engine steps") and "slow_step" in text
    finally:
        sock.close(0)
        ctx.term()


def test_an_unwritable_path_is_refused_at_start_naming_the_knob(tmp_path):
    with pytest.raises(ConfigError, match="RANKSERVE_HOST_PROFILE=.*cannot write"):
        HostProfile(str(tmp_path / "missing" / "host"))


def test_a_failed_write_later_is_logged_not_raised(tmp_path, caplog):
    prof = HostProfile(str(tmp_path / "host"))
    prof.before_step()
    prof.after_step()
    (tmp_path / "host.1").mkdir()  # the report's path is now a directory
    prof.on_idle()
    assert "cannot write" in caplog.text and prof.prof is None
