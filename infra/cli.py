"""The ``pdd`` command line: the program's entry point.

``infra`` adds its own commands here: ``up``/``down``/``status``/``restart`` manage a local
two-site deployment, ``wan`` adjusts its link, ``serve`` runs one service, ``generate`` runs an
engine backend in-process, ``secrets``/``streams``/``images`` prepare container deployments.
Other packages add theirs through the ``pdd.commands`` entry-point group (pyproject.toml):
``loadtest`` registers ``bench``, ``chaos``, ``demo``, ``compose-demo``, ``profile``, ``sim`` and
``plan`` without this module importing it. Every command names its handler
(``set_defaults(handler=...)``); :func:`main` calls it.
"""

import argparse
import json
import sys
import time
from importlib.metadata import entry_points
from pathlib import Path

from infra.cli_args import RUN_DIR_HELP, add_model_args
from infra.deployment_spec import DeploymentSpec, add_up_arguments
from shared.errors import PddError
from shared.logging import configure_logging
from shared.version import pdd_version

COMMAND_GROUP = "pdd.commands"
"""The entry-point group of commands other packages add: each entry point, named after the
command it adds, is a function ``add(commands)`` given the ``pdd`` subcommand parsers; the
command it adds sets its ``handler``."""


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """Help that states each flag's default, unless its text already does."""

    def _get_help_string(self, action):
        text = action.help or ""
        if (
            "default" in text
            or action.default in (None, False, [], argparse.SUPPRESS)
            or not action.option_strings
            or action.nargs == 0
        ):  # a switch: its name says what it does
            return text
        return f"{text} (default: %(default)s)"


def _use_defaults_formatter(parser: argparse.ArgumentParser):
    parser.formatter_class = DefaultsHelpFormatter
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                _use_defaults_formatter(sub)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every ``pdd`` subcommand, each with its ``handler``."""
    from infra.images import add_images_parser
    from infra.serve import add_serve_parsers
    from infra.wan_control import add_wan_parsers

    parser = argparse.ArgumentParser(prog="pdd", description=__doc__)
    parser.add_argument("--version", action="version", version=f"pdd {pdd_version()}")
    parser.add_argument("--log-level", default="warning", help="debug, info, warning or error")
    # A command that sets up logging itself (``serve``: at its service's level) says so.
    parser.set_defaults(sets_up_logging=False)
    commands = parser.add_subparsers(dest="command", required=True)
    _add_generate_parser(commands)
    _add_deployment_parsers(commands)
    _add_container_parsers(commands)
    add_serve_parsers(commands)
    add_wan_parsers(commands, show_handler=cmd_wan_show, set_handler=cmd_wan_set, partition_handler=cmd_wan_partition)
    add_images_parser(commands)
    _add_registered_commands(commands)
    _use_defaults_formatter(parser)
    return parser


def _add_registered_commands(commands):
    """The commands of :data:`COMMAND_GROUP`'s entry points (in name order)."""
    registered = sorted(entry_points(group=COMMAND_GROUP), key=lambda e: e.name)
    if not registered:  # the installed metadata predates the group
        print(f"pdd: no {COMMAND_GROUP} entry points installed: run `make setup` (pip install -e .)", file=sys.stderr)
    for entry in registered:
        entry.load()(commands)
        if entry.name not in commands.choices:
            raise PddError(f"{COMMAND_GROUP} entry point {entry.name} = {entry.value} added no command {entry.name!r}")


def _add_generate_parser(commands):
    generate = commands.add_parser("generate", help="run the engine in-process on one prompt")
    generate.add_argument("prompt", help="the user message (or raw text with --raw)")
    add_model_args(generate)
    generate.add_argument("--engine", default="hf", help="engine backend (shared/engine/backend.py registers them)")
    generate.add_argument("--max-tokens", type=int, default=128, help="output tokens at most")
    generate.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    generate.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    generate.add_argument("--seed", type=int, default=None, help="sampling seed (default: random)")
    generate.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    generate.add_argument("--raw", action="store_true", help="do not apply the chat template")
    generate.set_defaults(handler=cmd_generate)


def _add_deployment_parsers(commands):
    """``up``, ``down``, ``status``, ``supervise`` and ``restart``: the local deployment."""
    up = commands.add_parser("up", help="start the two-site deployment")
    add_up_arguments(up)
    up.set_defaults(handler=cmd_up)
    down = commands.add_parser("down", help="stop the deployment")
    down.add_argument("--run-dir", default=None, help=RUN_DIR_HELP)
    down.set_defaults(handler=cmd_down)
    status = commands.add_parser("status", help="show the deployment")
    status.add_argument("--run-dir", default=None, help=RUN_DIR_HELP)
    status.add_argument("--json", action="store_true", help="one entry per process: pid, state, metrics URL, restarts")
    status.set_defaults(handler=cmd_status)
    supervise = commands.add_parser("supervise", help="restart the deployment's exited processes (run by pdd up)")
    supervise.add_argument("--run-dir", default=None, help=RUN_DIR_HELP)
    supervise.set_defaults(handler=cmd_supervise)
    restart = commands.add_parser("restart", help="restart one process (e.g. cache-index-0, nats-b, wan-link)")
    restart.add_argument("name", help="process name as pdd status lists it")
    restart.add_argument("--run-dir", default=None, help=RUN_DIR_HELP)
    restart.set_defaults(handler=cmd_restart)


