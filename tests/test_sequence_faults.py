"""One sequence's failure ends that sequence, never the engine (``HfEngine.step``).

Faults are injected into a real engine on the tiny model: a sampler that raises for one
request, a logits row that is not finite, a forward pass that raises. The other sequences
carry on and still match transformers' greedy output; the failed one ends with
``finish_reason="error"`` and a stable code, and freeing it returns its blocks.
"""

import math

import pytest
import torch

from shared.engine.hf_engine import HfEngine
from shared.engine.sampler import Sampler, sample_token
from shared.engine.sampling import SamplingParams
from shared.errors import InvalidPrompt, InvalidSampling, SamplingFailed
from tests.helpers import prompt_of_length, reference_greedy

GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)


class FailingFor(Sampler):
    """The engine's own sampler, made to fail one request's draws (the fault injected)."""

    def __init__(self, inner: Sampler, request_id: str, fault: str):
        self.__dict__.update(inner.__dict__)
        self.request_id, self.fault = request_id, fault

    def sample(self, seq, logits, facts=None):
        if seq.request_id == self.request_id:
            if self.fault == "raise":
                raise RuntimeError("injected sampling fault")
            logits = logits.clone()
            logits[0] = float("nan")  # a non-finite row, as an overflowing model would give
            facts = None  # the step's facts describe the row before the fault
        return super().sample(seq, logits, facts)


def run_to_end(engine: HfEngine) -> dict[str, list]:
    outputs: dict[str, list] = {}
    while engine.has_work():
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
            if out.finished:
                engine.free(out.request_id)
    return outputs


@pytest.mark.parametrize("fault", ["raise", "nan"])
def test_a_failing_sequence_ends_alone_and_the_others_stay_exact(tiny, fault):
    engine = HfEngine(tiny, num_blocks=64)
    engine.sampler = FailingFor(engine.sampler, "victim", fault)
    prompts = {name: prompt_of_length(tiny, 40, seed=i) for i, name in enumerate(["a", "victim", "b"])}
    for name, prompt in prompts.items():
        engine.add_request(name, prompt, GREEDY)
    outputs = run_to_end(engine)
    (failure,) = outputs["victim"]
    assert failure.finish_reason == "error" and failure.error_code == "sampling_failed", failure
    for name in ("a", "b"):
        assert [o.token_id for o in outputs[name]] == reference_greedy(tiny, prompts[name], 12)
    assert engine.num_sequences == 0 and engine.blocks.num_used_blocks == 0
    assert engine.blocks.num_available_blocks == engine.blocks.num_blocks


def test_a_failed_forward_pass_ends_its_batch_and_the_next_request_is_served(tiny, monkeypatch):
    engine = HfEngine(tiny, num_blocks=64)
    run = engine.runner.run
    monkeypatch.setattr(engine.runner, "run", lambda batch: (_ for _ in ()).throw(RuntimeError("injected")))
    engine.add_request("doomed", prompt_of_length(tiny, 20), GREEDY)
    (failure,) = run_to_end(engine)["doomed"]
    assert failure.finish_reason == "error" and failure.error_code == "step_failed"
    monkeypatch.setattr(engine.runner, "run", run)
    prompt = prompt_of_length(tiny, 30, seed=3)
    engine.add_request("next", prompt, GREEDY)
    assert [o.token_id for o in run_to_end(engine)["next"]] == reference_greedy(tiny, prompt, 12)


@pytest.mark.parametrize(
    "field,value",
    [
        ("temperature", 1e-39),
        ("temperature", math.nan),
        ("temperature", math.inf),
        ("top_p", math.nan),
        ("repetition_penalty", 1e-39),
        ("repetition_penalty", math.nan),
        ("frequency_penalty", math.inf),
        ("presence_penalty", math.nan),
        ("top_k", 2**64 + 1),
    ],
)
def test_the_engine_refuses_out_of_range_sampling_by_name(tiny, field, value):
    engine = HfEngine(tiny, num_blocks=8)
    with pytest.raises(InvalidSampling) as refused:
        engine.add_request("r", [1, 2, 3], SamplingParams(max_tokens=4, **{field: value}))
    assert refused.value.field == field and engine.num_sequences == 0


def test_the_engine_refuses_token_ids_outside_its_vocabulary(tiny):
    engine = HfEngine(tiny, num_blocks=8)
    for prompt in ([1, engine.vocab_size], [-1, 2]):
        with pytest.raises(InvalidPrompt):
            engine.add_request("r", prompt, GREEDY)
    assert engine.num_sequences == 0


def test_sampling_at_the_edges_of_the_ranges_stays_finite():
    logits = torch.linspace(-60, 60, 1000)
    edges = [
        SamplingParams(temperature=0.01),
        SamplingParams(temperature=2.0, top_p=1e-300),
        SamplingParams(temperature=0.01, top_k=2**31 - 1, top_p=1e-45),
    ]
    for params in edges:
        params.validate()
        assert sample_token(logits, params, seed=1, token_index=0) == 999
    with pytest.raises(SamplingFailed):
        sample_token(torch.full((10,), float("-inf")), SamplingParams(temperature=1.0), seed=1, token_index=0)
