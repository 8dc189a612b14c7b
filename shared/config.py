"""Service configuration: read once at start-up from flags and environment, validated.

Each service's configuration is a frozen dataclass. Every field is a setting reachable as a
flag (``--kv-cache-mb``) and as an environment variable (``PDD_KV_CACHE_MB``); a flag wins
over the environment, which wins over the default. A bad value raises ``ConfigError``
naming the flag and the variable.
"""

import argparse
import dataclasses
import ipaddress
import os
import socket
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shared.errors import ConfigError
from shared.hf_cache import SMOLLM2_HF_ID
from shared.subjects import FIXED_WORDS, check_token

ENV_PREFIX = "PDD_"


def setting(
    default: Any,
    help: str,
    check: Callable[[Any], str | None] | None = None,
    choices: tuple | None = None,
    alias: str | None = None,
):
    """Declare a setting: its default, help text, an optional check returning an error, and
    an optional second flag name."""
    return field(default=default, metadata={"help": help, "check": check, "choices": choices, "alias": alias})


def positive(value) -> str | None:
    """Check: strictly positive."""
    return None if value > 0 else "must be > 0"


def non_negative(value) -> str | None:
    """Check: zero or more."""
    return None if value >= 0 else "must be >= 0"


def subject_token(value: str) -> str | None:
    """Check: empty (auto) or a NATS subject token."""
    if not value:
        return None
    try:
        check_token(value, "value")
    except ValueError as exc:
        return str(exc)
    return None


def site_name(value: str) -> str | None:
    """Check: a NATS subject token that is not one of the subjects' fixed words."""
    if value in FIXED_WORDS:
        return f"{value!r} is a word of the subjects themselves ({', '.join(sorted(FIXED_WORDS))}); name the site otherwise"
    return subject_token(value)


def host_port(value: str) -> str | None:
    """Check: empty or ``host:port``."""
    if not value:
        return None
    host, _, port = value.rpartition(":")
    return None if host and port.isdigit() else "must be host:port"


def stream_count(value: int) -> str | None:
    """Check: 0 (from the path's bandwidth-delay product) or a bulk stream count up to 8."""
    from shared.bulk.path_sizing import MAX_STREAMS

    return None if 0 <= value <= MAX_STREAMS else f"must be within 0..{MAX_STREAMS}"


def known_backend(value: str) -> str | None:
    """Check: a registered engine backend."""
    from shared.engine.backend import backend_names  # the engine package imports torch

    names = backend_names()
    return None if value in names else f"no such engine backend (have: {', '.join(names)})"


@dataclass(frozen=True)
class CommonConfig:
    """Settings every service reads."""

    site: str = setting("site-a", "site (datacenter) this instance runs at", site_name)
    instance_id: str = setting("", "unique instance name; default <service>-<host>-<pid>", subject_token)
    nats_url: str = setting("nats://127.0.0.1:4222", "NATS server of this instance's own site")
    nats_seed_file: str = setting(
        "",
        "file with this service role's NATS nkey seed (a locked-down deployment's servers refuse clients without one)",
    )
    tls_ca_file: str = setting(
        "", "the deployment's CA certificate: NATS over TLS, and mutual TLS on the bulk channel's WAN path"
    )
    tls_cert_file: str = setting("", "this service's TLS certificate (bulk channel, mutual TLS)")
    tls_key_file: str = setting("", "private key of --tls-cert-file")
    log_level: str = setting("info", "log level", choices=("debug", "info", "warning", "error"))
    served_model_name: str = setting(
        SMOLLM2_HF_ID,
        "model id the API serves and /v1/models lists, and the "
        "model_name label of metrics (default: SmolLM2's Hugging Face id)",
    )
    otlp_endpoint: str = setting(
        "",
        "OTLP/HTTP traces endpoint (e.g. http://jaeger:4318); empty: the standard "
        "OTEL_EXPORTER_OTLP_(TRACES_)ENDPOINT, else no export",
    )
    heartbeat_s: float = setting(1.0, "seconds between LoadReported heartbeats", positive)
    bulk_secret: str = setting(
        "",
        "per-deployment secret of the bulk channel: prefill signs FlowOpens with the "
        "key derived from it (receivers hold only --bulk-verify-key)",
    )
    bulk_secret_file: str = setting(
        "", "file holding the bulk secret (read at start-up; keeps it out of the environment)"
    )
    metrics_host: str = setting("127.0.0.1", "address of the Prometheus /metrics endpoint")
    metrics_port: int = setting(0, "port of the Prometheus /metrics endpoint (0: none)", non_negative)
    metrics_key_sha256: str = setting(
        "",
        "SHA-256 (hex) of the bearer key /metrics asks for; required when "
        "--metrics-host is not a loopback address (/health stays open)",
    )
    metrics_key_sha256_file: str = setting(
        "", "file holding --metrics-key-sha256 (pdd secrets writes metrics-key.sha256; Prometheus holds metrics.key)"
    )
    request_lease_s: float = setting(
        8.0,
        "engines free a request whose router has been silent this long while its site is heard (the router died)",
        positive,
    )
    cut_off_lease_s: float = setting(
        30.0,
        "engines free a request whose router's whole site has been "
        "silent this long (a cut or congested link, not a dead router)",
        positive,
    )


