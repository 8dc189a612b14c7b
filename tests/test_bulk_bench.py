"""``pdd bench bulk`` end to end at a tiny size: every figure the comparison reports is there
and measured (not a timing check)."""

from loadtest.bulk_bench import format_report, run_bulk_bench

RATES = ("raw_plain", "ours_plain", "raw_tls", "ours_tls", "memcpy")


def test_the_bulk_bench_reports_every_rate_and_ratio():
    report = run_bulk_bench(2, 1, geometry=(2, 2, 16), prompt_tokens=64, frame_tokens=32, checks_megabytes=1)
    for name in RATES:
        assert report[f"{name}_gbps"] > 0 and len(report["runs_gbps"][name]) == 1
    assert report["ours_over_raw_plain"] > 0 and report["ours_over_raw_tls"] > 0
    ciphers = report["setup"]["tls_ciphers"]
    assert ciphers["raw"] == ciphers["ours"] and ciphers["ours"].startswith("TLS_")
    assert report["link"] is None and report["receiver_checks"]["xxh3_checksum_gb_per_s"] > 0
    assert "ours / raw" in format_report(report)
