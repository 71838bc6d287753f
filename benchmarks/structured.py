"""Structured: what holding outputs to a pattern costs (actors/structured_output.py).

Three parts, each timed side by side in one process:
- `compile`: a pattern's DFA from its text (actors/regex_dfa.py; the ingress, P and
  D each do it once a pattern, then it is cached), for a regex, a choice among 100
  strings, a JSON schema, any JSON object (`response_format: json_object`) and an
  answer that may call two strict tools (`tool_choice: "auto"`), and for patterns
  at the automaton's bound and past it (refused: how soon);
- `masks`: the tokens a DFA state allows, walked over the whole vocabulary the
  first time a request reaches the state (or over its longest tokens, where a state
  alike to a token shared its mask: a long string's characters), then read from the
  cache; for any JSON object and inside a string of at most 2000 characters; for the tiny
  preset's tokenizer and for a vocabulary of Qwen2's size (151,643 byte strings,
  log-normal lengths about Qwen2's mean of 6.7 bytes, the 256 single bytes among
  them: no tokenizer of that size is on disk, and the walk's cost depends only on
  the count and lengths);
- `decode`: the tiny engine generating `--batch` requests of `--tokens` tokens,
  unconstrained against held to `[a-z ]+` (two states: the per-step cost of the
  masks) and to JSON lines (`JSON_LINES`: some 40 states; like `[a-z ]+` it can
  always go on, so every request runs its `--tokens` and the batch stays full, where
  a pattern that completes would end requests early and shrink it), jump-forward
  off so that every token is a step's, in alternation
  (`--repeats`); with overlapped decode (a GPU's) a constrained step's
  sampling also waits for the host to read the step before (its forward does
  not: `ModelRunner.sample_deferred`), which costs nothing on CPU;
- `jump-forward`: `--batch` requests answering a JSON schema of six keys (`ANSWER`:
  strings, an integer, enums, a boolean), the engine with jump-forward on against
  off (`EngineConfig.jump_forward`), alternated: the time to answer them all, the
  engine steps it took and the tokens an answer has (the two differ in tokens: the
  fixed text is tokenized alone, not as the model would split it).
"""

from __future__ import annotations

import argparse
import random
import time

from benchmarks import report
from benchmarks.arguments import positive_int

