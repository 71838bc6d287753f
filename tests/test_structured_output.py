"""Structured output's patterns: the byte DFA against Python's `re`, and JSON
schemas as patterns (the engine holding its outputs to them:
tests/test_structured_engine.py; P/D over HTTP: tests/test_serve_app.py)."""

from __future__ import annotations

import json
import random
import re
import threading
import time

import numpy as np
import pytest

from actors.integer_ranges import integer_range_regex
from actors.json_schema import schema_regex
from actors.json_text import free_json_regex
from actors import dfa_minimise, regex_dfa
from actors.regex_dfa import START, RegexError, choice_regex, compile_regex
from actors.sampling_params import InvalidRequestError, SamplingParams

PATTERNS = [
    r"\d{3}-\d{4}", r"(yes|no|maybe)", r"[A-Z][a-z]*( [A-Z][a-z]*)*", r"-?(0|[1-9]\d*)(\.\d+)?([eE][+-]?\d+)?",
    r'"([^"\\]|\\.)*"', r"[一-龥]{1,3}", r"[^a]", r"\w+@\w+\.com", r"^abc$", r"(?s).a", r"a{0,5}b?", r"[\s\S]",
    r"[^\x00-\x7f]+", r"(?:ab|c)+[^a-z\d]x{2,3}?.é", r"\U0001F600|[\u0800-\uFFFF]",
    # repeats of more than MANY_COPIES copies, each built from its part's own DFA
    r"(?:ab|c){2,12}d", r"(?s)[^a]{9}.?", r"(?:é{9}|[xy]){0,10}\d", r"(?:a|bc)*(?:x|1){9,}",
]
ALPHABET = list("abcxyzAB019 -.\"\\@é一龥\n😀eE+") + [chr(0xFF), chr(0x800), chr(0xFFFF), chr(0x10000)]


def _random_match(dfa, rng: random.Random, max_bytes: int = 60) -> bytes | None:
    """Bytes along a random path of the DFA that ends accepting (None if it did not)."""
    state, out = 1, b""
    for _ in range(max_bytes):
        if dfa.terminal[state] or (dfa.accepting[state] and rng.random() < 0.25):
            break
        state_bytes = [b for b in range(256) if dfa.transitions[state, b]]
        byte = rng.choice(state_bytes)
        out += bytes([byte])
        state = dfa.transitions[state, byte]
    return out if dfa.accepting[state] else None


@pytest.mark.parametrize("pattern", PATTERNS + [r"^yes$|\Ano\Z", r"^a\$|b$", r"(?s)^a.$|^b$"])
def test_the_dfa_matches_what_python_matches(pattern):
    dfa, rng = compile_regex(pattern), random.Random(pattern)
    for _ in range(3000):  # random texts: the same verdict
        text = "".join(rng.choice(ALPHABET) for _ in range(rng.randrange(0, 7)))
        assert dfa.fullmatch(text) == bool(re.fullmatch(pattern, text, re.ASCII)), text
    for _ in range(300):  # the DFA's own matches: UTF-8, and Python's matches too
        data = _random_match(dfa, rng)
        if data is not None:
            assert re.fullmatch(pattern, data.decode(), re.ASCII), data


def test_states_that_no_text_tells_apart_are_one():
    """The minimised DFA: after `a` and after `c` the same texts complete `(ab|cb)`;
    a schema's automaton a fraction of the subset construction's (the states a
    request reaches each cost a walk of the vocabulary)."""
    dfa = compile_regex("ab|cb")
    assert len(dfa.accepting) == 4  # dead, start, before the b, after it
    assert dfa.walk(START, b"a") == dfa.walk(START, b"c") != 0 and dfa.transitions[0].max() == 0
    assert len(compile_regex(schema_regex({})).accepting) < 400  # (1312 before)
    chain = compile_regex("[a-z]{0,300}")  # no two states alike, told apart in 300 rounds: kept as built
    assert len(chain.accepting) == 302 and chain.fullmatch("a" * 300) and not chain.fullmatch("a" * 301)


def _built(pattern: str) -> tuple[np.ndarray, np.ndarray]:
    """The subset construction's automaton of `pattern` (by class of bytes), before merging."""
    built = {}

    def keep(by_class, accepting):
        built["dfa"] = by_class, accepting
        return by_class, accepting
    original, regex_dfa.minimised = regex_dfa.minimised, keep
    try:
        regex_dfa._compile(pattern)
    finally:
        regex_dfa.minimised = original
    return built["dfa"]


SCHEMA = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 3, "maximum": 977},
                                          "b": {"enum": ["x", 2]}}}


