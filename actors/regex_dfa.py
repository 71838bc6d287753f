"""A regular expression as a DFA over UTF-8 bytes: what constrained decoding walks.

A request's `regex` (SGLang's, vLLM's `guided_regex`; a choice list or a JSON schema
becomes one, actors/structured_output.py) must be matched whole by its output. The
tokens of a byte-level BPE tokenizer are byte strings, not characters (one
character of CJK text may be split over two tokens), so the automaton reads bytes:
each character a pattern names becomes its UTF-8 bytes, and a character class (with
`.` and the negated ones) becomes the UTF-8 byte ranges of its code points, split so
each alternative is a product of byte ranges (the split RE2 and Rust's regex crate
make; surrogates excluded).

Python's own parser reads the pattern (`re._parser`, `sre_parse` before 3.11), so
the syntax and its errors are Python's. Then a Thompson NFA, the subset
construction over the classes of bytes no edge tells apart, and the states no text
tells apart merged (actors/dfa_minimise.py: a schema's automaton a few times smaller, any
JSON object's 2679 states 305). Its semantics are
`re.fullmatch` with `re.ASCII`: `\\d`, `\\w`, `\\s` match ASCII only (outlines and
xgrammar draw the same line), `.` every character but a newline (every one under
`(?s)`); a JSON schema's `pattern`, which the client's validator reads with
Unicode's categories, holds only what both readings match (`class_ranges`).
What cannot be a finite automaton, or would match other text than Python
does, is refused with the reason: backreferences, lookarounds, word boundaries,
anchors other than at the two ends, case-insensitive matching, possessive
repeats. A pattern whose automaton has more than `MAX_STATES` states once merged
is refused too (its transitions, 512 bytes a state, are held by the ingress and
each worker a request visits), and one whose subset construction passes
`MAX_BUILT_STATES` or `MAX_WORK` before merging (its time).

A repeat of many copies (`x{0,1000}`: a JSON schema's `maxLength`, `maxItems`) is
built from its part's own merged DFA, one copy of its states a count
(`_Nfa._copier`), not from the part's NFA: the subset construction then builds
about the merged automaton itself (a JSON string of at most 1000 characters: 14
states a character, 14,004 in all, 0.5 s), where built from the NFA it made about
twice the states and left them to merging, whose rounds grow with the chain's
length and stop short of it (a bound of 5000 states then refused any string of
more than about 185 characters; clients like a `maxLength` of 2000, which is now
28,004 states). xgrammar met the same blow-up (`[a-z]{2,20000}` slow to compile)
and added a repetition expression to its grammars (its PR #368); llama.cpp turns a
repetition of more than 2000 into an unbounded one, so it lets through text longer
than the schema allows, which Tandem never does: past `MAX_STATES` it refuses.

The DFAs of a process's latest patterns are kept (`compile_regex`; the ingress and
each worker a request visits compile a pattern once), at most `MAX_CACHED` of them
and `MAX_CACHED_STATES` states in all: a pattern at the bound holds 15 MB. A
pattern is compiled once at a time (actors/compile_cache.py).

States: 0 is dead (nothing can follow), 1 the start. Transitions that lead only to
dead states go to 0, so a live state can still be completed, and a state is
`terminal` when it accepts and nothing may follow.
"""

from __future__ import annotations

import functools
import re
import unicodedata
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

import numpy as np

from actors.code_points import MAX_CODE_POINT, byte_set_sequences, complement, merged
from actors.compile_cache import CompileCache, MakersOwn
from actors.dfa_minimise import DEAD, START, minimised, prune_dead
from actors.regex_anchors import unanchored
from actors.sampling_params import InvalidRequestError

try:
    import re._constants as sre
    import re._parser as sre_parse
except ImportError:  # Python 3.10
    import sre_constants as sre  # noqa: F401
    import sre_parse

MAX_STATES = 30_000  # of the automaton kept (its states merged): 15 MB of transitions (int16) at most
MAX_BUILT_STATES = 60_000  # of the subset construction's, before merging
MAX_NFA_STATES = 100_000  # bounds what counted repeats expand to
MANY_COPIES = 8  # a repeat of more copies is built from its part's own DFA (`_Nfa._copier`)
MAX_WORK = 3_000_000  # NFA states visited by the subset construction: about a second of it at most
MAX_REQUEST_WORK = 2 * MAX_WORK  # by every compile one request asks for (`request_work`),
STATE_WORK = 32  # each state built counted as this much more (merging them costs about as much as building)
MAX_CACHED = 64  # compiled patterns a process keeps,
MAX_CACHED_STATES = 120_000  # and their states in all (60 MB of transitions)
COPIES_HINT = (" (a counted repeat, such as a JSON schema's maxLength or maxItems, is a copy of its part a count, "
               "and repeats nested in each other multiply)")


