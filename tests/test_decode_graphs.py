"""The static-shape decode step that CUDA graphs replay, checked on CPU without
capture: padded rows must not change real rows, and must write only the scratch
block. (The capture itself needs CUDA: `benchmarks/gpu_check.py` compares engines
with and without graphs.)"""

import random

import torch

from actors.block_table_rows import BlockTableRows
from actors.decode_graphs import batch_buckets
from actors.host_tensors import padded_int64_rows
from actors.llm import LLM
from actors.sampling_params import SamplingParams


def test_batch_buckets():
    assert batch_buckets(1) == [1]
    assert batch_buckets(3) == [1, 2, 3]
    assert batch_buckets(8) == [1, 2, 4, 8]
    assert batch_buckets(20) == [1, 2, 4, 8, 16, 20]
    assert batch_buckets(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]


def test_block_table_rows_equal_the_tables_rebuilt_each_step():
    """The host mirror of the static step's block tables, against converting every
    table afresh: sequences that keep their rows and grow, swap rows, leave, come
    back as a new list (preempted, re-admitted), and padding rows."""
    rng = random.Random(8)
    pad, max_rows, max_blocks = 99_999, 8, 40
    rows = BlockTableRows(max_rows, max_blocks, pad)
    tables = [[rng.randrange(1000) for _ in range(rng.randint(1, 5))] for _ in range(12)]
    batch = tables[:5]
    for _ in range(300):
        for table in batch:  # decoding: now and then a block more
            if rng.random() < 0.3 and len(table) < max_blocks:
                table.append(rng.randrange(1000))
        event = rng.random()
        if event < 0.1:
            batch = rng.sample(tables, rng.randint(1, max_rows))  # another batch
        elif event < 0.15:
            index = rng.randrange(len(tables))
            tables[index] = [rng.randrange(1000) for _ in range(rng.randint(1, 3))]  # a new list
            batch = [t for t in batch if any(t is u for u in tables)] or [tables[index]]
        used = [rng.randint(max(1, len(t) - 1), len(t)) for t in batch]  # the step reads a prefix
        bucket = rng.randint(len(batch), max_rows)
        width = rows.update(batch, used, bucket)
        expected = padded_int64_rows([t[:n] for t, n in zip(batch, used)] + [[]] * (bucket - len(batch)), pad=pad)
        assert width == expected.shape[1]
        assert (rows.array[:bucket, :width] == expected.numpy()).all()
        assert (rows.array[:bucket, width:] == pad).all()


def test_padded_static_decode_matches_eager_bit_for_bit(tiny_qwen2_dir):
    """Five sequences finishing at different steps decode in batches of 5, 4, 3, 2
    and 1 (buckets 8, 4, 4, 2, 1): tokens, logprobs and every KV block but the
    scratch one are identical to the eager engine's (the CPU kernels are
    batch-invariant, so nothing is allowed to differ)."""
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 2000) for _ in range(n)] for n in (1, 15, 16, 40, 97)]
    params = [SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=True, logprobs=3) for n in (9, 14, 20, 25, 33)]
    engines = {}
    for mode in ("eager", "static"):
        llm = LLM(tiny_qwen2_dir, block_size=16, prefill_chunk_size=64, max_num_seqs=8, enable_prefix_cache=False)
        runner = llm.engine.runner
        if mode == "static":
            runner.decode_graphs = runner.static_decode(capture=False)
            assert runner.decode_graphs.buckets == [1, 2, 4, 8]
        outputs = llm.generate(prompts, params)
        engines[mode] = (outputs, runner)

    eager, static = engines["eager"], engines["static"]
    for ours, theirs in zip(static[0], eager[0]):
        assert ours.token_ids == theirs.token_ids
        assert ours.logprobs == theirs.logprobs
    scratch = static[1].scratch_block
    assert torch.equal(static[1].kv_cache[:scratch], eager[1].kv_cache[:scratch])
    assert static[1].kv_cache[scratch].abs().sum() > 0  # padding rows wrote there
    assert eager[1].kv_cache[scratch].abs().sum() == 0  # and nothing else does