@pytest.mark.parametrize("pattern", PATTERNS + [schema_regex({}), free_json_regex(), schema_regex(SCHEMA)])
def test_hashed_rounds_merge_what_the_exact_rounds_merge(pattern):
    """Merging by a hash of each state's blocks (`_hashed_split`) settles on the
    blocks the exact rounds do; blocks a collision would give (here: every state
    one block, and two states of different futures in one) are caught."""
    by_class, accepting = _built(pattern)
    multipliers = np.random.default_rng(0).integers(1, 2**63, by_class.shape[1] + 1, dtype=np.uint64) | 1
    hashed = dfa_minimise._refined(by_class, accepting,
                                   lambda b, _: dfa_minimise._hashed_split(b, by_class, multipliers))
    exact = dfa_minimise._refined(by_class, accepting, lambda b, n: dfa_minimise._split(b, by_class, n))
    pairs = set(zip(hashed.tolist(), exact.tolist()))  # the same blocks, numbered apart: a one-to-one pairing
    assert len(pairs) == len(set(hashed.tolist())) == len(set(exact.tolist()))
    assert dfa_minimise._merges_soundly(exact, by_class, accepting)
    assert not dfa_minimise._merges_soundly(np.zeros_like(exact), by_class, accepting)
    told_apart = [s for s in range(2, len(accepting)) if exact[s] != exact[START] and accepting[s] == accepting[START]]
    if told_apart:
        wrong = exact.copy()
        wrong[wrong == exact[told_apart[0]]] = exact[START]
        assert not dfa_minimise._merges_soundly(wrong, by_class, accepting)


def test_dead_ends_are_the_states_no_accepting_state_can_be_reached_from():
    """`prune_dead`'s search back from the accepting states against the rounds of "leads
    to a live state" it replaced (one round a step of the longest path), on random
    automata: the same transitions kept."""
    rng = np.random.default_rng(5)
    for _ in range(200):
        num_states, num_columns = rng.integers(2, 40), rng.integers(1, 6)
        transitions = rng.integers(0, num_states, (num_states, num_columns)).astype(np.int32)
        transitions[0] = 0
        accepting = rng.random(num_states) < 0.1
        accepting[0] = False
        live = accepting.copy()
        while not (live == (reaches := live[transitions].any(axis=1) | accepting)).all():
            live = reaches
        live[0] = False
        expected = np.where(live[transitions], transitions, 0)
        assert (dfa_minimise.prune_dead(transitions, accepting) == expected).all()


@pytest.mark.parametrize("pattern, message", [
    (r"(a)\1", "backreferences"), (r"(?=a)b", "lookahead"), (r"\bfoo", "anchors"), (r"a^b", "anchors"),
    (r"(?i)abc", "case-insensitive"), ("a(", "not valid"), ("", "non-empty"), (r"a{100000}", "too large"),
    (r"(a|b)*a(a|b){15}", "too complex"), (r"[^\x00-\U0010FFFF]", "matches no text"),
])
def test_patterns_that_cannot_constrain_are_refused_with_the_reason(pattern, message):
    with pytest.raises(RegexError, match=message):
        compile_regex(pattern)
    with pytest.raises(InvalidRequestError, match=message):  # as a request's params say it
        SamplingParams(regex=pattern)


def test_a_choice_is_its_strings_and_nothing_else():
    dfa = compile_regex(choice_regex(["a.b", "yes", "y(e)s?"]))
    assert [dfa.fullmatch(t) for t in ("a.b", "yes", "y(e)s?", "axb", "y", "ye")] == [True] * 3 + [False] * 3


SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer"},
        "score": {"type": ["number", "null"]},
        "tags": {"type": "array", "items": {"enum": ["a", "b", 3]}, "maxItems": 3},
        "home": {"$ref": "#/$defs/Place"},
    },
    "required": ["name", "age"],
    "$defs": {"Place": {"type": "object", "properties": {"city": {"const": "Oslo"}}, "required": ["city"]}},
}


def _valid(doc) -> bool:
    """SCHEMA, checked by hand."""
    if not isinstance(doc, dict) or set(doc) - set(SCHEMA["properties"]) or not {"name", "age"} <= set(doc):
        return False
    return (isinstance(doc["name"], str) and len(doc["name"]) <= 12 and type(doc["age"]) is int
            and (doc.get("score") is None or isinstance(doc["score"], (int, float)))
            and all(t in ("a", "b", 3) for t in doc.get("tags", [])) and len(doc.get("tags", [])) <= 3
            and doc.get("home", {"city": "Oslo"}) == {"city": "Oslo"})