class RegexError(InvalidRequestError):
    """A pattern that is not valid, or that Tandem cannot constrain an output to."""


class RequestWorkSpent(RegexError, MakersOwn):
    """A request's compiles together past `MAX_REQUEST_WORK` (`request_work`):
    another request waiting for the same pattern compiles it itself."""


_work_left: ContextVar[list[int] | None] = ContextVar("tandem_regex_work_left", default=None)


@contextmanager
def request_work(total: int = MAX_REQUEST_WORK):
    """Within it, the compiles not found cached share `total` work (each is
    bounded by `MAX_WORK` alone too): one request's patterns, a JSON schema's
    every string `pattern`, a batch's regexes. Each compile was bounded, their
    number not: an 892-byte schema of twelve patterns took 25 compiles and 8 s
    of CPU before its 400, and a 2 MiB body could ask for thousands."""
    token = _work_left.set([total])
    try:
        yield
    finally:
        _work_left.reset(token)


@dataclass(frozen=True, eq=False)
class ByteDfa:
    transitions: np.ndarray  # int16 [states, 256]: the next state; 0 dead
    accepting: np.ndarray  # bool [states]
    by_class: np.ndarray  # int16 [states, classes]: the same, a column a class of bytes no edge tells apart

    @functools.cached_property
    def terminal(self) -> np.ndarray:
        """bool [states]: accepting, and no byte may follow."""
        return self.accepting & (self.transitions == DEAD).all(axis=1)

    def walk(self, state: int, data: bytes) -> int:
        """The state after `data` from `state` (0 once dead)."""
        transitions = self.transitions
        for byte in data:
            state = int(transitions[state, byte])
            if state == DEAD:
                return DEAD
        return state

    def fullmatch(self, text: str) -> bool:
        return bool(self.accepting[self.walk(START, text.encode())])


COMPILED: CompileCache[ByteDfa] = CompileCache(MAX_CACHED, MAX_CACHED_STATES, lambda dfa: len(dfa.accepting))


def compile_regex(pattern: str) -> ByteDfa:
    """The pattern's DFA (kept: `COMPILED`); RegexError when it cannot be one."""
    if not isinstance(pattern, str) or not pattern:
        raise RegexError("regex must be a non-empty string")
    return COMPILED.get(pattern, _checked_compile)


def _checked_compile(pattern: str) -> ByteDfa:
    try:
        return _compile(pattern)
    except RecursionError:
        raise RegexError("regex is nested too deeply") from None


def parse_whole(pattern: str) -> tuple[list, bool]:
    """Python's parse of `pattern` as matched whole: its items, less a `^` (`\\A`)
    first and a `$` (`\\Z`) last, its alternatives' too (`unanchored`), and
    whether `(?s)` holds for it all."""
    try:
        parsed = sre_parse.parse(unanchored(pattern), 0)
    except (sre.error, OverflowError) as exc:
        raise RegexError(f"regex is not valid: {exc}") from None
    flags = parsed.state.flags
    if flags & (sre.SRE_FLAG_IGNORECASE | sre.SRE_FLAG_LOCALE):
        raise RegexError("regex: case-insensitive matching ((?i)) is not supported")
    items = list(parsed)
    if items[:1] in ([(sre.AT, sre.AT_BEGINNING)], [(sre.AT, sre.AT_BEGINNING_STRING)]):
        items = items[1:]
    if items[-1:] in ([(sre.AT, sre.AT_END)], [(sre.AT, sre.AT_END_STRING)]):
        items = items[:-1]
    return items, bool(flags & sre.SRE_FLAG_DOTALL)


def _compile(pattern: str) -> ByteDfa:
    items, dotall = parse_whole(pattern)
    nfa = _Nfa(dotall)
    start, end = nfa.sequence(items)
    dfa = _determinise(nfa, start, end)
    if not dfa.accepting.any():
        raise RegexError("regex matches no text")
    return dfa


