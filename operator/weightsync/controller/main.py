"""`weightsync-operator`: the operator's entry point.

    weightsync-operator                     # every namespace (or WATCH_NAMESPACES)
    weightsync-operator --namespace team-a  # only these (repeatable)

Configuration comes from `WEIGHTSYNC_OPERATOR_*` (see `settings`); the Kubernetes
credentials from the pod's ServiceAccount, or KUBECONFIG outside a cluster.

Without `LEADER_LEASE` one kopf operator runs every handler. With it (the chart's
replicas), every replica runs a serving operator (webhooks, indexes) at once, and a
leading one (reconcile, timers, pod watch) only while it holds the Lease
(`run_replicated`): admission is answered by any replica, reconciling done by one.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import socket
import sys
from typing import Any

import kopf

from weightsync.api import GROUP
from weightsync.controller import handlers, metrics, names
from weightsync.controller.admission.sidecar import AgentTemplate
from weightsync.controller.admission.webhook import build_server
from weightsync.controller.admission.webhook_config import Configurations
from weightsync.controller.agents.client import AgentClient
from weightsync.controller.cluster import events, tokens
from weightsync.controller.cluster.cache import Indexes
from weightsync.controller.cluster.events import EventPoster
from weightsync.controller.cluster.kube import Kube, load_config
from weightsync.controller.cluster.leases import Leases
from weightsync.controller.cluster.podwatch import PodStore, PodWatch
from weightsync.controller.leader import Elector
from weightsync.controller.passes.reconcile import Reconciler
from weightsync.controller.runtime import operators, taskdump, timing
from weightsync.controller.runtime.tasks import Tasks
from weightsync.controller.runtime.timing import HANDLER_BACKOFF_SECONDS as BACKOFF
from weightsync.controller.runtime.timing import HANDLER_TIMEOUT_SECONDS as TIMEOUT
from weightsync.controller.runtime.timing import TIMER_EXIT_POLL_SECONDS
from weightsync.controller.settings import OperatorSettings, SettingsError

log = logging.getLogger("weightsync.operator")

# The exit status of a replica that lost the Lease: the kubelet starts it again, a standby.
EXIT_LOST_LEASE = 3
# The serving operator's finalizer, which it never adds (it has no handler that needs one).
# Not ours: kopf removes its finalizer from objects it watches without such a handler, and
# the serving operator watches WeightSyncs for its indexes.
SERVING_FINALIZER = f"serving.{GROUP}/never-set"


def agent_template(settings: OperatorSettings) -> AgentTemplate:
    def present(**values: str) -> dict[str, str]:
        return {key: value for key, value in values.items() if value}

    return AgentTemplate(
        image=settings.agent_image,
        pull_policy=settings.agent_image_pull_policy.value,
        requests=present(cpu=settings.agent_cpu_request, memory=settings.agent_memory_request),
        limits=present(cpu=settings.agent_cpu_limit, memory=settings.agent_memory_limit),
        http_port=settings.agent_http_port,
        metrics_port=settings.agent_metrics_port,
        log_level=settings.agent_log_level,
        env=tuple(var.to_k8s() for var in settings.agent_env),
    )


class OwnKindsDiffBase(kopf.AnnotationsDiffBaseStorage):
    """kopf's diff base in our annotations, built only for our own kinds.

    kopf builds a "last handled" essence (a deep copy of the object without its
    status) on every event of every watched object, though only kinds with change
    handlers use it. Ours are WeightSyncs; workloads are watched for indexes alone, and
    copying each pod's spec on each of a thousand events (when kopf watched pods too)
    was a sixth of the operator's time while a WeightSync scaled to 1,000 pods.

    The essence is the spec alone: kopf's keeps the user's labels and annotations, so a
    200 KB annotation was copied into the diff-base annotation beside it, the patch
    exceeded the API server's 256 KB for annotations, and kopf's bookkeeping failed
    with a traceback. A change of labels or annotations needs no handler (the timer's
    pass reads the object anyway).
    """

    def build(self, *, body: kopf.Body, extra_fields: Any = None) -> kopf.BodyEssence:
        if not str(body.get("apiVersion", "")).startswith(f"{GROUP}/"):
            return kopf.BodyEssence()
        essence: kopf.BodyEssence = super().build(body=body, extra_fields=extra_fields)
        essence.pop("metadata", None)
        return essence


def configure_kopf(
    kopf_settings: kopf.OperatorSettings, settings: OperatorSettings, server: Any
) -> None:
    """kopf's settings: our names, server-side pod filtering, and every timeout explicit."""
    persistence = kopf_settings.persistence
    persistence.finalizer = names.FINALIZER
    # Progress and the diff base in annotations under our prefix: the status schema is
    # strict (no x-kubernetes-preserve-unknown-fields), so kopf must not write there.
    persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    persistence.diffbase_storage = OwnKindsDiffBase(prefix=GROUP, key="last-handled-configuration")
    # Events: the reconcile posts its own (transitions, plans); kopf turns only warnings
    # and errors from handler logs into Events, so routine logs do not spam `describe`.
    kopf_settings.posting.enabled = True
    kopf_settings.posting.level = logging.WARNING
    kopf_settings.posting.reporting_component = events.COMPONENT
    kopf_settings.posting.event_name_prefix = events.NAME_PREFIX
    # One replica with a Recreate strategy: no peering objects to coordinate replicas.
    kopf_settings.peering.standalone = True
    # A watch is ended by the server after 5 min and re-listed; the client gives it 30 s
    # more before it calls the connection dead; connecting takes 10 s at most. The same
    # values as the operator's own pod watch and writer (`runtime.timing`).
    kopf_settings.watching.server_timeout = timing.WATCH_SERVER_TIMEOUT_SECONDS
    kopf_settings.watching.client_timeout = timing.WATCH_CLIENT_TIMEOUT_SECONDS
    kopf_settings.watching.connect_timeout = timing.API_CONNECT_TIMEOUT_SECONDS
    # Plain API requests (patches, Events) fail after 30 s and are retried with backoff.
    kopf_settings.networking.request_timeout = timing.API_REQUEST_TIMEOUT_SECONDS
    kopf_settings.networking.connect_timeout = timing.API_CONNECT_TIMEOUT_SECONDS
    # Retries are kopf's, set on each handler at registration (`runtime.timing`): one that
    # raised is called again after HANDLER_BACKOFF_SECONDS until HANDLER_TIMEOUT_SECONDS
    # from its first call. kopf cancels no handler that hangs: a pass's own deadline
    # (PASS_TIMEOUT_SECONDS, well below the timeout) does.
    kopf_settings.execution.default_backoff = BACKOFF
    kopf_settings.execution.max_workers = 8  # sync admission handlers run in threads
    kopf_settings.background.cancellation_polling = TIMER_EXIT_POLL_SECONDS
    # On SIGTERM, handlers get 20 s to finish before kopf cancels them (the chart's
    # terminationGracePeriodSeconds is longer).
    kopf_settings.process.ultimate_exiting_timeout = 20
    kopf_settings.admission.server = server
    # Not kopf's: it creates configurations before patching them, a right that cannot be
    # limited to a name. The server writes them (`controller.webhook_config`).
    kopf_settings.admission.managed = None


