"""Mask rows reused inside JSON strings (runtime/grammar_state.py): every row the manager hands
out equals a fresh xgrammar fill of the same matcher, over random walks through the bench's
schemas and harder ones, with the real Qwen3 tokenizer; and most string rows are reused."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import SHARED, STORIES_EMBEDDED
from rankserve.runtime.bench.throughput import SCHEMAS
from rankserve.runtime.grammar_state import plain_tokens
from rankserve.runtime.sampling_params import StructuredOutputsParams
from rankserve.runtime.structured_output import StructuredOutputManager

QWEN3 = SHARED / "tokenizers" / "qwen3"
VOCAB = 151936
HARD = [  # nesting, free keys, escapes met in strings, bounded and patterned strings, enums
    {"type": "object", "properties": {
        "a": {"type": "array", "items": {"type": "object", "properties": {"k": {"type": "string"}}}},
        "code": {"type": "string", "pattern": "[a-z]{2,5}"},
        "short": {"type": "string", "maxLength": 6},
        "kind": {"enum": ["x\"y", "plain"]}}, "required": ["a", "short"]},
    {"type": "array", "items": {"type": "string"}, "minItems": 2},
]


@pytest.fixture(scope="module")
def manager():
    if not QWEN3.exists():
        pytest.skip("../shared/tokenizers/qwen3 not present")
    m = StructuredOutputManager(str(QWEN3), str(QWEN3), VOCAB)
    yield m
    m.shutdown()


def new_grammar(m, so, eos=151645):
    g = m.submit(so)
    g.future.result()
    m.init_matcher(g, eos)
    return g


def allowed(row: np.ndarray, vocab: int = VOCAB) -> np.ndarray:
    return np.flatnonzero(np.unpackbits(row.view(np.uint8), bitorder="little")[:vocab])


def test_reused_rows_equal_fresh_fills(manager):
    fuzz(manager, VOCAB, 151645)


@pytest.mark.parametrize("name", ["llama3", "stories"])
def test_reused_rows_equal_fresh_fills_other_vocabularies(name):
    """Llama 3's byte-level vocabulary, and a SentencePiece one with byte fallback (its
    tokens may start with a space: the matcher's byte count must still agree)."""
    path, size = (SHARED / "tokenizers" / "llama3", 128256) if name == "llama3" else (STORIES_EMBEDDED, 512)
    if not path.exists():
        pytest.skip(f"{path} not present")
    m = StructuredOutputManager(str(path), str(path), size)
    try:
        fuzz(m, size, None, *((50, 0.3) if name == "llama3" else (120, 0.05)))
    finally:
        m.shutdown()


