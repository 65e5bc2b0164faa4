"""The ``vllm.endpoint_plugins`` entry point ``flyserve-endpoint``: the engine channel's API-server side.

vLLM (0.32+) loads it in the OpenAI API server only when ``VLLM_PLUGINS`` names it, and
``VLLM_PLUGINS`` is also the allowlist of general plugins, so name both:
``VLLM_PLUGINS=flyserve,flyserve-endpoint``. The workers need ``FLYSERVE_ATTENTION=1`` as usual
(the general plugin then installs the worker method, flyserve.vllm.engine_channel).

``init_state`` starts a ChannelPusher on the server's event loop: it watches the state directory
($FLYSERVE_STATE_DIR, on the API server's node) and pushes each new version to every worker of
every engine by collective RPC, one call per engine core (data parallel: see engine_rpcs), and
asks the workers for their reports every few seconds. Without this plugin, ranks keep polling the
state directory (the fallback). Under vLLM 0.32's legacy Ray DAG executor it starts nothing: the
channel's ordering does not hold there (flyserve.vllm.topology.channel_ordering).

Environment: FLYSERVE_CHANNEL_POLL_S  seconds between two looks at control/current.json (0.05).
             FLYSERVE_ROUTES=1        also serve the sidecar's routes under /flyserve (see attach_router).
"""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Any

from flyserve.control.paths import StateDir, default_state_dir
from flyserve.control.rank_modes import FILE_POLLING_UNORDERED
from flyserve.vllm.channel_pusher import DEFAULT_POLL_S, ChannelPusher
from flyserve.vllm.engine_channel import REPORT_METHOD
from flyserve.vllm.env_numbers import env_number
from flyserve.vllm.topology import channel_ordering

log = logging.getLogger("flyserve.vllm")

NAME = "flyserve-endpoint"
POLL_ENV = "FLYSERVE_CHANNEL_POLL_S"
RPC_TIMEOUT_S: float | None = None
"""No timeout: the multiprocessing executor's RPC timeout abandons a response that still arrives
later on the same queue (vLLM 0.32, multiproc_executor.collective_rpc), and the next RPC would read
it. The worker side takes microseconds; a push waits only for the step in flight to end."""
ROUTES_ENV = "FLYSERVE_ROUTES"
ROUTES_PREFIX = "/flyserve"
TOKEN_FILE_ENV = "FLYSERVE_SIDECAR_TOKEN_FILE"


def poll_interval() -> float:
    return env_number(
        POLL_ENV, DEFAULT_POLL_S, float, ok=lambda v: 0 < v <= 60, expect="a number of seconds in (0, 60]"
    )


class FlyserveEndpointPlugin:
    """Satisfies vLLM's EndpointPlugin protocol (structurally; vLLM is imported only by vLLM)."""

    name = NAME
    required_tasks = None  # any server with an engine; the render-only server passes engine_client=None

    def __init__(self) -> None:
        self.pusher: ChannelPusher | None = None
        self.routes_app: Any = None
        self.task: asyncio.Task[None] | None = None
        self.stop = asyncio.Event()

    def attach_router(self, app: Any) -> None:
        """With FLYSERVE_ROUTES=1, mount the sidecar's app under /flyserve in vLLM's own server (same
        routes, same bearer-token auth: $FLYSERVE_SIDECAR_TOKEN_FILE or $FLYSERVE_SIDECAR_TOKEN), so a
        deployment without a sidecar process still has /flyserve/dispatch-stats, /flyserve/thresholds.
        Off by default: routes on vLLM's port are network surface the operator must choose."""
        if os.environ.get(ROUTES_ENV, "").strip().lower() not in ("1", "true", "yes", "on"):
            return
        from pathlib import Path

        from flyserve.sidecar.app import create_app
        from flyserve.sidecar.settings import SidecarSettings, read_token
        from flyserve.vllm.runtime import profile_name

        token_file = os.environ.get(TOKEN_FILE_ENV)
        settings = SidecarSettings(
            state_dir=default_state_dir(),
            profile=profile_name(),
            token=read_token(Path(token_file) if token_file else None),
            watch_config=False,  # the sidecar or `flyserve thresholds watch` watches the file
            share_control_metrics=False,  # vLLM owns this process's Prometheus multiprocess setting
        )
        self.routes_app = create_app(settings)
        app.mount(ROUTES_PREFIX, self.routes_app)
        log.info(
            "flyserve routes under %s in vLLM's server (mutations %s)",
            ROUTES_PREFIX,
            "need the bearer token" if settings.token is not None else "disabled: no token",
        )

    async def init_state(self, engine_client: Any, state: Any, args: Any) -> None:
        if self.routes_app is not None:
            self.routes_app.state.stats.start()  # a mounted app gets no lifespan of its own
        if engine_client is None:
            log.warning("flyserve engine channel: no engine in this server; ranks keep file polling")
            return
        ordering = channel_ordering(
            getattr(args, "distributed_executor_backend", None), vllm_version=_vllm_version()
        )
        if not ordering.ordered:
            # The workers refuse a push too (they keep file polling, mode FILE_POLLING_UNORDERED):
            # this only keeps the API server from retrying a channel that cannot hold.
            log.warning(
                "flyserve engine channel: NOT started: executor %s: %s; thresholds come by file polling "
                "with the publisher's margin (control_mode %r)",
                ordering.executor,
                ordering.why,
                FILE_POLLING_UNORDERED,
            )
            return
        core = getattr(engine_client, "engine_core", None)
        index = getattr(core, "client_index", 0)
        if isinstance(index, int) and index > 0:
            # vLLM starts one API server per DP engine by default (--api-server-count); each has a
            # client of every engine. One pusher is enough and two would race: API server 0 pushes.
            log.info("flyserve engine channel: API server %d leaves pushing to API server 0", index)
            return
        state_dir = StateDir(default_state_dir())
        rpc, report_rpc, engines = engine_rpcs(engine_client)

        self.pusher = ChannelPusher(
            state_dir, rpc, poll_s=poll_interval(), engines=engines, report_rpc=report_rpc
        )
        state.flyserve_channel = self.pusher
        log.info(
            "flyserve thresholds: mode engine channel (pushing versions from %s to every worker of engines %s)",
            state_dir.path,
            "[0]" if engines is None else list(engines),
        )
        try:
            # Attach before the server takes its first request: from here on every worker takes
            # versions from this channel only, so none can apply one early from its own file poll.
            await self.pusher.sync_once()
        except Exception as exc:  # noqa: BLE001 - serve anyway; the task retries
            log.error("flyserve engine channel: first push failed (%s); the channel task retries", exc)
        self.task = asyncio.get_running_loop().create_task(
            self.pusher.run(self.stop), name="flyserve-channel"
        )


