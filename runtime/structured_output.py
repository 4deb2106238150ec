"""Structured outputs (constrained decoding) with xgrammar, on rank 0.

Design: on the engine loop `check` does only the cheap checks; `submit` hands the parse
(regex / EBNF / JSON schema → xgrammar Grammar: seconds for a deeply nested schema) and the
costly part (building the per-token mask tables against the vocabulary) to a thread pool, where
an invalid constraint fails its request (`LLM.generate` parses with `validate` first, so it
raises before anything is queued); futures are cached by (kind, spec) so a repeated schema
compiles once. Until its future is done the request stays in the waiting queue and the scheduler skips it (others are
scheduled meanwhile). Then it gets a GrammarMatcher (`RequestGrammar`, kept on the Request). Each
step the scheduler fills one bitmask row per constrained request that samples; the rows travel in
the step plan to the sampling rank, and the sampled token is accepted into the matcher in
`Scheduler.update`.
"""
from __future__ import annotations

import collections
import concurrent.futures
import json
import os
import re
import threading
import time

import numpy as np

from . import envs
from .grammar_state import at_string_start, plain_tokens, string_rules, token_lengths
from .json_schema_check import UnsupportedSchema, check_schema
from .sampling_params import StructuredOutputsParams

MAX_WHITESPACE = 64  # a JSON whitespace run longer than this is never useful (and could loop)
CACHE_SIZE = 256


MAX_FILL_THREADS = 16  # a node-wide affinity (MPI without binding) must not mean 100+ threads


def fill_threads() -> int:
    """Threads of xgrammar's batched mask fill: RANKSERVE_GRAMMAR_THREADS, else the CPUs this
    process may run on less two (the engine loop's thread, and one spare), at most 16. The fill
    is on the step's critical path whenever it takes as long as the forward (W1 on an H200:
    ~6 ms a step either way), so it gets the cores the loop does not use; xgrammar's own default
    (half the node's CPU count, not the job's) gives it half of them, or far too many under
    Slurm or in a container."""
    n = envs.get("RANKSERVE_GRAMMAR_THREADS")
    if n is None:
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        n = min(cpus - 2, MAX_FILL_THREADS)
    return max(1, n)


def _clean(err: Exception) -> str:
    """xgrammar errors start with a C++ timestamp and source location: keep the message."""
    msg = str(err).strip()
    return re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", msg).replace("Check failed: (error.empty()) is false: ", "")


# xgrammar 0.2.9 writes a JSON string with minLength / maxLength as `"\"" [^"\\\r\n]{m,n} "\""`
# (its own rule for other strings excludes \0-\x1f and allows escapes): raw control characters
# such as a tab get through, which no JSON parser accepts, and escapes do not. The mended class:
# one JSON string character, an escape counting as one as JSON Schema counts it.
_LOOSE_CHAR = '[^\\"\\\\\\r\\n]'
_JSON_CHAR = ('([^\\0-\\x1f\\"\\\\] | "\\\\" [\\"\\\\/bfnrt] '
              '| "\\\\u" [0-9a-fA-F] [0-9a-fA-F] [0-9a-fA-F] [0-9a-fA-F])')


def _json_strings(grammar):
    """The grammar with xgrammar's loose length-bounded string characters mended (see above)."""
    import xgrammar as xgr
    ebnf = str(grammar)
    if _LOOSE_CHAR not in ebnf:
        return grammar
    return xgr.Grammar.from_ebnf(ebnf.replace(_LOOSE_CHAR, _JSON_CHAR))


def parse_grammar(so: StructuredOutputsParams):
    """The xgrammar Grammar for a constraint; JSON ones (schemas, also inside structural tags)
    with their strings mended (_json_strings). A user's own regex or grammar stays as written."""
    _check_schemas(so)
    g = _parse_grammar(so)
    try:
        return _json_strings(g) if so.kind in ("json", "json_object", "structural_tag") else g
    except RuntimeError as e:  # (a grammar xgrammar wrote but cannot read back)
        raise ValueError(f"invalid structured_outputs.{so.kind}: {_clean(e)}") from None