@dataclass(frozen=True)
class EngineConfig(CommonConfig):
    """Settings of services that run the model."""

    engine: str = setting(
        "hf", "engine backend (registered in shared/engine/backend.py; hf: transformers)", known_backend
    )
    model: str = setting("smollm2", "smollm2, tiny or an HF model folder")
    device: str = setting("cpu", "torch device (cpu, cuda, cuda:N)")
    dtype: str = setting("float32", "weights and KV dtype", choices=("float32", "bfloat16", "float16"))
    block_size: int = setting(16, "tokens per KV block (same on every instance)", positive)
    kv_cache_mb: int = setting(512, "KV pool size in MiB", positive)
    max_sequences: int = setting(16, "requests held at once", positive)
    max_batch_tokens: int = setting(
        2048, "most tokens one engine step computes (a longer prompt is computed in chunks of this size)", positive
    )
    first_chunk_tokens: int = setting(
        0,
        "most tokens a prompt's first step computes (0: --max-batch-tokens; smaller: its KV leaves sooner)",
        non_negative,
    )
    torch_threads: int = setting(0, "torch CPU threads (0: torch's default)", non_negative)
    standin_step_ms: float = setting(
        20.0,
        "--engine standin only: wall time of one engine step in milliseconds (sets the token rate: "
        "sequences / step time per instance; 0: as fast as the CPU allows)",
        non_negative,
    )
    engine_call_log: str = setting(
        "",
        "append every engine-thread call (queued, start and end times; a step's "
        "batch) as JSON lines to this file; empty: off",
    )
    prefix_cache: bool = setting(True, "reuse cached prefix blocks (off: the no-decode-side-cache baseline)")
    bulk_tls_local: bool = setting(
        True,
        "mutual TLS on the bulk channel's local path too, so every frame is "
        "integrity-protected end to end (the WAN path always has it once --tls-ca-file "
        "is set; false: plaintext on the local path, to measure what TLS costs); senders "
        "and relays must agree",
    )


@dataclass(frozen=True)
class BulkReceiverConfig(EngineConfig):
    """Settings of services that receive KV (relay and main decode)."""

    bulk_verify_key: str = setting(
        "",
        "public key (hex) that checks prefill's FlowOpen signatures; it cannot "
        "sign one, so no receiver can open a flow into another",
    )
    bulk_verify_key_file: str = setting("", "file holding --bulk-verify-key (pdd secrets writes bulk-verify.pub)")
    bulk_host: str = setting("127.0.0.1", "address the bulk KV receiver listens on")
    bulk_port: int = setting(0, "port of the bulk KV receiver (0: any free port)", non_negative)
    bulk_advertise: str = setting(
        "",
        "host:port senders use to reach the bulk receiver "
        "(the WAN link's address for a remote site, unless --bulk-link is set); default: "
        "the listen address, or this host's address when listening on all of them",
        host_port,
    )
    bulk_link: str = setting(
        "",
        "host:port of the WAN link's routed port that senders at the other site dial; "
        "each connection names this receiver's advertised address, so any number of "
        "replicas share the port (empty: senders dial --bulk-advertise)",
        host_port,
    )
    kv_timeout_s: float = setting(120.0, "longest wait for a flow's next KV frame", positive)
    handoff_timeout_s: float = setting(30.0, "longest wait for a handoff reply", positive)


@dataclass(frozen=True)
class RelayDecodeConfig(BulkReceiverConfig):
    """Settings of relay decode: when to hand over, and how."""

    catch_up_threshold_tokens: int = setting(64, "backlog above which the handoff goes in catch-up chunks", positive)
    final_gap_tokens: int = setting(8, "catch-up hands over for good once the gap is this small", non_negative)
    load_watermark: float = setting(0.5, "relay load (active/max sequences) at which it hands over one-shot", positive)
    max_catch_up_chunks: int = setting(16, "catch-up hands over for good after this many chunks", positive)
    max_chunk_tokens: int = setting(32, "largest catch-up chunk (bounds each stall of main decode)", positive)