def _vllm_version() -> str | None:
    try:
        import vllm

        return getattr(vllm, "__version__", None)
    except ImportError:
        return None


def engine_rpcs(engine_client: Any) -> tuple[Any, Any, tuple[int, ...] | None]:
    """(push rpc, report rpc, engine indices) for ``engine_client``.

    vLLM 0.32's DP client answers ``collective_rpc`` with the FIRST engine's result only
    (``DPLBAsyncMPClient.call_utility_async``, v1/engine/core_client.py). Its engine cores are in
    ``core_engines`` (ZMQ identities, in the order of ``engine_ranks_managed``), and
    ``_call_utility_async(method, *args, engine=identity)`` sends one utility call to one engine
    core: the engine core runs ``collective_rpc`` between two of its steps, on all its workers. One
    such call per engine, gathered with their exceptions, gives every engine's answer (or its
    failure) - what the pusher needs to confirm per engine. A client without those (in-process
    engine, another vLLM) falls back to ``collective_rpc``: one engine's answers."""
    core = getattr(engine_client, "engine_core", None)
    identities = getattr(core, "core_engines", None)
    call_one = getattr(core, "_call_utility_async", None)
    ranks = getattr(core, "engine_ranks_managed", None)
    if callable(call_one) and isinstance(identities, list) and identities:
        if not (isinstance(ranks, list) and len(ranks) == len(identities)):
            ranks = [int.from_bytes(i, "little") for i in identities]
        pairs = list(zip((int(r) for r in ranks), identities, strict=True))

        async def per_engine(method: str, args: tuple[Any, ...]) -> dict[int, Any]:
            results = await asyncio.gather(
                *(call_one("collective_rpc", method, RPC_TIMEOUT_S, args, None, engine=i) for _, i in pairs),
                return_exceptions=True,
            )
            return {r: res for (r, _), res in zip(pairs, results, strict=True)}

        async def rpc(method: str, docs: list[str]) -> dict[int, Any]:
            return await per_engine(method, (docs,))

        async def report_rpc() -> dict[int, Any]:
            return await per_engine(REPORT_METHOD, ())

        return rpc, report_rpc, tuple(r for r, _ in pairs)

    async def rpc_one(method: str, docs: list[str]) -> list[Any]:
        return list(await engine_client.collective_rpc(method, timeout=RPC_TIMEOUT_S, args=(docs,)))

    async def report_one() -> list[Any]:
        return list(await engine_client.collective_rpc(REPORT_METHOD, timeout=RPC_TIMEOUT_S, args=()))

    return rpc_one, report_one, None


def plugin() -> FlyserveEndpointPlugin:
    """The entry point's factory (pyproject.toml: [project.entry-points."vllm.endpoint_plugins"])."""
    from flyserve.vllm.plugin import show_logs

    show_logs()
    return FlyserveEndpointPlugin()