def _check_schemas(so: StructuredOutputsParams) -> None:
    """ValueError if a JSON schema of the constraint uses a keyword the grammar would not
    enforce (json_schema_check.py); in a structural tag, every "schema" / "json_schema" value."""
    kind = so.kind
    if kind not in ("json", "structural_tag"):
        return
    try:
        spec = json.loads(getattr(so, kind)) if isinstance(getattr(so, kind), str) else so.json
    except ValueError:
        return  # not JSON: the parse below names the error
    try:
        if kind == "json":
            check_schema(spec)
        else:
            for schema in _tag_schemas(spec):
                check_schema(schema)
    except UnsupportedSchema as e:
        raise ValueError(f"invalid structured_outputs.{kind}: {e}") from None


def _tag_schemas(value):
    if isinstance(value, dict):
        for k, v in value.items():
            if k in ("schema", "json_schema") and isinstance(v, dict):
                yield v
            else:
                yield from _tag_schemas(v)
    elif isinstance(value, list):
        for v in value:
            yield from _tag_schemas(v)


def _parse_grammar(so: StructuredOutputsParams):
    """The xgrammar Grammar for a constraint; ValueError naming the problem if it is invalid."""
    import xgrammar as xgr
    kind = so.kind
    try:
        if kind in ("json", "json_object"):  # json_object: an object (not any JSON value)
            schema = '{"type": "object"}' if kind == "json_object" else (
                so.json if isinstance(so.json, str) else json.dumps(so.json))
            return xgr.Grammar.from_json_schema(schema, any_whitespace=not so.disable_any_whitespace,
                                                max_whitespace_cnt=MAX_WHITESPACE)
        if kind == "regex":
            return xgr.Grammar.from_regex(so.regex)
        if kind == "choice":
            if not so.choice:
                raise ValueError("the list of choices is empty")
            # literal characters, not \u escapes: EBNF reads a surrogate pair as two characters
            return xgr.Grammar.from_ebnf("root ::= " + " | ".join(json.dumps(c, ensure_ascii=False)
                                                                  for c in so.choice))
        if kind == "grammar":
            if "::=" not in so.grammar and re.search(r"^\s*\??\w+\s*:", so.grammar, re.M):
                raise ValueError("this is a Lark grammar (`rule: ...`); only EBNF / GBNF grammars "
                                 "are supported (`root ::= ...`)")
            return xgr.Grammar.from_ebnf(so.grammar)
        tag = json.loads(so.structural_tag)
        if isinstance(tag, dict) and "structures" in tag:  # vLLM's older {structures, triggers} form
            items = [xgr.StructuralTagItem(begin=s["begin"], schema=json.dumps(s["schema"]), end=s["end"])
                     for s in tag["structures"]]
            return xgr.Grammar.from_structural_tag(items, tag["triggers"])
        return xgr.Grammar.from_structural_tag(so.structural_tag)
    except KeyError as e:
        raise ValueError(f"invalid structured_outputs.{kind}: missing field {e}") from None
    except (RuntimeError, ValueError, TypeError) as e:
        raise ValueError(f"invalid structured_outputs.{kind}: {_clean(e)}") from None


def vocab_type_of(vocab: dict[str, int]):
    """How the vocabulary spells bytes, from the vocabulary itself: <0x0A>-style byte tokens
    (SentencePiece byte fallback), GPT-2 byte-level letters (Ġ for a space, Ċ for a newline), or
    plain strings."""
    import xgrammar as xgr
    if "<0x0A>" in vocab:
        return xgr.VocabType.BYTE_FALLBACK
    if "Ċ" in vocab or "Ġ" in vocab:
        return xgr.VocabType.BYTE_LEVEL
    return xgr.VocabType.RAW


def tokenizer_info(tok, vocab_size: int, stop_token_ids: list[int] | None):
    """xgrammar's view of the tokenizer. Its detection reads the tokenizer object, whose class
    differs across transformers versions; where it disagrees with the vocabulary, the
    vocabulary wins (a byte-level vocabulary read as plain strings lets a newline token into a
    JSON string: seen on the GPU machine's transformers 5.17)."""
    import xgrammar as xgr
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab_size, stop_token_ids=stop_token_ids)
    vocab = tok.get_vocab()
    kind = vocab_type_of(vocab)
    if info.vocab_type == kind:
        return info
    encoded = [""] * vocab_size
    for token, idx in vocab.items():
        if idx < vocab_size:
            encoded[idx] = token
    return xgr.TokenizerInfo(encoded, vocab_type=kind, vocab_size=vocab_size,
                             stop_token_ids=info.stop_token_ids,
                             add_prefix_space=info.add_prefix_space if kind == xgr.VocabType.BYTE_FALLBACK else False)


