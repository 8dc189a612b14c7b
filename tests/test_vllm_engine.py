"""vLLM behind ``EngineBackend`` (``--engine vllm``): exact against transformers and against our
engine, KV crossing both ways as wire frames, a relay's tokens absorbed and extended, a long
prompt computed in chunks whose KV exports as they complete, and vLLM's cached blocks named by
PDD's hashes. The engine computes prompts in chunks (``FIRST_CHUNK`` tokens first, then up to
``CHUNK`` per step), so every exactness test here also runs chunked prefill.

Runs in the vLLM venv (``make test-vllm``); ``make test`` deselects it.
"""

import pytest
import torch

pytest.importorskip("vllm")

from shared.block_hash import hash_blocks
from shared.engine.backend import BackendOptions, RequestStatus, create_backend, generate
from shared.engine.hf_engine import HfEngine
from shared.engine.sampling import SamplingParams
from shared.errors import FrameOwnershipError
from shared.kv_wire import decode_frame, frame_bytes
from tests.helpers import prompt_of_length, reference_greedy

pytestmark = pytest.mark.vllm

BLOCK_SIZE = 32  # vLLM's CPU attention takes multiples of 32; every instance of a deployment shares it
CHUNK, FIRST_CHUNK = 96, 32
GREEDY = SamplingParams(max_tokens=24, ignore_eos=True)
FIRST_ONLY = SamplingParams(max_tokens=1, ignore_eos=True)


@pytest.fixture(scope="module")
def events():
    return []


@pytest.fixture(scope="module")
def vllm(smollm2, events):
    backend = create_backend(
        "vllm",
        BackendOptions(
            model="smollm2",
            block_size=BLOCK_SIZE,
            kv_cache_bytes=256 << 20,
            max_batch_tokens=CHUNK,
            first_chunk_tokens=FIRST_CHUNK,
            kv_listener=lambda kind, hashes: events.append((kind, hashes)),
        ),
        smollm2,
    )
    yield backend
    backend.shutdown()


@pytest.fixture
def hf(smollm2):
    return HfEngine(smollm2, num_blocks=256, block_size=BLOCK_SIZE)


def run(engine) -> list:
    outputs = []
    while engine.has_work():
        outputs += engine.step()
    return outputs


def ship(sender, receiver, request_id: str, prompt: list[int], frame_tokens: int = 64) -> int:
    """Prompt KV from sender to receiver through the wire format; the receiver's start index."""
    start = receiver.begin_import(request_id, prompt, GREEDY)
    for parts in sender.export_frames(request_id, start, len(prompt), max_tokens_per_frame=frame_tokens):
        receiver.import_frame(decode_frame(bytearray(frame_bytes(parts)), receiver.frame_expectation))
    return start


def prefill(engine, request_id: str, prompt: list[int]) -> int:
    engine.add_request(request_id, prompt, FIRST_ONLY)
    run(engine)
    return engine.request(request_id).output_token_ids[0]


def test_vllm_greedy_output_is_transformers_greedy_output(vllm, smollm2):
    prompt = prompt_of_length(smollm2, 150)
    assert generate(vllm, "alone", prompt, GREEDY) == reference_greedy(smollm2, prompt, GREEDY.max_tokens)
    assert vllm.request_ids() == []


def test_a_long_prompts_kv_exports_chunk_by_chunk_as_it_will_after_the_prompt(vllm, smollm2):
    prompt = unshared_prompt(smollm2, "chunked", 330)
    vllm.add_request("chunked", prompt, FIRST_ONLY)
    reach, early = [], []  # num_kv_tokens after each step before the first token; frames read then
    while not vllm.request("chunked").output_token_ids:
        vllm.step()
        view = vllm.request("chunked")
        if view.output_token_ids:
            break
        reach.append(view.num_kv_tokens)
        start, end = early[-1][1] if early else 0, view.num_kv_tokens // BLOCK_SIZE * BLOCK_SIZE
        if end > start:
            early.append((start, end, vllm.export_frames("chunked", start, end, max_tokens_per_frame=64)))
    view = vllm.request("chunked")
    cached = view.num_cached_tokens
    assert reach[0] == cached + FIRST_CHUNK
    assert reach == list(range(cached + FIRST_CHUNK, len(prompt), CHUNK))
    assert view.num_kv_tokens == len(prompt) and early[-1][1] == reach[-1] // BLOCK_SIZE * BLOCK_SIZE
    for start, end, frames in early:  # the finished request's blocks hold the same KV, same hashes
        late = vllm.export_frames("chunked", start, end, max_tokens_per_frame=64)
        assert len(late) == len(frames)
        for before, after in zip(decoded(vllm, frames), decoded(vllm, late)):
            assert before.header.block_hashes == after.header.block_hashes
            assert before.header.token_ids == after.header.token_ids
            assert torch.equal(before.kv, after.kv)
    tokens = [t for _, _, frames in early for frame in decoded(vllm, frames) for t in frame.header.token_ids]
    assert tokens == prompt[: early[-1][1]]
    assert list(view.output_token_ids) == reference_greedy(smollm2, prompt, 1)
    vllm.free("chunked")
    run(vllm)


def test_a_prompt_arriving_beside_a_long_one_computes_a_first_chunk_too(vllm, smollm2):
    long, beside = unshared_prompt(smollm2, "long", 330), unshared_prompt(smollm2, "beside", 200)
    vllm.add_request("long", long, FIRST_ONLY)
    vllm.step()
    vllm.add_request("beside", beside, FIRST_ONLY)
    vllm.step()
    first_chunk = vllm.request("beside").num_kv_tokens
    outputs = run(vllm)
    assert first_chunk == vllm.request("beside").num_cached_tokens + FIRST_CHUNK
    assert {o.request_id: [o.token_id] for o in outputs} == {
        "long": reference_greedy(smollm2, long, 1),
        "beside": reference_greedy(smollm2, beside, 1),
    }
    vllm.free("long")
    vllm.free("beside")
    run(vllm)