def choice_regex(choices: list[str]) -> str:
    """A pattern matching exactly one of `choices` (vLLM's guided_choice). A string
    is refused: iterated, `"yes"` was the choices y, e and s (`structured_outputs`
    passes its `choice` as given)."""
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
        raise RegexError("choice must be a non-empty list of non-empty strings")
    return "|".join(f"(?:{re.escape(c)})" for c in choices)


# ---- pattern -> NFA ------------------------------------------------------------------

_ASCII_CATEGORIES = {
    sre.CATEGORY_DIGIT: [(48, 57)],
    sre.CATEGORY_SPACE: [(9, 13), (32, 32)],
    sre.CATEGORY_WORD: [(48, 57), (65, 90), (95, 95), (97, 122)],
}
_NEGATED_CATEGORIES = {sre.CATEGORY_NOT_DIGIT: sre.CATEGORY_DIGIT, sre.CATEGORY_NOT_SPACE: sre.CATEGORY_SPACE,
                       sre.CATEGORY_NOT_WORD: sre.CATEGORY_WORD}


@functools.cache
def _any_dialects(category) -> list[tuple[int, int]]:
    """The code points some regex dialect's Unicode `\\d`, `\\s` or `\\w` matches
    (Python's, Rust's as pydantic's validators use it, ECMA-262's): each
    dialect's set within these, their complements hold only what every dialect
    leaves out. Read once, from the Unicode database (about a second)."""
    def member(code_point: int) -> bool:
        char = chr(code_point)
        if category is sre.CATEGORY_DIGIT:
            return char.isdecimal()
        if category is sre.CATEGORY_SPACE:
            return char.isspace() or code_point in (0xFEFF, 0x180E)  # (ECMA's BOM; Unicode 4's Mongolian space)
        return (char.isalnum() or char == "_" or code_point in (0x200C, 0x200D)
                or unicodedata.category(char) in ("Mn", "Mc", "Me", "Pc", "Nl", "No"))

    ranges, start = [], None
    for code_point in range(MAX_CODE_POINT + 2):
        inside = code_point <= MAX_CODE_POINT and member(code_point)
        if inside and start is None:
            start = code_point
        elif not inside and start is not None:
            ranges.append((start, code_point - 1))
            start = None
    return ranges


