"""A checkpoint's sampling defaults (generation_config.json): what is read, what
is refused, how the HTTP bodies fill only the fields a request left out, and the
same over real HTTP and offline."""

from __future__ import annotations

import json

import httpx
import pytest

from actors.config import CheckpointError
from actors.llm import LLM
from actors.sampling_defaults import SamplingDefaults
from actors.sampling_params import SamplingParams
from cluster.api_models import ChatBody, CompletionBody
from cluster.sglang_body import GenerateBody
from tests.conftest import served_app

# Qwen2.5 Instruct's generation_config.json, less its token ids.
QWEN_INSTRUCT = {"do_sample": True, "temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05}
MODEL = SamplingDefaults(temperature=0.7, top_p=0.8, top_k=20, repetition_penalty=1.05)
MODEL_MIN_P = SamplingDefaults(temperature=0.6, top_p=0.95, top_k=20, min_p=0.05)


def with_generation_config(folder, **fields):
    (folder / "generation_config.json").write_text(json.dumps(fields))
    return folder


def copy_checkpoint(source, folder, **generation):
    """The checkpoint at `source` in `folder`, its generation_config.json's fields
    updated with `generation`."""
    for item in source.iterdir():
        (folder / item.name).write_bytes(item.read_bytes())
    config = json.loads((folder / "generation_config.json").read_text())
    return with_generation_config(folder, **{**config, **generation})


# ---- reading generation_config.json -------------------------------------------------------
def test_the_fields_the_file_names_are_the_defaults(tmp_path):
    assert SamplingDefaults.load(with_generation_config(tmp_path, **QWEN_INSTRUCT)) == MODEL
    assert SamplingDefaults.load(tmp_path, "openai") == SamplingDefaults()
    partial = with_generation_config(tmp_path, temperature=0.6, top_p=0.9, top_k=None, max_new_tokens=64)
    assert SamplingDefaults.load(partial) == SamplingDefaults(temperature=0.6, top_p=0.9)
    min_p = with_generation_config(tmp_path, temperature=0.6, top_p=0.95, top_k=20, min_p=0.05)
    assert SamplingDefaults.load(min_p) == MODEL_MIN_P


def test_do_sample_and_a_missing_file_change_nothing(tmp_path, tiny_qwen2_dir):
    """`do_sample: false` (transformers' default, and the presets') does not make
    requests greedy, as in vLLM and SGLang; no file: OpenAI's defaults."""
    assert json.loads((tiny_qwen2_dir / "generation_config.json").read_text())["do_sample"] is False
    assert SamplingDefaults.load(tiny_qwen2_dir) == SamplingDefaults()
    assert SamplingDefaults.load(tmp_path) == SamplingDefaults()


@pytest.mark.parametrize("fields, message", [
    ({"top_p": 0}, "top_p must be in"),
    ({"temperature": -1}, r"temperature must be in \[0, 10000\]"),
    ({"temperature": "hot"}, "temperature must be a number"),
    ({"top_k": True}, "top_k must be a number"),
    ({"top_k": 2.5}, "top_k must be an integer"),
    ({"repetition_penalty": 0}, "repetition_penalty must be in"),
    ({"min_p": 1.5}, "min_p must be in"),
])
def test_defaults_no_request_could_carry_are_a_checkpoint_error(tmp_path, fields, message):
    with pytest.raises(CheckpointError, match=f"generation_config.json: {message}"):
        SamplingDefaults.load(with_generation_config(tmp_path, **fields))


def test_a_file_that_is_not_an_object_is_a_checkpoint_error(tmp_path):
    (tmp_path / "generation_config.json").write_text("[0.7]")
    with pytest.raises(CheckpointError, match="not a JSON object"):
        SamplingDefaults.load(tmp_path)


# ---- the HTTP bodies ----------------------------------------------------------------------
def sampled(params: SamplingParams) -> tuple:
    return params.temperature, params.top_p, params.top_k, params.min_p, params.repetition_penalty


@pytest.mark.parametrize("make", [
    lambda **f: ChatBody(messages=[{"role": "user", "content": "hi"}], **f).sampling(16, MODEL),
    lambda **f: CompletionBody(prompt="hi", **f).sampling(16, MODEL),
    lambda **f: GenerateBody(text="hi", **f).sampling(16, MODEL)[0],
    lambda **f: GenerateBody(text="hi", sampling_params=f).sampling(16, MODEL)[0],
], ids=["chat", "completions", "generate", "generate-sampling_params"])
def test_an_omitted_field_takes_the_models_default_and_a_set_one_wins(make):
    assert sampled(make()) == (0.7, 0.8, 20, 0.0, 1.05)
    # OpenAI's own values, set: they are what the request asked for, not "unset"
    assert sampled(make(temperature=1.0, top_p=1.0, repetition_penalty=1.0)) == (1.0, 1.0, 20, 0.0, 1.0)
    assert sampled(make(temperature=0, top_k=5, min_p=0.1)) == (0, 0.8, 5, 0.1, 1.05)
    assert make(temperature=0.5).seed is None and make(seed=3).temperature == 0.7


def test_a_models_min_p_fills_an_omitted_min_p():
    messages = [{"role": "user", "content": "hi"}]
    assert sampled(ChatBody(messages=messages).sampling(16, MODEL_MIN_P)) == (0.6, 0.95, 20, 0.05, 1.0)
    assert ChatBody(messages=messages, min_p=0).sampling(16, MODEL_MIN_P).min_p == 0
    assert GenerateBody(text="hi", min_p=0.2).sampling(16, MODEL_MIN_P)[0].min_p == 0.2


def test_sglangs_top_k_minus_one_turns_the_models_top_k_off():
    assert GenerateBody(text="hi", sampling_params={"top_k": -1}).sampling(16, MODEL)[0].top_k == 0
    assert GenerateBody(text="hi", top_k=-1).sampling(16, MODEL)[0].top_k == 0


# ---- served, and offline -------------------------------------------------------------------
ARGS = {
    "mode": "colocated",
    "colocated": {"replicas": 1, "num_cpus": 1},
    "engine": {"block_size": 16, "num_kv_blocks": 256},
    "pool_name": "test-pool-sampling-defaults",
}
PROMPT = [5, 6, 7, 8, 9, 10]
GREEDY_PENALISED = {"temperature": 0, "repetition_penalty": 1.5}  # the copy's defaults


@pytest.fixture(scope="module")
def model_dir(tiny_qwen2_dir, tmp_path_factory):
    return copy_checkpoint(tiny_qwen2_dir, tmp_path_factory.mktemp("sampling-defaults"), **GREEDY_PENALISED)


@pytest.fixture(scope="module")
def base_url(serve_port, model_dir):
    yield from served_app("defaults", {**ARGS, "model": {"path": str(model_dir)}}, serve_port)


def test_served_requests_take_the_checkpoints_defaults(base_url, model_dir):
    """The copy says greedy with a repetition penalty: a request that names neither
    gets exactly that (the same tokens as offline with those params), one that sets
    OpenAI's values gets plain sampling's, and offline `generate` without params
    samples as the checkpoint says too."""
    llm = LLM(model_dir, block_size=16)
    length = {"max_new_tokens": 16, "ignore_eos": True}
    (penalised,) = llm.generate([PROMPT], SamplingParams(**GREEDY_PENALISED, **length))
    (plain,) = llm.generate([PROMPT], SamplingParams(temperature=0, **length))
    assert penalised.token_ids != plain.token_ids  # the penalty shows in these 16 tokens
    default = llm.generate([PROMPT])[0].token_ids  # may end early, at an end token
    assert default and default == penalised.token_ids[:len(default)]
    assert llm.default_sampling_params(seed=2) == SamplingParams(**GREEDY_PENALISED, seed=2)

    def generate(**fields) -> list[int]:
        body = {"input_ids": PROMPT, "sampling_params": {**length, **fields}}
        response = httpx.post(f"{base_url}/generate", json=body, timeout=60)
        assert response.status_code == 200, response.text
        return response.json()["output_ids"]

    assert generate() == generate() == penalised.token_ids
    assert generate(temperature=0, repetition_penalty=1.0) == plain.token_ids
    # min_p 1 keeps only the best token: sampling at temperature 1 is greedy
    assert generate(temperature=1.0, min_p=1.0) == penalised.token_ids
    completion = httpx.post(f"{base_url}/v1/completions", timeout=60, json={
        "prompt": PROMPT, "max_tokens": 16, "ignore_eos": True}).json()
    assert completion["choices"][0]["text"] == penalised.text