def fuzz(manager, size: int, eos, steps: int = 70, min_reused: float = 0.3):
    """Random walks of 16 matchers; every row the manager gives equals a fresh fill, and at
    least `min_reused` of the rows were reused."""
    sos = [StructuredOutputsParams(json=s) for s in SCHEMAS + HARD] + [StructuredOutputsParams(json_object=True)]
    manager._get_compiler()
    info = manager.tokenizer_info
    vocab = info.decoded_vocab
    quote = np.array([b'"' in b for b in vocab])  # tokens that may end a string
    escape = np.array([b"\\" in b for b in vocab])
    wide = np.array([any(c > 127 for c in b) for b in vocab])  # multi-byte, possibly partial
    rng = np.random.default_rng(0)
    gs = [new_grammar(manager, sos[i % len(sos)], eos) for i in range(16)]
    fresh = torch.zeros((len(gs), (size + 31) // 32), dtype=torch.int32)
    filled0, reused0, checked = manager.rows_filled, manager.rows_reused, 0
    for step in range(steps):
        rows = manager.fill_bitmask(gs)
        pairs = []
        for i, g in enumerate(gs):
            if g.matcher.is_terminated():
                gs[i] = new_grammar(manager, sos[int(rng.integers(len(sos)))], eos)
                continue
            g.matcher.fill_next_token_bitmask(fresh, i)
            assert np.array_equal(rows[i], fresh[i].numpy()), f"step {step} row {i}"
            checked += 1
            ok = allowed(rows[i], size)
            r = rng.random()  # mostly string text, often a quote, sometimes escapes or UTF-8
            for pick in ((r < 0.15) & quote, (r > 0.9) & escape, (0.8 < r <= 0.9) & wide):
                cand = ok[pick[ok]]
                if len(cand):
                    ok = cand
                    break
            pairs.append((g, int(rng.choice(ok))))
        manager.accept(pairs)
        assert not any(g.failed for g, _ in pairs)
    reused = manager.rows_reused - reused0
    assert reused > min_reused * (manager.rows_filled - filled0 + reused) and checked > 10 * steps


def test_plain_tokens():
    vocab = [b"abc", b' "', b"a\\n", b"\xe6\x97", b"\xe6\x97\xa5", b"\n", b"", b"<stop>", b" x"]
    assert plain_tokens(vocab, {7}, 10).tolist() == [True, False, False, False, True, False, False,
                                                     False, True, False]


@pytest.mark.parametrize("reuse", ["1", "0"])
def test_string_rows_reused_unless_turned_off(manager, monkeypatch, reuse):
    from transformers import AutoTokenizer
    monkeypatch.setenv("RANKSERVE_GRAMMAR_REUSE_MASKS", reuse)
    m = StructuredOutputManager(str(QWEN3), str(QWEN3), VOCAB)
    m._compiler, m._plain, m._token_bytes = manager._compiler, manager._plain, manager._token_bytes
    g = new_grammar(m, StructuredOutputsParams(json=SCHEMAS[0]))
    m.fill_bitmask([g])
    # '{"notes": [" ' then six plain tokens inside the string: each of their rows is reused
    ids = AutoTokenizer.from_pretrained(str(QWEN3)).encode('{"notes": ["hello world and the data of')
    for t in ids:
        m.accept([(g, t)])
        m.fill_bitmask([g])
    assert m.rows_reused + m.rows_filled == len(ids) + 1
    assert m.rows_reused == (len(ids) - 4 if reuse == "1" else 0)
    m.shutdown()


def test_bench_rows_profile(tmp_path):
    """`bench.grammar --rows`: per-row fill times by state; the reuse finds unchanged masks."""
    import json
    from rankserve.runtime.bench.grammar import main
    if not QWEN3.exists():
        pytest.skip("../shared/tokenizers/qwen3 not present")
    out = tmp_path / "rows.json"
    assert main(["--tokenizer", str(QWEN3), "--rows", "--num-seqs", "6", "--steps", "40",
                 "--output-json", str(out)]) == 0
    r = json.loads(out.read_text())[0]
    assert r["rows"] == 240 and 0 < r["reused"] <= r["same_as_previous"] and r["string_us"] > 0


def compare_reuse(model_dir, monkeypatch, n: int, max_tokens: int) -> tuple[list, int]:
    """Token ids of `n` seeded requests at temperature 1 with the row reuse on and off (they
    must be equal), and the rows reused."""
    import functools

    import rankserve
    from rankserve import SamplingParams
    LLM = functools.partial(rankserve.LLM, **({"num_gpu_blocks_override": 512}
                                              if torch.cuda.is_available() else {}))
    sps = [SamplingParams(temperature=1.0, seed=s, max_tokens=max_tokens,
                          structured_outputs=StructuredOutputsParams(json=SCHEMAS[s % len(SCHEMAS)]))
           for s in range(n)]
    outs, reused = {}, {}
    for flag in ("1", "0"):
        monkeypatch.setenv("RANKSERVE_GRAMMAR_REUSE_MASKS", flag)
        llm = LLM(str(model_dir), max_num_seqs=n)
        outs[flag] = [o.outputs[0] for o in llm.generate(["Give me a record:"] * n, sps)]
        reused[flag] = llm.engine.structured.rows_reused
    assert [o.token_ids for o in outs["1"]] == [o.token_ids for o in outs["0"]] and reused["0"] == 0
    return outs["1"], reused["1"]


def test_outputs_identical_with_and_without_reuse(qwen3_chat_dir, monkeypatch):
    """Through `LLM` (async scheduling, the grammar thread): the token ids with reused rows are
    those of filling every row, and rows were reused."""
    _, reused = compare_reuse(qwen3_chat_dir, monkeypatch, 6, 40)
    assert reused > 10


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_outputs_identical_with_and_without_reuse_cuda(qwen3_chat_dir, monkeypatch):
    """On CUDA (rows written into the pinned buffer, xgrammar's mask kernel), a larger batch:
    the same tokens either way, and every finished document is valid JSON of its schema."""
    import json

    import jsonschema
    outs, reused = compare_reuse(qwen3_chat_dir, monkeypatch, 48, 96)
    assert reused > 100
    for i, o in enumerate(outs):
        if o.finish_reason == "stop":
            jsonschema.validate(json.loads(o.text), SCHEMAS[i % len(SCHEMAS)])