class _Nfa:
    """States are list indexes; each has byte edges (a frozenset of bytes, a target)
    and epsilon edges."""

    def __init__(self, dotall: bool) -> None:
        self.dotall = dotall
        self.byte_edges: list[list[tuple[frozenset[int], int]]] = []
        self.epsilon: list[list[int]] = []

    def state(self) -> int:
        if len(self.epsilon) >= MAX_NFA_STATES:
            raise RegexError(f"regex is too large: its counted repeats expand past {MAX_NFA_STATES} automaton states"
                             + COPIES_HINT)
        self.byte_edges.append([])
        self.epsilon.append([])
        return len(self.epsilon) - 1

    def sequence(self, items) -> tuple[int, int]:
        start = end = self.state()
        for op, av in items:
            first, last = self.item(op, av)
            self.epsilon[end].append(first)
            end = last
        return start, end

    def item(self, op, av) -> tuple[int, int]:
        if op in CHARACTER_OPS:
            return self.code_points(character_ranges(op, av, self.dotall))
        if op is sre.SUBPATTERN:
            _group, add_flags, del_flags, items = av
            if add_flags & (sre.SRE_FLAG_IGNORECASE | sre.SRE_FLAG_LOCALE):
                raise RegexError("regex: case-insensitive matching ((?i)) is not supported")
            if (add_flags | del_flags) & sre.SRE_FLAG_DOTALL:
                raise RegexError("regex: (?s) is supported only for the whole pattern")
            return self.sequence(items)
        if op is sre.BRANCH:
            start, end = self.state(), self.state()
            for items in av[1]:
                first, last = self.sequence(items)
                self.epsilon[start].append(first)
                self.epsilon[last].append(end)
            return start, end
        if op in (sre.MAX_REPEAT, sre.MIN_REPEAT):  # greedy or lazy: the same set of matches
            low, high, items = av
            return self.repeat(items, low, None if high == sre.MAXREPEAT else high)
        if op is sre.AT:
            raise RegexError("regex: anchors and word boundaries are supported only as ^ at the start and $ at the end "
                             "(of the pattern or of each of its top-level alternatives)")
        if op in (sre.GROUPREF, sre.GROUPREF_EXISTS):
            raise RegexError("regex: backreferences are not supported")
        if op in (sre.ASSERT, sre.ASSERT_NOT):
            raise RegexError("regex: lookahead and lookbehind are not supported")
        raise RegexError(f"regex: {str(op).lower()} is not supported")

    def repeat(self, items, low: int, high: int | None) -> tuple[int, int]:
        copies = low + (1 if high is None else high - low)
        copy = self._copier(items) if copies > MANY_COPIES else functools.partial(self.sequence, items)
        start = end = self.state()
        for _ in range(low):
            first, last = copy()
            self.epsilon[end].append(first)
            end = last
        if high is None:  # a loop: zero or more further copies
            first, last = copy()
            self.epsilon[end].append(first)
            self.epsilon[last].append(first)
            tail = self.state()
            self.epsilon[end].append(tail)
            self.epsilon[last].append(tail)
            return start, tail
        exit_ = self.state()  # optional copies, nested: x{0,3} as (x(x(x)?)?)?
        for _ in range(high - low):
            first, last = copy()
            self.epsilon[end] += [first, exit_]
            end = last
        self.epsilon[end].append(exit_)
        return start, exit_

    def _copier(self, items):
        """A way to add a copy of `items`: their own DFA (merged), whose states become
        this NFA's. The subset construction then meets no choice inside a copy, so a
        counted repeat's automaton is built about as small as it merges, which its
        rounds of merging could not reach (a JSON string's `maxLength`: a chain of
        copies each told apart from the next only by its distance to the end)."""
        part = _Nfa(self.dotall)
        dfa = _determinise(part, *part.sequence(items))
        edges = [[(frozenset(np.nonzero(row == target)[0].tolist()), int(target))
                  for target in np.unique(row) if target != DEAD] for row in dfa.transitions]

        def copy() -> tuple[int, int]:
            ids = [DEAD] + [self.state() for _ in range(1, len(edges))]
            exit_ = self.state()
            for state in range(1, len(edges)):
                self.byte_edges[ids[state]] = [(byte_set, ids[target]) for byte_set, target in edges[state]]
                if dfa.accepting[state]:
                    self.epsilon[ids[state]].append(exit_)
            return ids[START], exit_
        return copy

    def code_points(self, ranges: list[tuple[int, int]]) -> tuple[int, int]:
        """One character from `ranges`: its UTF-8 byte sequences as alternatives."""
        start, end = self.state(), self.state()
        for sequence in byte_set_sequences(tuple(ranges)):
            state = start
            for i, byte_set in enumerate(sequence):
                target = end if i == len(sequence) - 1 else self.state()
                self.byte_edges[state].append((byte_set, target))
                state = target
        return start, end


CHARACTER_OPS = (sre.LITERAL, sre.NOT_LITERAL, sre.ANY, sre.IN)  # a parse's items that are one character


def character_ranges(op, av, dotall: bool, portable: bool = False) -> list[tuple[int, int]]:
    """The code points one character of a parse (`CHARACTER_OPS`) may be.
    `portable`: only those every dialect's Unicode categories agree on (a JSON
    schema's pattern, which the client's validator reads so: `class_ranges`)."""
    if op is sre.LITERAL:
        return [(av, av)]
    if op is sre.NOT_LITERAL:
        return complement([(av, av)])
    if op is sre.ANY:
        return [(0, MAX_CODE_POINT)] if dotall else complement([(10, 10)])
    return class_ranges(av, portable)


def class_ranges(av, portable: bool = False) -> list[tuple[int, int]]:
    """A class's code points, `\\d`, `\\s` and `\\w` read as ASCII's. `portable`: only
    those it holds read so and read with every dialect's Unicode categories
    (`_any_dialects`) too: `\\S` or `[^\\s]` read as ASCII's let through a no-break
    space that Python's `re`, pydantic and ECMA-262 read as `\\s`, and the client's
    validator refused the value; `[\\s\\S]` is every character either way."""
    ascii_read = _class_ranges(av, _ASCII_CATEGORIES.__getitem__)
    if not portable:
        return ascii_read
    return complement(merged(complement(ascii_read) + complement(_class_ranges(av, _any_dialects))))


