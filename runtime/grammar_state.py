"""Which structured-output masks are known not to change from one step to the next.

Most of a JSON document's tokens are the inside of a string, and there a row's mask stays the
same while its fill is the costly kind (~50 us a row on one CPU core: the tokens that contain a
quote depend on the whole parse stack). xgrammar writes a JSON string's body as one
tail-recursive rule,

    basic_string_sub ::= (("\\"") | ([^\\0-\\x1f\\"\\\\\\r\\n] basic_string_sub) | ("\\\\" E basic_string_sub))

so from the state "at the start of that rule" (the only state in the parser's last step,
predicted where the text ends), a token made only of characters of the middle alternative's
class (no quote, no backslash, no control character, whole UTF-8 characters) can only take that
alternative, character by character, and ends at the start of the same rule, one call deeper in
a chain of tail calls: the text the grammar still accepts after it is the same, and so is the
mask (a function of what may follow). `StructuredOutputManager` keeps such a row and copies it
instead of filling it again; `tests/test_structured_output_reuse.py` checks every reused row
against a fresh fill.

The state is read from xgrammar's debug print of the matcher (its format is not an API: if it
does not parse as below, or the string rule is not written as above, nothing is reused).
"""
from __future__ import annotations

import re

import numpy as np

_NAME = r"([A-Za-z0-9_]+)"
# the string-body rule, any name (\1) and escape rule; an optional lookahead after it
_STRING_RULE = re.compile(
    "^" + _NAME + re.escape(' ::= (("\\"") | ([^\\0-\\x1f\\"\\\\\\r\\n] ') + r"\1"
    + re.escape(') | ("\\\\" ') + _NAME + " " + r"\1" + re.escape("))") + r"( \(=.*\))?$")
_STATE = re.compile(r"ParserState\(rule_id=(-?\d+), sequence_id=-?\d+, element_id=-?\d+, "
                    r"rule_start_pos=(-?\d+), sub_element_id=(-?\d+)\)")


def string_rules(compiled) -> frozenset[int]:
    """Ids of the compiled grammar's JSON-string-body rules (a rule's id is its line in the
    grammar's print)."""
    lines = str(compiled.grammar).splitlines()
    return frozenset(i for i, line in enumerate(lines) if _STRING_RULE.match(line))


def plain_tokens(decoded_vocab: list[bytes], special: set[int], vocab_size: int) -> np.ndarray:
    """Per token id: whether its bytes are whole UTF-8 characters, none of them a quote, a
    backslash or a control character (< 0x20): those a JSON string body takes as they are."""
    plain = np.zeros(vocab_size, dtype=bool)
    for i, b in enumerate(decoded_vocab[:vocab_size]):
        if not b or i in special:
            continue
        try:
            text = b.decode("utf-8")
        except UnicodeDecodeError:
            continue
        plain[i] = all(c >= " " and c not in '"\\' for c in text)
    return plain


def token_lengths(decoded_vocab: list[bytes], vocab_size: int) -> np.ndarray:
    """Bytes of each token as the matcher reads them (its positions count bytes)."""
    out = np.zeros(vocab_size, dtype=np.int64)
    n = min(len(decoded_vocab), vocab_size)
    out[:n] = [len(b) for b in decoded_vocab[:n]]
    return out


def at_string_start(matcher, rules: frozenset[int], num_bytes: int) -> bool:
    """Whether the matcher's only state is a string-body rule predicted at the end of the text
    (`num_bytes` accepted so far) with no character half read."""
    if not rules:
        return False
    text = matcher._debug_print_internal_state()
    last = text.rpartition("Last step:")[2]
    states = _STATE.findall(last)
    if len(states) != 1 or last.count("ParserState(") != 1:
        return False
    rule, start, sub = (int(x) for x in states[0])
    return rule in rules and start == num_bytes and sub == 0
