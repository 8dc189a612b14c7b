"""The provisioned Grafana dashboard asks only for metrics the processes export."""

import json
import re
from pathlib import Path

from tests.helpers import exported_families

ROOT = Path(__file__).resolve().parent.parent
DASHBOARDS = sorted((ROOT / "infra/observability/dashboards").glob("*.json"))
SUFFIXES = ("_bucket", "_total", "_sum", "_count", "_created")


def family_of(name: str) -> str:
    for suffix in SUFFIXES:
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


def test_every_dashboard_query_names_an_exported_metric():
    assert DASHBOARDS
    exported = exported_families()
    for path in DASHBOARDS:
        dashboard = json.loads(path.read_text())
        exprs = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
        exprs += [v["query"] for v in dashboard["templating"]["list"]]
        assert len(exprs) >= 12
        for expr in exprs:
            names = re.findall(r"\b(pdd_[a-z_]+)\b", expr)
            assert names, expr
            for name in names:
                assert family_of(name) in exported, f"{path.name}: {name} is not exported"


def test_the_dashboard_covers_what_the_issue_asks_for():
    text = " ".join(
        t["expr"] for p in DASHBOARDS for panel in json.loads(p.read_text())["panels"] for t in panel["targets"]
    )
    for metric in (
        "pdd_ttft_seconds_bucket",
        "pdd_inter_token_latency_seconds_bucket",
        "pdd_wan_bytes_total",
        'producer="RLD"',
        "pdd_handoffs_total",
        "pdd_recoveries_total",
    ):
        assert metric in text, metric
