"""The rate a prefill reports to the routers: what its engine computes per second, not how long
one prompt waited beside others."""

import pytest

from services.prefill.speed import MIN_SAMPLE_TOKENS, PrefillSpeed


class Clock:
    def __init__(self):
        self.now_s = 100.0

    def __call__(self) -> float:
        return self.now_s


def test_a_prompt_computed_alone_samples_its_own_rate():
    clock = Clock()
    speed = PrefillSpeed(clock=clock)
    speed.started("a")
    clock.now_s += 2.0
    speed.finished("a", 800)
    assert speed.tokens_per_s == pytest.approx(400.0)


def test_two_prompts_computed_together_each_sample_the_engines_rate_not_half_of_it():
    """800 tokens each, packed into the same steps at 400 tokens/s: both end after 4 s."""
    clock = Clock()
    speed = PrefillSpeed(clock=clock)
    speed.started("a")
    speed.started("b")
    clock.now_s += 4.0
    speed.finished("a", 800)
    assert speed.tokens_per_s == pytest.approx(400.0)
    speed.finished("b", 800)
    assert speed.tokens_per_s == pytest.approx(400.0)


def test_a_warm_turn_beside_a_cold_prompt_is_charged_only_its_share():
    """A cold prompt of 1,200 tokens computes alone for 1 s, then beside a 400-token warm turn
    for 2 s (the engine still computes 400 tokens/s: 200 each), then alone for 1 s more."""
    clock = Clock()
    speed = PrefillSpeed(clock=clock)
    speed.started("cold")
    clock.now_s += 1.0
    speed.started("warm")
    clock.now_s += 2.0
    speed.finished("warm", 400)
    assert speed.tokens_per_s == pytest.approx(400.0)  # 400 tokens in its 1 s share, not in 2 s
    clock.now_s += 1.0
    speed.finished("cold", 1200)
    assert speed.tokens_per_s == pytest.approx(400.0)  # 1 + 1 + 1 s charged: 3 s for 1,200


def test_prompts_the_engine_computes_one_after_the_other_still_sample_its_rate():
    """The scheduler may finish one prompt first: 800 tokens each at 400 tokens/s, the first
    done after 2 s (charged 1 s of them), the second alone for 2 s more (charged 3 s)."""
    clock = Clock()
    speed = PrefillSpeed(clock=clock)
    speed.started("first")
    speed.started("second")
    clock.now_s += 2.0
    speed.finished("first", 800)
    clock.now_s += 2.0
    speed.finished("second", 800)
    assert speed.tokens_per_s == pytest.approx(400.0)


def test_abandoned_and_tiny_prompts_leave_the_rate_alone_and_free_their_share():
    clock = Clock()
    speed = PrefillSpeed(clock=clock)
    speed.started("gone")
    speed.started("tiny")
    speed.started("real")
    clock.now_s += 3.0
    speed.abandoned("gone")
    speed.finished("tiny", MIN_SAMPLE_TOKENS - 1)
    assert speed.tokens_per_s == 0.0
    clock.now_s += 1.0  # alone from here: the whole second is its own
    speed.finished("real", 800)
    assert speed.tokens_per_s == pytest.approx(400.0)
