"""Speculative decoding: which requests draft, how many tokens, and how a step's
samples confirm them.

The engine asks `Drafter.propose` for a request's drafts after each token it
takes; the scheduler puts them in the request's next decode chunk (after its last
token, so the step computes 1 + k positions); the runner samples a row at each of
them, every row with the draw of the token it samples (`kernels.sampling.uniform_draws`
by output index). Row 0 samples the token after the last one, as a plain decode
would. If it equals draft 0, row 1's logits were computed after the right
token, so its sample is the next token; and so on: `num_confirmed` counts the drafts
the samples confirm, and the engine takes that many samples plus one. Drawing each
row as the plain decode would and keeping the samples while they match is the
speculative sampling of Leviathan et al. (2023) for a draft that puts all its mass
on one token: accept draft `d` with probability p(d), otherwise draw from p without
`d`. With seeded draws it is more: the tokens are the plain decode's tokens, as far
as a step's rows leave each other's results alone (on CPU they do up to 128 rows a
step, the C++ small-batch linear layers', and the tests hold the tokens to it;
MKL's past that and a GPU's GEMM may round differently for another number of
rows, as they do whenever a batch grows or shrinks: kernels/sampling.py).

Drafting costs compute (a rejected draft is a position computed for nothing), so
it backs off where it does not pay: a request whose drafts all fail skips the
next 1, 3, 7, then 15 proposals each time, until one is confirmed;
and no request drafts while more than `speculative_max_batch` run, where a
step's compute, not its weight reads, sets its time (vLLM's
`disable_by_batch_size`).

Before each step `Drafter.trim` keeps only the drafts that raise the step's
goodput, its expected tokens per second (the aim of SmartSpec, Liu et al. 2024,
"Optimizing Speculative Decoding for Serving Large Language Models Using
Goodput"). A step of R rows takes t(R), measured live (actors/step_costs.py);
one of B decoding requests, R0 rows before drafts (a row a request, more for one
whose pattern's fixed text is still to compute) and n drafts yields B tokens
plus every confirmed draft: draft j of a request (from 1) stands only if its
first j do, with a probability read off the request's latest verified drafts
(actors/draft_acceptance.py), its gain. The step costs t(R0 + n) whichever
drafts they are, so the best n are the n of highest gain (a request's gains fall
with j: its first drafts come first, as verifying needs); `trim` takes the n
whose tokens per second is highest; except one step in `EXPLORE_EVERY`, which
verifies k more (k the drafts a request may verify), so that the time of a few
rows more than pay stays measured (a row count's time is measured only by steps
of that many rows, and a time measured once, high, would hold the rule where it
first stopped). So a lone request on a CPU verifies a few drafts a step, a batch
of eight only its surest, and on a GPU, where a row costs next to nothing, every
request drafts all it may. The rule never changes a token, only which drafts a
step verifies.

A draft row's logits are processed as a plain decode's would be at that token:
the rules that depend on the index alone (logit_bias, allowed_token_ids,
min_new_tokens) by its index, penalties, bad words and a pattern's mask over the
output and the drafts before the row (actors/model_runner.py). A request held to
a pattern drafts only what keeps its output a prefix of a match (the drafts are
cut at the first that leaves it), and none past a token after which the pattern
fixes the text: jump-forward writes that text there, as after a plain decode's
token, and the samples after it are dropped; the drafts that follow that text
ride on the chunk that computes it (its rows: the text's last token, then a
draft each). A prefill worker never drafts (it samples one token a request).
"""

from __future__ import annotations

from actors.config import EngineConfig
from actors.prompt_lookup import PromptLookup
from actors.request import Request
from actors.step_costs import DecodeStepCosts


MAX_BACKOFF_DOUBLINGS = 4  # a pause of at most 2**4 - 1 = 15 proposals
EXPLORE_EVERY = 16  # one trimmed step in this many verifies k drafts more than pay
# A request's prompt is indexed for lookup this many n-gram entries a step (tokens
# times the n-gram lengths), and it drafts once it is all in: built at its first
# proposal, a 32k-token prompt's index held the engine thread, and every running
# request's next token with it, 38 ms at n from 2 to 4 and 235 ms at 1 to 16; a
# slice, at most 4.6 and 15.6 ms, over 25 and 128 steps (docs/benchmarks.md,
# "By-hand probes (fifty-first session)").
INDEX_ENTRIES_A_STEP = 4096


