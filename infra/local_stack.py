"""A whole two-site deployment inside one process: for tests and quick experiments.

Real nats-server processes (one per site, leafnode through the WAN link), the real WAN link
on loopback sockets, and every service as its own actor on this event loop — the same
classes the launcher runs as separate processes. Models are loaded once and shared.
"""

import asyncio
import shutil
import subprocess
import tempfile
from pathlib import Path

import nats

from infra.credentials import PEER_OF_ROLE, Credentials, ensure_credentials
from infra.nats_server import (
    SITE_A,
    SITE_B,
    NatsSite,
    free_port,
    instances_away,
    leafnode_count,
    start_nats,
    start_nats_on_free_ports,
    wait_until,
)
from infra.streams import create_site_streams
from infra.wan_link import LinkProfile, Route, WanLink
from services.cache_index.service import CacheIndexService
from services.main_decode.service import MainDecodeService
from services.prefill.service import PrefillService
from services.relay_decode.service import RelayDecodeService
from services.router.service import RouterService
from shared import nats_client
from shared.bulk.auth import verify_key
from shared.bulk.link_route import route_key
from shared.config import (
    BulkReceiverConfig,
    CacheIndexConfig,
    PrefillConfig,
    RelayDecodeConfig,
    RouterConfig,
    build_config,
)
from shared.model_loader import LoadedModel, ModelMetadata
from shared.nats_roles import ADMIN

_COMMON_SETTINGS = {"heartbeat_s": 0.25}
"""Settings every service of the stack starts with."""


async def start_site_pair(
    link: WanLink,
    workdir: Path,
    processes: list,
    credentials: Credentials | None = None,
    identities: tuple[tuple[str, str], ...] = (),
    md_site: str = SITE_B,
) -> dict[str, NatsSite]:
    """Start site A's and site B's nats-servers, the leafnode crossing ``link``.

    Started processes are appended to ``processes`` (also when a later step fails), for the
    caller to stop. Returns once the leafnode is connected. With ``credentials`` the servers
    are locked down (role nkeys, TLS, a mutual-TLS leafnode).
    """
    site_a = await _start_nats_server(
        workdir,
        processes,
        lambda: NatsSite(
            SITE_A,
            free_port(),
            free_port(),
            workdir / "js-a",
            leaf_listen_port=free_port(),
            credentials=credentials,
            identities=identities,
            away=instances_away(SITE_A, identities, md_site),
        ),
    )
    leaf_port = await link.add_route(
        Route("leafnode", "127.0.0.1", 0, "127.0.0.1", site_a.leaf_listen_port, from_site=SITE_B)
    )
    site_b = await _start_nats_server(
        workdir,
        processes,
        lambda: NatsSite(
            SITE_B,
            free_port(),
            free_port(),
            workdir / "js-b",
            leaf_remote_url=f"nats-leaf://127.0.0.1:{leaf_port}",
            credentials=credentials,
            identities=identities,
            away=instances_away(SITE_B, identities, md_site),
        ),
    )
    # JetStream behind a leafnode answers cross-domain API calls once both servers are up.
    await asyncio.get_running_loop().run_in_executor(
        None, wait_until, lambda: leafnode_count(site_a) >= 1, 15, "leafnode between the sites did not connect"
    )
    await _create_streams((site_a, site_b), credentials)
    return {SITE_A: site_a, SITE_B: site_b}


async def _start_nats_server(workdir: Path, processes: list, make_site) -> NatsSite:
    """Start a nats-server on the ports ``make_site()`` draws (off the event loop); append its
    process to ``processes``."""
    site, process = await asyncio.get_running_loop().run_in_executor(None, start_nats_on_free_ports, make_site, workdir)
    processes.append(process)
    return site


async def _create_streams(sites: tuple[NatsSite, ...], credentials: Credentials | None):
    """The deployment step: each site's streams, made by the admin identity alone."""
    login = {"seed_file": str(credentials.seed_file(ADMIN)), "ca_file": str(credentials.ca_file)} if credentials else {}
    for site in sites:
        await create_site_streams(site.url, site.site, **login)


