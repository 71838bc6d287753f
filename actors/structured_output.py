"""Structured output: a request's tokens held to a regular expression, token by token.

A request with `params.regex` (set from the APIs' ways of asking: a regex, a choice,
a JSON schema, a tool call; cluster/output_format.py) draws each token from those whose bytes keep
the output a prefix of some match of the pattern (actors/regex_dfa.py: a DFA over
bytes). What each DFA state allows is found by walking every token of the
vocabulary through the DFA at once (numpy, the tokens sorted longest first so each
byte position is one gather, by a flat index, over a shrinking prefix; a few
milliseconds a state for a 152k-token vocabulary), the first time a request reaches
that state, and kept as a packed bit mask (19 KB a state there); states alike to
every token of up to `SHARED_BYTES` bytes share that part of their masks
(`TokenIndex`). outlines builds the same state -> tokens
index ahead for every state; xgrammar adds a pushdown automaton for grammars that
are not regular. Here the index is lazy: a request pays only for the states it
visits.

The ends: in an accepting state the request's end tokens (EOS unless `ignore_eos`,
its stop tokens) may be drawn besides the tokens that continue a match; a token
that leaves the output in a state that accepts and has no way on ends the request
("stop") without another draw, as SGLang ends a request whose grammar terminated.
`max_new_tokens` may still cut a match short ("length"), as everywhere. A stop id
the request named that is also text of the pattern is drawn only where the output
matches, or where it is the one way on: it then ends the request short of a match
("stop", as asked), or under `min_new_tokens`, whose ban on stop ids gives way
there (kernels/logit_bias.py), it is drawn as text. A pattern
is applied to the output only, from its first token: on a P/D pair, P draws the
first token from the start state and D walks it before its own first draw, so the
state is the output's alone and nothing crosses with the KV.

Needs a byte-level BPE tokenizer (Qwen2, Llama 3, the built-in presets) with a
token for each of the 256 bytes: then every live state has a token that continues
it, so a draw always has a token to take. `allowed_token_ids` and `bad_words` are
refused beside a pattern (each could ban every token it allows).

A constrained row's next mask depends on the token just drawn: with overlapped
decode, a step holding one launches its forward ahead and is sampled once the host
has read that token (actors/engine.py, `ModelRunner.sample_deferred`).

Constrained requests speculate (actors/speculation.py): their drafts are cut at the
first that would leave the pattern (`num_useful_drafts`), and a draft row is masked
from the state after the drafts before it, as a plain decode of that token would be
(vLLM's structured outputs fill one bitmask row per draft the same way).

Where a state leaves a single byte, and the next one too, up to a state that
accepts or branches, that text is fixed (`TokenIndex.forced`): the engine writes it
without a step (jump-forward, actors/output_writer.py `_jump_forward`).
"""

from __future__ import annotations

import numpy as np

from actors.compile_cache import CompileCache
from actors.dfa_minimise import classes_within
from actors.regex_dfa import START, ByteDfa, compile_regex
from actors.sampling_params import InvalidRequestError

MAX_PATTERNS = 16  # a worker keeps the indexes of its latest patterns,
MAX_MASKS = 1024  # each up to this many states' masks (16 MB at 152k tokens; then it starts afresh)
MAX_FORCED_BYTES = 256  # text jump-forward writes at once, at most
SHARED_BYTES = 16  # states alike in what texts of up to this many bytes lead on share their tokens' masks that long


class VocabularyBytes:
    """A vocabulary's tokens as bytes, for walking them all through a DFA at once:
    `columns` [longest, tokens] the bytes of each token that has any (special tokens
    and ids past the tokenizer have none), longest first, a row a byte position (one
    step of the walk reads a row whole), `active[j]` how many of them have more than
    j bytes."""

    def __init__(self, token_bytes: list[bytes]) -> None:
        lengths = np.fromiter((len(b) for b in token_bytes), dtype=np.int64, count=len(token_bytes))
        if len({b for b in token_bytes if len(b) == 1}) < 256:
            raise InvalidRequestError("structured output needs a tokenizer with a token for every byte")
        order = np.argsort(-lengths, kind="stable")
        order = order[lengths[order] > 0]
        self.vocab_size = len(token_bytes)
        self.token_bytes = token_bytes
        self.token_ids = order
        matrix = np.zeros((len(order), int(lengths[order[0]])), dtype=np.uint8)
        for row, token_id in enumerate(order.tolist()):
            data = token_bytes[token_id]
            matrix[row, : len(data)] = np.frombuffer(data, dtype=np.uint8)
        self.columns = np.ascontiguousarray(matrix.T)
        sorted_lengths = lengths[order]
        self.active = [int(np.count_nonzero(sorted_lengths > j)) for j in range(matrix.shape[1])]

    def mask(self, ids) -> np.ndarray:
        """A packed mask (np.packbits' bit order) over the vocabulary with `ids` set."""
        bits = np.zeros(self.vocab_size, dtype=bool)
        bits[ids if isinstance(ids, np.ndarray) else np.fromiter(ids, dtype=np.int64)] = True
        return np.packbits(bits)