def _spec_key(so: StructuredOutputsParams) -> tuple:
    kind = so.kind
    spec = getattr(so, kind)
    if kind == "json" and not isinstance(spec, str):
        spec = json.dumps(spec, sort_keys=True)
    return kind, spec if not isinstance(spec, list) else tuple(spec), so.disable_any_whitespace


class RequestGrammar:
    """A request's constraint state (lives on the Request as `req.grammar`).

    `num_seen` counts the output tokens already given to `accept`. Under async scheduling a
    request's next mask is filled before the engine has processed its previous token, so that
    token is accepted at fill time (`StructuredOutputManager.catch_up`) and `Scheduler.update`
    only reads the verdict (`failed`)."""

    def __init__(self, so: StructuredOutputsParams, future: concurrent.futures.Future):
        self.future = future
        self.matcher = None  # set once compiled
        self.active = so.start_after_token_id is None  # constrained from the first output token?
        self.start_after = so.start_after_token_id
        self.opener = so.reasoning_start_token_id if not self.active else None
        self.num_seen = 0
        self.failed = False  # a token the grammar rejects (the mask makes it impossible)
        self.string_rules: frozenset[int] = frozenset()  # (grammar_state.py) set with the matcher
        self.num_bytes: int | None = 0  # of text the matcher has read (its positions count bytes)
        self.row: np.ndarray | None = None  # the mask of the matcher's current state, when known

    @property
    def ready(self) -> bool:
        return self.matcher is not None

    @property
    def choosing(self) -> bool:
        """At the first output token, which may open the reasoning (`opener`) or begin the
        constrained answer: its mask is the grammar's plus the opener."""
        return not self.active and self.num_seen == 0 and self.opener is not None

    @property
    def masked(self) -> bool:
        return self.active or self.choosing

    def begin(self, token: int) -> None:
        """Before a token is accepted: a first token other than the opener begins the answer."""
        if self.choosing and token != self.opener:
            self.active = True

    def accept(self, token: int) -> bool:
        """Advance over a sampled token; False if the grammar rejects it."""
        self.begin(token)
        self.num_seen += 1
        if not self.active:
            self.active = token == self.start_after
            return True
        self.row, self.num_bytes = None, None  # (position no longer known: rows always filled)
        ok = self.failed is False and self.matcher.accept_token(token)
        self.failed = not ok
        return ok

    @property
    def terminated(self) -> bool:
        return self.active and self.matcher.is_terminated()


class _Walk:
    """A matcher's walk through a request's drafts (`StructuredOutputManager._draft_rows`): the
    request's grammar state as it would be after them, the matcher itself aside."""

    def __init__(self, g: RequestGrammar, drafts: list[int], at: int):
        self.g, self.drafts, self.at = g, drafts, at
        self.active, self.seen, self.known = g.active, g.num_seen, g.row
        self.taken = 0  # drafts the matcher accepted (rolled back after)
        self.done = False

    def end(self, rows: np.ndarray, r: int) -> None:
        """Rows r.. of its drafts are never read: full."""
        rows[r:self.at + 1 + len(self.drafts)] = -1
        self.done = True


# Building a compiler (tokenizer load, xgrammar's vocabulary tables, the per-token tables of
# grammar_state) takes seconds with a 150k vocabulary; an engine made again in the same process
# (tests, notebooks, `LLM` re-created) reuses the last few. They are read-only once built, and
# xgrammar's GrammarCompiler is thread-safe (the pool threads of one manager share it already).
_COMPILERS: collections.OrderedDict[tuple, tuple] = collections.OrderedDict()
_COMPILERS_LOCK = threading.Lock()


def _compiler_state(tokenizer_path: str, model_dir: str, vocab_size: int,
                    trust_remote_code: bool = False) -> tuple:
    """(tokenizer_info, stop ids, plain tokens, token byte lengths, GrammarCompiler)."""
    key = (os.path.realpath(tokenizer_path), os.path.realpath(model_dir), vocab_size)
    with _COMPILERS_LOCK:
        if key in _COMPILERS:
            _COMPILERS.move_to_end(key)
            return _COMPILERS[key]
        import xgrammar as xgr
        from .inputs import eos_token_ids_of, load_tokenizer
        tok = load_tokenizer(tokenizer_path, trust_remote_code)
        if tok is None:
            raise ValueError("structured outputs need a tokenizer; this model has none")
        stop = eos_token_ids_of(tok, model_dir)
        info = tokenizer_info(tok, vocab_size, stop or None)
        stop_ids = set(info.stop_token_ids)
        vocab = info.decoded_vocab
        plain = plain_tokens(vocab, stop_ids | set(info.special_token_ids), vocab_size).tolist()
        token_bytes = token_lengths(vocab, vocab_size).tolist()
        state = _COMPILERS[key] = (info, stop_ids, plain, token_bytes,
                                   xgr.GrammarCompiler(info, max_threads=2, cache_enabled=False))
        if len(_COMPILERS) > 4:
            _COMPILERS.popitem(last=False)
        return state


