"""The benchmark report's checks say why the relay's token share missed, from the run's own
counts: never a cause the counts contradict."""

from loadtest.report import checks


def results(handoff_modes: dict, finished_on: dict, odd: int, load: float) -> dict:
    pdd = {
        "requests": 63,
        "errors": 0,
        "pipelines": {"P-MD": 36, "P-RLD-MD": 27},
        "handoff_modes": handoff_modes,
        "finished_on": finished_on,
        "odd_traffic": odd,
        "mean_output_tokens": 234.3,
        "wan_link_load": load,
    }
    share = {
        "label": "RLD token share",
        "median": 0.24,
        "low": 0.18,
        "high": 0.30,
        "per_repetition": [0.24, 0.23, 0.25],
        "target": 0.2,
        "verdict": "UNDECIDED",
    }
    return {"modes": {"pdd": pdd}, "intervals": {"rld_token_share": share}}


def share_line(report: list[str]) -> str:
    return next(line for line in report if "RLD token share" in line)


def test_a_share_made_of_handed_over_requests_is_not_blamed_on_answers_ending_on_the_relay():
    line = share_line(checks(results({"catch-up": 12, "one-shot": 9}, {"MD": 57, "RLD": 6}, odd=3, load=0.22)))
    assert "27 of 63 requests were relayed: 21 handed over to main decode, 6 ended on the relay (3 of them odd" in line
    assert "done before its KV lands" not in line and "the link carried" not in line


def test_a_share_made_of_answers_ending_on_the_relay_says_so_and_names_a_saturated_link():
    line = share_line(checks(results({"one-shot": 2}, {"MD": 38, "RLD": 25}, odd=3, load=1.5)))
    assert "2 handed over to main decode, 25 ended on the relay" in line
    assert "done before its KV lands" in line and "the link carried 1.5×" in line
