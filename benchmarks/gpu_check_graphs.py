"""The GPU check's `graphs` step (`benchmarks/gpu_check.py`, step 4): decode steps
eager, replayed from CUDA graphs, and with overlapped decode, against each other
(tokens, seeded draws, speculation, prefill graphs), their step times, and the host
syncs in overlapped decode steps."""

from __future__ import annotations

from pathlib import Path

from benchmarks.gpu_timing import decode_step_s

HELD_TEXT = "[a-z ,.]{1,200}"  # a pattern some of the check's sampled requests are held to
DECODE_MODES = {  # engine settings of each way to run decode steps, slowest first
    "eager": dict(cuda_graphs=False, overlap_decode=False),
    "graphs": dict(cuda_graphs=True, overlap_decode=False),
    "graphs+overlap": dict(cuda_graphs=True, overlap_decode=True),
}


def check_graphs(model_dir: Path, exact_model_dir: Path, device: str, dtype: str, decode_batch: int) -> dict:
    import random

    import torch

    from actors.llm import LLM
    from actors.sampling_params import SamplingParams

    def engine(model: Path, dtype: str, mode: str, **more) -> LLM:
        settings = DECODE_MODES[mode]
        llm = LLM(model, device=device, dtype=dtype, kv_cache_bytes=2 * 2**30 if device == "cuda" else 128 * 2**20,
                  max_num_seqs=max(decode_batch, 8), enable_prefix_cache=False, **settings, **more)
        runner = llm.engine.runner
        if settings["cuda_graphs"] and device != "cuda":  # the CPU twin: padded static steps, no capture
            runner.decode_graphs = runner.static_decode(capture=False)
        if more.get("prefill_graphs") and device != "cuda":
            runner.prefill_graphs = runner.static_prefill(capture=False)
        return llm

    rng = random.Random(2)
    prompts = [[rng.randrange(3, 2000) for _ in range(rng.randint(1, 150))] for _ in range(11)]
    greedy = [SamplingParams(max_new_tokens=rng.randint(4, 40), temperature=0, ignore_eos=True) for _ in prompts]
    # Some rows also penalised, biased, held to a minimum (kernels/penalties.py,
    # kernels/logit_bias.py: their gathers and scatters on the device too), or held
    # to a pattern (its mask crosses to the device; overlapped, such a step is
    # sampled once the host has the tokens before: ModelRunner.sample_deferred).
    extras = [{}, dict(repetition_penalty=1.2, frequency_penalty=0.5, presence_penalty=0.3),
              dict(logit_bias={5: 3.0, 6: -100.0}, min_new_tokens=3), dict(regex=HELD_TEXT)]
    sampled = [SamplingParams(max_new_tokens=rng.randint(4, 40), temperature=0.8, top_p=0.95, seed=i,
                              ignore_eos=True, logprobs=2, **extras[i % len(extras)]) for i, _ in enumerate(prompts)]
    tokens, sampled_tokens = {}, {}
    for mode in DECODE_MODES:
        llm = engine(exact_model_dir, "float32", mode)
        tokens[mode] = [o.token_ids for o in llm.generate(prompts, greedy)]
        if mode != "eager":  # the same kernels: seeded sampling must agree too
            sampled_tokens[mode] = [(o.token_ids, o.logprobs) for o in llm.generate(prompts, sampled)]
        del llm
    # Speculative decoding through the graphs: drafts as decode rows (actors/speculation.py), the same tokens.
    llm = engine(exact_model_dir, "float32", "graphs", num_speculative_tokens=4, prompt_lookup_min=1)
    speculated = [o.token_ids for o in llm.generate(prompts, greedy)]
    speculated_sampled = [(o.token_ids, [lp.token_id for lp in o.logprobs]) for o in llm.generate(prompts, sampled)]
    result = {
        "prompts": len(prompts),
        "identical_greedy": {mode: sum(a == b for a, b in zip(tokens["eager"], tokens[mode])) for mode in DECODE_MODES},
        "identical_sampled_with_overlap": sum(same_draws(a, b) for a, b in zip(*sampled_tokens.values())),
        "sampled_differences": differences(*sampled_tokens.values(),
                                            kinds=[i % len(extras) for i in range(len(prompts))]),
        "identical_with_speculation": sum(a == b for a, b in zip(speculated, tokens["graphs"])) + sum(
            ids == b[0] and top == [lp.token_id for lp in b[1]]
            for (ids, top), b in zip(speculated_sampled, sampled_tokens["graphs"])),
        "drafts_confirmed": llm.engine.num_accepted_draft_tokens,
        "step_s": {},
    }
    del llm
    # Prefill graphs (`prefill_graphs`): one prompt at a time, so that each prefill
    # step is one prompt's chunk from position 0, the steps they replay.
    one_by_one = {}
    for prefill_graphs in (False, True):
        llm = engine(exact_model_dir, "float32", "graphs", prefill_graphs=prefill_graphs)
        one_by_one[prefill_graphs] = [llm.generate([p], [g])[0].token_ids for p, g in zip(prompts, greedy)]
        result["prefill_graphs_captured"] = llm.engine.runner.prefill_graphs is not None
        del llm
    result["identical_with_prefill_graphs"] = sum(a == b for a, b in zip(*one_by_one.values()))
    for mode in DECODE_MODES:
        llm = engine(model_dir, dtype, mode)
        if mode == "graphs":
            graphs_used = llm.engine.runner.decode_graphs
            result["captured"] = graphs_used is not None and graphs_used.is_captured
        for batch in (1, decode_batch):
            step_s = decode_step_s(torch, llm, device, batch, 128, 32, random.Random(3))
            result["step_s"][f"{mode}_batch{batch}"] = step_s
        if mode == "graphs+overlap":
            result["steps_launched_ahead"] = llm.engine.num_steps_launched_ahead
            if device == "cuda":
                result["decode_host_syncs"] = _decode_host_syncs(torch, llm, decode_batch)
        del llm
    for batch in (1, decode_batch):
        times = {mode: result["step_s"][f"{mode}_batch{batch}"] for mode in DECODE_MODES}
        result[f"speedup_batch{batch}"] = times["eager"] / times["graphs"]
        result[f"overlap_speedup_batch{batch}"] = times["graphs"] / times["graphs+overlap"]
    result["ok"] = (all(n == len(prompts) for n in result["identical_greedy"].values())
                    and result["identical_sampled_with_overlap"] == len(prompts)
                    and result["identical_with_speculation"] == 2 * len(prompts) and result["drafts_confirmed"] > 0
                    and result["steps_launched_ahead"] > 0
                    and result["identical_with_prefill_graphs"] == len(prompts) and result["prefill_graphs_captured"]
                    and (result["captured"] or device != "cuda"))
    return result