def _add_container_parsers(commands):
    """``secrets``, ``streams`` and ``install-tokenizer``: what compose and Kubernetes deployments
    are prepared with."""
    secrets = commands.add_parser(
        "secrets",
        help="write a deployment's CA, certificate, NATS nkeys and bulk "
        "secret into a folder (for docker-compose / Kubernetes)",
    )
    secrets.add_argument("--out", required=True, help="folder (created 0700; files 0600; existing ones kept)")
    secrets.add_argument(
        "--san",
        action="append",
        default=[],
        help="another DNS name for the certificate, e.g. the address site B dials site A's "
        "leafnode at (repeatable; applies when the certificate is made)",
    )
    secrets.add_argument(
        "--owner",
        default=None,
        metavar="UID[:GID]",
        help="hand the folder to this user (the containers' user, 10001, when compose runs them as it; needs root)",
    )
    secrets.set_defaults(handler=cmd_secrets)
    streams = commands.add_parser(
        "streams",
        help="create one site's JetStream streams as the admin identity "
        "(the deployment step of compose and Kubernetes)",
    )
    streams.add_argument("--site", required=True, help="the site (its JetStream domain)")
    streams.add_argument("--nats-url", required=True, help="that site's NATS server")
    streams.add_argument("--seed-file", default="", help="admin.nk of the secrets folder (no service holds it)")
    streams.add_argument("--ca-file", default="", help="the deployment's CA certificate")
    streams.set_defaults(handler=cmd_streams)
    hf = commands.add_parser(
        "install-tokenizer",
        help="put SmolLM2's tokenizer in the Hugging Face cache under "
        "its hub id (for aiperf, guidellm, eval harnesses; make setup runs it)",
    )
    hf.add_argument(
        "--hub-cache",
        default=None,
        help="hub cache folder (default: $HF_HUB_CACHE, else $HF_HOME/hub, else ~/.cache/huggingface/hub)",
    )
    hf.set_defaults(handler=cmd_install_tokenizer)


def cmd_generate(args) -> int:
    """Stream one completion to stdout; statistics go to stderr."""
    from shared.engine.sampling import SamplingParams

    sampling = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        seed=args.seed,
        stop=tuple(args.stop),
    )
    sampling.validate()  # before torch and the model load: a bad flag costs nothing
    from shared.engine.backend import BackendOptions, create_backend
    from shared.model_loader import load_model

    loaded = load_model(args.model, device=args.device, dtype=args.dtype)
    prompt = _prompt_ids(loaded.tokenizer, args.prompt, raw=args.raw)
    block_size = 32 if args.engine == "vllm" else 16  # vLLM's CPU attention takes multiples of 32
    engine = create_backend(
        args.engine,
        BackendOptions(
            model=args.model, device=args.device, dtype=args.dtype, kv_cache_bytes=1 << 30, block_size=block_size
        ),
        loaded,
    )
    start = time.perf_counter()
    engine.add_request("cli", prompt, sampling)
    first_token_s = _print_stream(engine, loaded.tokenizer, start)
    seq = engine.free("cli")
    elapsed = time.perf_counter() - start
    num_out = len(seq.output_token_ids)
    stats = {
        "prompt_tokens": len(prompt),
        "output_tokens": num_out,
        "finish_reason": seq.finish_reason,
        "ttft_s": round(first_token_s, 3),
        "decode_tok_s": round((num_out - 1) / max(elapsed - first_token_s, 1e-9), 1),
    }
    print(json.dumps(stats), file=sys.stderr)
    return 0


def _prompt_ids(tokenizer, text: str, raw: bool) -> list[int]:
    """``text`` as token ids: as it is (``raw``), else as a user message in the chat template."""
    if raw:
        return tokenizer.encode(text)
    messages = [{"role": "user", "content": text}]
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False))


def _print_stream(engine, tokenizer, start: float) -> float:
    """Step ``engine`` until its request ``cli`` is done, printing its text as it grows; return
    the seconds from ``start`` to the first token."""
    printed, first_token_s = "", None
    while engine.has_work():
        for out in engine.step():
            if out.error:
                raise PddError(out.error)
            first_token_s = first_token_s or time.perf_counter() - start
        text = tokenizer.decode(engine.request("cli").output_token_ids, skip_special_tokens=True)
        # Hold back a trailing replacement char: a multi-byte character may be half-decoded.
        stable = text.rstrip("\ufffd")
        sys.stdout.write(stable[len(printed) :])
        sys.stdout.flush()
        printed = stable
    print(file=sys.stdout)
    return first_token_s


