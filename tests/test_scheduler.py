"""The HF engine's scheduler without a model: budgets, decode-first order, preemption."""

import math

from shared.engine.backend import RequestStatus
from shared.engine.block_manager import BlockManager
from shared.engine.prefix_cache import PrefixCache
from shared.engine.sampling import SamplingParams
from shared.engine.scheduler import Scheduler
from shared.engine.sequence import Sequence

BLOCK = 4


def scheduler(num_blocks: int, max_batch_tokens: int = 64) -> Scheduler:
    cache = PrefixCache()
    return Scheduler(BlockManager(num_blocks, cache), cache, BLOCK, max_batch_tokens)


def add(s: Scheduler, rid: str, num_tokens: int, first_token: int = 0) -> Sequence:
    prompt = list(range(first_token, first_token + num_tokens))
    seq = Sequence(rid, prompt, len(prompt), SamplingParams(max_tokens=8), seed=1)
    s.adopt_cached_prefix(seq, [])
    s.sequences[rid] = seq
    return seq


def plan(batch) -> list[tuple[str, int, bool]]:
    return [(e.seq.request_id, e.num_tokens, e.samples) for e in batch]


def test_decodes_go_first_and_prompts_are_chunked_to_the_budget():
    s = scheduler(num_blocks=32, max_batch_tokens=10)
    decoding = add(s, "decoding", 5)
    s.computed(s.schedule()[0])
    decoding.token_ids.append(99)  # its sampled token is pending
    add(s, "long-prompt", 20, first_token=100)
    batch, unfit = s.schedule()
    assert unfit is None and plan(batch) == [("decoding", 1, True), ("long-prompt", 9, False)]
    s.computed(batch)
    assert plan(s.schedule()[0]) == [("long-prompt", 10, False)]


def test_a_prompts_first_chunk_is_bounded_lower_so_its_first_blocks_are_ready_sooner():
    cache = PrefixCache()
    s = Scheduler(BlockManager(32, cache), cache, BLOCK, max_batch_tokens=16, first_chunk_tokens=4)
    add(s, "long-prompt", 30)
    chunks = []
    while s.has_work():
        batch, _ = s.schedule()
        chunks.append(plan(batch)[0][1])
        s.computed(batch)
    assert chunks == [4, 16, 10]


def test_a_short_prompt_waits_for_no_chunk_of_a_long_one_that_arrived_first():
    """A warm turn arriving while a cold prompt is computed in chunks goes in the next step, and
    the long prompt fills what budget it leaves: it is delayed by the warm turn's tokens only."""
    s = scheduler(num_blocks=64, max_batch_tokens=16)
    add(s, "cold", 60)
    s.computed(s.schedule()[0])  # the cold prompt's first chunk
    add(s, "warm", 5, first_token=100)
    assert plan(s.schedule()[0]) == [("warm", 5, True), ("cold", 11, False)]
    steps = 1
    while s.has_work():
        batch, _ = s.schedule()
        assert batch and sum(e.num_tokens for e in batch) <= 16
        s.computed(batch)
        steps += 1
        if not s.get("cold").num_pending_tokens:
            break
    assert steps == math.ceil((60 + 5) / 16)  # every step full until the cold prompt's last


def test_computed_blocks_enter_the_prefix_cache_and_a_second_prompt_reuses_them():
    s = scheduler(num_blocks=32)
    first = add(s, "a", 10)
    s.computed(s.schedule()[0])
    assert len(first.block_hashes) == 2  # two full blocks of four
    second = Sequence("b", list(range(10)), 10, SamplingParams(), seed=1)
    hit = s.adopt_cached_prefix(second, first.block_hashes)
    assert hit == first.block_ids[:2] and second.num_cached_tokens == 8


def test_the_youngest_running_sequence_is_preempted_when_nothing_fits():
    s = scheduler(num_blocks=4)
    old = add(s, "old", 8)  # 2 blocks
    s.computed(s.schedule()[0])
    young = add(s, "young", 8, first_token=50)
    s.computed(s.schedule()[0])  # 2 more: the pool is full
    old.token_ids.extend(range(200, 204))  # old needs a third block
    young.status = RequestStatus.PAUSED  # a paused sequence holds its blocks but is not a victim
    batch, unfit = s.schedule()
    assert unfit is old and s.num_preemptions == 0
    young.status = RequestStatus.RUNNING
    young.num_kv_tokens = len(young.token_ids)  # young has nothing pending
    batch, unfit = s.schedule()
    assert unfit is None and plan(batch) == [("old", 4, True)]
    assert s.num_preemptions == 1 and young.block_ids == [] and young.num_kv_tokens == 0


def test_a_prompt_larger_than_the_pool_is_reported_unfit():
    s = scheduler(num_blocks=2)
    huge = add(s, "huge", 12)
    assert s.schedule() == ([], huge)
