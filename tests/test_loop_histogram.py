"""The token path's lock-free histogram exposes what prometheus_client's own would."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from shared.loop_histogram import LoopHistogram

BUCKETS = (0.005, 0.01, 0.02, 0.1, 0.5, 1, 5)


def exposition_lines(registry: CollectorRegistry) -> list[str]:
    """The exposition without ``_created`` samples (a Histogram's creation time)."""
    return [line for line in generate_latest(registry).decode().splitlines() if "_created" not in line]


@settings(max_examples=50, deadline=None, derandomize=True)
@given(
    observations=st.lists(
        st.tuples(
            st.sampled_from(["P-MD", "P-RLD-MD"]),
            st.one_of(st.sampled_from(BUCKETS), st.floats(min_value=0, max_value=10, allow_nan=False)),
        ),
        max_size=60,
    )
)
def test_the_exposition_equals_a_prometheus_histograms(observations):
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    loop = LoopHistogram("pdd_test_seconds", "A test.", ["model_name", "pipeline"], BUCKETS, registry=ours)
    reference = Histogram("pdd_test_seconds", "A test.", ["model_name", "pipeline"], buckets=BUCKETS, registry=theirs)
    for pipeline, amount in observations:
        loop.labels("m", pipeline).observe(amount)
        reference.labels("m", pipeline).observe(amount)
    assert exposition_lines(ours) == exposition_lines(theirs)


def test_a_wrong_number_of_label_values_is_refused():
    histogram = LoopHistogram("pdd_test_seconds", "A test.", ["model_name", "pipeline"], BUCKETS, registry=None)
    with pytest.raises(ValueError, match="2 label values"):
        histogram.labels("m")