class TokenIndex:
    """One pattern over one vocabulary: the tokens each DFA state may draw next.

    States that no text of up to `SHARED_BYTES` bytes tells apart (which lead to a
    dead state after the same such texts: `classes_within`) allow the same tokens
    of up to that many bytes, so that part of a mask is walked once a class; only
    the longer tokens (2% of a Qwen2-sized vocabulary) are walked for each state. A
    counted repeat's copies are the case: a JSON string of at most 2000 characters
    has 28,004 states, each a step of a request writing it, and 211 classes. A step
    inside a string of at most 150 characters paid a walk of the whole vocabulary
    (7.9 ms a state at 152k tokens, on the engine thread); now 0.5 ms, most of it the
    first state of each class (docs/benchmarks.md, session 58). xgrammar's masks
    inside such a string took 5 ms (its issue #465)."""

    def __init__(self, dfa: ByteDfa, vocabulary: VocabularyBytes) -> None:
        self.dfa = dfa
        self.vocabulary = vocabulary
        self.classes = classes_within(dfa.by_class, SHARED_BYTES)
        active = vocabulary.active
        self._num_long = active[SHARED_BYTES] if len(active) > SHARED_BYTES else 0  # (the first tokens: longest first)
        self._masks: dict[int, np.ndarray] = {}
        self._shared: dict[int, np.ndarray] = {}  # a class's mask of the tokens of up to SHARED_BYTES bytes
        self._forced: dict[int, bytes] = {}

    def continuing(self, state: int) -> np.ndarray:
        """The packed mask of the tokens after which the output can still match."""
        mask = self._masks.get(state)
        if mask is None:
            if len(self._masks) + (len(self._shared) if self._num_long else 0) >= MAX_MASKS:  # (arrays kept)
                self._masks.clear()
                self._shared.clear()
            group = int(self.classes[state])
            shared = self._shared.get(group)
            if shared is None:
                shared = self._shared[group] = self.vocabulary.mask(
                    self._live(state, self._num_long, len(self.vocabulary.token_ids)))
            mask = shared
            if self._num_long:
                mask = shared.copy()
                long_ids = self._live(state, 0, self._num_long)
                np.bitwise_or.at(mask, long_ids >> 3, (0x80 >> (long_ids & 7)).astype(np.uint8))
            self._masks[state] = mask
        return mask

    def _live(self, state: int, first: int, end: int) -> np.ndarray:
        """The ids of the tokens `first:end` (in the vocabulary's order, longest
        first) after which, from `state`, the output can still match."""
        vocabulary, flat = self.vocabulary, self.dfa.transitions.ravel()  # (one index a step: 3x a pair's speed)
        states = np.full(end - first, state, dtype=np.int64)
        for column, active in enumerate(vocabulary.active):
            count = min(active, end) - first
            if count <= 0:
                break
            walked = states[:count]
            walked *= 256
            walked += vocabulary.columns[column, first:first + count]
            states[:count] = flat[walked]
        return vocabulary.token_ids[first:end][states != 0]

    def forced(self, state: int) -> bytes:
        """The bytes that must follow `state` whatever is drawn: while a state does
        not accept and one byte alone leads on (cut to whole UTF-8 characters)."""
        forced = self._forced.get(state)
        if forced is None:
            data, transitions, accepting = bytearray(), self.dfa.transitions, self.dfa.accepting
            current = state
            while not accepting[current] and len(data) < MAX_FORCED_BYTES:
                (following,) = np.nonzero(transitions[current])
                if len(following) != 1:
                    break
                data.append(int(following[0]))
                current = int(transitions[current, following[0]])
            forced = self._forced[state] = _whole_characters(bytes(data))
        return forced


def _whole_characters(data: bytes) -> bytes:
    """`data` up to its last whole UTF-8 character (b"" if it starts inside one)."""
    for cut in range(len(data), max(len(data) - 4, -1), -1):
        try:
            data[:cut].decode()
            return data[:cut]
        except UnicodeDecodeError:
            continue
    return b""


