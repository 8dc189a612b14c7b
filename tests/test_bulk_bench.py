"""``pdd bench bulk`` end to end at a tiny size: every figure the comparison reports is there
and measured (not a timing check)."""

from loadtest.bulk_bench import format_report, run_bulk_bench

RATES = ("raw_plain", "ours_plain", "raw_tls", "ours_tls", "ours_tls_two_streams", "memcpy")


def test_the_bulk_bench_reports_every_rate_and_ratio():
    report = run_bulk_bench(2, 1, geometry=(2, 2, 16), prompt_tokens=64, frame_tokens=32, checks_megabytes=1)
    for name in RATES:
        assert report[f"{name}_gbps"] > 0 and len(report["runs_gbps"][name]) == 1
    assert report["ours_over_raw_plain"] > 0 and report["ours_over_raw_tls"] > 0
    ciphers = report["setup"]["tls_ciphers"]
    assert ciphers["raw"] == ciphers["ours"] and ciphers["ours"].startswith("TLS_")
    checks = report["receiver_checks"]
    assert report["link"] is None and checks["xxh3_checksum_gb_per_s"] > 0 and checks["both_checks_gb_per_s"] > 0
    assert "ours / raw" in format_report(report)


def test_through_the_link_one_stream_is_held_to_its_window_and_the_default_stripes_past_it():
    from infra.wan_link import LinkProfile

    # 200 Mbit/s, 20 ms, a 128 KiB window: one stream may carry at most 52 Mbit/s, and the
    # bandwidth-delay product (500 KB) asks for four streams
    link = LinkProfile(bandwidth_bps=200e6, rtt_ms=20, jitter_ms=0, window_bytes=128 << 10)
    report = run_bulk_bench(
        1, 1, geometry=(2, 2, 16), prompt_tokens=64, frame_tokens=32, checks_megabytes=1, link=link, link_megabytes=2
    )
    figures = report["link"]
    assert figures["rate_gbps"] == 0.2 and figures["rtt_ms"] == 20 and figures["window_bytes"] == 128 << 10
    assert figures["window_cap_gbps"] == round((128 << 10) * 8 / 0.020 / 1e9, 3)
    for name in ("one_stream_gbps", "raw_one_stream_gbps"):
        assert 0 < figures[name] <= figures["window_cap_gbps"] * 1.05, (name, figures)
    assert figures["default_streams"] == 4 and 0 < figures["default_gbps"] <= figures["rate_gbps"] * 1.05
    assert figures["raw_four_streams_gbps"] > figures["raw_one_stream_gbps"]
    assert "through the WAN link" in format_report(report)