# Logprob values may differ in the last bits between runs whose batches differ in
# size (overlapped decode launches a step for a request before it sees it finish):
# cuBLAS picks its kernel by the batch's rows, and a row's sums then run in another
# order. The first H200 run saw up to 3.7e-6 in float32, the tokens all the same.
LOGPROB_TOLERANCE = 1e-4


def same_draws(first: tuple, second: tuple) -> bool:
    """The same tokens, the same top-logprob ids, logprob values within LOGPROB_TOLERANCE."""
    (ids_a, lps_a), (ids_b, lps_b) = first, second
    if ids_a != ids_b or len(lps_a) != len(lps_b):
        return False
    for a, b in zip(lps_a, lps_b):
        if a.token_id != b.token_id or [t for t, _ in a.top] != [t for t, _ in b.top]:
            return False
        values = [(a.logprob, b.logprob)] + [(x, y) for (_, x), (_, y) in zip(a.top, b.top)]
        if any(abs(x - y) > LOGPROB_TOLERANCE for x, y in values):
            return False
    return True


def differences(first: list, second: list, kinds: list[int]) -> list[dict]:
    """Where two runs' (token ids, logprobs) of the same requests part: each differing
    request's index, its kind of extras (the index into check_graphs' `extras`), the
    first output position whose token differs (None if only logprob values do), and
    the largest logprob difference over the positions before it."""
    found = []
    for index, ((ids_a, lps_a), (ids_b, lps_b), kind) in enumerate(zip(first, second, kinds)):
        if (ids_a, lps_a) == (ids_b, lps_b):
            continue
        parted = next((i for i, (a, b) in enumerate(zip(ids_a, ids_b)) if a != b), None)
        same = len(ids_a) if parted is None else parted
        gaps = [abs(a.logprob - b.logprob) for a, b in zip(lps_a[:same], lps_b[:same])]
        found.append({"request": index, "kind": kind, "first_token_difference": parted, "length": len(ids_a),
                      "max_logprob_difference": max(gaps, default=0.0)})
    return found


def _decode_host_syncs(torch, llm, batch: int) -> dict:
    """Where decode steps make the host wait for the device, other than reading a
    step's tokens (an event, which torch does not report): torch's sync debug mode
    warns on every synchronising op (`.item()`, a blocking copy, ...). Any in the
    launch path would undo overlapped decode. Counted over 16 decode steps at
    `batch` after the prefills; a diagnostic, so its own failure is recorded, not
    raised."""
    import random
    import warnings

    from actors.sampling_params import SamplingParams

    try:
        rng = random.Random(4)
        engine = llm.engine
        params = SamplingParams(max_new_tokens=40, temperature=0, ignore_eos=True)
        held = SamplingParams(max_new_tokens=40, temperature=0, ignore_eos=True, regex=HELD_TEXT)
        for i in range(batch):  # (a quarter held to a pattern: its masks are made in the launch path)
            engine.add_request([rng.randrange(3, 2000) for _ in range(64)], held if i % 4 == 3 else params)
        while engine.scheduler.waiting or any(r.is_prefill for r in engine.scheduler.running):
            engine.step()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                for _ in range(16):
                    engine.step()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        while engine.has_unfinished():
            engine.step()
        messages = sorted({str(w.message)[:200] for w in caught})
        return {"steps": 16, "warnings": len(caught), "distinct": messages[:5]}
    except Exception as exc:  # a diagnostic: record it, keep the step's results
        return {"error": f"{type(exc).__name__}: {exc}"}
