"""Engine behaviour beyond greedy parity: sampling, stops, limits, bad input,
aborts, and block accounting under a randomized workload."""

from __future__ import annotations

import json
import random

import pytest
import torch

from actors.config import CheckpointError, EngineConfig, ModelLocation
from actors.engine import Engine
from actors.llm import LLM
from actors.request import FinishReason
from actors.sampling_params import InvalidRequestError, SamplingParams
from actors.stop_strings import StopStrings
from actors.tokenization import encode_prompt, load_tokenizer


@pytest.fixture(scope="module")
def llm(tiny_qwen2_dir):
    # (128 tokens a step at most: every step on the C++ small-batch linear layers, whose rows leave each other
    # alone; MKL's, past 128 rows, round by the step's size: kernels/sampling.py)
    return LLM(tiny_qwen2_dir, block_size=16, prefill_chunk_size=48, max_num_batched_tokens=128)


def test_same_seed_same_output_whatever_shares_the_batch(llm):
    params = SamplingParams(max_new_tokens=24, temperature=0.9, top_p=0.95, top_k=50, seed=42)
    alone = llm.generate(["A seeded request"], params)[0]
    rng = random.Random(0)
    others = [
        SamplingParams(max_new_tokens=rng.randint(4, 30), temperature=rng.choice([0.0, 0.7, 1.3]))
        for _ in range(7)
    ]
    prompts = ["noise " * rng.randint(1, 40) for _ in range(7)]
    mixed = llm.generate(prompts[:3] + ["A seeded request"] + prompts[3:], others[:3] + [params] + others[3:])
    assert mixed[3].token_ids == alone.token_ids
    unseeded = SamplingParams(max_new_tokens=24, temperature=0.9)
    a, b = llm.generate(["A seeded request"] * 2, unseeded)
    assert a.token_ids != b.token_ids  # without a seed, each request draws its own


def test_sampling_at_high_temperature_differs_from_greedy(llm):
    greedy = llm.generate(["Sampling"], SamplingParams(max_new_tokens=32, temperature=0))[0]
    sampled = llm.generate(["Sampling"], SamplingParams(max_new_tokens=32, temperature=2.0, seed=1, ignore_eos=True))[0]
    assert sampled.token_ids != greedy.token_ids


def test_max_new_tokens_and_ignore_eos(llm):
    out = llm.generate(["Count"], SamplingParams(max_new_tokens=5, temperature=0, ignore_eos=True))[0]
    assert len(out.token_ids) == 5 and out.finish_reason is FinishReason.LENGTH


def test_stop_token_ids_end_the_request(llm):
    free = llm.generate(["Stop here"], SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True))[0]
    stop_id = free.token_ids[3]
    first = free.token_ids.index(stop_id)
    out = llm.generate(
        ["Stop here"], SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True, stop_token_ids=(stop_id,))
    )[0]
    assert out.token_ids == free.token_ids[: first + 1]
    assert out.finish_reason is FinishReason.STOP and out.stop_matched == stop_id  # (SGLang's `matched`)
    assert free.stop_matched is None  # (ended for its length)
    # The stop token's text is left out of the text, as vLLM leaves it, unless asked for (it was left out always)
    kept = llm.generate(["Stop here"], SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True,
                                                      stop_token_ids=(stop_id,), include_stop_str_in_output=True))[0]
    assert kept.token_ids == out.token_ids
    assert out.text == llm.tokenizer.decode(out.token_ids[:-1]) and kept.text == llm.tokenizer.decode(out.token_ids)


