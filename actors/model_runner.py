"""Turns a scheduler plan into tensors, runs the model, samples.

Owns the model and the worker's KV cache tensor (layout in kernels/attention.py),
and so the whole-block copies in and out of it that KV transfers make. The step's
tokens are laid out multi-token chunks first (each a `PrefillSpan`), then every
single-token chunk as one batched decode (a decode's drafts too, a row a token,
actors/speculation.py). On CUDA a step of decodes only replays a CUDA graph
(`actors/decode_graphs.py`), and so, with `prefill_graphs`, does a step of one
prompt's chunk from position 0 (`actors/prefill_graphs.py`); the cache holds one
block more than the block pool hands out, the scratch block that the graphs'
padding rows write.

Streams, on CUDA. A worker's engine thread computes on `compute_stream`, a stream
of its own created non-blocking, so it never waits implicitly for other work on
the device (`use_compute_stream`, called once by the engine's thread; the offline
`LLM` computes on whatever stream its caller uses). KV transfers run on other
threads, on the legacy default stream, where Ray's NCCL streams (created blocking)
order themselves implicitly: so a transfer and the next step's compute overlap.
What orders the two is explicit: every step records `step_done` on the stream it
ran on; `read_blocks` waits on the device for the step that computed the blocks
(or the latest), `write_blocks` for the latest step (whose work may still touch
blocks freed since) and, off the compute stream, returns only once the blocks hold
the bytes, so a transfer's completion signal means what it says.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
from torch import nn

from actors.attention_metadata import AttentionMetadata, PrefillSpan
from actors.config import EngineConfig, ModelConfig
from actors.decode_graphs import MAX_GRAPH_BATCH, DecodeGraphs
from actors.host_tensors import int64_tensor, padded_int64_rows
from actors.launched_step import LaunchedStep, to_host
from actors.model import ForCausalLM, ModelKernels
from actors.prefill_graphs import PrefillGraphs
from actors.request import Request, TokenLogprob
from actors.scheduler import ScheduledChunk
from actors.weights import load_weights
from kernels.activation import select_silu_and_mul
from kernels.attention import select_decode_attention, select_prefill_attention
from kernels.blocks import select_block_copy
from kernels.linear import select_linear
from kernels.norm import select_add_rms_norm, select_rms_norm
from kernels.logit_bias import add_logit_bias_, keep_masked_, keep_only_
from kernels.penalties import TokenCounts, penalise_
from kernels.rope_cache import select_rope_and_write_kv
from kernels.sampling import logprobs_of, ranks_of, sample, uniform_draws


def kv_bytes_per_block(model: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    elements = model.num_layers * 2 * block_size * model.num_kv_heads * model.head_dim
    return elements * torch.empty((), dtype=dtype).element_size()


PROMPT_LOGPROB_ROWS = 256  # prompt positions whose logits are made at once


def empty_on(model: nn.Module, device: torch.device) -> nn.Module:
    """`model.to_empty(device=device)` for a model built on the meta device: storage
    of each parameter's and buffer's shape and dtype, uninitialised. Made with
    `torch.empty` from the shapes: `to_empty`'s `empty_like` of a meta tensor goes
    through torch's Python references, which import sympy, about 0.4 s of every
    worker's start here (tests/test_worker_startup.py)."""
    made: dict[int, torch.Tensor] = {}  # a tensor two modules share stays shared

    def empty(tensor: torch.Tensor) -> torch.Tensor:
        if id(tensor) not in made:
            storage = torch.empty(tensor.shape, dtype=tensor.dtype, device=device)
            made[id(tensor)] = (nn.Parameter(storage, requires_grad=tensor.requires_grad)
                                if isinstance(tensor, nn.Parameter) else storage)
        return made[id(tensor)]

    for module in model.modules():
        for tensors in (module._parameters, module._buffers):
            for name, tensor in tensors.items():
                if tensor is not None:
                    tensors[name] = empty(tensor)
    return model