class Drafter:
    def __init__(self, config: EngineConfig, max_model_len: int) -> None:
        self.num_tokens = config.num_speculative_tokens
        self.min_n, self.max_n = config.prompt_lookup_min, config.prompt_lookup_max
        self.index_tokens_a_step = max(INDEX_ENTRIES_A_STEP // (self.max_n - self.min_n + 1), 1)
        self.max_batch = config.speculative_max_batch
        self.max_model_len = max_model_len
        self.step_costs = DecodeStepCosts()  # the engine records its decode-only steps
        self._num_trims = 0

    @property
    def is_on(self) -> bool:
        return self.num_tokens > 0

    def can_draft(self, request: Request) -> bool:
        """Whether the request may draft at all: not a prefill worker's."""
        return self.is_on and not request.exports_kv

    def propose(self, request: Request, num_running: int) -> None:
        """Set `request.draft_token_ids` to what may follow its tokens (at most the
        tokens it may still write after the next one), or to none while it backs
        off or `num_running` requests are more than `max_batch`."""
        request.draft_token_ids = []
        room = min(self.num_tokens, request.params.max_new_tokens - len(request.output_token_ids) - 1,
                   self.max_model_len - request.num_tokens - 1)
        if room <= 0 or request.is_finished or (self.max_batch is not None and num_running > self.max_batch):
            return
        if request.draft_pause_steps:
            request.draft_pause_steps -= 1
            return
        lookup = request.lookup
        if lookup is None:
            lookup = request.lookup = PromptLookup(self.min_n, self.max_n)
        indexed = len(lookup.tokens)
        if indexed < request.num_prompt_tokens:  # (`INDEX_ENTRIES_A_STEP`)
            lookup.add(request.prompt_token_ids[indexed:indexed + self.index_tokens_a_step])
            if len(lookup.tokens) < request.num_prompt_tokens:
                return
        lookup.add(request.output_token_ids[len(lookup.tokens) - request.num_prompt_tokens:])  # (no prompt copy)
        drafts = lookup.next_tokens(room)
        if drafts and request.constraint is not None:
            del drafts[request.constraint.num_useful_drafts(request.output_token_ids, drafts, request.jumps_forward):]
        request.draft_token_ids = drafts

    def trim(self, running: list[Request]) -> None:
        """Cut the running requests' drafts to those that give the next step the
        most expected tokens per second (the module docstring); all stay while
        the step costs are unknown. Every `EXPLORE_EVERY`-th time it keeps
        `num_tokens` more, so that the time of the rows next to those that pay
        stays measured."""
        drafting = [r for r in running if r.draft_token_ids]
        if not drafting:
            return
        curve = self.step_costs.curve()
        if curve is None:
            return
        self._num_trims += 1
        # The rows before drafts: a decode's token, or the text jump-forward wrote (each samples one token).
        sampling = [r for r in running if r.num_pending_tokens == 1 or r.draft_token_ids]
        num_decoding, num_rows = len(sampling), sum(r.num_pending_tokens for r in sampling)
        # A request's gains fall with j (ties by j): the best n drafts are the n of highest gain.
        gains = sorted(((r.draft_acceptance.gain(j), -j, i) for i, r in enumerate(drafting)
                        for j in range(1, len(r.draft_token_ids) + 1)), reverse=True)
        tokens, best_n = float(num_decoding), 0
        best = tokens / max(curve(num_rows), 1e-9)
        for n, (gain, _, _) in enumerate(gains, 1):
            tokens += gain
            rate = tokens / max(curve(num_rows + n), 1e-9)
            if rate > best:
                best_n, best = n, rate
        if self._num_trims % EXPLORE_EVERY == 0:
            best_n += self.num_tokens  # a few rows more than pay, to measure them
        num_kept = [0] * len(drafting)
        for _, _, i in gains[:best_n]:
            num_kept[i] += 1
        for request, count in zip(drafting, num_kept):
            del request.draft_token_ids[count:]

    @staticmethod
    def record(request: Request, num_drafts: int, num_confirmed_drafts: int) -> None:
        """After a step verified `num_drafts` of the request's drafts: its
        acceptance, and back off if none stood."""
        request.draft_acceptance.record(num_drafts, num_confirmed_drafts)
        if num_confirmed_drafts:
            request.num_failed_drafts = 0
        else:
            request.num_failed_drafts += 1
            request.draft_pause_steps = (1 << min(request.num_failed_drafts, MAX_BACKOFF_DOUBLINGS)) - 1


def num_confirmed(draft_token_ids: tuple[int, ...], sampled_ids: list[int]) -> int:
    """How many drafts the samples confirm: sample i is the token after the known
    ones and the first i drafts, so draft i stands while it equals sample i."""
    count = 0
    for draft, sampled in zip(draft_token_ids, sampled_ids):
        if draft != sampled:
            break
        count += 1
    return count
