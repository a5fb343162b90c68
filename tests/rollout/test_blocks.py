"""Block manager and scheduler on the host: prefix cache rules, LRU revival, preemption."""

from __future__ import annotations

from handoff.rollout.blocks import BlockManager, block_hash
from handoff.rollout.sampling import SamplingParams
from handoff.rollout.scheduler import Scheduler
from handoff.rollout.sequence import Sequence, Status

PARAMS = SamplingParams(temperature=0.0, max_tokens=100)


def _seq(tokens: list[int], seq_id: int = 0) -> Sequence:
    return Sequence(seq_id, tokens, PARAMS, request_index=0, sample_index=0, key=0,
                    stop_ids=frozenset())


def _manager(num_blocks: int = 16, rows: int = 4) -> BlockManager:
    return BlockManager(num_blocks, 4, max_num_seqs=rows, max_blocks_per_seq=8)


def test_hash_chains_the_whole_prefix():
    a = block_hash([1, 2, 3, 4], block_hash([9, 9, 9, 9], 0))
    b = block_hash([1, 2, 3, 4], block_hash([8, 9, 9, 9], 0))
    assert a != b and a == block_hash([1, 2, 3, 4], block_hash([9, 9, 9, 9], 0))


def test_prefix_hits_skip_the_last_prompt_token_and_null_block():
    m = _manager()
    first = _seq(list(range(12)))  # exactly three full blocks
    assert m.allocate(first)
    assert 0 not in first.block_table and first.num_cached_tokens == 0
    assert m.tables[first.row, :3].tolist() == first.block_table
    same = _seq(list(range(12)), 1)
    assert m.allocate(same)
    # The third block holds the last prompt token: it is recomputed, not shared.
    assert same.num_cached_tokens == 8
    assert same.block_table[:2] == first.block_table[:2]
    assert same.block_table[2] != first.block_table[2]
    assert m.ref_count[first.block_table[0]] == 2
    longer = _seq(list(range(13)), 2)
    assert m.allocate(longer) and longer.num_cached_tokens == 12
    assert m.prefix_hits == 8 + 12


def test_freed_blocks_are_revived_then_evicted_in_lru_order():
    m = _manager(num_blocks=7, rows=2)  # blocks 1..6 usable
    prompt = list(range(9))
    a = _seq(prompt)
    m.allocate(a)
    assert a.block_table == [1, 2, 3]
    m.free_seq(a)
    assert m.num_free_blocks == 6 and m.num_cached_free_blocks == 2
    b = _seq(prompt, 1)
    m.allocate(b)
    assert b.block_table == [1, 2, 4] and b.num_cached_tokens == 8  # 1 and 2 revived
    m.free_seq(b)  # free list (LRU first): 5 6 3 4 2 1
    c = _seq([100 + i for i in range(12)], 2)
    m.allocate(c)
    assert c.block_table == [5, 6, 3]  # least recently used first, cached blocks spared
    m.free_seq(c)  # 4 2 1 3 6 5
    e = _seq([200 + i for i in range(5)], 3)
    m.allocate(e)
    assert e.block_table == [4, 2]  # the prefix's deeper block goes before its root
    f = _seq(prompt, 4)
    m.free_seq(e)
    m.allocate(f)
    assert f.num_cached_tokens == 4 and f.block_table[0] == 1


def test_collision_guard_compares_tokens():
    m = _manager()
    a = _seq([1, 2, 3, 4, 5])
    m.allocate(a)
    block = a.block_table[0]
    m.tokens[block] = (9, 9, 9, 9)  # simulate a hash collision with other contents
    b = _seq([1, 2, 3, 4, 5], 1)
    m.allocate(b)
    assert b.num_cached_tokens == 0


def test_full_blocks_are_hashed_after_their_store_and_slots_refused_when_full():
    m = _manager(num_blocks=3, rows=2)  # blocks 1 and 2 usable
    s = _seq([1, 2, 3])
    m.allocate(s)
    s.append(4, 0.0)  # 4 tokens: the decode step writes token 3 and fills block 0
    assert m.reserve_decode_slot(s)
    assert m.hashes[s.block_table[0]] == -1  # not before that step's KV is stored
    m.register_filled_block(s)  # postprocess of that step, before its token is appended
    h = m.hashes[s.block_table[0]]
    assert h == block_hash([1, 2, 3, 4], 0) and m.hash_to_block[h] == s.block_table[0]
    # A step staged ahead reserves room for the token still being sampled.
    assert m.reserve_decode_slot(s, ahead=1) and len(s.block_table) == 2
    s.append(5, 0.0)
    assert m.reserve_decode_slot(s) and len(s.block_table) == 2
    for t in (6, 7, 8, 9):
        s.append(t, 0.0)
    assert not m.reserve_decode_slot(s)  # needs a third block, none left
    assert len(s.block_table) == 2


def test_scheduler_preempts_from_the_back_and_requeues_first():
    m = BlockManager(5, 4, max_num_seqs=4, max_blocks_per_seq=4)  # 4 usable blocks
    sched = Scheduler(m, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=16)
    seqs = [_seq([10 * i + j for j in range(4)], i) for i in range(3)]
    for s in seqs:
        sched.add(s)
    batch, is_prefill = sched.schedule()
    assert is_prefill and batch == seqs and m.num_free_blocks == 1
    sched.postprocess(batch, [1, 2, 3], [0.0] * 3)  # each now needs a second block
    batch, is_prefill = sched.schedule()
    assert not is_prefill
    assert batch == seqs[:2] and sched.num_preemptions == 1
    assert list(sched.waiting) == [seqs[2]] and seqs[2].status is Status.WAITING
    assert seqs[2].block_table == [] and seqs[2].row == -1


def test_scheduler_respects_max_num_seqs_and_token_budget():
    m = BlockManager(64, 4, max_num_seqs=8, max_blocks_per_seq=8)
    sched = Scheduler(m, max_num_seqs=2, max_num_batched_tokens=10, max_model_len=32)
    for i in range(3):
        sched.add(_seq([i] * 6, i))
    batch, _ = sched.schedule()
    assert len(batch) == 1  # 6 + 6 tokens exceed the budget of 10
    batch, is_prefill = sched.schedule()
    assert is_prefill and len(batch) == 1 and len(sched.running) == 2
    batch, is_prefill = sched.schedule()
    assert not is_prefill and len(batch) == 2  # max_num_seqs reached: decode