@dataclass(frozen=True)
class PrefillConfig(EngineConfig):
    """Settings of the prefill service."""

    max_batch_tokens: int = setting(
        256,
        "most prompt tokens one prefill step computes: a longer prompt is computed in chunks "
        "of this size, and each chunk's complete blocks ship while the next one computes",
        positive,
    )
    first_chunk_tokens: int = setting(
        64,
        "most tokens of a prompt's first chunk: smaller than the rest, so its KV starts crossing "
        "sooner (0: --max-batch-tokens)",
        non_negative,
    )
    frame_tokens: int = setting(256, "tokens of KV per bulk frame", positive)
    connect_timeout_s: float = setting(10.0, "bulk connect timeout", positive)
    accept_timeout_s: float = setting(
        120.0, "wait for a receiver to accept a flow (it may wait for blocks another flow is bringing)", positive
    )
    send_timeout_s: float = setting(300.0, "longest time to ship one request's KV", positive)
    wan_bandwidth_mbit: float = setting(
        100.0, "the WAN path's rate, for its bandwidth-delay product (sizes --bulk-streams' default)", positive
    )
    wan_rtt_ms: float = setting(40.0, "the WAN path's round trip, for its bandwidth-delay product", non_negative)
    bulk_window_bytes: int = setting(
        0, "one connection's largest TCP window (0: this host's tcp_wmem maximum, 4 MiB here)", non_negative
    )
    bulk_streams: int = setting(
        0,
        "connections each WAN KV flow is striped over (0: from the path's bandwidth-delay product, "
        "ceil(rate x RTT / --bulk-window-bytes), at most 8)",
        stream_count,
    )
    bulk_streams_local: int = setting(
        1, "connections each local-path KV flow is striped over (0: from a same-site path, i.e. 1)", stream_count
    )


@dataclass(frozen=True)
class RouterConfig(CommonConfig):
    """Settings of the router (HTTP front door)."""

    model: str = setting("smollm2", "model whose tokenizer the router uses")
    http_host: str = setting("127.0.0.1", "HTTP listen address")
    http_port: int = setting(8000, "HTTP port", non_negative)
    http_reuse_port: bool = setting(
        False,
        "share the HTTP port with the other routers on this host (SO_REUSEPORT: the kernel spreads "
        "new connections over every router listening; pdd up --routers N)",
    )
    api_keys: str = setting(
        "",
        "comma-separated API keys clients must send as 'Authorization: Bearer <key>' (empty: none needed)",
        alias="--api-key",
    )
    max_body_mb: int = setting(16, "largest request body in MiB (larger: 413)", positive)
    block_size: int = setting(16, "tokens per KV block (same as the engines')", positive)
    kv_bytes_per_token: int = setting(
        0, "KV bytes per prompt token for WAN predictions (0: from the model)", non_negative
    )
    wan_bandwidth_mbit: float = setting(100.0, "WAN bandwidth estimate for pipeline choice", positive)
    wan_rtt_ms: float = setting(40.0, "WAN round-trip estimate for pipeline choice", non_negative)
    ttft_target_ms: float = setting(500.0, "relay when the predicted WAN transfer exceeds this", non_negative)
    pipeline_policy: str = setting(
        "auto", "auto (PDD's choice), or force P-MD / P-RLD-MD (baselines, tests)", choices=("auto", "P-MD", "P-RLD-MD")
    )
    default_max_tokens: int = setting(
        256, "max_tokens when a request gives none (clamped to the context left)", positive
    )
    max_in_flight: int = setting(
        0,
        "requests running at once (0: what the main decoders report they hold, their max_sequences summed)",
        non_negative,
    )
    max_queued: int = setting(0, "requests waiting for a slot; beyond: 429 (0: as many as run)", non_negative)
    queue_timeout_s: float = setting(30.0, "longest wait for a slot before a 429", positive)
    odd_traffic_filter: bool = setting(
        True, "cancel the WAN transfer of long-input/very-short-output requests the relay finishes"
    )
    odd_max_output_tokens: int = setting(8, "output bounds above this are never odd traffic", non_negative)
    relay_step_ms: float = setting(
        80.0, "relay decode step estimate (is the relay done before the KV lands?)", positive
    )
    first_token_timeout_s: float = setting(120.0, "longest wait for a request's first token", positive)
    token_timeout_s: float = setting(60.0, "longest wait between two tokens", positive)
    sse_write_timeout_s: float = setting(
        15.0,
        "a streaming client that takes longer than this to accept one event is dropped and its request cancelled",
        positive,
    )
    instance_ttl_s: float = setting(5.0, "an instance silent this long is considered gone", positive)
    partition_tolerance_s: float = setting(
        15.0,
        "how long in-flight requests wait for a remote site that "
        "went silent as a whole (a stall or partition) before they "
        "are resumed elsewhere",
        positive,
    )
    max_recoveries: int = setting(
        2,
        "times a request is resumed elsewhere by token replay after an instance fails it (0: fail the request at once)",
        non_negative,
    )
    recovery_wait_s: float = setting(
        30.0,
        "how long a recovery waits for a live instance to resume on "
        "(e.g. while a supervisor restarts the only prefill)",
        non_negative,
    )