class ModelRunner:
    def __init__(self, model_config: ModelConfig, config: EngineConfig, model_dir: Path) -> None:
        self.model_config = model_config
        self.config = config
        self.device = torch.device(config.device)
        dtype = config.torch_dtype
        backend = config.kernel_backend
        kernels = ModelKernels(
            prefill_attention=select_prefill_attention(backend, self.device),
            decode_attention=select_decode_attention(backend, self.device, dtype),
            linear=select_linear(backend, self.device, dtype),
            rms_norm=select_rms_norm(backend, self.device, dtype),
            add_rms_norm=select_add_rms_norm(backend, self.device, dtype),
            rope_and_write_kv=select_rope_and_write_kv(backend, self.device, dtype),
            silu_and_mul=select_silu_and_mul(backend, self.device),
        )
        self.block_copy = select_block_copy(backend, self.device)
        # Shapes only, then storage in `dtype` (the checkpoint's weights fill it): built on the
        # device in float32 and then cast, a model took twice its weights' memory as it started.
        with torch.device("meta"):
            model = ForCausalLM(model_config, kernels)
        model = empty_on(model.to(dtype=dtype), self.device)
        model.model.make_rope(self._max_len(), self.device)
        load_weights(model, Path(model_dir), dtype)
        self.model = model.eval()
        self.num_blocks = config.num_kv_blocks or max(
            2, config.kv_cache_bytes // kv_bytes_per_block(model_config, config.block_size, dtype)
        )
        self.scratch_block = self.num_blocks  # never handed out: padding rows write here
        self.kv_cache = torch.zeros(
            self.num_blocks + 1,
            model_config.num_layers,
            2,
            config.block_size,
            model_config.num_kv_heads,
            model_config.head_dim,
            dtype=dtype,
            device=self.device,
        )
        self.last_step_s = 0.0
        cuda = self.device.type == "cuda"
        self.compute_stream = torch.cuda.Stream(self.device) if cuda else None
        self.step_done: torch.cuda.Event | None = None  # recorded after each step's work (CUDA)
        self.decode_graphs: DecodeGraphs | None = None
        self.prefill_graphs: PrefillGraphs | None = None
        if config.cuda_graphs and cuda and not model_config.is_moe:  # (experts' groups are sized on the host)
            self.decode_graphs = self.static_decode(capture=True)
            if not self.decode_graphs.is_captured:
                self.decode_graphs = None
        if config.prefill_graphs and cuda and not model_config.is_moe:
            self.prefill_graphs = self.static_prefill(capture=True)
            if not self.prefill_graphs.is_captured:
                self.prefill_graphs = None
        if cuda:  # weights and the zeroed cache, written on this thread's stream, are in place
            torch.cuda.synchronize(self.device)

    def static_decode(self, capture: bool) -> DecodeGraphs:
        """Static-shape decode steps over this runner's model and cache, for up to
        max_num_seqs sequences of up to max_model_len tokens, each with its drafts'
        rows (1 + num_speculative_tokens a sequence: sized for sequences alone, a
        step of 13 requests drafting 4 tokens among 64 ran eagerly), within the
        step's token budget and MAX_GRAPH_BATCH rows; `capture` records them as
        CUDA graphs (CUDA only)."""
        max_blocks = -(-self._max_len() // self.config.block_size)
        rows = self.config.max_num_seqs * (1 + self.config.num_speculative_tokens)
        max_batch = min(rows, self.config.max_num_batched_tokens, MAX_GRAPH_BATCH)
        return DecodeGraphs(self.model, self.kv_cache, self.scratch_block, max_batch, max_blocks, capture)

    def static_prefill(self, capture: bool) -> PrefillGraphs:
        """Static-shape prefill steps of one chunk from position 0, of up to the
        largest chunk a step holds; `capture` records them as CUDA graphs (CUDA only)."""
        max_tokens = min(self.config.prefill_chunk_size, self.config.max_num_batched_tokens, self._max_len())
        return PrefillGraphs(self.model, self.kv_cache, self.scratch_block, max_tokens, capture)

    def _max_len(self) -> int:
        """The longest sequence: max_model_len, at most the model's positions."""
        max_positions = self.model_config.max_position_embeddings
        return min(self.config.max_model_len or max_positions, max_positions)

    def use_compute_stream(self) -> None:
        """Make the compute stream the calling thread's current stream (CUDA; the
        engine's own thread calls this once, before its first step)."""
        if self.compute_stream is not None:
            torch.cuda.set_stream(self.compute_stream)

    def _after(self, event: torch.cuda.Event | None) -> None:
        """Order the current stream's next work after `event` (default: the latest
        step)."""
        event = event or self.step_done
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)

    def read_blocks(self, block_ids: list[int], after: torch.cuda.Event | None = None) -> torch.Tensor:
        """A contiguous copy of these KV blocks, in this order, on the cache's device:
        [n, num_layers, 2, block_size, kvh, d], enqueued (CUDA) after `after`, the
        `step_done` of the step that computed them (default: the latest step). Any
        thread; the caller keeps the blocks from being reused meanwhile."""
        self._after(after)
        index = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        return self.block_copy.gather(self.kv_cache, index)

    def write_blocks(self, block_ids: list[int], kv: torch.Tensor) -> None:
        """Overwrite these KV blocks (distinct ids) with `kv` ([n, num_layers, 2,
        block_size, kvh, d], any device, the cache's dtype). Any thread; off the
        compute stream it returns once the blocks hold `kv`."""
        self._after(None)
        index = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        self.block_copy.scatter(self.kv_cache, index, kv.to(self.device))
        if self.compute_stream is not None and torch.cuda.current_stream(self.device) != self.compute_stream:
            written = torch.cuda.Event()
            written.record()
            written.synchronize()

    def _slots(self, block_table: list[int], positions: range) -> list[int]:
        size = self.config.block_size
        return [block_table[p // size] * size + p % size for p in positions]

    def _metadata(self, chunks: list[ScheduledChunk]):
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        spans: list[PrefillSpan] = []
        decode_tables: list[list[int]] = []
        decode_lens: list[int] = []
        for chunk in chunks:
            request = chunk.request
            table = request.block_table
            input_ids += request.token_ids_between(chunk.start, chunk.known_end)
            input_ids += chunk.draft_token_ids
            span_positions = range(chunk.start, chunk.end)
            positions += span_positions
            slots += self._slots(table, span_positions)
            if chunk.is_decode:  # a drafted decode too: a row a token, each with its own context (the KV is
                decode_tables += [table] * chunk.num_new_tokens  # written before attention reads it)
                decode_lens += range(chunk.start + 1, chunk.end + 1)
            else:
                q_start = len(input_ids) - chunk.num_new_tokens
                block_table = int64_tensor(table, self.device)
                spans.append(PrefillSpan(q_start, chunk.num_new_tokens, chunk.end, block_table))
        num_prefill_tokens = sum(s.q_len for s in spans)
        tables = lens = None
        if decode_tables:
            tables = padded_int64_rows(decode_tables, pad=0, device=self.device)
            lens = int64_tensor(decode_lens, self.device)
        meta = AttentionMetadata(
            slot_mapping=int64_tensor(slots, self.device),
            prefills=tuple(spans),
            num_prefill_tokens=num_prefill_tokens,
            decode_block_tables=tables,
            decode_context_lens=lens,
        )
        return int64_tensor(input_ids, self.device), int64_tensor(positions, self.device), meta

    @torch.inference_mode()
    def launch(self, chunks: list[ScheduledChunk], input_ids: torch.Tensor | None = None) -> LaunchedStep:
        """Enqueue one step, sampling included, without waiting for the device (on
        CUDA; on CPU it runs here). `input_ids`: a step of single-token decodes
        whose tokens the host does not know yet, given on the device instead (the
        previous step's `LaunchedStep.token_ids`, one row a chunk, in order); every
        such chunk samples. A chunk with drafts samples a row at each of its last
        1 + drafts positions, in order (`LaunchedStep.requests` names its request
        that many times)."""
        started = time.perf_counter()
        drafted = any(c.draft_token_ids for c in chunks)
        if drafted:
            ordered = [c for c in chunks if not c.is_decode] + [c for c in chunks if c.is_decode]
        else:  # (the same order, without a property call a chunk: this runs every step)
            ordered = [c for c in chunks if c.num_new_tokens > 1] + [c for c in chunks if c.num_new_tokens == 1]
        only_decodes = bool(ordered) and ordered[0].is_decode
        num_rows = sum(c.num_new_tokens for c in ordered) if drafted else len(ordered)  # (if only decodes)
        assert input_ids is None or (only_decodes and len(input_ids) == num_rows), "input_ids: decodes only"
        if self.decode_graphs is not None and only_decodes and self.decode_graphs.fits(num_rows):
            hidden = self.run_static_decode(self.decode_graphs, ordered, input_ids)
        elif self.prefill_graphs is not None and self.prefill_graphs.fits(ordered):
            hidden = self.prefill_graphs.run(ordered[0])
        else:
            known_ids, positions, meta = self._metadata(ordered)
            hidden = self.model(known_ids if input_ids is None else input_ids, positions, self.kv_cache, meta)
        ends, sampling, token_indexes, drafts_before = (self._drafted_rows(ordered) if drafted
                                                         else self._rows(ordered, input_ids is not None))
        step = LaunchedStep(sampling, started)
        if input_ids is None:  # (a step launched ahead only decodes)
            step.prompt_parts = list(self._prompt_logprobs(hidden, ordered))
        if sampling:
            rows = hidden[: len(ends)] if ends[-1] == len(ends) - 1 else hidden[int64_tensor(ends, self.device)]
            # An argmax alone needs no float32 copy of the logits (at batch 64 on an H200,
            # 0.5B preset: 28 us of a 1.07 ms step, and the argmax reads half the bytes).
            logits = self.model.compute_logits(rows, float32=not all(r.params.argmax_only for r in sampling))
            if input_ids is not None and any(request.reads_output for request in sampling):
                step.unsampled = logits, token_indexes, input_ids
            else:
                self._sample(logits, step, token_indexes, input_ids, drafts_before)
        self._record_done(step)
        return step

    @torch.inference_mode()
    def sample_deferred(self, step: LaunchedStep) -> None:
        """Sample a step launched ahead whose rows read their output (a pattern's
        mask, a long bad word's bans), now that the host has read the tokens before:
        only the forward ran ahead, on the device while the host read them, as vLLM
        fills a step's grammar bitmask while the forward runs. A row whose request
        has more output than it expected (jump-forward wrote text after its input)
        is stale: drawn unmasked, its token dropped."""
        logits, token_indexes, input_ids = step.unsampled
        step.unsampled = None
        step.stale_rows = frozenset(row for row, request in enumerate(step.requests)
                                    if not request.is_finished and len(request.output_token_ids) != token_indexes[row])
        self._sample(logits, step, token_indexes, input_ids)
        self._record_done(step)

    def _record_done(self, step: LaunchedStep) -> None:
        """On CUDA, `step_done`: an event after the work enqueued so far, which the
        step's token copies wait for (unless its sampling waits: `sample_deferred`)."""
        if self.compute_stream is not None:
            self.step_done = torch.cuda.Event()
            self.step_done.record()
            step.ready = None if step.unsampled is not None else self.step_done

    @staticmethod
    def _rows(ordered: list[ScheduledChunk], all_sample: bool) -> tuple[list[int], list[Request], list[int], list]:
        """The rows a step samples (no drafts): each sampling chunk's last token's
        row in the hidden states, its request, the output index of the token it
        samples; and no drafts before any."""
        ends, sampling, token_indexes, offset = [], [], [], 0
        for chunk in ordered:
            offset += chunk.num_new_tokens
            if all_sample or chunk.samples:
                ends.append(offset - 1)
                sampling.append(chunk.request)
                token_indexes.append(chunk.end - chunk.request.num_prompt_tokens)
        return ends, sampling, token_indexes, []

    @staticmethod
    def _drafted_rows(ordered: list[ScheduledChunk]) -> tuple[list[int], list[Request], list[int], list]:
        """`_rows` of a step with drafts: a row at a sampling chunk's last known
        token and one at each of its drafts (the token after it, if it is right),
        and each row's drafts before it."""
        ends, sampling, token_indexes, drafts_before, offset = [], [], [], [], 0
        for chunk in ordered:
            offset += chunk.num_new_tokens
            if chunk.samples:
                drafts = chunk.draft_token_ids
                ends += range(offset - 1 - len(drafts), offset)
                sampling += [chunk.request] * (1 + len(drafts))
                first = chunk.known_end - chunk.request.num_prompt_tokens
                token_indexes += range(first, first + 1 + len(drafts))
                drafts_before += (drafts[:i] for i in range(1 + len(drafts)))
        return ends, sampling, token_indexes, drafts_before

    def collect(self, step: LaunchedStep) -> tuple[list[int], list[TokenLogprob | None] | None]:
        """The tokens a launched step sampled, once the device has them (waits): see
        `LaunchedStep.tokens`. (A deferred sampling nobody ran, after a failed step, runs
        here.)"""
        if step.unsampled is not None:
            self.sample_deferred(step)
        result = step.tokens()
        self.last_step_s = time.perf_counter() - step.started
        return result

    def run_static_decode(
        self, static: DecodeGraphs, chunks: list[ScheduledChunk], input_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Hidden states of decode chunks (a row a token, drafts included), through
        `static` (its padded buffers, and its graphs when captured); `input_ids` as
        in `launch`."""
        if any(c.draft_token_ids for c in chunks):
            return static.run(
                token_ids=[t for c in chunks for t in (c.request.token_ids_between(c.start, c.known_end)
                                                       + list(c.draft_token_ids))],
                positions=[p for c in chunks for p in range(c.start, c.end)],
                block_tables=[c.request.block_table for c in chunks for _ in range(c.num_new_tokens)],
            )
        return static.run(
            token_ids=[c.request.token_ids_between(c.start, c.end)[0] for c in chunks] if input_ids is None
            else input_ids,
            positions=[c.start for c in chunks],
            block_tables=[c.request.block_table for c in chunks],
        )

    def _sample(self, logits: torch.Tensor, step: LaunchedStep, token_indexes: list[int],
                input_ids: torch.Tensor | None = None, drafts_before: list[tuple[int, ...]] = ()) -> None:
        """Sample the step's rows on the device (row i draws for output token
        `token_indexes[i]` of its request, after its output and `drafts_before[i]`
        when given; `input_ids` as in `launch`); start copying what the host reads."""
        params = [r.params for r in step.requests]
        temperatures = [p.temperature for p in params]
        draws = (uniform_draws([r.seed for r in step.requests], token_indexes) if any(t > 0 for t in temperatures)
                 else [0.0] * len(params))  # greedy rows read no draw
        processed = [row for row, p in enumerate(params) if p.processes_logits]
        scores = (self._process_logits(logits, step, processed, token_indexes, input_ids, drafts_before) if processed
                  else logits)
        step.token_ids = sample(scores, temperatures, [p.top_k for p in params], [p.top_p for p in params], draws,
                                [p.min_p for p in params])
        num_top = max((p.logprobs or 0) for p in params)
        outputs = [step.token_ids]
        if any(p.logprobs is not None for p in params):
            chosen, top_ids, top_lps = logprobs_of(logits, step.token_ids, num_top)
            outputs += [chosen] + ([top_ids, top_lps] if num_top else [])
        step.host = [to_host(t) for t in outputs]

    def _prompt_logprobs(self, hidden: torch.Tensor, ordered: list[ScheduledChunk]):
        """For each chunk of a prompt whose request wants its logprobs: (request, first
        position, host copies of the logprobs and ranks of the prompt tokens its
        positions predict[, top ids, top logprobs]). `hidden` has a row per token of
        `ordered`."""
        offset = 0
        for chunk in ordered:
            request, wanted = chunk.request, chunk.request.params.prompt_logprobs
            last = min(chunk.end, request.num_prompt_tokens - 1)  # positions from here on predict output
            # In slices: a 2048-token chunk's logits over a 152k vocabulary are 1.2 GB in float32.
            for start in range(chunk.start, last, PROMPT_LOGPROB_ROWS) if wanted is not None else ():
                end = min(start + PROMPT_LOGPROB_ROWS, last)
                targets = int64_tensor(request.prompt_token_ids[start + 1 : end + 1], self.device)
                rows = hidden[offset + start - chunk.start : offset + end - chunk.start]
                logits = self.model.compute_logits(rows)
                chosen, *top = logprobs_of(logits, targets, wanted)
                yield request, start, [to_host(t) for t in (chosen, ranks_of(logits, targets), *top) if t is not None]
            offset += chunk.num_new_tokens

    def _process_logits(self, logits: torch.Tensor, step: LaunchedStep, rows: list[int],
                        token_indexes: list[int], input_ids: torch.Tensor | None,
                        drafts_before: list[tuple[int, ...]]) -> torch.Tensor:
        """A copy of `logits` with the given rows' tokens outside their
        `allowed_token_ids` banned, their logit bias, their stop tokens banned while
        under `min_new_tokens` and their bad words' next tokens (actors/logit_rules.py,
        kernels/logit_bias.py, actors/bad_words.py), then their penalties
        (kernels/penalties.py; in a step launched ahead, a row's last token is its
        input, on the device: counted there). A draft row's bad words and penalties
        read the drafts before it as output, and so does its pattern's mask. The raw
        logits stay for logprobs."""
        scores = logits.clone(memory_format=torch.contiguous_format)
        keep_only_(scores, rows, [step.requests[row].logit_rules.allowed_ids for row in rows])
        before = drafts_before or [()] * len(step.requests)
        constrained = [row for row in rows if step.requests[row].constraint is not None
                       and not step.requests[row].is_finished and row not in step.stale_rows]  # (tokens dropped)
        masks = [step.requests[row].constraint.mask(step.requests[row].output_token_ids, token_indexes[row],
                                                    before[row]) for row in constrained]
        keep_masked_(scores, constrained, masks)
        additions = []
        for row in rows:
            request = step.requests[row]
            bad_word_ids = () if request.bad_words is None else request.bad_words.banned(
                request.output_token_ids + list(before[row]) if before[row] else request.output_token_ids,
                token_indexes[row])
            additions.append(request.logit_rules.additions(token_indexes[row], bad_word_ids))
        add_logit_bias_(scores, rows, *zip(*additions))
        penalised = [row for row in rows if step.requests[row].params.has_penalties]
        if not penalised:
            return scores
        params = [step.requests[row].params for row in penalised]
        settings = ([p.repetition_penalty for p in params], [p.frequency_penalty for p in params],
                    [p.presence_penalty for p in params])
        counts = [_row_counts(step.requests[row], token_indexes[row], before[row]) for row in penalised]
        # Counted up to the token before the one being sampled, but for a row's input
        # token when the host has not read it yet (a step launched ahead): on the device.
        uncounted = [i for i, row in enumerate(penalised) if counts[i].num_output < token_indexes[row]]
        penalise_(scores, penalised, counts, *settings, input_ids, uncounted)
        return scores


def _row_counts(request: Request, num_output: int, drafts: tuple[int, ...]) -> TokenCounts:
    """The counts a row's penalties read: over the prompt and the output before the
    token it samples, output number `num_output`, the last `len(drafts)` of which
    are the drafts before a draft row."""
    if not drafts:
        return _token_counts(request, num_output)
    return _token_counts(request, num_output - len(drafts)).with_outputs(drafts)


def _token_counts(request: Request, num_output: int) -> TokenCounts:
    """The request's token counts over its prompt and its first `num_output` output
    tokens (those before the one being sampled), brought up to date from the
    last step's."""
    counts = request.token_counts
    if counts is None or counts.num_output > num_output:  # a first step, or fewer tokens than counted
        counts = request.token_counts = TokenCounts(
            request.prompt_token_ids if request.params.repetition_penalty != 1 else ())
    for token in request.output_token_ids[counts.num_output : num_output]:
        counts.add_output(token)
    return counts