GOAL_COMPILE_S = 1.0
ANSWER = {"type": "object", "required": ["name", "city", "age", "kind", "colour", "ok"], "properties": {
    "name": {"type": "string", "maxLength": 12}, "city": {"type": "string", "maxLength": 12},
    "age": {"type": "integer", "minimum": 0, "maximum": 120}, "kind": {"enum": ["cat", "dog", "bird"]},
    "colour": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"}}}
JSON_LINES = r'(\{"id": \d{1,4}, "name": "[a-z ]{0,12}"\}\n)+'


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batch", type=positive_int, default=16)
    parser.add_argument("--tokens", type=positive_int, default=128)
    parser.add_argument("--repeats", type=positive_int, default=9)


def _patterns() -> dict[str, str]:
    from actors.json_schema import schema_regex
    from actors.json_text import free_json_regex
    from actors.regex_dfa import choice_regex

    schema = {"type": "object", "required": ["name", "age"], "properties": {
        "name": {"type": "string", "maxLength": 20}, "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 3}, "ok": {"type": "boolean"}}}
    return {"regex (a phone number)": r"\(\d{3}\) \d{3}-\d{4}",
            "choice of 100 strings": choice_regex([f"option {i}" for i in range(100)]),
            "JSON schema (4 properties)": schema_regex(schema),
            "JSON schema (a string of at most 1000 characters)": schema_regex({"type": "string", "maxLength": 1000}),
            "any JSON object": free_json_regex(),
            "auto answer, 2 strict tools": _strict_tools_regex(),
            "auto answer, 20 strict tools": _agent_tools_regex(20)}


def _strict_tools_regex() -> str:
    """An answer of text and calls of two strict tools (tool_choice "auto":
    cluster/hermes_calls.py held_regex)."""
    from cluster.tool_calls import Tool, tool_regex

    weather = {"type": "object", "required": ["city", "unit"], "additionalProperties": False, "properties": {
        "city": {"type": "string", "maxLength": 40}, "unit": {"enum": ["celsius", "fahrenheit"]}}}
    tools = [Tool.model_validate({"type": "function", "function": {"name": name, "parameters": parameters,
                                                                  "strict": True}})
             for name, parameters in (("get_weather", weather), ("get_time", None))]
    return tool_regex(tools, "auto")


def _agent_tools_regex(num_tools: int) -> str:
    """An answer of text and calls of an agent's strict tools, each its own seven
    arguments (five scalars, an enum, a list of strings)."""
    from cluster.tool_calls import Tool, tool_regex

    kinds = ["string", "integer", "boolean", "number", "string"]
    tools = []
    for i in range(num_tools):
        properties = {f"p{i}_{j}": {"type": kinds[(i + j) % 5]} for j in range(5)}
        properties |= {"mode": {"enum": ["a", "b", "c"]}, "items": {"type": "array", "items": {"type": "string"}}}
        tools.append(Tool.model_validate({"type": "function", "function": {
            "name": f"tool_{i}", "strict": True, "parameters": {"type": "object", "properties": properties,
                                                              "required": list(properties),
                                                              "additionalProperties": False}}}))
    return tool_regex(tools, "auto")


# Patterns at and past the automaton's bound (actors/regex_dfa.py MAX_STATES): how long
# the largest takes, and how soon one too large is refused.
LIMIT_PATTERNS = {"[a-z]{0,19900} (19902 states)": "[a-z]{0,19900}", "(.{0,40}x){0,40} (refused)": "(.{0,40}x){0,40}",
                  "[\\s\\S]{5000} (refused)": "[\\s\\S]{5000}"}


def _compile_s(pattern: str, repeats: int) -> tuple[float, int | str]:
    """Median seconds to compile (the cache cleared each time), and the DFA's states
    or "refused"."""
    from actors.regex_dfa import COMPILED, RegexError, compile_regex

    times, states = [], "refused"
    for _ in range(repeats):
        COMPILED.clear()
        started = time.perf_counter()
        try:
            states = len(compile_regex(pattern).transitions)
        except RegexError:
            pass
        times.append(time.perf_counter() - started)
    return report.median(times), states


def _qwen_sized_vocabulary() -> list[bytes]:
    rng = random.Random(0)
    alphabet = bytes(range(32, 127))
    tokens = [bytes([b]) for b in range(256)]
    while len(tokens) < 151_643:
        tokens.append(bytes(rng.choice(alphabet) for _ in range(min(int(rng.lognormvariate(1.7, 0.5)) + 1, 40))))
    return tokens


def _mask_ms(token_bytes: list[bytes], pattern: str, text: bytes) -> tuple[float, float]:
    """ms a state: first visits, then cached, along `text` read a byte at a time."""
    from actors.structured_output import TokenIndexes

    indexes = TokenIndexes(token_bytes)
    indexes.prepare(pattern)
    byte_ids = {data[0]: i for i, data in enumerate(token_bytes) if len(data) == 1}
    ids = [byte_ids[b] for b in text]  # a token a byte: every state along the text is visited
    result = []
    for _ in range(2):
        constraint = indexes.constraint(pattern, [])
        started = time.perf_counter()
        for i in range(len(ids) + 1):
            constraint.mask(ids, i)
        result.append((time.perf_counter() - started) / (len(ids) + 1) * 1e3)
    return result[0], result[1]


def _prompts(batch: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 2000) for _ in range(32)] for _ in range(batch)]


def _decode_s(llm, pattern: str | None, args, seed: int) -> float:
    from actors.sampling_params import SamplingParams

    params = SamplingParams(max_new_tokens=args.tokens, temperature=0.8, seed=seed, ignore_eos=True, regex=pattern)
    started = time.perf_counter()
    outputs = llm.generate(_prompts(args.batch, seed), params)
    elapsed = time.perf_counter() - started
    return elapsed / sum(len(o.token_ids) for o in outputs)


def _jump_forward(args) -> dict[str, dict[str, list[float]]]:
    from actors.json_schema import schema_regex
    from actors.llm import LLM
    from actors.model_builder import ensure_checkpoint
    from actors.sampling_params import SamplingParams

    model_dir = ensure_checkpoint("tiny", "qwen2")
    engines = {name: LLM(model_dir, max_num_seqs=args.batch, enable_prefix_cache=False, jump_forward=name == "on")
               for name in ("on", "off")}
    pattern = schema_regex(ANSWER)
    results = {name: {"s": [], "steps": [], "tokens": []} for name in engines}
    for repeat in range(args.repeats):
        for name in (list(engines) if repeat % 2 == 0 else list(reversed(engines))):
            llm = engines[name]
            steps = llm.engine.num_steps
            started = time.perf_counter()
            params = SamplingParams(max_new_tokens=200, temperature=0.8, seed=repeat, regex=pattern)
            outputs = llm.generate(_prompts(args.batch, repeat), params)
            results[name]["s"].append(time.perf_counter() - started)
            results[name]["steps"].append(llm.engine.num_steps - steps)
            results[name]["tokens"].append(sum(len(o.token_ids) for o in outputs) / len(outputs))
    return results


def main(args: argparse.Namespace) -> None:
    import torch

    from actors.json_schema import schema_regex
    from actors.json_text import free_json_regex
    from actors.llm import LLM
    from actors.model_builder import ensure_checkpoint

    torch.set_num_threads(1)
    compiled = {name: _compile_s(pattern, args.repeats)
                for name, pattern in {**_patterns(), **LIMIT_PATTERNS}.items()}
    report.print_table("Compiling a pattern (median)", ["pattern", "ms", "DFA states"],
                       [[name, s * 1e3, states] for name, (s, states) in compiled.items()])

    # Jump-forward off: these rows are the masks' cost, step for step (JSON lines has fixed text to jump).
    llm = LLM(ensure_checkpoint("tiny", "qwen2"), max_num_seqs=args.batch, enable_prefix_cache=False,
              jump_forward=False)
    text = b'{"name": "Ada", "tags": ["x", "y"], "nested": {"n": [1, 2.5, null]}, "ok": true}'
    vocabularies = {"tiny preset (2,048 tokens)": llm.engine.byte_level.without_special,
                    "Qwen2-sized (151,643 tokens)": _qwen_sized_vocabulary()}
    masks = {name: _mask_ms(tokens, free_json_regex(), text) for name, tokens in vocabularies.items()}
    report.print_table("A state's token mask, any JSON object (ms a state)", ["vocabulary", "first visit", "cached"],
                       [[name, first, cached] for name, (first, cached) in masks.items()])
    long_string = schema_regex({"type": "string", "maxLength": 2000})
    string_masks = {name: _mask_ms(tokens, long_string, b'"' + b"ab\\n" * 250) for name, tokens in vocabularies.items()}
    report.print_table("A state's token mask, the first 750 characters of a string of at most 2000 (ms a state)",
                       ["vocabulary", "first visit", "cached"],
                       [[name, first, cached] for name, (first, cached) in string_masks.items()])

    workloads = {"unconstrained": None, "[a-z ]+": "[a-z ]+", "JSON lines": JSON_LINES}
    times: dict[str, list[float]] = {name: [] for name in workloads}
    for repeat in range(args.repeats):
        for name in (list(workloads) if repeat % 2 == 0 else list(reversed(workloads))):
            times[name].append(_decode_s(llm, workloads[name], args, seed=repeat))
    base = report.median(times["unconstrained"])
    report.print_table(f"Decoding {args.batch} requests x {args.tokens} tokens, tiny preset (median of "
                       f"{args.repeats})", ["workload", "ms a token", "min", "max", "x unconstrained"],
                       [[name, report.median(t) * 1e3, min(t) * 1e3, max(t) * 1e3, report.median(t) / base]
                        for name, t in times.items()])
    jumps = _jump_forward(args)
    report.print_table(f"{args.batch} answers to a six-key JSON schema, tiny preset (median of {args.repeats})",
                       ["jump-forward", "s for the batch", "engine steps", "tokens an answer"],
                       [[name, report.median(r["s"]), report.median(r["steps"]), report.median(r["tokens"])]
                        for name, r in jumps.items()])
    slowest = max(s for s, _ in compiled.values())  # the limit patterns included
    json_ratio = report.median(times["JSON lines"]) / base
    jump_ratio = report.median(jumps["on"]["s"]) / report.median(jumps["off"]["s"])
    report.finish(
        "structured", args.out,
        {"config": {k: v for k, v in vars(args).items() if not callable(v)}, "compile_s": compiled,
         "mask_ms": masks, "string_mask_ms": string_masks, "decode_s_per_token": times, "jump_forward": jumps,
         "machine": report.machine_info()},
        f"slowest compile {slowest * 1e3:.0f} ms; JSON-lines decode {json_ratio:.2f}x unconstrained; "
        f"jump-forward answers a schema in {jump_ratio:.2f}x the time",
        f"compile <= {GOAL_COMPILE_S:g} s",
    )