def test_eos_ends_the_request_unless_ignored(llm, tiny_qwen2_dir, tmp_path):
    free = llm.generate(["Until EOS"], SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True))[0]
    eos = free.token_ids[4]
    # The same weights with that token declared as EOS in config.json.
    for item in tiny_qwen2_dir.iterdir():
        (tmp_path / item.name).write_bytes(item.read_bytes())
    config = json.loads((tmp_path / "config.json").read_text())
    config["eos_token_id"] = eos
    (tmp_path / "config.json").write_text(json.dumps(config))
    eos_llm = LLM(tmp_path, block_size=16)
    stopped = eos_llm.generate(["Until EOS"], SamplingParams(max_new_tokens=12, temperature=0))[0]
    assert stopped.token_ids == free.token_ids[: free.token_ids.index(eos) + 1]
    assert stopped.finish_reason is FinishReason.STOP
    ignored = eos_llm.generate(["Until EOS"], SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True))[0]
    assert ignored.token_ids == free.token_ids


def test_generation_config_end_tokens_end_the_request_too(llm, tiny_qwen2_dir, tmp_path):
    """An end token listed only in generation_config.json (an instruct model's end
    of turn, Llama 3's `<|eot_id|>`) stops a request as config.json's does, as
    transformers' generate stops; `ignore_eos` ignores both."""
    free = llm.generate(["End of turn"], SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True))[0]
    end_of_turn = free.token_ids[3]
    for item in tiny_qwen2_dir.iterdir():
        (tmp_path / item.name).write_bytes(item.read_bytes())
    generation = json.loads((tmp_path / "generation_config.json").read_text())
    generation["eos_token_id"] = [0, end_of_turn]
    (tmp_path / "generation_config.json").write_text(json.dumps(generation))
    chat_llm = LLM(tmp_path, block_size=16)
    assert chat_llm.engine.model_config.eos_token_ids == (0, end_of_turn)  # config.json's first
    stopped = chat_llm.generate(["End of turn"], SamplingParams(max_new_tokens=12, temperature=0))[0]
    assert stopped.token_ids == free.token_ids[: free.token_ids.index(end_of_turn) + 1]
    assert stopped.finish_reason is FinishReason.STOP
    ignored = chat_llm.generate(["End of turn"], SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True))[0]
    assert ignored.token_ids == free.token_ids


def test_text_prompts_get_the_tokenizers_bos_and_templated_ones_do_not(tmp_path):
    """A tokenizer that puts a BOS before every text (Llama 3's does): a text
    prompt gets it, offline and through `encode_prompt` (what the Serve app runs for
    completions and /generate), as transformers gives it; text a chat template
    wrote does not (the template wrote its own: the chat bodies' default), nor a
    completion that says `add_special_tokens: false`; ids stay as they are."""
    from actors.model_builder import ensure_checkpoint

    for item in ensure_checkpoint("tiny", "llama").iterdir():
        (tmp_path / item.name).write_bytes(item.read_bytes())
    tokenizer_json = json.loads((tmp_path / "tokenizer.json").read_text())
    bos = {"SpecialToken": {"id": "<|im_start|>", "type_id": 0}}
    tokenizer_json["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [bos, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [bos, {"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {"<|im_start|>": {"id": "<|im_start|>", "ids": [1], "tokens": ["<|im_start|>"]}},
    }
    (tmp_path / "tokenizer.json").write_text(json.dumps(tokenizer_json))
    tokenizer = load_tokenizer(tmp_path)
    bare = tokenizer.encode("Once upon a time", add_special_tokens=False)
    assert encode_prompt(tokenizer, "Once upon a time") == [1] + bare == tokenizer("Once upon a time").input_ids
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                         add_generation_prompt=True)
    assert encode_prompt(tokenizer, chat, add_special_tokens=False) == tokenizer.encode(chat, add_special_tokens=False)
    assert encode_prompt(tokenizer, "Once upon a time", add_special_tokens=False) == bare
    assert encode_prompt(tokenizer, bare) == bare
    llm = LLM(tmp_path, block_size=16)
    out = llm.generate(["Once upon a time"], SamplingParams(max_new_tokens=2))[0]
    assert out.prompt_token_ids == [1] + bare
    answer = llm.chat([{"role": "user", "content": "hi"}], SamplingParams(max_new_tokens=2))[0]  # as chat over HTTP
    assert answer.prompt_token_ids == tokenizer.encode(chat, add_special_tokens=False)