def _class_ranges(av, category_ranges) -> list[tuple[int, int]]:
    ranges, negate = [], False
    for op, arg in av:
        if op is sre.NEGATE:
            negate = True
        elif op is sre.LITERAL:
            ranges.append((arg, arg))
        elif op is sre.RANGE:
            ranges.append(arg)
        elif op is sre.CATEGORY:
            category = _NEGATED_CATEGORIES.get(arg, arg)
            if category not in _ASCII_CATEGORIES:
                raise RegexError(f"regex: {str(arg).lower()} is not supported in a character class")
            members = category_ranges(category)
            ranges += complement(members) if arg in _NEGATED_CATEGORIES else members
        else:
            raise RegexError(f"regex: {str(op).lower()} is not supported in a character class")
    return complement(ranges) if negate else merged(ranges)


# ---- NFA -> DFA ----------------------------------------------------------------------

def _determinise(nfa: _Nfa, start: int, accept: int) -> ByteDfa:
    """The subset construction over classes of bytes (those no edge tells apart). A
    DFA state is the set of NFA states it may be in that read a byte or accept (the
    epsilon-only ones are left out: two sets that differ only there are one state)."""
    sets = list({edge for edges in nfa.byte_edges for edge, _ in edges})
    classes: dict[tuple, list[int]] = {}
    for byte in range(256):
        classes.setdefault(tuple(byte in s for s in sets), []).append(byte)
    class_bytes = list(classes.values())
    class_of = {byte: column for column, members in enumerate(class_bytes) for byte in members}
    moves: list[dict[int, list[int]]] = []  # NFA state -> class -> targets
    columns_of: dict[frozenset[int], set[int]] = {}  # a set of bytes -> its classes
    for edges in nfa.byte_edges:
        by_class: dict[int, list[int]] = {}
        for edge, target in edges:
            columns = columns_of.get(edge)
            if columns is None:
                columns = columns_of[edge] = {class_of[byte] for byte in edge}
            for column in columns:
                by_class.setdefault(column, []).append(target)
        moves.append(by_class)
    closures: dict[int, frozenset[int]] = {}

    def closure(state: int) -> frozenset[int]:
        """The states that read a byte or accept, reachable from `state` by epsilon edges."""
        if state not in closures:
            seen, stack = {state}, [state]
            while stack:
                for target in nfa.epsilon[stack.pop()]:
                    if target not in seen:
                        seen.add(target)
                        stack.append(target)
            closures[state] = frozenset(s for s in seen if moves[s] or s == accept)
        return closures[state]

    order = [frozenset(), closure(start)]
    index = {state_set: i for i, state_set in enumerate(order)}
    rows: list[list[int]] = [[0] * len(class_bytes)]
    left = _work_left.get()  # (a request's: `request_work`)
    work = 0
    try:
        while len(rows) < len(order):
            targets: dict[int, list[int]] = {}
            for nfa_state in order[len(rows)]:
                for column, to in moves[nfa_state].items():
                    targets.setdefault(column, []).extend(to)
            row = [0] * len(class_bytes)
            for column, to in targets.items():
                moved = frozenset().union(*(closure(t) for t in to))
                work += len(to) + len(moved)
                if moved not in index:
                    index[moved] = len(order)
                    order.append(moved)
                row[column] = index[moved]
            rows.append(row)
            if len(order) > MAX_BUILT_STATES:
                raise RegexError(f"regex is too complex: its automaton passes {MAX_BUILT_STATES} states as built"
                                 + COPIES_HINT)
            if work > MAX_WORK:
                raise RegexError("regex is too complex to compile quickly")
            if left is not None and work + STATE_WORK * len(order) > left[0]:
                raise RequestWorkSpent("the request's patterns are too complex to compile quickly together "
                                       "(a JSON schema's string patterns, a batch's regexes): ask for fewer")
    finally:
        if left is not None:
            left[0] -= work + STATE_WORK * len(order)
    accepting = np.array([accept in s for s in order], dtype=bool)
    by_class, accepting = minimised(prune_dead(np.array(rows, dtype=np.int32), accepting), accepting)
    if len(accepting) > MAX_STATES:
        raise RegexError(f"regex is too complex: its automaton has {len(accepting)} states, more than {MAX_STATES}"
                         f"{COPIES_HINT}")
    transitions = np.zeros((len(accepting), 256), dtype=np.int16)  # (MAX_STATES < 2**15)
    for column, members in enumerate(class_bytes):
        transitions[:, members] = by_class[:, column:column + 1]
    return ByteDfa(transitions, accepting, by_class.astype(np.int16))