@dataclass(frozen=True)
class CacheIndexConfig(CommonConfig):
    """Settings of the cache-index."""

    kv_event_sites: str = setting("site-a,site-b", "sites (JetStream domains) whose KV event streams to follow")
    instance_ttl_s: float = setting(10.0, "forget an instance silent this long", positive)


def settings_of(cls) -> list[dataclasses.Field]:
    """The settings (dataclass fields) of a config class."""
    return list(dataclasses.fields(cls))


def flag_name(name: str) -> str:
    """``kv_cache_mb`` → ``--kv-cache-mb``."""
    return "--" + name.replace("_", "-")


def env_name(name: str) -> str:
    """``kv_cache_mb`` → ``PDD_KV_CACHE_MB``."""
    return ENV_PREFIX + name.upper()


def add_arguments(parser: argparse.ArgumentParser, cls):
    """Add one flag per setting; values stay None unless given, so env and defaults apply."""
    for f in settings_of(cls):
        names = [flag_name(f.name)] + ([f.metadata["alias"]] if f.metadata.get("alias") else [])
        parser.add_argument(
            *names,
            dest=f.name,
            default=None,
            metavar=f.type.__name__.upper() if isinstance(f.type, type) else "VALUE",
            help=f"{f.metadata['help']} [env {env_name(f.name)}, default {f.default!r}]",
        )


def build_config(cls, flags: Mapping[str, Any], environ: Mapping[str, str] | None = None, service: str = "pdd"):
    """Resolve every setting of ``cls`` (flag > env > default), convert and validate it."""
    environ = os.environ if environ is None else environ
    values = {}
    for f in settings_of(cls):
        raw, source = flags.get(f.name), flag_name(f.name)
        if raw is None and env_name(f.name) in environ:
            raw, source = environ[env_name(f.name)], env_name(f.name)
        value = f.default if raw is None else _convert(f, raw, source)
        _validate(f, value, source)
        values[f.name] = value
    for name in ("bulk_secret", "bulk_verify_key", "metrics_key_sha256"):
        if values.get(f"{name}_file") and not values.get(name):
            values[name] = _read_secret(values[f"{name}_file"], f"{name}_file")
    if values.get("metrics_port") and not _loopback(values["metrics_host"]) and not values["metrics_key_sha256"]:
        raise ConfigError(
            f"setting {flag_name('metrics_key_sha256_file')} (metrics_key_sha256_file): required "
            f"when /metrics listens on {values['metrics_host']!r}, not on loopback only"
        )
    if "instance_id" in values and not values["instance_id"]:
        values["instance_id"] = f"{service}-{socket.gethostname()}-{os.getpid()}".replace(".", "-")[:128]
    return cls(**values)


def _loopback(host: str) -> bool:
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _read_secret(path: str, name: str) -> str:
    try:
        secret = Path(path).read_text().strip()
    except OSError as exc:
        raise ConfigError(f"setting {flag_name(name)} ({name}): cannot read {path!r}: {exc.strerror}") from None
    if not secret:
        raise ConfigError(f"setting {flag_name(name)} ({name}): {path!r} is empty")
    return secret


def _convert(f: dataclasses.Field, raw, source: str):
    if not isinstance(raw, str):
        return raw
    try:
        if f.type in (int, "int"):
            return int(raw)
        if f.type in (float, "float"):
            return float(raw)
        if f.type in (bool, "bool"):
            if raw.lower() not in ("1", "0", "true", "false", "yes", "no"):
                raise ValueError(raw)
            return raw.lower() in ("1", "true", "yes")
    except ValueError:
        raise ConfigError(
            f"setting {source} ({f.name}): {raw!r} is not a valid {getattr(f.type, '__name__', f.type)}"
        ) from None
    return raw


def _validate(f: dataclasses.Field, value, source: str):
    choices = f.metadata.get("choices")
    if choices and value not in choices:
        raise ConfigError(f"setting {source} ({f.name}): {value!r} is not one of {', '.join(choices)}")
    check = f.metadata.get("check")
    problem = check(value) if check else None
    if problem:
        raise ConfigError(f"setting {source} ({f.name}): {problem}, got {value!r}")
