"""`weightsync-agent`: the sidecar's entry point. All configuration comes from
`WEIGHTSYNC_*` environment variables (see `AgentSettings`)."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys

from pydantic import ValidationError

from weightsync.agent.settings import AgentSettings


def missing_gpu(device: str, count: int = 1) -> str | None:
    """Why this container cannot run agents on `device` and the `count - 1` GPUs after it
    (a trainer pod's local ranks, or a sink's engine GPUs), or None. The sidecar sees
    exactly the GPUs of the ResourceClaims it shares with its workload; anything else is
    a configuration the operator refuses, so say so instead of failing inside the first
    round."""
    if not device.startswith("cuda"):
        return None
    import torch

    first = torch.device(device).index or 0
    seen = torch.cuda.device_count()
    if first + count <= seen:
        return None
    wanted = device if count == 1 else f"{device} and the {count - 1} GPU(s) after it"
    return (
        f"{wanted}: not visible in this container, which sees {seen} GPU(s); the agent"
        " sidecar is given its workload's GPUs only through the ResourceClaims the"
        " workload container names (docs/real-cluster.md, GPUs)"
    )


def _nccl_defaults() -> None:
    # CleanUpOnly: on a collective timeout the NCCL watchdog aborts the communicator but
    # leaves the agent alive; the round fails and the next generation takes over.
    os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")


def _exit_without_gpu(problem: str | None) -> None:
    if problem is not None:
        print(f"weightsync-agent: {problem}", file=sys.stderr)
        sys.exit(2)


async def _run(settings: AgentSettings) -> None:
    from weightsync.agent.control_api import serve
    from weightsync.agent.service import Agent

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await serve(Agent(settings), stop)


def main() -> None:
    try:
        settings = AgentSettings.from_env()
    except ValidationError as exc:
        print(f"weightsync-agent: invalid configuration:\n{exc}", file=sys.stderr)
        sys.exit(2)
    logging.basicConfig(
        level=settings.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if settings.local_ranks:
        from weightsync.agent.local_ranks import check_socket, parse_local_ranks, supervise

        try:
            local_ranks = parse_local_ranks(settings.local_ranks)
            check_socket(os.environ)
        except ValueError as exc:
            print(f"weightsync-agent: invalid configuration: {exc}", file=sys.stderr)
            sys.exit(2)
        _exit_without_gpu(missing_gpu(settings.device, max(local_ranks) + 1))
        sys.exit(supervise(local_ranks))
    copies = settings.engine_devices or 1  # unset: every GPU it sees is its engine's
    _exit_without_gpu(missing_gpu(settings.device, copies))
    _nccl_defaults()
    asyncio.run(_run(settings))
    # The agent has released its groups, slots and host buffers. Daemon threads may still
    # block inside C++ calls (a doorbell's store wait, a detached abort); the interpreter's
    # teardown would destroy their objects under them and abort the process ("terminate
    # called without an active exception", exit -6). Exit without that teardown.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
