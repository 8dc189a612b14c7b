"""Cache-index: decode-side cache hits, exact WAN bytes, and a rebuild after a restart."""

import asyncio

from infra.wan_link import LinkProfile
from services.cache_index.service import CacheIndexService
from shared.kv_wire import PREFIX_SIZE
from tests.helpers import chat_body, chat_prompt, expected_text, post, until

FAST_WAN = LinkProfile(bandwidth_bps=0, rtt_ms=2, jitter_ms=0)
# 1 Mbit/s: a follow-up arrives while the previous turn's KV is still crossing.
SLOW_WAN = LinkProfile(bandwidth_bps=1e6, rtt_ms=4, jitter_ms=0)


async def test_only_missed_blocks_cross_the_wan(make_stack, tiny):
    stack = await make_stack(profile=FAST_WAN, router_settings={"pipeline_policy": "P-MD"})
    base = "Chapter one of a long report about ports and shipping lanes. " * 20
    status, _first = await post(stack, "/chat/completions", chat_body(base, 4))
    assert status == 200
    prompt_blocks = len(chat_prompt(tiny, base)) // 16
    await until(
        lambda: len(stack.cache_index.instances["main-decode-0"].block_hashes) >= prompt_blocks,
        10,
        "first prompt indexed",
    )
    extended = base + "Chapter two covers the weather. " * 10
    status, second = await post(stack, "/chat/completions", chat_body(extended, 4))
    pdd = second["pdd"]
    prompt_len = len(chat_prompt(tiny, extended))
    missed_tokens = prompt_len - pdd["cached_blocks_md"] * 16
    kv_bytes = missed_tokens * stack.prefill.engine.layout.kv_bytes_per_token
    assert pdd["cached_blocks_md"] >= prompt_blocks - 1
    assert kv_bytes <= pdd["wan_kv_bytes"] <= 1.05 * kv_bytes, (pdd["wan_kv_bytes"], kv_bytes)
    assert pdd["wan_kv_bytes"] - kv_bytes < 2 * 1024 + PREFIX_SIZE


async def test_restarted_cache_index_rebuilds_and_routing_continues(make_stack, tiny):
    stack = await make_stack(profile=FAST_WAN, router_settings={"pipeline_policy": "P-MD"})
    contents = [f"Report {i} on river traffic and locks. " * 20 for i in range(3)]
    for content in contents:
        assert (await post(stack, "/chat/completions", chat_body(content, 4)))[0] == 200
    old = stack.cache_index
    await until(lambda: len(old.instances["main-decode-0"].block_hashes) >= 3 * 10, 10, "indexed")
    before = set(old.instances["main-decode-0"].block_hashes)
    await old.stop()
    # While the index is down the router still routes (no hits known: it falls back to P-MD cold).
    status, _during = await post(stack, "/chat/completions", chat_body("A short question?", 4))
    assert status == 200
    stack.cache_index = CacheIndexService(old.config)
    await stack.cache_index.start()
    await until(
        lambda: (
            "main-decode-0" in stack.cache_index.instances
            and before <= stack.cache_index.instances["main-decode-0"].block_hashes
        ),
        10,
        "rebuilt",
    )
    # No request ran since the restart: applied events can only come from replaying the streams.
    assert stack.cache_index.events_applied > 0
    status, again = await post(stack, "/chat/completions", chat_body(contents[0], 4))
    assert status == 200 and again["pdd"]["cached_blocks_md"] >= 10


async def test_kv_events_are_kept_in_each_sites_jetstream_domain(make_stack):
    from shared.kv_event_stream import STREAM_NAME

    stack = await make_stack(profile=FAST_WAN, router_settings={"pipeline_policy": "P-MD"})
    assert (await post(stack, "/chat/completions", chat_body("Tides and moons. " * 30, 4)))[0] == 200
    nc = await stack.connect("site-a", "cache-index-0")
    try:
        counts = {}
        for site in ("site-a", "site-b"):
            info = await nc.jetstream(domain=site).stream_info(STREAM_NAME)
            counts[site] = info.state.messages
            assert info.config.subjects == [f"pdd.evt.{site}.kv.*"]
    finally:
        await nc.close()
    assert counts["site-a"] >= 1 and counts["site-b"] >= 1  # prefill's and main decode's blocks