def test_stop_strings_cut_the_text(llm):
    free = llm.generate(["Stop string"], SamplingParams(max_new_tokens=20, temperature=0, ignore_eos=True))[0]
    text = free.text
    assert len(text) > 6
    stop = text[4:6]
    out = llm.generate(["Stop string"], SamplingParams(max_new_tokens=20, temperature=0, ignore_eos=True, stop=stop))[0]
    assert out.finish_reason is FinishReason.STOP
    assert out.text == text[: text.find(stop)]
    assert stop not in out.text


def test_stop_strings_anywhere_end_at_the_first_match(llm):
    """Stop strings cut across token boundaries at random offsets (several at once):
    the text ends right before the match that ends first in the whole output (the
    search only looks at where a new match can end, so this pins that it misses
    none)."""
    rng = random.Random(5)
    prompts = [f"stop {i}" for i in range(6)]
    base = SamplingParams(max_new_tokens=40, temperature=0, ignore_eos=True)
    for prompt, free in zip(prompts, llm.generate(prompts, base)):
        text = free.text
        stops = []
        for _ in range(3):
            start = rng.randrange(1, len(text) - 1)
            stops.append(text[start : start + rng.randint(1, 6)])
        out = llm.generate([prompt], SamplingParams(max_new_tokens=40, temperature=0, ignore_eos=True, stop=stops))[0]
        end, start, first = min((text.find(s) + len(s), text.find(s), s) for s in stops)
        assert out.finish_reason is FinishReason.STOP and out.text == text[:start], (text, stops, out.text)
        assert out.stop_matched == first  # (the match that ends first)
        # Kept (include_stop_str_in_output): the text ends with the match that ends first.
        kept = llm.generate([prompt], SamplingParams(max_new_tokens=40, temperature=0, ignore_eos=True, stop=stops,
                                                     include_stop_str_in_output=True))[0]
        assert kept.text == text[:end] and kept.token_ids == out.token_ids, (text, stops, kept.text)


@pytest.mark.parametrize("keep", [False, True])
def test_overlapping_stop_strings_cut_where_the_first_to_end_does_however_the_text_came(keep):
    """Found by a review: with "Hello" and "ell", "H|el|lo" was cut to "" and
    "H|e|l|l|o" to "H" (the earliest start among a step's matches). Kept, a
    stop string ends in text not read yet: nothing is held back."""
    for splits in (["H", "el", "lo wor"], ["H", "e", "l", "l", "o"], ["Hello"], ["xH", "ello"]):
        stops = StopStrings(("Hello", "ell"), keep)
        text, dropped = "", None
        for piece in splits:
            text += piece
            dropped = stops.feed(piece)
            if dropped is not None:
                break
        cut = text[: len(text) - dropped]
        assert cut == text[: text.index("ell") + (3 if keep else 0)], (splits, cut)
        assert stops.held_chars == (0 if keep else 4)