class LocalStack:
    """Start with ``await stack.start()``; the router is at ``stack.base_url``."""

    def __init__(
        self,
        loaded: LoadedModel,
        metadata: ModelMetadata,
        *,
        num_main: int = 1,
        num_relay: int = 1,
        num_routers: int = 1,
        profile: LinkProfile | None = None,
        router_settings: dict | None = None,
        engine_settings: dict | None = None,
        decode_settings: dict | None = None,
        relay_settings: dict | None = None,
        secret: str = "local-stack-secret",
        secure: bool = True,
        engines: dict[str, str] | None = None,
        md_site: str = SITE_B,
    ):
        """``md_site``: where the main decoders run (site A: beside the prefill, as the
        same-site baseline; their KV then crosses no WAN)."""
        self.loaded, self.metadata = loaded, metadata
        self.md_site = md_site
        self.num_main, self.num_relay, self.num_routers = num_main, num_relay, num_routers
        self.link = WanLink(profile or LinkProfile(bandwidth_bps=0, rtt_ms=0, jitter_ms=0), route_key=route_key(secret))
        self.router_settings = router_settings or {}
        self.engine_settings = {"model": loaded.name, "kv_cache_mb": 64, **(engine_settings or {})}
        self.decode_settings = decode_settings or {}
        self.relay_settings = relay_settings or {}
        self.engines = engines or {}
        """Per role (``prefill``, ``relay_decode``, ``main_decode``), a backend other than the
        default (a mixed deployment: ``{"prefill": "vllm"}``)."""
        self.secret = secret
        self.workdir = Path(tempfile.mkdtemp(prefix="pdd-stack-"))
        self.credentials = (
            ensure_credentials(
                self.workdir / "secrets", instance_ids=tuple(instance for _, instance in self.identities)
            )
            if secure
            else None
        )
        self.nats_processes = []
        self.sites: dict[str, NatsSite] = {}
        self.routers: list[RouterService] = []
        self.prefill: PrefillService | None = None
        self.relays: list[RelayDecodeService] = []
        self.mains: list[MainDecodeService] = []
        self.cache_index: CacheIndexService | None = None

    @property
    def router(self) -> RouterService | None:
        """The first router (``router-0``)."""
        return self.routers[0] if self.routers else None

    @property
    def base_url(self) -> str:
        """OpenAI base URL of the first router (``router_url(i)``: of router ``i``)."""
        return self.router_url(0)

    def router_url(self, index: int) -> str:
        """OpenAI base URL of router ``index`` (each listens on its own free port)."""
        return f"http://127.0.0.1:{self.routers[index].port}/v1"

    @property
    def services(self) -> list:
        """Every service actor, routers last."""
        return [s for s in [self.cache_index, self.prefill, *self.relays, *self.mains, *self.routers] if s]

    async def start(self) -> "LocalStack":
        """Start NATS, the link and every service; return once the router sees them all."""
        self.sites = await start_site_pair(
            self.link, self.workdir, self.nats_processes, self.credentials, self.identities, self.md_site
        )
        await self._start_services()
        await self.wait_ready()
        return self

    @property
    def identities(self) -> tuple[tuple[str, str], ...]:
        """``(role, instance_id)`` of every service instance, each with its own NATS identity."""
        return (
            ("cache_index", "cache-index-0"),
            ("prefill", "prefill-0"),
            *(("relay_decode", f"relay-decode-{i}") for i in range(self.num_relay)),
            *(("main_decode", f"main-decode-{i}") for i in range(self.num_main)),
            *(("router", f"router-{i}") for i in range(self.num_routers)),
        )

    def security(self, instance_id: str) -> dict:
        """The settings instance ``instance_id`` needs to join this stack's NATS as itself."""
        if self.credentials is None:
            return {}
        creds = self.credentials
        settings = {"nats_seed_file": str(creds.seed_file(instance_id)), "tls_ca_file": str(creds.ca_file)}
        peer = PEER_OF_ROLE.get({i: r for r, i in self.identities}.get(instance_id, ""))
        if peer:  # an engine: its own certificate for the bulk channel
            settings.update(tls_cert_file=str(creds.cert_file(peer)), tls_key_file=str(creds.key_file(peer)))
        return settings

    async def connect(self, site: str, instance_id: str) -> nats.NATS:
        """A NATS client at ``site`` holding instance ``instance_id``'s credentials, or with
        ``admin`` the deployment step's (for tests: e.g. a stolen credential)."""
        role = {i: r for r, i in self.identities}.get(instance_id, ADMIN)  # admin: the deployment step's
        creds = self.security(instance_id)
        return await nats_client.connect(
            self.sites[site].url,
            role=role,
            instance_id=instance_id,
            seed_file=creds.get("nats_seed_file", ""),
            ca_file=creds.get("tls_ca_file", ""),
        )

    async def _start_services(self):
        """Make every service (cache index, prefill, relays, main decoders, router), then start each."""
        receiver_key = {"bulk_verify_key": verify_key(self.secret)}  # receivers cannot sign flows
        self.cache_index = self._cache_index_service()
        self.prefill = self._prefill_service()
        for i in range(self.num_relay):
            self.relays.append(self._relay_service(i, receiver_key))
        # One routed port for every main decoder, as `pdd up` and compose run it.
        wan_port = await self.link.add_route(Route("bulk-main-decode", "127.0.0.1", 0, "*", 0, from_site=SITE_A))
        for i in range(self.num_main):
            self.mains.append(self._main_service(i, receiver_key, wan_port))
        self.routers = [self._router_service(i) for i in range(self.num_routers)]
        for service in self.services:
            await service.start()

    def _cache_index_service(self) -> CacheIndexService:
        """The cache index, at site A."""
        return CacheIndexService(
            build_config(
                CacheIndexConfig,
                {
                    **_COMMON_SETTINGS,
                    **self.security("cache-index-0"),
                    "site": SITE_A,
                    "nats_url": self.sites[SITE_A].url,
                    "instance_id": "cache-index-0",
                },
                {},
            )
        )

    def _prefill_service(self) -> PrefillService:
        """The prefill engine, at site A, holding the bulk secret it signs flows with."""
        return PrefillService(
            build_config(
                PrefillConfig,
                {
                    **_COMMON_SETTINGS,
                    "bulk_secret": self.secret,
                    **self.security("prefill-0"),
                    **self.engine_settings,
                    **self._engine("prefill"),
                    "site": SITE_A,
                    "nats_url": self.sites[SITE_A].url,
                    "instance_id": "prefill-0",
                },
                {},
            ),
            self.loaded,
        )

    def _relay_service(self, i: int, receiver_key: dict) -> RelayDecodeService:
        """Relay decoder ``i``, at site A."""
        return RelayDecodeService(
            build_config(
                RelayDecodeConfig,
                {
                    **_COMMON_SETTINGS,
                    **receiver_key,
                    **self.security(f"relay-decode-{i}"),
                    **self.engine_settings,
                    **self.decode_settings,
                    **self.relay_settings,
                    **self._engine("relay_decode"),
                    "site": SITE_A,
                    "nats_url": self.sites[SITE_A].url,
                    "instance_id": f"relay-decode-{i}",
                },
                {},
            ),
            self.loaded,
        )

    def _main_service(self, i: int, receiver_key: dict, wan_port: int) -> MainDecodeService:
        """Main decoder ``i``, at ``md_site``: its bulk channel on a port the kernel gives it when
        it listens (a port drawn earlier can be taken meanwhile as some client's local port),
        reached through the link's ``wan_port`` from the other site."""
        return MainDecodeService(
            build_config(
                BulkReceiverConfig,
                {
                    **_COMMON_SETTINGS,
                    **receiver_key,
                    **self.security(f"main-decode-{i}"),
                    **self.engine_settings,
                    **self.decode_settings,
                    **self._engine("main_decode"),
                    "site": self.md_site,
                    "nats_url": self.sites[self.md_site].url,
                    "instance_id": f"main-decode-{i}",
                    "bulk_link": f"127.0.0.1:{wan_port}",
                },
                {},
            ),
            self.loaded,
        )

    def _router_service(self, index: int) -> RouterService:
        """Router ``index``, at site A, on a free HTTP port (``router_settings`` override the rest)."""
        return RouterService(
            build_config(
                RouterConfig,
                {
                    **_COMMON_SETTINGS,
                    **self.security(f"router-{index}"),
                    "site": SITE_A,
                    "nats_url": self.sites[SITE_A].url,
                    "instance_id": f"router-{index}",
                    "model": self.loaded.name,
                    "http_port": 0,
                    "instance_ttl_s": 2.0,
                    **self.router_settings,
                },
                {},
            ),
            self.metadata,
        )

    def _engine(self, role: str) -> dict:
        return {"engine": self.engines[role]} if role in self.engines else {}

    async def wait_ready(self, timeout_s: float = 20.0):
        """Until every router sees every engine instance and the other routers, and the
        cache-index is in sync."""
        want = {"prefill": 1, "relay_decode": len(self.relays), "main_decode": len(self.mains), "cache_index": 1}

        def sees_all(router: RouterService) -> bool:
            live = router.registry.summary()
            routers = router.registry.routers()
            return all(len(live[s]) >= n for s, n in want.items()) and len(routers) >= len(self.routers)

        def ready():
            synced = all(idx.seq >= 0 for idx in self.cache_index.instances.values())
            return (
                all(map(sees_all, self.routers)) and synced and len(self.cache_index.instances) >= 1 + len(self.mains)
            )

        deadline = asyncio.get_running_loop().time() + timeout_s
        while not ready():
            if asyncio.get_running_loop().time() > deadline:
                raise TimeoutError(f"stack not ready: {self.router.registry.summary()}")
            await asyncio.sleep(0.05)

    async def stop_nats(self, site: str):
        """Stop the site's nats-server (a fault: core NATS loses what is published meanwhile)."""
        process = self.nats_processes[list(self.sites).index(site)]
        process.terminate()
        await asyncio.get_running_loop().run_in_executor(None, process.wait, 10)

    async def start_nats(self, site: str):
        """Start the site's nats-server again on the same ports and JetStream store."""
        self.nats_processes[list(self.sites).index(site)] = await asyncio.get_running_loop().run_in_executor(
            None, start_nats, self.sites[site], self.workdir
        )

    async def restart_nats(self, site: str):
        """Stop and start the site's nats-server."""
        await self.stop_nats(site)
        await self.start_nats(site)

    async def stop(self):
        """Stop services, the link and NATS; remove the work folder."""
        for service in reversed(self.services):
            try:
                await service.stop()
            except (nats.errors.Error, RuntimeError):
                pass
        await self.link.close()
        for process in self.nats_processes:
            process.terminate()
        for process in self.nats_processes:
            try:
                process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                process.kill()
        shutil.rmtree(self.workdir, ignore_errors=True)