def test_a_schemas_pattern_matches_its_documents_and_only_them():
    dfa = compile_regex(schema_regex(SCHEMA))
    good = [{"name": "Al", "age": 3}, {"name": "Al", "age": -3, "tags": ["a", 3], "home": {"city": "Oslo"}},
            {"name": "", "age": 0, "score": None}, {"name": "x", "age": 1, "score": 2.5e3}]
    bad = [{"age": 3}, {"name": "Al"}, {"name": "Al", "age": 3.5}, {"name": "Al", "age": 3, "extra": 1},
           {"age": 3, "name": "Al"}, {"name": "much too long a name", "age": 3}]
    for doc in good:  # as json.dumps lays it out, and only so
        assert dfa.fullmatch(json.dumps(doc)) and not dfa.fullmatch(json.dumps(doc, separators=(",", ":"))), doc
    for doc in bad:
        assert not dfa.fullmatch(json.dumps(doc)), doc
    rng = random.Random(0)
    for _ in range(300):  # whatever the automaton accepts is JSON the schema allows
        data = _random_match(dfa, rng, max_bytes=200)
        if data is not None:
            assert _valid(json.loads(data)), data


def _same_language(first, second) -> bool:
    """Whether two byte DFAs accept the same texts: every pair of states both reach
    on one text accepts alike and is dead alike (their dead ends pruned)."""
    seen, stack = {(START, START)}, [(START, START)]
    while stack:
        a, b = stack.pop()
        if first.accepting[a] != second.accepting[b] or (a == 0) != (b == 0):
            return False
        for pair in set(zip(first.transitions[a].tolist(), second.transitions[b].tolist())):
            if pair not in seen:
                seen.add(pair)
                stack.append(pair)
    return True


@pytest.mark.parametrize("pattern", [
    r"(?:ab|c){2,12}d", r"(?s)[^a]{9}.?", r"(?:é{9}|[xy]){0,10}\d", r"(?:a|bc)*(?:x|1){9,}", r"(?:a{3}b){9,11}c?",
    r"(?:(?:ab){0,9}c){9}", r"[\s\S]{10}", r"(?:x?){12}", r"(?:a|){10}b", r"(?:😀|\d\d){3,20}",
    schema_regex({"type": "array", "minItems": 2, "maxItems": 12, "items": {"type": "string", "maxLength": 10}}),
    schema_regex({"type": "string", "minLength": 3, "maxLength": 40}),
])
def test_a_repeat_built_from_its_parts_own_automaton_matches_the_same_texts(pattern, monkeypatch):
    """`_Nfa._copier` (more than MANY_COPIES copies) against the copies built from the
    part's NFA: the same language, checked state pair by state pair."""
    copied = regex_dfa._compile(pattern)
    monkeypatch.setattr(regex_dfa, "MANY_COPIES", 10**9)
    assert _same_language(copied, regex_dfa._compile(pattern))
    assert not _same_language(copied, regex_dfa._compile(pattern + "x"))  # (the check tells languages apart)


def test_a_long_strings_length_bounds_are_held_with_one_automaton_state_a_count_and_place():
    """`maxLength` 2000 (clients like it): each count's copy of a JSON string's
    character built from the character's own DFA is as small as merging could make it
    (14 states a count), which the rounds of merging could not reach past a few hundred
    (a maxLength of 250 was refused; two strings of 100 and 500 too). Counted in
    characters of the value: an escape or a character of four UTF-8 bytes is one."""
    dfa = compile_regex(schema_regex({"type": "string", "minLength": 2, "maxLength": 2000}))
    assert len(dfa.accepting) < 14 * 2001 + 10
    for body, ok in [("a" * 2000, True), ("a" * 2001, False), ("😀\\n\\u00e9" * 666 + "xy", True),
                     ("😀\\n\\u00e9" * 667, False), ("é", False), ("é" * 2, True)]:
        assert dfa.fullmatch(f'"{body}"') == ok, body[:12]
    two = compile_regex(schema_regex({"type": "object", "required": ["name", "bio"], "properties": {
        "name": {"type": "string", "maxLength": 100}, "bio": {"type": "string", "maxLength": 500}}}))
    assert two.fullmatch(json.dumps({"name": "n" * 100, "bio": "b" * 500}))
    assert not two.fullmatch(json.dumps({"name": "n" * 100, "bio": "b" * 501}))


def test_a_schema_past_the_automatons_bound_is_refused_saying_why_its_bounds_multiply():
    """Up to 50 strings of up to 100 characters: 50 copies of a string's 1400 states.
    "regex is too complex" alone said nothing to a client that sent no regex."""
    pattern = schema_regex({"type": "array", "maxItems": 50, "items": {"type": "string", "maxLength": 100}})
    with pytest.raises(InvalidRequestError, match="JSON schema's maxLength or maxItems.*nested in each other multiply"):
        SamplingParams(regex=pattern)


