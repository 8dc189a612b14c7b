"""Driving ``docker-compose.yml`` for demos and tests: up, scale, wait, down, and what is left.

Uses whichever Compose the machine has: the v2 plugin (``docker compose``) or v1
(``docker-compose``); both talk to the engine ``DOCKER_HOST`` names (or the default socket).
"""

import os
import shutil
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from infra.http_probe import get_json

ROOT = Path(__file__).resolve().parent.parent
CONTAINER_UID = 10001
"""The user the images run as (``infra/Dockerfile``, ``infra/nats/Dockerfile``)."""


COMPOSE_HTTP_TIMEOUT_S = 600


class ComposeError(RuntimeError):
    """A compose command failed, or the stack did not become ready in time."""


def compose_command() -> list[str]:
    """``docker compose`` where the plugin exists, else ``docker-compose``."""
    if shutil.which("docker") and subprocess.run(["docker", "compose", "version"], capture_output=True).returncode == 0:
        return ["docker", "compose"]
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    raise ComposeError("neither `docker compose` nor `docker-compose` is installed")


@dataclass
class ComposeStack:
    """One compose project of ``docker-compose.yml``.

    Attributes:
        project: The compose project name (containers, networks and volumes carry it).
        secrets_dir: The mounted secrets folder (``PDD_SECRETS_DIR``).
        router_port: Host port (on 127.0.0.1) the router is published on.
        wan_control_port: Host port of the WAN link's control API.
        env: Extra environment for compose (image names, user ids…).
    """

    project: str
    secrets_dir: Path
    router_port: int
    wan_control_port: int
    env: dict = field(default_factory=dict)

    @property
    def router_url(self) -> str:
        return f"http://127.0.0.1:{self.router_port}/v1"

    @property
    def wan_control_url(self) -> str:
        return f"http://127.0.0.1:{self.wan_control_port}"

    @property
    def control_key(self) -> str:
        """The WAN link control API's key (``control.key`` of the mounted secrets)."""
        from infra.wan_control import control_key_in

        return control_key_in(self.secrets_dir)

    def compose(self, *args: str, check: bool = True, capture: bool = False) -> str:
        """Run a compose command for this project."""
        env = {
            # Docker's API answers compose within 60 s by default; on a vfs data root removing
            # a dozen full container filesystems takes longer than that.
            "COMPOSE_HTTP_TIMEOUT": str(COMPOSE_HTTP_TIMEOUT_S),
            **os.environ,
            "PDD_SECRETS_DIR": str(self.secrets_dir),
            "PDD_ROUTER_PORT": str(self.router_port),
            "PDD_WAN_CONTROL_PORT": str(self.wan_control_port),
            **self.env,
        }
        argv = [*compose_command(), "-f", str(ROOT / "docker-compose.yml"), "-p", self.project, *args]
        result = subprocess.run(argv, env=env, cwd=ROOT, text=True, stdout=subprocess.PIPE if capture else None)
        if check and result.returncode != 0:
            raise ComposeError(f"{' '.join(argv[-len(args) :])} failed (exit {result.returncode})")
        return result.stdout or ""

    def up(self, main_decoders: int = 1, relays: int = 1, prefills: int = 1, routers: int = 1):
        """Start the default profile with that many replicas of each scalable service."""
        self.compose(
            "up",
            "-d",
            "--no-build",
            "--scale",
            f"main-decode={main_decoders}",
            "--scale",
            f"relay-decode={relays}",
            "--scale",
            f"prefill={prefills}",
            "--scale",
            f"router={routers}",
        )

    def containers(self, service: str) -> list[str]:
        """Ids of the running containers of ``service``, in a stable order."""
        labels = [f"label=com.docker.compose.project={self.project}", f"label=com.docker.compose.service={service}"]
        argv = ["docker", "ps", "-q", "--no-trunc", *(a for label in labels for a in ("--filter", label))]
        return sorted(subprocess.run(argv, capture_output=True, text=True, check=True).stdout.split())

    def kill(self, container: str):
        """SIGKILL one container (a crash: nothing it runs gets to clean up)."""
        subprocess.run(["docker", "kill", container], capture_output=True, check=True)

    def scale_main_decode(self, replicas: int):
        """Change the number of main-decode replicas (the others keep running)."""
        self.scale("main-decode", replicas)

    def scale(self, service: str, replicas: int):
        """Change the number of ``service``'s replicas (the others keep running)."""
        self.compose(
            "up", "-d", "--no-build", "--no-recreate", "--no-deps", "--scale", f"{service}={replicas}", service
        )

    def down(self):
        """Stop and remove the project's containers, networks and volumes."""
        self.compose("down", "-v", "--remove-orphans", "--timeout", "20")

    def health(self) -> dict | None:
        """The router's ``/health`` (instances per service), or None while it does not answer."""
        return get_json(f"http://127.0.0.1:{self.router_port}/health", timeout_s=3.0)

    def wait_ready(self, want: dict[str, int], timeout_s: float = 420.0):
        """Until the router sees ``want`` live instances per service (e.g. main_decode: 2;
        router: the live routers, itself included)."""
        deadline, last_report = time.monotonic() + timeout_s, 0.0
        while True:
            health = self.health()
            seen = {s: len((health or {}).get("instances", {}).get(s, [])) for s in want}
            if health and all(seen[s] == n for s, n in want.items()):
                return health
            if time.monotonic() > deadline:
                self.compose("ps", check=False)
                raise ComposeError(f"not ready after {timeout_s:.0f} s: router sees {seen}, wants {want}")
            if time.monotonic() - last_report > 15:
                last_report = time.monotonic()
                print(f"waiting for the stack: {'router not answering' if not health else seen}", flush=True)
            time.sleep(1.0)

    def leftovers(self) -> dict[str, list[str]]:
        """Containers, networks and volumes of this project that still exist."""
        label = f"label=com.docker.compose.project={self.project}"
        found = {}
        for kind, args in (
            ("containers", ["ps", "-a", "-q"]),
            ("networks", ["network", "ls", "-q"]),
            ("volumes", ["volume", "ls", "-q"]),
        ):
            result = subprocess.run(["docker", *args, "--filter", label], capture_output=True, text=True)
            found[kind] = result.stdout.split()
        return found


def let_containers_read(secrets_dir: Path) -> dict[str, str]:
    """Make the secrets folder readable in the containers; return the compose environment
    that takes. As root the folder is handed to the containers' user; otherwise they run as
    the caller (``PDD_UID``/``PDD_GID``), who owns it."""
    if os.geteuid() == 0:
        from infra.credentials import give_to

        give_to(secrets_dir, CONTAINER_UID, CONTAINER_UID)
        return {}
    return {"PDD_UID": str(os.getuid()), "PDD_GID": str(os.getgid())}