def test_a_stop_string_that_begins_before_min_new_tokens_stops_where_it_ends(llm, tiny_qwen2_dir):
    """A match that begins in the text of the tokens `min_new_tokens` keeps and
    ends in the first token allowed to stop is a match (vLLM's too): the search
    keeps its tail from the first token on, not from where stopping begins."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen2_dir)
    kw = dict(max_new_tokens=30, temperature=0, ignore_eos=True)
    free = llm.generate(["min then stop"], SamplingParams(**kw))[0]
    texts = [tokenizer.decode(free.token_ids[: k + 1]) for k in range(len(free.token_ids))]
    cases = 0
    for k in range(1, 20):  # a stop of token k-1's last character and token k's first
        before, after = texts[k - 1], texts[k]
        if not before or len(after) <= len(before) or "\ufffd" in after:
            continue
        stop = before[-1] + after[len(before)]
        if free.text.find(stop) != len(before) - 1:  # (its first match must be that one)
            continue
        out = llm.generate(["min then stop"], SamplingParams(**kw, min_new_tokens=k, stop=stop))[0]
        assert out.finish_reason is FinishReason.STOP and len(out.token_ids) == k + 1, (stop, k, out)
        assert out.text == free.text[: len(before) - 1]
        cases += 1
    assert cases >= 2


def test_a_stop_string_in_the_tail_flushed_at_the_end_stops_the_request(llm):
    """The last token leaves an incomplete character, flushed as U+FFFD when the
    request ends: the flushed tail was never searched for stop strings, and a
    stop of U+FFFD ended the request for its length with the stop in its text
    (found by a review; one mid-text stopped it)."""
    kw = dict(max_new_tokens=4, temperature=1.3, seed=70, ignore_eos=True)
    prompt = [5, 77, 1200, 33, 73]
    free = llm.generate([prompt], SamplingParams(**kw))[0]
    assert free.text.endswith("\ufffd") and free.text.count("\ufffd") == 1, free.text  # (the case: the tail's)
    out = llm.generate([prompt], SamplingParams(**kw, stop=("\ufffd",)))[0]
    assert out.finish_reason is FinishReason.STOP and out.text == free.text[:-1] and out.stop_matched == "\ufffd"
    engine = llm.engine  # aborted with the tail held back, it stays aborted (found by a second read)
    engine.add_request(prompt, SamplingParams(**{**kw, "max_new_tokens": 8}, stop=("\ufffd",)), "cut")
    while len(engine.requests["cut"].output_token_ids) < 4:
        engine.step()
    assert engine.abort("cut").finish_reason is FinishReason.ABORT


def test_text_equals_decoding_the_tokens(llm):
    params = SamplingParams(max_new_tokens=40, temperature=1.5, seed=3, ignore_eos=True)
    for out in llm.generate(["héllo wörld 中文 🙂", "plain"], params):
        assert out.text == llm.tokenizer.decode(out.token_ids, skip_special_tokens=True)


def test_top_n_logprobs(llm):
    out = llm.generate(["Logprobs"], SamplingParams(max_new_tokens=4, temperature=0, logprobs=3))[0]
    for lp in out.logprobs:
        assert len(lp.top) == 3
        assert lp.top[0][0] == lp.token_id  # greedy picks the best
        assert lp.top[0][1] == pytest.approx(lp.logprob)
        assert lp.top[0][1] >= lp.top[1][1] >= lp.top[2][1]


@pytest.mark.parametrize(
    "prompt, kwargs, message",
    [
        ("", dict(max_new_tokens=4), "prompt is empty"),
        ([], dict(max_new_tokens=4), "prompt is empty"),
        ([1] * 5000, dict(max_new_tokens=4), "context"),
        ([10**9], dict(max_new_tokens=4), "outside the vocabulary"),
        # a stop id outside the vocabulary: min_new_tokens would index the logits with it
        ("hi", dict(max_new_tokens=4, min_new_tokens=2, stop_token_ids=(-280,)), "stop_token_ids token id -280"),
        ("hi", dict(max_new_tokens=4, stop_token_ids=(10**9,)), "stop_token_ids token id"),
    ],
)
def test_bad_prompts_are_refused(llm, prompt, kwargs, message):
    with pytest.raises(InvalidRequestError, match=message):
        llm.generate([prompt], SamplingParams(**kwargs))
    assert not llm.engine.has_unfinished()


def test_a_vanishing_temperature_is_greedy(llm):
    """Below 1e-5 (vLLM's line) a temperature samples greedily, its limit: 1e-30
    would overflow float32 logits into NaN, and 5e-50 is 0 in float32."""
    assert SamplingParams(temperature=5e-50).is_greedy and not SamplingParams(temperature=1e-5).is_greedy
    greedy, *tiny = llm.generate(["A vanishing temperature"] * 3, [
        SamplingParams(max_new_tokens=8, temperature=t, ignore_eos=True) for t in (0.0, 1e-30, 5e-50)])
    assert all(out.token_ids == greedy.token_ids for out in tiny)


def test_an_argmax_alone_reads_the_logits_in_the_models_dtype(tiny_qwen2_dir):
    """A step whose rows are all greedy, with no logprobs and no logit processing,
    takes its argmax from bfloat16 logits (no float32 copy); every other step gets
    float32. The tokens are those of float32 logits: the conversion is exact."""
    llm = LLM(tiny_qwen2_dir, dtype="bfloat16", enable_prefix_cache=False)
    model, asked = llm.engine.runner.model, []
    compute_logits = model.compute_logits
    model.compute_logits = lambda rows, float32=True: asked.append(float32) or compute_logits(rows, float32)
    prompts = [list(range(5 + i, 40 + 3 * i)) for i in range(4)]
    plain = SamplingParams(max_new_tokens=12, ignore_eos=True, temperature=0)
    tokens = [out.token_ids for out in llm.generate(prompts, plain)]
    assert asked and not any(asked)
    model.compute_logits = lambda rows, float32=True: compute_logits(rows, True)  # float32 always
    assert [out.token_ids for out in llm.generate(prompts, plain)] == tokens
    model.compute_logits = lambda rows, float32=True: asked.append(float32) or compute_logits(rows, float32)
    asked.clear()
    beside = SamplingParams(max_new_tokens=3, ignore_eos=True, temperature=0)  # ends with the other row
    for params in (SamplingParams(max_new_tokens=3, ignore_eos=True, temperature=0, logprobs=1),
                   SamplingParams(max_new_tokens=3, ignore_eos=True, temperature=0, repetition_penalty=1.1),
                   SamplingParams(max_new_tokens=3, ignore_eos=True, temperature=0.7, seed=1)):
        llm.generate(prompts[:1] * 2, [beside, params])
        assert asked and all(asked)
        asked.clear()
    assert not SamplingParams(temperature=0, regex="[a-z]+").argmax_only and SamplingParams(temperature=0).argmax_only


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(max_new_tokens=0), "max_new_tokens"),
        (dict(temperature=-0.1), "temperature"),
        (dict(temperature=1e300), r"temperature must be in \[0, 10000\]"),  # inf in float32: NaN logits
        (dict(temperature=float("nan")), "temperature"),
        (dict(repetition_penalty=5e-324), r"repetition_penalty must be in \[0.01, 10\]"),  # 0 in float32
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=-1), "top_k"),
        (dict(stop=("",)), "stop"),
        (dict(max_new_tokens=4, min_new_tokens=5), r"min_new_tokens \(5\) must be <= max_new_tokens \(4\)"),
    ],
)
def test_bad_sampling_params_are_refused(kwargs, message):
    with pytest.raises(InvalidRequestError, match=message):
        SamplingParams(**kwargs)


def test_a_mixtures_experts_load_from_the_hubs_layout_or_transformers_v5s(tmp_path):
    """Experts one by one (`mlp.experts.<e>.gate_proj.weight`, as the Hub and the
    builder store them) or as 3D tensors (`mlp.experts.gate_up_proj`, transformers
    v5's modules): the same model. An expert the model does not have is refused."""
    from safetensors.torch import save_file

    from actors.model_builder import ensure_checkpoint

    hub = ensure_checkpoint("tiny", "qwen3_moe")
    params = SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True)
    expected = LLM(hub, block_size=16).generate([[5, 6, 7]], params)[0].token_ids
    engine = Engine(hub, EngineConfig(block_size=16))
    weights = {name: tensor.contiguous() for name, tensor in engine.runner.model.state_dict().items()}
    folder = tmp_path / "fused"
    folder.mkdir()
    for item in hub.iterdir():
        if not item.name.endswith(".safetensors"):
            (folder / item.name).write_bytes(item.read_bytes())
    save_file(_hf_names(weights, engine.model_config), str(folder / "model.safetensors"))
    assert LLM(folder, block_size=16).generate([[5, 6, 7]], params)[0].token_ids == expected
    extra = _hf_names(weights, engine.model_config)
    extra["model.layers.1.mlp.experts.99.up_proj.weight"] = torch.zeros(8, 128)
    save_file(extra, str(folder / "model.safetensors"))
    with pytest.raises(CheckpointError, match="the model has 8 experts"):
        Engine(folder, EngineConfig(block_size=16))


def _hf_names(weights: dict, config) -> dict:
    """Our parameters under HF's names: q/k/v and gate/up split again, experts left
    as the 3D tensors transformers v5 holds."""
    out, q, kv, inter = {}, config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim, \
        config.intermediate_size
    for name, tensor in weights.items():
        if name.endswith("qkv_proj.weight"):
            base = name.removesuffix("qkv_proj.weight")
            out[base + "q_proj.weight"], out[base + "k_proj.weight"], out[base + "v_proj.weight"] = (
                t.contiguous() for t in tensor.split([q, kv, kv]))
        elif name.endswith("mlp.gate_up_proj.weight"):
            base = name.removesuffix("gate_up_proj.weight")
            out[base + "gate_proj.weight"], out[base + "up_proj.weight"] = (t.contiguous() for t in tensor.split(inter))
        else:
            out[name] = tensor
    return out


def test_missing_and_corrupt_checkpoints(tmp_path, tiny_qwen2_dir):
    with pytest.raises(CheckpointError, match="no such checkpoint"):
        Engine(tmp_path / "nope")
    with pytest.raises(CheckpointError, match="no such checkpoint"):  # (not taken for a Hub repo id)
        load_tokenizer(tmp_path / "nope")
    with pytest.raises(CheckpointError, match=f"model folder {tmp_path / 'nope'} not found: model.path must name"):
        ModelLocation(path=str(tmp_path / "nope")).resolve()  # a manifest's model.path
    with pytest.raises(CheckpointError, match="config.json"):
        Engine(tmp_path)
    broken = tmp_path / "broken"
    broken.mkdir()
    for item in tiny_qwen2_dir.iterdir():
        (broken / item.name).write_bytes(item.read_bytes())
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(CheckpointError, match="safetensors"):
        Engine(broken)
    (broken / "generation_config.json").write_text('{"eos_token_id": "end"}')
    with pytest.raises(CheckpointError, match="generation_config.json: invalid eos_token_id"):
        Engine(broken)
    (broken / "generation_config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="generation_config.json: unreadable"):
        Engine(broken)
    (broken / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="config"):
        Engine(broken)
    no_vocabulary = tmp_path / "no-vocabulary"
    no_vocabulary.mkdir()
    for item in tiny_qwen2_dir.iterdir():
        if not item.name.startswith("tokenizer"):
            (no_vocabulary / item.name).write_bytes(item.read_bytes())
    with pytest.raises(CheckpointError, match="the tokenizer encodes no text"):  # (every prompt was "empty")
        load_tokenizer(no_vocabulary)


def test_abort_frees_blocks(tiny_qwen2_dir):
    engine = Engine(tiny_qwen2_dir, EngineConfig(block_size=16, prefill_chunk_size=32))
    engine.add_request([5] * 100, SamplingParams(max_new_tokens=50), "a")
    engine.add_request([6] * 40, SamplingParams(max_new_tokens=50), "b")
    engine.step()
    assert engine.pool.num_used > 0
    out = engine.abort("a")
    assert out.finish_reason is FinishReason.ABORT and out.finished
    engine.abort("b")
    assert engine.abort("missing") is None
    assert not engine.has_unfinished()
    engine.pool.check()
    assert engine.pool.num_used == 0


def test_the_runner_reads_and_writes_whole_kv_blocks(tiny_qwen2_dir):
    """A transfer's two ends: P reads listed blocks as one tensor, D writes such a
    tensor into its own blocks; every other block stays as it was."""
    runner = Engine(tiny_qwen2_dir, EngineConfig(block_size=16, num_kv_blocks=8)).runner
    runner.kv_cache.copy_(torch.randn_like(runner.kv_cache))
    before = runner.kv_cache.clone()
    kv = runner.read_blocks([6, 1, 4])
    assert kv.is_contiguous() and torch.equal(kv, before[[6, 1, 4]])
    runner.write_blocks([0, 7, 2], kv)
    assert torch.equal(runner.kv_cache[[0, 7, 2]], kv)
    assert torch.equal(runner.kv_cache[[1, 3, 4, 5, 6]], before[[1, 3, 4, 5, 6]])


@pytest.mark.parametrize("overlap", [False, True], ids=["in-turn", "overlapped"])
def test_randomized_workload_keeps_block_accounting(tiny_qwen2_dir, overlap):
    """Arrivals, aborts and preemption at random; invariants after every step (with
    overlapped decode, a step may be in flight then)."""
    rng = random.Random(7)
    engine = Engine(tiny_qwen2_dir, EngineConfig(block_size=16, num_kv_blocks=40, prefill_chunk_size=40,
                                                 max_num_batched_tokens=96, overlap_decode=overlap))
    live: list[str] = []
    for step in range(300):
        if rng.random() < 0.3:
            prompt = [rng.randrange(100) for _ in range(rng.randint(1, 200))]
            params = SamplingParams(max_new_tokens=rng.randint(1, 60), temperature=rng.choice([0, 1.0]), ignore_eos=True)
            live.append(engine.add_request(prompt, params))
        if live and rng.random() < 0.05:
            engine.abort(live.pop(rng.randrange(len(live))))
        for out in engine.step():
            if out.finished:
                live.remove(out.request_id)
        engine.pool.check()
        tables = [b for r in engine.scheduler.running for b in r.block_table]
        assert len(tables) == len(set(tables)) or engine.config.enable_prefix_cache
        assert engine.pool.num_used == len(set(tables))
        assert all(not r.block_table for r in engine.scheduler.waiting)
    while engine.has_unfinished():
        engine.step()
    engine.pool.check()
    assert engine.pool.num_used == 0
    assert engine.scheduler.num_preemptions > 0
    assert (engine.num_steps_launched_ahead > 0) == overlap


def test_kernel_backends_give_the_same_tokens(tiny_qwen2_dir):
    """The C++ CPU kernels (auto: decode attention and small-batch linear) and the
    torch references agree on a batch."""
    rng = random.Random(11)
    prompts = [[rng.randrange(3, 2000) for _ in range(n)] for n in (1, 17, 64, 150, 333)]
    params = SamplingParams(max_new_tokens=20, temperature=0, ignore_eos=True)
    outputs = {}
    for backend in ("auto", "torch"):
        llm = LLM(tiny_qwen2_dir, block_size=16, prefill_chunk_size=64, kernel_backend=backend)
        outputs[backend] = [o.token_ids for o in llm.generate(prompts, params)]
    assert outputs["auto"] == outputs["torch"]


def test_an_output_keeps_what_it_said_as_the_request_goes_on(llm):
    """Outputs share the request's growing lists (no copy a step): each must still
    read as of its own step afterwards, and `new_token_ids` give the tail."""
    engine = llm.engine
    engine.add_request([5, 6, 7], SamplingParams(max_new_tokens=12, temperature=0.5, seed=1, logprobs=1), "snap")
    seen = []
    while engine.has_unfinished():
        seen += [(out, out.token_ids, out.logprobs, out.token_times_s) for out in engine.step()]
    final = seen[-1][0]
    assert final.finished and final.num_tokens == 12
    for out, token_ids, logprobs, times in seen:
        assert out.token_ids == token_ids == final.token_ids[: out.num_tokens]
        assert out.logprobs == logprobs and out.token_times_s == times and len(times) == out.num_tokens
        assert final.new_token_ids(out.num_tokens) == final.token_ids[out.num_tokens :]
        assert final.new_logprobs(out.num_tokens) == final.logprobs[out.num_tokens :]


@pytest.mark.parametrize("max_model_len", [0, 1, -5])
def test_a_max_model_len_with_no_room_for_a_token_is_refused_clearly(max_model_len):
    """0 meant the model's whole context; a negative one refused every prompt
    for its length."""
    with pytest.raises(ValueError, match="max_model_len must be >= 2"):
        EngineConfig(max_model_len=max_model_len)
