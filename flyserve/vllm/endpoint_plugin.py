"""The ``vllm.endpoint_plugins`` entry point ``flyserve-endpoint``: the engine channel's API-server side.

vLLM (0.32+) loads it in the OpenAI API server only when ``VLLM_PLUGINS`` names it, and
``VLLM_PLUGINS`` is also the allowlist of general plugins, so name both:
``VLLM_PLUGINS=flyserve,flyserve-endpoint``. The workers need ``FLYSERVE_ATTENTION=1`` as usual
(the general plugin then installs the worker method, flyserve.vllm.engine_channel).

``init_state`` starts a ChannelPusher on the server's event loop: it watches the state directory
($FLYSERVE_STATE_DIR, on the API server's node) and pushes each new version to every worker by
collective RPC. Without this plugin, ranks keep polling the state directory (the fallback).

Environment: FLYSERVE_CHANNEL_POLL_S  seconds between two looks at control/current.json (0.05).
             FLYSERVE_ROUTES=1        also serve the sidecar's routes under /flyserve (see attach_router).
"""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Any

from flyserve.control.paths import StateDir, default_state_dir
from flyserve.vllm.channel_pusher import DEFAULT_POLL_S, ChannelPusher

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
    raw = os.environ.get(POLL_ENV)
    if not raw:
        return DEFAULT_POLL_S
    try:
        v = float(raw)
    except ValueError:
        raise ValueError(f"{POLL_ENV} must be a number of seconds, got {raw[:40]!r}") from None
    if not 0 < v <= 60:
        raise ValueError(f"{POLL_ENV} must be in (0, 60] seconds, got {v}")
    return v


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
        backend = getattr(args, "distributed_executor_backend", None)
        if backend == "ray":
            # Ray runs execute_model on a compiled graph's thread and a collective RPC on the actor's
            # own thread: the two are not ordered, so "the same step" is checked, not guaranteed.
            log.warning(
                "flyserve engine channel: the Ray executor does not order RPCs with engine steps; "
                "every push's answers are checked and a split is logged and counted (split_steps)"
            )
        state_dir = StateDir(default_state_dir())

        async def rpc(method: str, docs: list[str]) -> list[Any]:
            return list(await engine_client.collective_rpc(method, timeout=RPC_TIMEOUT_S, args=(docs,)))

        self.pusher = ChannelPusher(state_dir, rpc, poll_s=poll_interval())
        state.flyserve_channel = self.pusher
        log.info(
            "flyserve thresholds: mode engine channel (pushing versions from %s to every worker)",
            state_dir.path,
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


def plugin() -> FlyserveEndpointPlugin:
    """The entry point's factory (pyproject.toml: [project.entry-points."vllm.endpoint_plugins"])."""
    from flyserve.vllm.plugin import show_logs

    show_logs()
    return FlyserveEndpointPlugin()