class StructuredOutputManager:
    def __init__(self, tokenizer_path: str, model_dir: str, vocab_size: int, max_workers: int = 2,
                 trust_remote_code: bool = False):
        self.tokenizer_path = tokenizer_path
        self.trust_remote_code = trust_remote_code
        self.model_dir = model_dir
        self.vocab_size = vocab_size  # the logits' width: may exceed the tokenizer's vocabulary
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers, thread_name_prefix="grammar")
        # mask fills that overlap the engine's host work (one at a time: steps are ordered)
        self.fill_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="grammar-fill")
        self._lock = threading.Lock()
        self._compiler = None
        self._batch = None  # xgrammar BatchGrammarMatcher, made on first use
        self._stop_ids: set[int] = set()
        # compiled grammars by constraint (xgrammar's own cache is off: it has no bound), held
        # to RANKSERVE_GRAMMAR_CACHE_MB (a compiled grammar's token tables: ~14 MiB at 150k tokens)
        self.cache: collections.OrderedDict[tuple, concurrent.futures.Future] = collections.OrderedDict()
        self.cache_bytes = envs.get("RANKSERVE_GRAMMAR_CACHE_MB") << 20
        self._valid: collections.OrderedDict[tuple, None] = collections.OrderedDict()  # parsed fine
        # cumulative seconds (SchedulerStats): compiling; filling masks and accepting tokens
        # (mask = fill + accept, on the grammar thread or the engine's); the engine loop waiting
        # for a fill (the part of it the step did not hide)
        self.compile_seconds = 0.0
        self.fill_seconds = 0.0
        self.accept_seconds = 0.0
        self.wait_seconds = 0.0
        # rows of a step: filled by xgrammar, or copied from the step before (grammar_state.py)
        self.reuse_masks = envs.get("RANKSERVE_GRAMMAR_REUSE_MASKS")
        self.rows_filled = 0
        self.rows_reused = 0
        self.tokenizer_info = None  # xgrammar's, with the compiler
        self._plain: list[bool] = []
        self._token_bytes: list[int] = []

    @property
    def mask_seconds(self) -> float:
        return self.fill_seconds + self.accept_seconds

    def _get_compiler(self):
        with self._lock:  # first use builds it (a tokenizer load: ~1 s), in a pool thread
            if self._compiler is None:
                (self.tokenizer_info, self._stop_ids, self._plain, self._token_bytes,
                 self._compiler) = _compiler_state(self.tokenizer_path, self.model_dir, self.vocab_size,
                                                   self.trust_remote_code)
            return self._compiler

    def _compile(self, so: StructuredOutputsParams):
        t0 = time.perf_counter()
        try:
            compiled = self._get_compiler().compile_grammar(parse_grammar(so))
            return compiled, string_rules(compiled) if self.reuse_masks else frozenset()
        finally:
            with self._lock:
                self.compile_seconds += time.perf_counter() - t0

    @staticmethod
    def check(so: StructuredOutputsParams) -> None:
        """The cheap checks (one constraint; no keyword the grammar would not enforce), for the
        engine loop: parsing may take seconds (a deeply nested schema), so it is left to the
        compilation on a grammar thread, where an invalid constraint fails its request."""
        _ = so.kind
        _check_schemas(so)

    def validate(self, so: StructuredOutputsParams) -> None:
        """Parse the constraint (ValueError if invalid), once per constraint (`LLM.generate`,
        before it queues anything): a W1-like batch repeats a few schemas."""
        key = _spec_key(so)
        if key in self._valid:
            self._valid.move_to_end(key)
            return
        parse_grammar(so)
        self._valid[key] = None
        if len(self._valid) > CACHE_SIZE:
            self._valid.popitem(last=False)

    def submit(self, so: StructuredOutputsParams) -> RequestGrammar:
        """Start (or reuse) the compilation; the request waits until it is done."""
        key = _spec_key(so)
        fut = self.cache.get(key)
        if fut is None or (fut.done() and fut.exception() is not None):
            fut = self.cache[key] = self.pool.submit(self._compile, so)
        self.cache.move_to_end(key)
        self._evict()
        return RequestGrammar(so, fut)

    def _evict(self) -> None:
        """Drop the oldest grammars (but the newest) past CACHE_SIZE or `cache_bytes`; requests
        hold their own. A grammar still compiling counts 0 bytes until the next call."""
        def size(f):
            ok = f.done() and not f.cancelled() and f.exception() is None
            return f.result()[0].memory_size_bytes if ok else 0
        sizes = {k: size(f) for k, f in self.cache.items()}
        total = sum(sizes.values())
        for k in list(self.cache)[:-1]:
            if total <= self.cache_bytes and len(self.cache) <= CACHE_SIZE:
                break
            total -= sizes[k]
            del self.cache[k]

    def init_matcher(self, g: RequestGrammar, eos_token_id: int | None) -> None:
        """Called once `g.future` is done; raises the compilation error if it failed."""
        import xgrammar as xgr
        compiled, g.string_rules = g.future.result()
        stop = None
        if eos_token_id is not None and eos_token_id not in self._stop_ids:
            stop = sorted(self._stop_ids | {eos_token_id})  # EOS only where the grammar may end
        g.matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=stop)

    def fill_bitmask(self, grammars: list[RequestGrammar], out=None,
                     drafts: list[list[int]] | None = None) -> np.ndarray:
        """Rows of allowed-token bits (int32 words) for this step, written into `out` (an int32
        tensor of as many rows: the runner's pinned buffer, so the rows go to the device
        without another host copy) or a new array: one row per matcher, or with `drafts`
        (speculative decoding) 1 + len(drafts[i]) rows for matcher i, the mask of each verified
        position (`_draft_rows`). A matcher that has ended or failed gets a full row: its
        request finishes when the engine sees the token that ended it, and whatever this step
        samples for it is dropped. A row whose mask is known (`g.row`: inside a JSON string, see
        grammar_state.py) is copied, not filled."""
        import torch
        import xgrammar as xgr
        t0 = time.perf_counter()
        sizes = [1] * len(grammars) if drafts is None else [1 + len(d) for d in drafts]
        at = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(int).tolist()  # row 0 of each
        n = sum(sizes)
        mask = out if out is not None else torch.empty((n, (self.vocab_size + 31) // 32), dtype=torch.int32)
        if self._batch is None:  # fills the rows on several threads, without the GIL
            self._batch = xgr.BatchGrammarMatcher(fill_threads())
        live, fill = [], []
        for i, g in enumerate(grammars):  # (a known row is a string's: neither ended nor failed)
            if not g.masked:  # not begun (reasoning): free; planned anyway, as under async
                continue  # scheduling the token that begins it may be accepted only just now
            if g.row is not None or (not g.failed and not g.matcher.is_terminated()):
                live.append(i)
                if g.row is None:
                    fill.append(i)
        rows = mask.numpy()
        if fill:
            self._batch.batch_fill_next_token_bitmask([grammars[i].matcher for i in fill], mask,
                                                      [at[i] for i in fill] if len(fill) < n else None)
        for i in live:
            g = grammars[i]
            if g.row is not None:  # the state's mask is known: an earlier step filled it
                rows[at[i]] = g.row
            elif g.string_rules and at_string_start(g.matcher, g.string_rules, g.num_bytes):
                g.row = rows[at[i]].copy()
        for i in live:  # (after the rows kept for reuse: the opener is allowed once)
            if grammars[i].choosing:
                op = grammars[i].opener
                rows.view(np.uint32)[at[i], op >> 5] |= np.uint32(1 << (op & 31))
        self.rows_filled += len(fill)
        self.rows_reused += len(live) - len(fill)
        if len(live) < len(grammars):  # through numpy: the runner's buffer is an inference tensor
            rows[sorted(at[i] for i in set(range(len(grammars))) - set(live))] = -1  # (made in its step)
        walks = [(g, drafts[i], at[i]) for i, g in enumerate(grammars) if sizes[i] > 1]
        if walks:
            self._draft_rows(walks, mask, rows)
        self.fill_seconds += time.perf_counter() - t0
        return rows

    def _draft_rows(self, walks: list[tuple[RequestGrammar, list[int], int]], mask, rows: np.ndarray) -> None:
        """For each (grammar, drafts, row of its current state, already filled): the rows after
        it, the mask after each draft. The matchers are walked through the drafts, a batched
        accept and fill per draft position, then rolled back: the tokens the step accepts are
        given to them once, in `Scheduler.update`. A draft the grammar rejects is not allowed
        by the row before it, so the verify step stops there and the rows after it are never
        read (full rows); past the grammar's end (a stop token accepted) the same: the request
        ends at that token. Inside a JSON string a plain token keeps the row (grammar_state.py);
        before a reasoning ends the rows are free, as the request's own are."""
        import xgrammar as xgr
        state = [_Walk(g, d, at) for g, d, at in walks]
        for j in range(max(len(d) for _, d, _ in walks)):
            step, fill = [], []
            for w in state:
                if w.done or j >= len(w.drafts):
                    continue
                g, tok, r = w.g, w.drafts[j], w.at + 1 + j
                if not w.active and w.seen == 0 and g.opener is not None and tok != g.opener:
                    w.active = True  # the first token, not the opener: begins the answer
                w.seen += 1
                if w.active and not g.failed and not g.matcher.is_terminated():
                    step.append(w)
                elif w.active:
                    w.end(rows, r)
                else:  # reasoning: free, until the token that begins the answer
                    w.active, w.known = tok == g.start_after, None
                    if not w.active:
                        rows[r] = -1
                    elif g.matcher.is_terminated():
                        w.end(rows, r)
                    else:
                        fill.append((g, r))
            oks = xgr.BatchGrammarMatcher.batch_accept_token(
                [w.g.matcher for w in step], [w.drafts[j] for w in step]) if step else []
            for w, ok in zip(step, oks):
                r = w.at + 1 + j
                if not ok:
                    w.end(rows, r)
                    continue
                w.taken += 1
                if w.known is not None and self._plain[w.drafts[j]]:
                    rows[r] = w.known
                    self.rows_reused += 1
                elif w.g.matcher.is_terminated():
                    w.end(rows, r)
                else:
                    w.known = None
                    fill.append((w.g, r))
            if fill:
                self._batch.batch_fill_next_token_bitmask([g.matcher for g, _ in fill], mask,
                                                          [r for _, r in fill])
                self.rows_filled += len(fill)
        for w in state:
            if w.taken:
                w.g.matcher.rollback(w.taken)

    def accept(self, pairs: list[tuple[RequestGrammar, int]]) -> None:
        """Feed sampled tokens to their matchers (the active ones in one xgrammar call)."""
        import xgrammar as xgr
        t0 = time.perf_counter()
        batch = []
        for g, tok in pairs:
            g.begin(tok)
            if g.active and not g.failed:
                batch.append((g, tok))
            else:
                g.accept(tok)
        if batch:
            oks = xgr.BatchGrammarMatcher.batch_accept_token([g.matcher for g, _ in batch],
                                                             [t for _, t in batch])
            plain, size = self._plain, self._token_bytes
            for (g, tok), ok in zip(batch, oks):
                g.num_seen += 1
                g.failed = not ok
                if g.num_bytes is not None:
                    g.num_bytes += size[tok]
                if not (ok and plain[tok]):  # a plain token: the string goes on, same mask
                    g.row = None
        self.accept_seconds += time.perf_counter() - t0

    def accept_runs(self, runs: list[tuple[RequestGrammar, list[int]]]) -> list[int]:
        """Feed each matcher its tokens of a step (speculative decoding: the accepted drafts,
        then the sampled token), a batched `accept` per position. A matcher stops at the token
        that ends the grammar or that it rejects; returns how many tokens each one read (the
        request's output stops there)."""
        used = [0] * len(runs)
        for k in range(max((len(t) for _, t in runs), default=0)):
            idx = [i for i, (g, toks) in enumerate(runs) if len(toks) > k and used[i] == k
                   and not g.failed and not g.terminated]
            if not idx:
                break
            self.accept([(runs[i][0], runs[i][1][k]) for i in idx])
            for i in idx:
                used[i] += 1
        return used

    def wait_any(self, grammars: list[RequestGrammar], timeout: float) -> None:
        concurrent.futures.wait([g.future for g in grammars], timeout, concurrent.futures.FIRST_COMPLETED)

    def shutdown(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.fill_pool.shutdown(wait=False, cancel_futures=True)
