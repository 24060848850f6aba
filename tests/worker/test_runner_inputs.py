"""The model runner's step inputs (vectorised in numpy) equal the per-token Python loop they
replaced, on every step of traffic with prefill chunks, decodes, prefix-cache hits and
sequences joining and finishing."""

from __future__ import annotations

import numpy as np

from detgate.worker.engine import offline as wl
from detgate.worker.engine.config import EngineConfig
from detgate.worker.engine.engine import Engine
from detgate.worker.model.loader import load


def reference_inputs(batch, bs: int) -> dict[str, np.ndarray]:
    """The loop the runner ran before: one Python list entry per token."""
    ids, pos, slots, qsl, seq_lens = [], [], [], [0], []
    max_blocks = max(len(e.seq.block_table) for e in batch.entries)
    tables = np.full((len(batch), max_blocks), -1, dtype=np.int32)
    for i, e in enumerate(batch.entries):
        table = e.seq.block_table
        tables[i, :len(table)] = table
        ids += e.seq.token_ids[e.start:e.end]
        positions = range(e.start, e.end)
        pos += positions
        slots += [table[p // bs] * bs + p % bs for p in positions]
        qsl.append(qsl[-1] + e.num_tokens)
        seq_lens.append(e.end)
    return {"input_ids": np.array(ids, np.int64), "positions": np.array(pos, np.int64),
            "slot_mapping": np.array(slots, np.int64), "query_start_loc": np.array(qsl, np.int32),
            "seq_lens": np.array(seq_lens, np.int32), "block_tables": tables,
            "max_query_len": max(e.num_tokens for e in batch.entries),
            "max_seq_len": max(seq_lens)}


def test_step_inputs_equal_the_per_token_loop(tiny_model):
    loaded = load(tiny_model, dtype="float32", device="cpu", mode="batch_invariant")
    eng = Engine(EngineConfig(model=str(tiny_model), mode="batch_invariant", max_num_seqs=12,
                              max_num_batched_tokens=48, num_kv_blocks=128),
                 loaded.model, loaded.config)
    runner = eng.runner
    prepare = runner._prepare_inputs
    checked = []

    def checked_prepare(batch, previous):
        want = reference_inputs(batch, runner.block_size)
        ids, pos, meta = prepare(batch, previous)
        got = {"input_ids": ids.numpy(), "positions": pos.numpy(),
               "slot_mapping": meta.slot_mapping.numpy(),
               "query_start_loc": meta.query_start_loc.numpy(),
               "seq_lens": meta.seq_lens.numpy(), "block_tables": meta.block_tables.numpy(),
               "max_query_len": meta.max_query_len, "max_seq_len": meta.max_seq_len}
        for name, value in want.items():
            assert np.array_equal(got[name], value), name
            assert np.asarray(got[name]).dtype == np.asarray(value).dtype, name
        checked.append(max(e.num_tokens for e in batch.entries))
        return ids, pos, meta

    runner._prepare_inputs = checked_prepare
    reqs = wl.determinism_workload(needles=4, fillers=14, prompt_len=37, needle_tokens=6,
                                   filler_prompt=(1, 90), filler_tokens=(1, 9),
                                   vocab_size=loaded.config.vocab_size, seed=3)
    wl.run(eng, reqs, arrival_seed=4)
    assert len(checked) > 10 and max(checked) > 1 and min(checked) == 1
