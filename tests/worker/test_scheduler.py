"""Scheduler: mixed batches under a token budget, chunked prefill, admission limits, preemption."""

from __future__ import annotations

from detgate.worker.engine.block_manager import BlockManager
from detgate.worker.engine.scheduler import Scheduler
from detgate.worker.engine.sequence import SamplingParams, Sequence, SequenceStatus

BS = 16


def make(num_blocks=64, max_num_seqs=8, max_num_batched_tokens=64, prefill_chunk=None, prefix=True):
    bm = BlockManager(num_blocks, BS, prefix)
    return Scheduler(bm, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                     prefill_chunk=prefill_chunk or max_num_batched_tokens)


def seq(n, rid, max_tokens=4, first=100, **params) -> Sequence:
    params = SamplingParams(max_tokens=max_tokens, **params)
    return Sequence(rid, list(range(first, first + n)), params, eos_token_ids=(0,))


def run_step(sched: Scheduler, token: int = 7):
    """Schedule a step and feed back `token` for every sampling sequence."""
    batch = sched.schedule()
    sched.postprocess(batch, [token] * sum(e.samples for e in batch.entries))
    return batch


def shape(batch):
    return [(e.seq.request_id, e.start, e.num_tokens) for e in batch.entries]


def test_prefill_then_decode_in_one_mixed_batch():
    s = make()
    a = seq(10, "a")
    s.add(a)
    assert shape(run_step(s)) == [("a", 0, 10)]
    assert len(a) == 11
    b = seq(5, "b")
    s.add(b)
    assert shape(run_step(s)) == [("a", 10, 1), ("b", 0, 5)]


def test_budget_chunks_a_long_prompt():
    s = make(max_num_batched_tokens=32)
    a = seq(80, "a")
    s.add(a)
    assert shape(run_step(s)) == [("a", 0, 32)]
    assert len(a) == 80  # no token sampled mid-prompt
    assert shape(run_step(s)) == [("a", 32, 32)]
    assert shape(run_step(s)) == [("a", 64, 16)]
    assert len(a) == 81


def test_chunk_size_limits_each_sequence_and_budget_admits_more():
    s = make(max_num_batched_tokens=64, prefill_chunk=16)
    s.add(seq(40, "a"))
    s.add(seq(40, "b"))
    assert shape(run_step(s)) == [("a", 0, 16), ("b", 0, 16)]
    assert shape(run_step(s)) == [("a", 16, 16), ("b", 16, 16)]
    assert shape(run_step(s)) == [("a", 32, 8), ("b", 32, 8)]


def test_max_num_seqs_caps_admission():
    s = make(max_num_seqs=2)
    for rid in "abc":
        s.add(seq(4, rid))
    assert [e.seq.request_id for e in run_step(s).entries] == ["a", "b"]
    assert [q.request_id for q in s.waiting] == ["c"]


def test_finish_on_max_tokens_eos_and_stop_ids():
    s = make()
    a, b, c = seq(4, "a", max_tokens=2), seq(4, "b"), seq(4, "c", stop_token_ids=(9,))
    for x in (a, b, c):
        s.add(x)
    batch = s.schedule()
    s.postprocess(batch, [7, 0, 9])
    assert (a.is_finished, b.finish_reason, c.finish_reason) == (False, "stop", "stop")
    run_step(s)
    assert a.finish_reason == "length" and a.token_ids[-2:] == [7, 7]
    assert not s.has_work()
    assert s.block_manager.num_free_blocks == 64


def test_ignore_eos():
    s = make()
    a = seq(4, "a", max_tokens=2, ignore_eos=True)
    s.add(a)
    run_step(s, token=0)
    assert not a.is_finished


def test_max_tokens_zero_finishes_after_prefill_without_sampling():
    s = make()
    a = seq(20, "a", max_tokens=0, single_pass=True)
    s.add(a)
    batch = s.schedule()
    assert shape(batch) == [("a", 0, 20)] and not batch.entries[0].samples
    s.postprocess(batch, [])
    assert a.finish_reason == "length" and len(a) == 20


def test_single_pass_waits_for_a_budget_that_fits_it_whole():
    s = make(max_num_batched_tokens=32, prefill_chunk=8)
    s.add(seq(30, "a", max_tokens=0, single_pass=True))
    assert shape(run_step(s)) == [("a", 0, 30)]  # chunk size does not apply
    s.add(seq(20, "b"))
    s.add(seq(30, "c", max_tokens=0, single_pass=True))
    assert shape(run_step(s)) == [("b", 0, 8)]  # c (30) does not fit in the 24 left


def test_preemption_frees_newest_and_recomputes_it_from_scratch():
    # 4 blocks of 16: a and b take 2 each after prefill; a's decode needs a 3rd block.
    s = make(num_blocks=4, prefix=False)
    a, b = seq(32, "a", max_tokens=8), seq(31, "b", max_tokens=8)
    s.add(a)
    s.add(b)
    run_step(s)
    assert len(a) == 33 and len(b) == 32
    batch = run_step(s)
    assert batch.num_preempted == 1
    assert shape(batch) == [("a", 32, 1)]
    assert b.status == SequenceStatus.WAITING and b.block_table == [] and b.num_computed_tokens == 0
    assert list(s.waiting) == [b]
    assert len(b) == 32  # its generated token is kept and will be recomputed as prompt
    # a finishes, then b is readmitted and recomputes all 32 tokens before sampling again.
    while not a.is_finished:
        run_step(s)
    batch = run_step(s)
    assert shape(batch) == [("b", 0, 32)]
    assert len(b) == 33


def test_preempted_sequence_comes_back_from_the_prefix_cache():
    s = make(num_blocks=4)
    a, b = seq(32, "a", max_tokens=8), seq(31, "b", max_tokens=8, first=500)
    s.add(a)
    s.add(b)
    run_step(s)
    run_step(s)  # b preempted; its first block stays cached
    while not a.is_finished:
        run_step(s)
    batch = run_step(s)
    assert shape(batch) == [("b", 16, 16)]


def test_shared_prefix_is_reused_across_running_sequences():
    s = make()
    a, b = seq(40, "a"), seq(40, "b")
    s.add(a)
    run_step(s)
    s.add(b)
    assert shape(run_step(s)) == [("a", 40, 1), ("b", 32, 8)]
    assert b.block_table[:2] == a.block_table[:2]


def test_preempts_itself_when_alone_and_out_of_blocks():
    s = make(num_blocks=1)
    a = seq(16, "a", max_tokens=4)
    s.add(a)
    run_step(s)
    batch = run_step(s)
    assert batch.entries == [] and batch.num_preempted == 1
    assert a.status == SequenceStatus.WAITING


def test_abort_frees_blocks_wherever_the_sequence_is():
    s = make(max_num_seqs=1)
    a, b = seq(20, "a"), seq(20, "b")
    s.add(a)
    s.add(b)
    run_step(s)
    s.finish(a, "abort")
    s.finish(b, "abort")
    assert (a.finish_reason, b.finish_reason) == ("abort", "abort")
    assert not s.has_work() and s.block_manager.num_free_blocks == 64