class OutputConstraint:
    """A request's place in its pattern: the DFA state after the output tokens
    walked so far."""

    def __init__(self, index: TokenIndex, end_token_ids) -> None:
        self.index = index
        self.end_mask = index.vocabulary.mask(end_token_ids)
        self.state = START
        self.num_walked = 0

    def _walk(self, output_ids: list[int], num_output: int) -> int:
        if num_output < self.num_walked:  # fewer tokens than walked: from the start again
            self.state, self.num_walked = START, 0
        token_bytes, dfa = self.index.vocabulary.token_bytes, self.index.dfa
        for token_id in output_ids[self.num_walked : num_output]:
            self.state = dfa.walk(self.state, token_bytes[token_id])
        self.num_walked = num_output
        return self.state

    def mask(self, output_ids: list[int], num_output: int, drafts: tuple[int, ...] = ()) -> np.ndarray:
        """The packed mask of the tokens the draw of output token `num_output` may take
        (after the output's first `num_output - len(drafts)` tokens and `drafts`, a
        draft row's drafts before it, walked without being kept): end tokens only
        where the output matches (an end token that is also text of the pattern, a
        stop id the request named, would end it short of a match; kept only where it
        is the one way on)."""
        state = self._walk(output_ids, num_output - len(drafts))
        token_bytes, dfa = self.index.vocabulary.token_bytes, self.index.dfa
        for token_id in drafts:
            state = dfa.walk(state, token_bytes[token_id])
        continuing = self.index.continuing(state)
        if self.index.dfa.accepting[state]:
            return continuing | self.end_mask
        kept = continuing & ~self.end_mask
        return kept if kept.any() else continuing

    def num_useful_drafts(self, output_ids: list[int], drafts: list[int], jumps_forward: bool) -> int:
        """How many of `drafts` (to follow the output) may be verified: those that keep
        it a prefix of a match, up to the first end token (a draft past them could not
        stand, its row's mask bans it, and the rows after it would be masked from a
        dead state), and, where the request jumps forward, up to the first after which
        the pattern fixes text (the engine writes that text there, not the drafts)."""
        token_bytes, dfa = self.index.vocabulary.token_bytes, self.index.dfa
        state = self._walk(output_ids, len(output_ids))
        for count, token_id in enumerate(drafts):
            data = token_bytes[token_id]
            state = dfa.walk(state, data) if data else 0  # (special tokens have no bytes: none continues)
            if not state or self.end_mask[token_id >> 3] & (0x80 >> (token_id & 7)):
                return count
            if jumps_forward and self.index.forced(state):
                return count + 1
        return len(drafts)

    def forced_text(self, output_ids: list[int]) -> str:
        """The text the pattern fixes after the output (jump-forward; "" if none)."""
        return self.index.forced(self._walk(output_ids, len(output_ids))).decode()

    def is_complete(self, output_ids: list[int]) -> bool:
        """Whether the output matches and nothing may follow."""
        return bool(self.index.dfa.terminal[self._walk(output_ids, len(output_ids))])


class TokenIndexes:
    """A worker's indexes, one a pattern (the latest `MAX_PATTERNS`, each made once
    at a time: actors/compile_cache.py), over its vocabulary's bytes (made at the
    first pattern)."""

    def __init__(self, token_bytes: list[bytes] | None) -> None:
        self._token_bytes = token_bytes
        self._vocabulary: VocabularyBytes | None = None
        self._indexes: CompileCache[TokenIndex] = CompileCache(MAX_PATTERNS)

    def prepare(self, pattern: str) -> None:
        """Compile `pattern` and make its index (the vocabulary's bytes at the first,
        the classes of states that share masks) ahead of `constraint`: a worker runs
        this off its engine thread."""
        if self._token_bytes is None:
            compile_regex(pattern)  # (`constraint` says why it cannot be held)
        else:
            self._indexes.get(pattern, self._new_index)

    def constraint(self, pattern: str, end_token_ids) -> OutputConstraint:
        if self._token_bytes is None:
            raise InvalidRequestError("structured output (regex, choice, JSON schema) needs a byte-level BPE "
                                      "tokenizer; this model's decodes otherwise")
        return OutputConstraint(self._indexes.get(pattern, self._new_index), end_token_ids)

    def _new_index(self, pattern: str) -> TokenIndex:
        if self._vocabulary is None:  # (two patterns' first indexes at once may both make it: no harm)
            self._vocabulary = VocabularyBytes(self._token_bytes)
        return TokenIndex(compile_regex(pattern), self._vocabulary)
