"""The router's token log: every index once, in order, whoever sends it and however often."""

from services.router.token_log import TokenLog
from shared.messages import TokensEmitted


def emitted(start: int, tokens: list[int], producer: str = "MD", finish: str | None = None):
    return TokensEmitted(
        request_id="router-0-abc",
        start_index=start,
        token_ids=tokens,
        producer=producer,
        instance_id=f"{producer}-0",
        finish_reason=finish,
    )


def test_tokens_from_two_producers_are_released_once_in_order():
    log = TokenLog()
    assert log.add(emitted(0, [10, 11], "RLD")) == [10, 11]
    assert log.add(emitted(3, [13])) == []  # index 2 is still missing
    assert log.add(emitted(0, [10, 11, 12])) == [12, 13]  # the handoff re-sends 0-2
    assert log.token_ids == [10, 11, 12, 13] and log.eager_tokens == 2


def test_the_final_index_completes_the_log_only_when_nothing_is_missing():
    log = TokenLog()
    log.add(emitted(1, [21], finish="length"))
    assert not log.complete and log.finish_reason == "length"
    log.add(emitted(0, [20]))
    assert log.complete and log.token_ids == [20, 21] and log.finished_on == "MD"


def test_a_recovered_attempt_re_emitting_delivered_tokens_adds_nothing_twice():
    log = TokenLog()
    log.add(emitted(0, [1, 2, 3], "RLD"))
    log.add(emitted(5, [6]))  # the failed attempt's token beyond a gap
    log.forget_pending()  # recovery: the new attempt recomputes from index 3
    assert log.add(emitted(0, [1, 2, 3, 4])) == [4]
    assert log.add(emitted(4, [5, 9], finish="stop")) == [5, 9]
    assert log.token_ids == [1, 2, 3, 4, 5, 9] and log.complete and log.eager_tokens == 3


def test_step_entries_and_messages_merge_by_index_whichever_comes_first():
    log = TokenLog()
    assert log.add_one(0, 30, "RLD") == [30]
    assert log.add_one(2, 32, "MD") == []  # index 1 is still missing
    assert log.add_one(0, 99, "MD") == []  # an index the client has is not taken again
    assert log.add(emitted(3, [33], finish="length")) == []  # the last token, overtaking a step
    assert log.add_one(1, 31, "RLD") == [31, 32, 33]
    assert log.complete and log.token_ids == [30, 31, 32, 33] and log.eager_tokens == 2
    assert log.logprobs == [None] * 4
