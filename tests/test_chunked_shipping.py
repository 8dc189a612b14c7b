"""A long prompt's KV crosses while the prompt still computes.

The prefill computes a long prompt in chunks (``max_batch_tokens`` per step); between two
steps it exports the blocks the last chunk completed and its receivers import them. Each
test lets the first chunk compute once every flow is open, then holds the prefill's later
steps until the receivers have imported KV: if the KV left only after the whole prompt,
nothing could arrive while the steps are held and the test would time out. The answer stays
exactly transformers' greedy output.
"""

import asyncio
import threading

import pytest

from tests.helpers import chat_body, chat_prompt, engines_idle, expected_text, held_engine_step, post, until

CHUNK_TOKENS = 64


class HeldSteps:
    """Prefill's first engine step waits (on the engine thread) until ``start``, the later ones
    until ``release``."""

    def __init__(self, prefill):
        self.start, self.release = threading.Event(), threading.Event()
        self.steps = 0
        submit = prefill.worker.submit

        def hold():
            self.steps += 1
            (self.start if self.steps == 1 else self.release).wait(30)

        def held_submit(fn, *args, **kwargs):
            return submit(held_engine_step(fn, args, kwargs, hold))

        prefill.worker.submit = held_submit


def flows_open(prefill, num_paths: int) -> bool:
    """Whether the prefill's one job has all its flows accepted."""
    jobs = list(prefill.jobs.values())
    if len(jobs) != 1 or jobs[0].shipping is None:
        return False
    paths = jobs[0].shipping.paths.values()
    return len(paths) == num_paths and all(p.flow is not None for p in paths)


def count_imported_frames(service, monkeypatch) -> list[int]:
    """A one-item list counting the KV frames ``service`` (a decoder) imports."""
    count = [0]
    import_frame = service.importer.import_frame

    async def counting_import_frame(request_id, frame):
        await import_frame(request_id, frame)
        count[0] += 1

    monkeypatch.setattr(service.importer, "import_frame", counting_import_frame)
    return count


@pytest.mark.parametrize("policy", ["P-MD", "P-RLD-MD"])
async def test_receivers_import_the_first_chunks_before_the_prompt_is_computed(make_stack, tiny, monkeypatch, policy):
    stack = await make_stack(
        engine_settings={"max_batch_tokens": CHUNK_TOKENS},
        decode_settings={"max_batch_tokens": 2048},
        router_settings={"pipeline_policy": policy},
    )
    content = "Describe every ship in the harbour, one by one. " * 20
    prompt = chat_prompt(tiny, content)
    assert len(prompt) > 3 * CHUNK_TOKENS
    receivers = [stack.mains[0]] + (stack.relays[:1] if policy == "P-RLD-MD" else [])
    counts = [count_imported_frames(service, monkeypatch) for service in receivers]
    held = HeldSteps(stack.prefill)
    request = asyncio.create_task(post(stack, "/chat/completions", chat_body(content, 16)))
    try:
        await until(lambda: flows_open(stack.prefill, len(receivers)), 20, "the prefill's flows to be accepted")
        held.start.set()
        await until(lambda: all(c[0] > 0 for c in counts), 20, "every receiver to import KV of the first chunk")
        assert held.steps == 2  # the second chunk is still waiting to be computed
    finally:
        held.start.set()
        held.release.set()
    status, body = await request
    assert status == 200 and body["pdd"]["pipeline"] == policy, body
    assert body["choices"][0]["message"]["content"] == expected_text(tiny, prompt, 16)
    assert held.steps >= len(prompt) // CHUNK_TOKENS
    await until(lambda: not stack.prefill.jobs and engines_idle(stack), 15, "every engine to idle")