def build_registry(
    shared: handlers.Shared, pod_watch: PodWatch, server: Any
) -> kopf.OperatorRegistry:
    """Every handler the operator runs, on a registry of its own (`handlers.register`,
    and the startup handlers that configure kopf)."""
    registry = kopf.OperatorRegistry()
    handlers.register(registry, shared, pod_watch)
    _register_startup(registry, shared, server, dump_tasks=True)
    return registry


def build_registries(
    shared: handlers.Shared, pod_watch: PodWatch, server: Any
) -> tuple[kopf.OperatorRegistry, kopf.OperatorRegistry]:
    """With leader election: the serving registry (every replica) and the leading one."""
    serving = kopf.OperatorRegistry()
    handlers.register_serving(serving, shared)
    _register_startup(serving, shared, server, dump_tasks=True, finalizer=SERVING_FINALIZER)

    @kopf.on.cleanup(registry=serving, timeout=TIMEOUT, backoff=BACKOFF)
    async def close_writer(**_: Any) -> None:
        await shared.kube.writer.close()

    leading = kopf.OperatorRegistry()
    handlers.register_leading(leading, shared, pod_watch)
    _register_startup(leading, shared, server=None, dump_tasks=False)
    return serving, leading


def _register_startup(
    registry: kopf.OperatorRegistry,
    shared: handlers.Shared,
    server: Any,
    *,
    dump_tasks: bool,
    finalizer: str = names.FINALIZER,
) -> None:
    if dump_tasks:

        @kopf.on.startup(registry=registry, timeout=TIMEOUT, backoff=BACKOFF)
        async def dump_tasks_on_sigusr1(**_: Any) -> None:
            taskdump.install(asyncio.get_running_loop())

    @kopf.on.startup(registry=registry, timeout=TIMEOUT, backoff=BACKOFF)
    def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
        configure_kopf(settings, shared.settings, server)
        settings.persistence.finalizer = finalizer


async def _first(*tasks: asyncio.Task[Any]) -> asyncio.Task[Any]:
    """The first of `tasks` (in this order) that is done, once one is."""
    await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    return next(task for task in tasks if task.done())


def _exit_lost(elector: Elector) -> None:
    """Stop reconciling now, whatever runs: the process ends (no cleanup that could let a
    handler write after a standby took over) and the kubelet starts it as a standby."""
    log.critical("leadership lost (%s): exiting to stand by", elector.lost_because)
    logging.shutdown()
    os._exit(EXIT_LOST_LEASE)


