"""The services need nothing but ``EngineBackend``: a backend with no transformers inside (the
library's stand-in engine, built in or registered from outside as tests/fake_backend.py does)
serves router → prefill → relay → main decode over real NATS and sockets, token-exact."""

import random

import pytest

from infra.wan_link import LinkProfile
from shared.config import EngineConfig, build_config
from shared.engine import standin
from shared.engine.backend import backend_names
from shared.errors import ConfigError
from tests import fake_backend  # noqa: F401 (registers the "fake" backend)
from tests.helpers import post, until

SLOW_WAN = LinkProfile(bandwidth_bps=20e6, rtt_ms=40, jitter_ms=0, seed=1)


@pytest.mark.parametrize(("engine", "policy"), [("fake", "P-MD"), ("standin", "P-RLD-MD")])
async def test_a_fake_backend_runs_the_whole_flow_token_exact(make_stack, tiny, engine, policy):
    settings = {"engine": engine, "standin_step_ms": 4.0} if engine == "standin" else {"engine": engine}
    stack = await make_stack(profile=SLOW_WAN, engine_settings=settings, router_settings={"pipeline_policy": policy})
    prompt = [random.Random(policy).randrange(1000, 2000) for _ in range(300)]
    status, body = await post(
        stack, "/completions", {"model": "tiny", "prompt": prompt, "max_tokens": 300, "temperature": 0}
    )
    assert status == 200, body
    assert body["choices"][0]["text"] == tiny.tokenizer.decode(standin.reference(prompt, 300), skip_special_tokens=True)
    pdd = body["pdd"]
    assert pdd["pipeline"] == policy and pdd["finished_on"] == "MD"
    if policy == "P-RLD-MD":
        assert pdd["eager_tokens"] > 0 and pdd["handoff_mode"] is not None  # the relay handed over
    engines = [service.engine for service in [stack.prefill, *stack.relays, *stack.mains]]
    await until(lambda: all(engine.load().num_sequences == 0 for engine in engines), 10, "every request freed")


def test_the_engine_setting_names_the_registered_backends():
    assert {"hf", "fake", "standin"} <= set(backend_names())
    assert build_config(EngineConfig, {"engine": "fake"}, {}).engine == "fake"
    with pytest.raises(ConfigError, match="engine.*no such engine backend"):
        build_config(EngineConfig, {"engine": "nope"}, {})


def test_a_bad_stand_in_step_time_names_its_setting():
    with pytest.raises(ConfigError, match="standin.step.ms"):
        build_config(EngineConfig, {"engine": "standin", "standin_step_ms": -1.0}, {})
