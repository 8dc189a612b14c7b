"""``make compose-demo`` (``pdd compose-demo``): the two-site demo in containers.

Builds nothing itself (``make images`` does, first): writes a fresh secrets folder, brings
``docker-compose.yml`` up on the user's Docker engine, waits until the router sees every
instance, holds the same agent conversation as ``make demo`` through the router's port on
127.0.0.1 (each answer checked against transformers' greedy output), slows the WAN link
through its control port before the last turn, then takes everything down and checks that
no container, network or volume of the project is left.
"""

import shutil
import tempfile
from pathlib import Path

from infra.compose import ComposeError, ComposeStack, let_containers_read
from infra.credentials import ensure_credentials
from infra.nats_server import free_port, write_config_includes
from infra.wan_control import call

SLOW_LINK = {"bandwidth_bps": 50e6, "rtt_ms": 80.0}
"""What the demo changes the link to before its last turn (from 100 Mbit/s, 40 ms)."""


def add_compose_demo_parser(commands):
    """The ``pdd compose-demo`` command (the ``compose-demo`` entry point of ``pdd.commands``)."""
    demo = commands.add_parser("compose-demo", help="the two-site demo in Docker containers (make images first)")
    demo.add_argument("--project", default="pdd-demo", help="compose project name")
    demo.add_argument("--main-decoders", type=int, default=1, help="main-decode replicas")
    demo.add_argument("--keep", action="store_true", help="leave the stack running (docker compose -p P down -v)")
    demo.set_defaults(handler=run_compose_demo)


def new_secrets() -> Path:
    """A fresh secrets folder the containers can read."""
    folder = Path(tempfile.mkdtemp(prefix="pdd-compose-secrets-")) / "secrets"
    creds = ensure_credentials(folder)
    write_config_includes(creds)
    return folder


def greedy_reference():
    """``reference(messages, max_tokens)``: transformers' own greedy answer (fp32)."""
    from loadtest.chaos import prompt_ids, references
    from shared.model_loader import load_model

    loaded = load_model("smollm2")
    return lambda messages, max_tokens: references(loaded, [prompt_ids(loaded, messages)], max_tokens)[0]


def run_compose_demo(args) -> int:
    """Up, conversation, link change, down; exit 0 only if every answer is exact and nothing is left."""
    from loadtest.demo_conversation import TURNS, run_demo

    secrets = new_secrets()
    stack = ComposeStack(args.project, secrets, free_port(), free_port(), env=let_containers_read(secrets))
    code = 1
    try:
        print(f"docker compose up (project {args.project}, {args.main_decoders} main decoder(s)) ...", flush=True)
        stack.up(args.main_decoders)
        stack.wait_ready({"prefill": 1, "relay_decode": 1, "main_decode": args.main_decoders, "cache_index": 1})
        print(f"PDD is up in containers: {stack.router_url}  (WAN link control: {stack.wan_control_url})")
        reference = greedy_reference()

        def slow_the_link(turn: int):
            if turn == len(TURNS) - 1:
                profile = call(stack.wan_control_url, SLOW_LINK, stack.control_key)["profile"]
                print(
                    f"     (WAN link now {profile['bandwidth_bps'] / 1e6:.0f} Mbit/s, RTT {profile['rtt_ms']:.0f} ms)"
                )

        code = run_demo(stack.router_url, "smollm2", reference=reference, after_turn=slow_the_link)
        routes = call(stack.wan_control_url, None, stack.control_key)["routes"]
        print(f"flows per main decoder through the link: {routes['bulk-main-decode']['targets']}")
    except ComposeError as exc:
        print(f"compose-demo: {exc}")
    finally:
        if args.keep:
            print(f"left running: docker compose -p {args.project} down -v  (PDD_SECRETS_DIR={secrets})")
        else:
            code = max(code, _take_down(stack, secrets))
    return code


def _take_down(stack: ComposeStack, secrets: Path) -> int:
    stack.down()
    left = {kind: ids for kind, ids in stack.leftovers().items() if ids}
    shutil.rmtree(secrets.parent, ignore_errors=True)
    if left:
        print(f"compose-demo: left behind: {left}")
        return 1
    print("docker compose down -v: no container, network or volume left")
    return 0