async def run_replicated(
    elector: Elector,
    serving: kopf.OperatorRegistry,
    leading: kopf.OperatorRegistry,
    *,
    namespaces: list[str],
    liveness: str | None,
    stopping: asyncio.Event | None = None,
) -> None:
    """Serve admission until stopped; reconcile while the Lease is ours. On SIGTERM the
    leading operator stops first (renewing meanwhile), then the Lease is released, then
    the serving operator stops: admission is answered to the end, and a standby takes
    over within a period. `stopping`: set by SIGINT and SIGTERM (tests set it too)."""
    loop = asyncio.get_running_loop()
    operators.track_owners(loop)
    stopping = stopping or asyncio.Event()

    def restore_signals() -> None:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stopping.set)

    restore_signals()
    scope: dict[str, Any] = {"clusterwide": not namespaces, "namespaces": namespaces}
    scope.update(standalone=True, restore_signals=restore_signals)
    serving_stop, leading_stop = asyncio.Event(), asyncio.Event()
    serving_task = asyncio.create_task(
        operators.run_operator(
            "serving", registry=serving, stop_flag=serving_stop, liveness_endpoint=liveness,
            **scope,
        )
    )  # fmt: skip
    stop_task = asyncio.create_task(stopping.wait())
    acquired = asyncio.create_task(elector.acquire())
    if await _first(acquired, stop_task, serving_task) is acquired:
        leading_task = asyncio.create_task(
            operators.run_operator("leading", registry=leading, stop_flag=leading_stop, **scope)
        )
        held = asyncio.create_task(elector.hold())
        if await _first(held, stop_task, serving_task, leading_task) is held:
            _exit_lost(elector)
        leading_stop.set()
        if await _first(leading_task, held) is held:
            _exit_lost(elector)
        held.cancel()
        await elector.release()
        leading_task.result()  # a leading operator that failed fails the process
    else:  # stopped while standing by: a Lease taken at that moment goes back at once
        acquired.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await acquired
        await elector.release()
    stop_task.cancel()
    serving_stop.set()
    await serving_task


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="weightsync-operator", description=__doc__.split("\n")[0])
    parser.add_argument(
        "--namespace", action="append", default=[], help="serve only this namespace (repeatable)"
    )
    args = parser.parse_args(argv)
    try:
        settings = OperatorSettings.from_env()
    except SettingsError as error:
        print(f"weightsync-operator: invalid configuration: {error}", file=sys.stderr)
        sys.exit(2)
    logging.basicConfig(
        level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    # kopf logs every successful handler, timer tick and webhook call at INFO; its
    # warnings and errors (failed handlers, retries) still come through.
    for noisy in ("kopf.objects", "aiohttp.access"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, logging.getLogger().level))
    kube = Kube(load_config())
    # Before kopf's loop: the key's and the certificates' writes on a loop of their own.
    token_key = kube.writer.run_blocking(
        tokens.load_key(kube, settings.namespace, settings.token_key_secret)
    )
    agents = AgentClient(settings.agent_timeout_seconds)
    namespaces = args.namespace or list(settings.watch_namespaces)
    tasks = Tasks()  # every background task, cancelled at cleanup (`runtime.tasks`)
    post_events = EventPoster(kube, tasks)
    pods = PodStore()
    indexes = Indexes(pods)
    reconciler = Reconciler(
        kube, agents, settings, post_events, token_key, indexes=indexes, tasks=tasks
    )
    shared = handlers.Shared(
        settings=settings,
        kube=kube,
        agents=agents,
        reconciler=reconciler,
        events=post_events,
        template=agent_template(settings),
        indexes=indexes,
        namespaces=tuple(namespaces),
        tasks=tasks,
    )
    selector = f"{names.INJECT_LABEL}={names.INJECT_VALUE}"
    pod_watch = PodWatch(kube.api, selector, namespaces, pods, shared.pod_changed)
    configurations = Configurations(kube.writer, settings.webhook_configuration)
    server = kube.writer.run_blocking(build_server(kube, settings, configurations))

    if settings.metrics_port:
        metrics.serve(settings.metrics_port)
    liveness = f"http://0.0.0.0:{settings.health_port}/healthz" if settings.health_port else None
    log.info(
        "starting: %s, webhook %s",
        f"namespaces {namespaces}" if namespaces else "cluster-wide",
        settings.webhook_url or f"service {settings.webhook_service_name}",
    )
    if settings.leader_lease:
        identity = settings.identity or f"{socket.gethostname()}-{os.getpid()}"
        leases = Leases(kube, settings.namespace, settings.leader_lease)
        elector = Elector(leases, identity)
        log.info("standing by for Lease %s/%s as %s", settings.namespace, leases.name, identity)
        serving, leading = build_registries(shared, pod_watch, server)
        replicated = run_replicated(
            elector, serving, leading, namespaces=namespaces, liveness=liveness
        )
        asyncio.run(replicated)
        return
    metrics.LEADER.set(1)  # alone: this process reconciles
    registry = build_registry(shared, pod_watch, server)
    kopf.run(
        registry=registry,
        clusterwide=not namespaces,
        namespaces=namespaces,
        liveness_endpoint=liveness,
        standalone=True,
    )


if __name__ == "__main__":
    main()