def cmd_up(args) -> int:
    """Start the deployment; with --detach return once healthy, else run until Ctrl-C."""
    from infra import launcher

    deployment = launcher.up(DeploymentSpec.from_args(args))
    print(
        f"PDD is up: {deployment.router_url}  (WAN link control: {deployment.wan_control_url}; "
        f"logs: {deployment.run_dir}/logs)"
    )
    if args.detach:
        return 0
    try:
        signal_wait()
    finally:
        launcher.down(Path(deployment.run_dir), quiet=True)
    return 0


def signal_wait():
    """Block until SIGINT or SIGTERM."""
    import signal

    received = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: received.append(1))
    while not received:
        signal.pause()


def cmd_down(args) -> int:
    """Stop the deployment."""
    from infra import launcher

    stopped = launcher.down(launcher.run_dir_of(args.run_dir))
    print(f"stopped {len(stopped)} processes")
    return 0


def cmd_status(args) -> int:
    """Print the deployment's processes and health."""
    from infra import launcher

    print(json.dumps(launcher.status(launcher.run_dir_of(args.run_dir), detailed=args.json), indent=2))
    return 0


def cmd_streams(args) -> int:
    """Create a site's streams (KV events, dead letters) as ``admin``."""
    import asyncio

    from infra.streams import create_site_streams

    names = asyncio.run(create_site_streams(args.nats_url, args.site, args.seed_file, args.ca_file))
    print(f"streams of {args.site}: {', '.join(names)}")
    return 0


def cmd_secrets(args) -> int:
    """Generate (or complete) a secrets folder that compose and Kubernetes mount."""
    from infra.credentials import ensure_credentials
    from infra.nats_server import write_config_includes

    creds = ensure_credentials(Path(args.out).resolve(), tuple(args.san))
    write_config_includes(creds)
    if args.owner:
        from infra.credentials import give_to

        uid, _, gid = args.owner.partition(":")
        if not uid.isdigit() or (gid and not gid.isdigit()):
            print(f"pdd secrets: --owner {args.owner!r}: expected UID or UID:GID", file=sys.stderr)
            return 2
        give_to(creds.folder, int(uid), int(gid or uid))
    print(f"secrets in {creds.folder}; for docker compose: export PDD_SECRETS_DIR={creds.folder}")
    return 0


def cmd_install_tokenizer(args) -> int:
    """Place SmolLM2's tokenizer where transformers finds it offline as HuggingFaceTB/SmolLM2-135M-Instruct."""
    from shared.hf_cache import SMOLLM2_HF_ID, install_tokenizer
    from shared.model_loader import ensure_smollm2_converted

    hub_cache = Path(args.hub_cache).expanduser() if args.hub_cache else None
    snapshot = install_tokenizer(ensure_smollm2_converted(), SMOLLM2_HF_ID, hub_cache)
    print(f"tokenizer of {SMOLLM2_HF_ID} in {snapshot} (load it with HF_HUB_OFFLINE=1)")
    return 0


def cmd_supervise(args) -> int:
    """Supervise the deployment (started by pdd up)."""
    from infra import launcher
    from infra.supervisor import supervise

    configure_logging()
    return supervise(launcher.run_dir_of(args.run_dir))


def cmd_restart(args) -> int:
    """Restart one service process of the running deployment."""
    from infra import launcher

    pid = launcher.restart(launcher.run_dir_of(args.run_dir), args.name)
    print(f"restarted {args.name} (pid {pid})")
    return 0


def cmd_wan_show(args) -> int:
    """Print the WAN link's profile and byte counters."""
    return _wan(args, None)


def cmd_wan_set(args) -> int:
    """Change the WAN link's profile."""
    from infra.wan_control import profile_changes

    return _wan(args, profile_changes(args))


def cmd_wan_partition(args) -> int:
    """Cut or restore the WAN link."""
    return _wan(args, {"partitioned": args.state == "on"})


def _wan(args, changes: dict | None) -> int:
    """GET (``changes`` None) or PUT the link profile; print the link's snapshot."""
    from infra import launcher, wan_control

    url, key = args.control_url, ""
    if args.control_key_file:
        key = Path(args.control_key_file).read_text().strip()
    if url is None or not args.control_key_file:
        deployment = launcher.load_state(launcher.default_run_dir())
        if deployment is None and url is None:
            raise wan_control.WanControlError("no running deployment; pass --control-url")
        if deployment is not None:
            url, key = url or deployment.wan_control_url, key or deployment.control_key()
    print(json.dumps(wan_control.call(url, changes, key), indent=2))
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``pdd`` console script: run the command's handler."""
    args = build_parser().parse_args(argv)
    if not args.sets_up_logging:
        configure_logging(args.log_level)
    try:
        return args.handler(args)
    except (PddError, ValueError) as exc:
        print(f"pdd: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