def unshared_prompt(smollm2, label: str, num_tokens: int) -> list[int]:
    """A prompt whose first block no other test's prompt shares (no prefix cache hit either way)."""
    return smollm2.tokenizer.encode(f"[{label}] ", add_special_tokens=False) + prompt_of_length(smollm2, num_tokens)


def decoded(engine, frames: list) -> list:
    return [decode_frame(bytearray(frame_bytes(parts)), engine.frame_expectation) for parts in frames]


def test_prefill_on_vllm_main_decode_on_our_engine_is_exact(vllm, hf, smollm2):
    prompt = prompt_of_length(smollm2, 150, seed=1)
    first = prefill(vllm, "p-vllm", prompt)
    ship(vllm, hf, "p-vllm", prompt)
    hf.finish_import("p-vllm", [first])
    run(hf)
    assert list(hf.request("p-vllm").output_token_ids) == reference_greedy(smollm2, prompt, GREEDY.max_tokens)
    assert hf.get("p-vllm").num_imported_tokens == len(prompt)
    vllm.free("p-vllm")
    run(vllm)
    assert vllm.bridge.held_blocks == {}  # the export's blocks went back to vLLM (still cached)
    assert vllm.cached_prefix_blocks(hash_blocks(prompt, BLOCK_SIZE)) == len(prompt) // BLOCK_SIZE


def test_prefill_on_our_engine_main_decode_on_vllm_is_exact(vllm, hf, smollm2):
    prompt = prompt_of_length(smollm2, 170, seed=2)
    first = prefill(hf, "p-hf", prompt)
    assert ship(hf, vllm, "p-hf", prompt) == 0
    vllm.finish_import("p-hf", [first])
    run(vllm)
    view = vllm.request("p-hf")
    assert list(view.output_token_ids) == reference_greedy(smollm2, prompt, GREEDY.max_tokens)
    assert view.num_imported_tokens == len(prompt) and view.status is RequestStatus.FINISHED
    vllm.free("p-hf")
    run(vllm)


def test_a_relays_tokens_absorbed_in_chunks_then_handed_over_on_vllm_are_exact(vllm, hf, smollm2):
    prompt = prompt_of_length(smollm2, 130, seed=3)
    reference = reference_greedy(smollm2, prompt, GREEDY.max_tokens)
    hf.add_request("relayed", prompt, GREEDY)
    while len(hf.request("relayed").output_token_ids) < 10:
        hf.step()
    relay_tokens = list(hf.request("relayed").output_token_ids)[:10]
    sender = HfEngine(smollm2, num_blocks=128, block_size=BLOCK_SIZE)
    prefill(sender, "relayed", prompt)
    ship(sender, vllm, "relayed", prompt)
    vllm.finish_import("relayed", [])  # parked until the relay hands over
    vllm.extend("relayed", relay_tokens[:4], sample=False)  # a catch-up chunk
    absorbed = run(vllm)
    assert [(o.absorbed, o.token_id, o.token_index) for o in absorbed] == [(True, None, 4)]
    vllm.extend("relayed", relay_tokens[4:])  # the final handoff
    run(vllm)
    assert list(vllm.request("relayed").output_token_ids) == reference
    vllm.free("relayed")
    run(vllm)


def test_a_handed_over_end_of_sequence_finishes_the_request_at_once(vllm, smollm2):
    prompt = prompt_of_length(smollm2, 64, seed=4)
    eos = next(iter(smollm2.eos_token_ids))
    vllm.begin_import("ends", prompt, SamplingParams(max_tokens=8))
    view = vllm.finish_import("ends", [eos])
    assert view.status is RequestStatus.FINISHED and view.finish_reason == "stop"
    assert not vllm.has_work()
    vllm.free("ends")


def test_frames_that_are_not_the_imports_next_are_refused(vllm, hf, smollm2):
    prompt = prompt_of_length(smollm2, 96, seed=5)
    prefill(hf, "framed", prompt)
    frames = [
        decode_frame(bytearray(frame_bytes(parts)), vllm.frame_expectation)
        for parts in hf.export_frames("framed", 0, len(prompt), max_tokens_per_frame=32)
    ]
    with pytest.raises(FrameOwnershipError):
        vllm.import_frame(frames[0])  # no import under way
    vllm.begin_import("framed", prompt, GREEDY)
    with pytest.raises(FrameOwnershipError):
        vllm.import_frame(frames[1])  # out of order
    vllm.import_frame(frames[0])
    vllm.free("framed")


def test_vllms_cached_blocks_are_announced_under_pdds_hashes(vllm, smollm2, events):
    prompt = prompt_of_length(smollm2, 200, seed=6)
    generate(vllm, "hashed", prompt, SamplingParams(max_tokens=2, ignore_eos=True))
    run(vllm)
    stored = {h for kind, hashes in events if kind == "stored" for h in hashes}
    chain = hash_blocks(prompt, BLOCK_SIZE)
    assert set(chain) <= stored
    assert vllm.cached_prefix_blocks(chain) == len(chain)
    dump = vllm.cached_block_hashes()
    assert dump.index(chain[0]) < dump.index(chain[-1])  # parents before children


def test_a_second_vllm_engine_in_one_process_is_refused_with_the_reason(vllm, smollm2):
    from shared.errors import ConfigError

    with pytest.raises(ConfigError, match="one vLLM engine per process"):
        create_backend("vllm", BackendOptions(model="smollm2", block_size=BLOCK_SIZE), smollm2)