async def test_follow_up_waits_for_blocks_already_in_flight(make_stack, tiny):
    """A follow-up sent while the previous turn's KV is still crossing does not send it twice."""
    stack = await make_stack(profile=SLOW_WAN, router_settings={"pipeline_policy": "P-MD"})
    first_ids = tiny.tokenizer.encode("The harbour master logged every ship. " * 70, add_special_tokens=False)
    second_ids = first_ids + tiny.tokenizer.encode(" Then the storm came.", add_special_tokens=False)
    body = {"model": "tiny", "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    first = asyncio.create_task(post(stack, "/completions", {**body, "prompt": first_ids}))
    main = stack.mains[0]
    await until(lambda: main.importer.imports, 10, "the first import to be under way")
    second = await post(stack, "/completions", {**body, "prompt": second_ids})
    (status_a, a), (status_b, b) = await first, second
    assert status_a == status_b == 200
    assert b["pdd"]["wan_kv_bytes"] < 0.2 * a["pdd"]["wan_kv_bytes"], (a["pdd"], b["pdd"])
    for ids, answer in ((first_ids, a), (second_ids, b)):
        assert answer["choices"][0]["text"] == expected_text(tiny, ids, 6)


async def test_turns_queued_behind_a_shared_prefix_still_wait_for_each_other(make_stack, tiny):
    """Turn 1 arrives while turn 0 itself waits behind another session sharing the system
    prompt: turn 1 waits for turn 0's blocks instead of asking for them a second time."""
    # One step and one frame per prompt (no chunked prefill): the shared blocks land only at the
    # end of the other import, which turn 0's flow (its TLS handshake crossing the same busy
    # link) must catch. In chunks, a slow prefill ships the shared blocks first, and turn 0
    # rightly finds them imported instead of waiting.
    one_step = {"frame_tokens": 2048, "max_batch_tokens": 2048, "first_chunk_tokens": 0}
    stack = await make_stack(profile=SLOW_WAN, router_settings={"pipeline_policy": "P-MD"}, engine_settings=one_step)
    encode = lambda text: tiny.tokenizer.encode(text, add_special_tokens=False)
    shared = encode("You are a careful agent who logs ships. " * 8)
    other_ids = shared + encode("Session one reads the tide tables. " * 120)
    turn0_ids = shared + encode("Session two counts the cranes. " * 40)
    turn1_ids = turn0_ids + encode(" And the barges?")
    body = {"model": "tiny", "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    main = stack.mains[0]
    other = asyncio.create_task(post(stack, "/completions", {**body, "prompt": other_ids}))
    await until(lambda: main.importer.imports, 10, "the other session's import to be under way")
    turn0 = asyncio.create_task(post(stack, "/completions", {**body, "prompt": turn0_ids}))
    await until(lambda: main.importer.waiting, 10, "turn 0 to wait behind the shared prefix")
    turn1 = await post(stack, "/completions", {**body, "prompt": turn1_ids})
    answers = {"other": await other, "turn0": await turn0, "turn1": turn1}
    assert all(status == 200 for status, _ in answers.values())
    wan = {name: answer["pdd"]["wan_kv_bytes"] for name, (_, answer) in answers.items()}
    assert wan["turn1"] < 0.2 * wan["turn0"], wan
    for ids, (_, answer) in zip((other_ids, turn0_ids, turn1_ids), answers.values()):
        assert answer["choices"][0]["text"] == expected_text(tiny, ids, 4)


async def test_a_request_finished_while_its_import_waits_in_line_is_not_parked(make_stack, tiny):
    """The relay finishes a request whose WAN flow still waits behind another import: main
    decode imports it for its cache and frees it, instead of parking it for a handoff. Neither
    the prefill, whose sending waits for the flow's acceptance meanwhile, nor main decode takes
    it for a request whose cancel was lost."""
    from tests.helpers import engines_idle, lost_cancels

    stack = await make_stack(profile=SLOW_WAN, router_settings={"pipeline_policy": "P-RLD-MD"})
    encode = lambda text: tiny.tokenizer.encode(text, add_special_tokens=False)
    shared = encode("You are a careful agent who logs ships. " * 8)
    # ~3 s of KV at 1 Mbit/s: the second flow waits in line longer than the lease's 1 s grace.
    first_ids = shared + encode("Session one reads the tide tables. " * 80)
    second_ids = shared + encode("Session two counts the cranes. " * 4)
    body = {"model": "tiny", "temperature": 0, "ignore_eos": True}
    main = stack.mains[0]
    before = lost_cancels()
    first = asyncio.create_task(post(stack, "/completions", {**body, "prompt": first_ids, "max_tokens": 200}))
    await until(lambda: main.importer.imports, 10, "the first import to be under way")
    status, second = await post(stack, "/completions", {**body, "prompt": second_ids, "max_tokens": 2})
    assert status == 200 and second["pdd"]["finished_on"] == "RLD"
    assert (await first)[0] == 200
    await until(lambda: engines_idle(stack), 20, "main decode to free both requests")
    assert lost_cancels() == before


async def test_a_restarted_decoder_is_credited_only_with_blocks_it_announces(make_stack, tiny):
    """``pdd down`` then ``pdd up`` on the same run folder: the streams still hold the old
    main decoder's events, but the new one (same name, new epoch) holds none of those blocks."""
    from services.main_decode.service import MainDecodeService

    stack = await make_stack(profile=SLOW_WAN, router_settings={"wan_bandwidth_mbit": 1, "odd_traffic_filter": False})
    content = "A cold report about tug boats and their crews. " * 12
    first = (await post(stack, "/chat/completions", chat_body(content, 4)))[1]
    assert first["pdd"]["pipeline"] == "P-RLD-MD"  # ~1.3 s of KV at 1 Mbit/s: relayed
    prompt_blocks = len(chat_prompt(tiny, content)) // 16
    await until(
        lambda: len(stack.cache_index.instances["main-decode-0"].block_hashes) >= prompt_blocks,
        15,
        "the first turn's KV to land and be indexed",
    )
    warm = (await post(stack, "/chat/completions", chat_body(content, 4)))[1]
    assert warm["pdd"]["pipeline"] == "P-MD"  # now cached on main decode
    old_main, old_index = stack.mains[0], stack.cache_index
    await old_main.stop()
    await old_index.stop()
    # As `pdd up` does it: the cache-index first (it replays the old decoder's events), then
    # main decode, which takes longer to start.
    stack.cache_index = CacheIndexService(old_index.config)
    await stack.cache_index.start()
    replayed = lambda: (
        "main-decode-0" in stack.cache_index.instances
        and len(stack.cache_index.instances["main-decode-0"].block_hashes) >= prompt_blocks
    )
    await until(replayed, 10, "the replay of the old decoder's events")
    stack.mains[0] = MainDecodeService(old_main.config, stack.loaded)
    await stack.mains[0].start()
    await stack.wait_ready()
    again = (await post(stack, "/chat/completions", chat_body(content, 4)))[1]
    assert again["pdd"]["pipeline"] == "P-RLD-MD", again["pdd"]  # cold again: relayed, as when fresh
    assert again["choices"][0]["message"]["content"] == expected_text(tiny, chat_prompt(tiny, content), 4)
