"""The per-step mask fill of structured outputs: in place into the runner's buffer, the thread
count, and the step loop's wait for a fill on the grammar thread (counted, not pickled)."""
from __future__ import annotations

import concurrent.futures
import pickle
import time

import numpy as np
import pytest
import torch

from conftest import STORIES_EMBEDDED
from rankserve.runtime.sampling_params import StructuredOutputsParams
from rankserve.runtime.scheduler import SchedulerOutput
from rankserve.runtime.structured_output import StructuredOutputManager, fill_threads

VOCAB = 512


@pytest.fixture(scope="module")
def manager():
    m = StructuredOutputManager(str(STORIES_EMBEDDED), str(STORIES_EMBEDDED), VOCAB)
    yield m
    m.shutdown()


def grammars(m, n):
    out = []
    for i in range(n):
        g = m.submit(StructuredOutputsParams(regex="[0-9]{2,4}" if i % 2 else "(yes|no)"))
        g.future.result()
        m.init_matcher(g, 2)
        out.append(g)
    return out


@pytest.mark.parametrize("inference_buffer", [False, True])
def test_fill_in_place_matches_a_fresh_fill(manager, inference_buffer):
    """`inference_buffer`: the runner makes its pinned buffer inside its inference-mode step,
    and the grammar thread fills it outside inference mode (a full row once crashed there)."""
    gs = grammars(manager, 5)
    gs[3].failed = True  # a failed (or ended) matcher gets a full row
    fresh = manager.fill_bitmask(gs)
    with torch.inference_mode(inference_buffer):
        buf = torch.zeros((8, (VOCAB + 31) // 32), dtype=torch.int32)
    t0 = manager.fill_seconds
    rows = manager.fill_bitmask(gs, buf[:5])
    assert rows.ctypes.data == buf.data_ptr()  # written where the runner copies from
    assert np.array_equal(rows, fresh) and (rows[3] == -1).all() and not (rows[0] == -1).all()
    assert not buf[5:].any() and manager.fill_seconds > t0


def test_fill_threads_knob(monkeypatch):
    monkeypatch.setenv("RANKSERVE_GRAMMAR_THREADS", "3")
    assert fill_threads() == 3
    monkeypatch.delenv("RANKSERVE_GRAMMAR_THREADS")
    assert fill_threads() >= 1
    monkeypatch.setenv("RANKSERVE_GRAMMAR_THREADS", "x")
    with pytest.raises(ValueError, match="RANKSERVE_GRAMMAR_THREADS"):
        fill_threads()


def test_waiting_for_a_background_fill_is_counted_and_the_plan_still_pickles(manager):
    pool = concurrent.futures.ThreadPoolExecutor(1)
    rows = np.full((1, 16), 7, dtype=np.int32)

    def slow():
        time.sleep(0.05)
        return rows
    plan = SchedulerOutput(grammar_req_ids=["a"], grammar_stats=manager,
                           grammar_fill=lambda background=False, out=None: pool.submit(slow))
    before = manager.wait_seconds
    plan.fill_async()
    assert plan.bitmask() is rows
    assert manager.wait_seconds - before >= 0.04
    sent = pickle.loads(pickle.dumps(plan))  # to other ranks: the rows, not the manager
    assert np.array_equal(sent.grammar_bitmask, rows) and sent.grammar_stats is None
    pool.shutdown()


def test_validate_parses_each_constraint_once(manager, monkeypatch):
    """`LLM.generate` validates every request twice and W1 repeats three schemas: parse once per
    constraint; an invalid one is parsed (and refused) every time."""
    from rankserve.runtime import structured_output
    calls = []
    real = structured_output.parse_grammar
    monkeypatch.setattr(structured_output, "parse_grammar", lambda so: calls.append(so) or real(so))
    ok = StructuredOutputsParams(json={"type": "object", "properties": {"v": {"type": "string"}}})
    for _ in range(3):
        manager.validate(ok)
        with pytest.raises(ValueError, match="regex"):
            manager.validate(StructuredOutputsParams(regex="(unclosed"))
    assert len(calls) == 4


def test_compiled_grammar_cache_is_bounded_in_bytes(monkeypatch):
    """Many different schemas (each user's own) must not grow the process without bound: a
    compiled grammar holds ~14 MiB of token tables with a 150k vocabulary, and both caches kept
    them (xgrammar's compiler cache without a limit, ours 256 of them: 3.5 GiB). Ours is held
    to RANKSERVE_GRAMMAR_CACHE_MB, oldest first; xgrammar's is off (ours serves the repeats)."""
    monkeypatch.setenv("RANKSERVE_GRAMMAR_CACHE_MB", "1")
    m = StructuredOutputManager(str(STORIES_EMBEDDED), str(STORIES_EMBEDDED), VOCAB)
    try:
        m.cache_bytes = 0  # (this vocabulary's grammars are a few KiB: hold the newest alone)
        for i in range(4):
            g = m.submit(StructuredOutputsParams(json={"type": "object", "required": [f"k{i}"],
                                                       "properties": {f"k{i}": {"type": "integer"}}}))
            g.future.result()
            m.init_matcher(g, 2)
            assert g.matcher.accept_string('{"k%d": 1}' % i)
        m.submit(StructuredOutputsParams(regex="x")).future.result()
        assert len(m.cache) == 1 and m._compiler.get_cache_size_bytes() == 0
    finally:
        m.shutdown()