def test_compiled_patterns_are_kept_within_a_count_and_a_number_of_states(monkeypatch):
    """A process keeps its latest patterns' automata, the least recently asked for
    dropped first once they pass `MAX_CACHED_STATES` states in all (one at the bound
    holds 15 MB; 64 of them were kept whatever their size) or `MAX_CACHED` patterns."""
    from actors.compile_cache import CompileCache

    monkeypatch.setattr(regex_dfa, "COMPILED", CompileCache(64, 30, lambda dfa: len(dfa.accepting)))
    kept = regex_dfa.COMPILED.keys
    first, second = compile_regex("a{10}"), compile_regex("b{10}")  # 12 states each
    assert kept() == ["a{10}", "b{10}"] and compile_regex("a{10}") is first  # asked for: the latest
    compile_regex("c{10}")
    assert kept() == ["a{10}", "c{10}"]
    assert compile_regex("b{10}") is not second and kept() == ["c{10}", "b{10}"]
    compile_regex("d{40}")  # past the bound alone: kept alone
    assert kept() == ["d{40}"]
    monkeypatch.setattr(regex_dfa, "COMPILED", CompileCache(2, 10**6, lambda dfa: len(dfa.accepting)))
    for pattern in ("x", "y", "z"):
        compile_regex(pattern)
    assert regex_dfa.COMPILED.keys() == ["y", "z"]


def test_threads_asking_for_one_new_pattern_at_once_share_one_compile(monkeypatch):
    """A burst of requests sharing a new schema each compiled it at once, holding
    the GIL in turn (the ingress's event loop waited on all of them); now one
    compiles and the others wait for its automaton, or its error."""
    import concurrent.futures
    import threading
    from actors import compile_cache

    monkeypatch.setattr(regex_dfa, "COMPILED", compile_cache.CompileCache(64, 10**6, lambda dfa: len(dfa.accepting)))
    calls, waiting, original = [], [], regex_dfa._checked_compile

    class CountedFuture(concurrent.futures.Future):
        def result(self, timeout=None):
            waiting.append(1)
            return super().result(timeout)
    monkeypatch.setattr(compile_cache, "Future", CountedFuture)

    def slow_compile(pattern):  # done once the 5 other threads wait for it
        calls.append(pattern)
        deadline = time.monotonic() + 10
        while len(waiting) < 5 and time.monotonic() < deadline:
            time.sleep(0.01)
        return original(pattern)
    monkeypatch.setattr(regex_dfa, "_checked_compile", slow_compile)
    for pattern, good in (("[a-z]{3}", True), ("a(", False)):
        calls.clear()
        waiting.clear()
        results = []

        def ask(pattern=pattern):
            try:
                results.append(compile_regex(pattern))
            except RegexError as exc:
                results.append(exc)
        threads = [threading.Thread(target=ask) for _ in range(6)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(10)
        assert calls == [pattern] and len(waiting) == 5 and len(results) == 6
        assert all(r is results[0] for r in results) if good else all(isinstance(r, RegexError) for r in results)
    calls.clear()
    with pytest.raises(RegexError):  # a refusal is not kept: asked again, compiled again
        compile_regex("a(")
    assert calls == ["a("]


STRING_PATTERNS = [r"^\S+$", r"^.{1,5}$", r"[^@]+@[^@]+\.\w+", r"(?s).{2}", r'^"[a-z]+"$', r"a\\b|c",
                   r"[\s\S]*", r"[^a-z]?x*", r"[\x00-\x1f]{2}", r"(?:é|\n){1,3}"]


@pytest.mark.parametrize("pattern", STRING_PATTERNS)
def test_a_string_pattern_holds_the_value_its_json_text_stands_for(pattern):
    """A pattern speaks of the value; the output is its JSON text, where a quote, a
    backslash and a control character are escaped. `^\\S+$` or `^.{1,5}$` allow a
    quote, so written between the quotes as they stood they were refused (they would
    let the output end its string early). Each character now as json.dumps writes
    it: a value's text matches exactly when the value matches (read with ASCII's
    categories and with Unicode's: `\\S` holds no no-break space, which a client's
    validator reads as a space), and what the automaton accepts is a JSON string
    whose value matches."""
    dfa, rng = compile_regex(schema_regex({"type": "string", "pattern": pattern})), random.Random(pattern)
    whole = pattern.removeprefix("^").removesuffix("$")
    alphabet = ALPHABET + ["\t", "\x01", "\x1f", "\x7f", "/", "\u2028"]
    values = ['a"b', "x\\y", "", "a@b.c", '"ab"', "a\\b", "\n\n"]
    values += ["".join(rng.choice(alphabet) for _ in range(rng.randrange(0, 7))) for _ in range(2000)]
    for value in values:
        matches = bool(re.fullmatch(whole, value, re.ASCII) and re.fullmatch(whole, value))
        assert dfa.fullmatch(json.dumps(value, ensure_ascii=False)) == matches, value
    for _ in range(300):
        data = _random_match(dfa, rng, max_bytes=80)
        if data is not None:
            assert re.fullmatch(whole, json.loads(data), re.ASCII) and re.fullmatch(whole, json.loads(data)), data


def test_a_string_pattern_holds_the_text_between_the_quotes():
    dfa = compile_regex(schema_regex({"type": "string", "pattern": r"^[A-Z]{3}-\d+$"}))
    assert dfa.fullmatch('"ABC-12"') and not dfa.fullmatch('"AB-12"') and not dfa.fullmatch("ABC-12")


def test_integer_ranges_are_every_integer_within_them_as_json_writes_it():
    rng = random.Random(2)
    ranges = [(0, 9), (0, None), (1, None), (-5, 5), (None, 0), (None, -3), (-100, -7), (13, 4567), (None, None),
              (99, 100), (0, 0), (250, 1999)]
    ranges += [(a, a + rng.randrange(5000)) for a in rng.sample(range(-3000, 3000), 30)]
    for low, high in ranges:
        dfa = compile_regex(integer_range_regex(low, high))
        start, stop = (-6000 if low is None else low - 30), (9000 if high is None else high + 30)
        for value in range(start, stop, max(1, (stop - start) // 2000)):
            assert dfa.fullmatch(str(value)) == ((low is None or value >= low) and (high is None or value <= high))
        assert not any(dfa.fullmatch(text) for text in ("-0", "00", "01", "-01", "", "1.0"))


@pytest.mark.parametrize("schema, good, bad", [
    ({"type": "integer", "minimum": 1, "maximum": 5}, ["1", "5", "3"], ["0", "6", "-1", "2.0"]),
    ({"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 10.5}, ["1", "10"], ["0", "11"]),
    ({"type": "number", "minimum": 0, "maximum": 1}, ["0", "0.25", "1", "1.000"], ["1.5", "-0.1", "2", "1e0"]),
    ({"type": "number", "minimum": 0}, ["0", "12345.5"], ["-1"]),
    ({"type": ["integer", "null"], "minimum": 0}, ["null", "7"], ["-7", '"7"']),
    ({"type": "string", "format": "date"}, ['"2024-02-29"', '"1999-12-31"', '"2024-04-30"'],
     ['"2024-13-01"', '"24-01-01"', '"2024-04-31"', '"2024-06-31"', '"2024-09-31"', '"2024-11-31"', '"2023-02-30"']),
    ({"type": "string", "format": "date-time"}, ['"2024-02-29T23:59:59Z"', '"2024-01-01T00:00:00.5+05:30"'],
     ['"2024-01-01T00:00:00"']),
    ({"type": "string", "format": "uuid"}, ['"123e4567-e89b-12d3-a456-426614174000"'], ['"123e4567"']),
    ({"type": "string", "format": "ipv4"}, ['"192.168.0.1"', '"0.0.0.0"'], ['"256.1.1.1"', '"1.2.3"']),
    ({"type": "string", "format": "email"}, ['"a.b+c@ex-ample.co.uk"'], ['"a@b"', '"@b.c"']),
    # Found by a review: without properties, an object was any object whatever these said;
    # a length counted a surrogate pair's two escapes as two characters.
    ({"type": "object", "additionalProperties": {"type": "integer"}}, ['{}', '{"a": 1, "b": 2}'], ['{"a": "x"}']),
    ({"type": "object", "additionalProperties": False}, ['{}'], ['{"a": 1}']),
    ({"type": "string", "minLength": 2}, ['"ab"', '"\\u00e9\\u00e9"'], ['"\\ud83d\\ude00"', '"a"']),
    ({"oneOf": [{"type": "string"}, {"type": "null"}]}, ['"a"', "null"], ["1"]),
    ({"type": "integer", "minimum": 10**400}, ["1" + "0" * 400], ["5"]),  # (math.isfinite raised OverflowError)
    # Found by a review: a $ref's JSON pointer escapes were read as written (a~1b is a/b)
    ({"$ref": "#/$defs/a~1b", "$defs": {"a/b": {"type": "integer"}, "a~1b": {"type": "string"}}}, ["7"], ['"x"']),
    # Found by a review: a definition was found by its name alone (definitions' x read $defs' x)
    ({"$ref": "#/definitions/x", "definitions": {"x": {"type": "integer"}}, "$defs": {"x": {"type": "string"}}},
     ["7"], ['"x"']),
    # Found by a review: a lone half of a surrogate pair as an escape is no Unicode text;
    # anchors were cut from the pattern's text (`\$` lost its `$`; alternatives kept theirs)
    ({"type": "string"}, ['"\\ud83d\\ude00"', '"\\u00e9"'], ['"hi \\ud83d"', '"\\ude00"', '"\\ud83d\\u0041"']),
    ({"type": "string", "pattern": r"^[0-9]+\$"}, ['"12$"'], ['"12"']),
    ({"type": "string", "pattern": r"^yes$|^no$"}, ['"yes"', '"no"'], ['"yesno"', '"y"']),
    ({"type": "string", "pattern": r"^$"}, ['""'], ['"a"']),
    ({"type": "string", "pattern": r"^[$^|]+$"}, ['"$|^"'], ['""']),
    # Found by a review: the pattern's writer read anchors the automaton drops (\A, \Z, ^ after a global flag)
    ({"type": "string", "pattern": r"\Aab\Z"}, ['"ab"'], ['"abc"']),
    ({"type": "string", "pattern": r"(?s)^a.c$"}, ['"a\\nc"', '"abc"', '"a\\"c"'], ['"ac"', '"abbc"']),
    # A pattern or format with length bounds (each was refused): its own lengths within them, or its one part
    # of varying length a character repeated, narrowed (pydantic's constr(pattern=..., min_length, max_length))
    ({"type": "string", "pattern": r"^[a-z0-9_]+$", "minLength": 3, "maxLength": 8}, ['"abc"', '"abcdefgh"'],
     ['"ab"', '"abcdefghi"', '"a-b"']),
    ({"type": "string", "pattern": r"^[A-Z][a-z]*$", "maxLength": 4}, ['"Abcd"', '"A"'], ['"Abcde"', '"abc"']),
    ({"type": "string", "pattern": r"^(x(\w+))$", "minLength": 3, "maxLength": 4}, ['"xab"', '"xabc"'],
     ['"xa"', '"xabcd"']),
    ({"type": "string", "pattern": r"^\S+$", "maxLength": 3}, ['"a\\"b"', '"\\\\"'], ['"abcd"', '""']),
    ({"type": "string", "pattern": r"^[A-Z]{3}-\d{4}$", "maxLength": 10}, ['"ABC-1234"'], ['"AB-1234"']),
    ({"type": "string", "format": "uuid", "minLength": 36, "maxLength": 36},
     ['"123e4567-e89b-12d3-a456-426614174000"'], ['"123e4567"']),
    # Found by a review: \S, [^\s], \W and \D let through what Unicode's categories hold (a no-break space, an
    # ideographic one, an Arabic-Indic digit), which Python's re, pydantic and ECMA-262 read as \s, \w or \d
    ({"type": "string", "pattern": r"^\S+$"}, ['"ab"', '"é"'], ['"a\u00a0b"', '"\u3000"', '"a\u2028b"']),
    ({"type": "string", "pattern": r"^[^\s,]+$"}, ['"ab"'], ['"a\u00a0b"', '"a,b"', '"\ufeff"']),
    ({"type": "string", "pattern": r"^\W+$"}, ['"-+"'], ['"é"', '"_"', '"\u0663"']),
    ({"type": "string", "pattern": r"^\D+$"}, ['"ab"'], ['"1"', '"\u0663"']),
    ({"type": "string", "pattern": r"^[\s\S]+$"}, ['"\u00a0x"'], ['""']),
    # Found by a review: a lone surrogate (JSON's "\ud800") in an option or a name was dropped: never written
    ({"enum": ["\ud800", "ok"]}, ['"\\ud800"', '"ok"'], ['""']),
    ({"type": "object", "properties": {"\udc00": {"type": "integer"}}, "required": ["\udc00"]},
     ['{"\\udc00": 1}'], ['{}']),
])
def test_bounds_formats_and_type_lists(schema, good, bad):
    dfa = compile_regex(schema_regex(schema))
    assert [dfa.fullmatch(t) for t in good + bad] == [True] * len(good) + [False] * len(bad)


def test_any_json_object_parses():
    dfa, rng = compile_regex(free_json_regex()), random.Random(1)
    assert dfa.fullmatch('{"a": [1, {"b": null}], "c": "d"}') and not dfa.fullmatch("[1]")
    for _ in range(300):
        data = _random_match(dfa, rng, max_bytes=200)
        if data is not None:
            assert isinstance(json.loads(data), dict), data


@pytest.mark.parametrize("schema, message", [
    ({"type": "array", "uniqueItems": True}, "uses uniqueItems"),
    # Found by a review: each was accepted and not held to (or, the last, an OverflowError: a 500)
    ({"type": "object", "required": ["a"]}, "not in properties"),
    ({"type": ["object", "null"], "required": ["a"]}, "not in properties"),
    ({"oneOf": [{"type": "number"}, {"type": "integer"}]}, "may both match a value"),
    ({"oneOf": [{"const": "a"}, {"enum": ["b", "a"]}]}, "may both match a value"),
    # Found by a review: an option of `properties` (or `items`) and no type matches every string (or null) too
    ({"oneOf": [{"properties": {"a": {"type": "integer"}}}, {"type": "string"}]}, "may both match a value"),
    ({"oneOf": [{"items": {"type": "integer"}}, {"type": "null"}]}, "may both match a value"),
    ({"type": "strin"}, r"at type: 'strin' is not one of \['array', "),
    # not schemas at all (the meta-schema's complaints; each was a TypeError, a 500 over HTTP)
    ({"$defs": 5}, "at \\$defs: 5 is not of type 'object'"), ({"type": "string", "format": []}, "at format: "),
    ({"type": "object", "required": "a"}, "at required: 'a' is not of type 'array'"),
    ({"type": "array", "minItems": True}, "at minItems: True is not of type 'integer'"),
    # schemas no output could match
    ({"type": "integer", "enum": ["a"]}, "not of type integer: no output could match"),
    ({"type": ["number", "null"], "enum": [1, True]}, "value true is not of type number or null"),
    ({"type": "string", "const": 3}, "const value 3 is not of type string"),
    ("{", "not valid JSON"), ({"$ref": "#/$defs/X"}, "not a definition"),
    ({"properties": {"a": {"$ref": "#/$defs/A"}}, "$defs": {"A": {"$ref": "#/$defs/A"}}}, "recursive"),
    ({"type": "object", "properties": {}, "required": ["a"]}, "not in properties"),
    ({"type": "string", "format": "hostname"}, "format 'hostname' is not supported"),
    ({"type": "integer", "multipleOf": 2}, "uses multipleOf"),
    ({"type": "integer", "minimum": 5, "maximum": 4}, "allows no integer"),
    ({"type": "number", "minimum": -1}, "a number's bounds"),
    ({"type": "number", "maximum": 0.5, "minimum": 0}, "a number's bounds"),
    ({"type": "integer", "minimum": float("inf")}, "must be a finite number"),  # JSON's Infinity, as Python reads it
    ({"type": ["integer", "null"], "maxLength": 3}, "uses maxLength"),
    ({"type": "string", "pattern": "^a(?=b)"}, "lookahead"), ({"type": "string", "pattern": "a("}, "not valid"),
    ({"type": "string", "pattern": "^(ab)+$", "maxLength": 6}, "one part of it varies in length"),
    ({"type": "string", "format": "email", "maxLength": 254}, "own lengths lie within them"),
    ({"type": "string", "pattern": "^[A-Z]{3}$", "minLength": 5}, "no value matches both"),
    ({"type": "string", "pattern": "^a{2,4}$", "minLength": 5}, "no value matches both"),
    # Found by a review: Infinity as a const (1e400 in a body) was the pattern `Infinity`, no JSON;
    # 1 and 1.0 are one value, which two oneOf options naming them both match
    ({"type": "object", "properties": {"v": {"const": float("inf")}}, "required": ["v"]}, "not finite"),
    ({"enum": [1, float("-inf")]}, "not finite"), ('{"enum": [NaN]}', "not valid JSON"),
    ('{"const": 1e400}', "not valid JSON"),
    ({"oneOf": [{"enum": [1, "a"]}, {"const": 1.0}]}, "may both match a value"),
    # Found by a review: each was an AttributeError or a TypeError (a 500)
    ({"$schema": 5, "type": "string"}, r"\$schema must be a string"),
    ({"$schema": "http://json-schema.org/draft-03/schema#", "type": "object", "properties": {}, "required": True},
     "drafts 4, 6, 7, 2019-09 and 2020-12 are supported"),
    ({"$schema": "http://json-schema.org/draft-07/schema#", "$defs": 5, "type": "string"},
     r"\$defs must be an object of schemas"),
    ({"$schema": "http://json-schema.org/draft-04/schema#", "type": "integer", "minimum": 5, "exclusiveMinimum": True},
     "exclusiveMinimum must be a finite number \\(draft 4's true/false form is not supported"),
    # Found by a review: its $ref read the root's definition of that name, not its own
    ({"$defs": {"x": {"type": "string"}}, "type": "object", "required": ["a"], "properties": {"a": {
        "$id": "https://example.com/a", "$defs": {"x": {"type": "integer"}}, "$ref": "#/$defs/x"}}},
     "a subschema with its own \\$id and definitions"),
])
def test_schemas_it_cannot_hold_an_output_to_are_refused(schema, message):
    with pytest.raises(RegexError, match=message):
        schema_regex(schema)


def test_an_objects_optional_members_may_each_be_left_out_in_order():
    """Every in-order choice of members that keeps the required ones, and no
    other; each member written once (one alternative per member that could come
    first repeated the rest: 22 optional properties passed the automaton's bounds)."""
    rng = random.Random(3)
    for _ in range(40):
        required = [rng.random() < 0.3 for _ in range(rng.randrange(1, 6))]
        names = [f"k{i}" for i in range(len(required))]
        schema = {"type": "object", "properties": {n: {"const": i} for i, n in enumerate(names)},
                  "required": [n for n, r in zip(names, required) if r]}
        dfa = compile_regex(schema_regex(schema))
        for mask in range(2 ** len(names)):
            kept = [i for i in range(len(names)) if mask >> i & 1]
            doc = json.dumps({names[i]: i for i in kept})
            assert dfa.fullmatch(doc) == all(i in kept for i, r in enumerate(required) if r), (required, doc)
            assert len(kept) < 2 or not dfa.fullmatch(json.dumps({names[i]: i for i in reversed(kept)}))
    many = {"type": "object", "properties": {f"field_{i}": {"type": ["string", "null"]} for i in range(60)}}
    assert compile_regex(schema_regex(many)).fullmatch('{"field_3": null, "field_59": "x"}')


def _nested(depth: int, wrap) -> dict:
    schema = {"type": "string"}
    for _ in range(depth):
        schema = wrap(schema)
    return schema


@pytest.mark.parametrize("schema", [
    _nested(25, lambda s: {"type": "array", "items": s}),
    _nested(25, lambda s: {"type": "object", "additionalProperties": s}),
    {"$defs": {f"d{i}": {"type": "object", "properties": {"a": {"$ref": f"#/$defs/d{i - 1}"},
                                                          "b": {"$ref": f"#/$defs/d{i - 1}"}}}
               for i in range(1, 30)} | {"d0": {"type": "string"}}, "$ref": "#/$defs/d29"},
    # wide: 3000 properties, each a reference to one 150k-character definition (2 GB before it was refused)
    {"$defs": {"D": _nested(11, lambda s: {"type": "array", "items": s})}, "type": "object",
     "properties": {f"p{i}": {"$ref": "#/$defs/D"} for i in range(3000)}},
])
def test_a_small_schema_whose_pattern_doubles_at_each_level_is_refused_as_it_is_written(schema):
    """An array or a map writes its item's pattern twice: an 800-byte schema of
    arrays 25 deep wrote a pattern of gigabytes (a worker killed for memory), 16
    deep took 19 s to be refused by the automaton's bounds. An object joined its
    properties' patterns before its own length was read."""
    import tracemalloc

    assert len(json.dumps(schema)) < 200_000
    tracemalloc.start()
    try:
        with pytest.raises(RegexError, match="json_schema is too large"):
            schema_regex(schema)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 64 * 2**20  # (the wide one peaked at 2.1 GB)


def test_a_requests_compiles_share_one_budget():
    """Found by a review: each compile was bounded, their number not (an
    892-byte schema of twelve string patterns: 25 compiles, 8 s of CPU before
    its 400). Within `request_work` the compiles not found cached share one
    budget; outside it each is bounded alone, and a pattern cached costs nothing."""
    tag = f"w{time.monotonic_ns()}"  # (patterns no earlier test compiled)
    patterns = [f"{tag}x{i}[ab]*a[ab]{{9}}" for i in range(3)]  # (about 60k work each: 1026 states)
    with regex_dfa.request_work(total=150_000):
        regex_dfa.compile_regex(patterns[0])
        regex_dfa.compile_regex(patterns[1])
        regex_dfa.compile_regex(patterns[0])  # (cached)
        with pytest.raises(regex_dfa.RequestWorkSpent, match="too complex to compile quickly together"):
            regex_dfa.compile_regex(patterns[2])
    regex_dfa.compile_regex(patterns[2])  # (no request's budget)
    schema = {"type": "object", "properties": {f"f{i}": {"type": "string", "pattern": f"{tag}y{i}[ab]*a[ab]{{9}}"}
                                               for i in range(4)}}
    with regex_dfa.request_work(total=150_000), pytest.raises(regex_dfa.RequestWorkSpent):
        schema_regex(schema)


def test_a_thread_that_waited_for_a_compile_over_its_makers_budget_compiles_it_itself():
    from actors.compile_cache import CompileCache, MakersOwn

    cache, started, calls = CompileCache(4), threading.Event(), []

    def make(key):
        calls.append(threading.current_thread().name)
        if len(calls) == 1:
            started.set()
            time.sleep(0.2)  # (the other thread waits for it meanwhile)
            raise MakersOwn("over the first caller's budget")
        return key.upper()

    first = threading.Thread(target=lambda: pytest.raises(MakersOwn, cache.get, "k", make), name="first")
    first.start()
    started.wait(5)
    assert cache.get("k", make) == "K" and calls == ["first", "MainThread"]
    first.join(5)
