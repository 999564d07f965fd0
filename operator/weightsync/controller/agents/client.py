"""The operator's client of the agents' control API (`weightsync.api.control`).

One aiohttp session for the whole operator; every request has a total timeout and a
bearer token. Failures are values, not exceptions: a pass asks many agents at once
and must carry on with the ones that answered.

Every request says the operator's protocol version (`api.protocol.HEADER`), and a request
to an agent of an older version leaves out the fields that version lacks; one that needs
such a field set is not sent (`api.protocol`'s skew policy).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TypeVar

import aiohttp
from pydantic import BaseModel, ValidationError

from weightsync.api.control import (
    STATUS_ADDITIONS,
    AgentStatus,
    ErrorResponse,
    MembershipPlan,
    PlanAccepted,
    RecoverRequest,
    RecoveryStatus,
)
from weightsync.api.protocol import HEADER, OLDEST, PROTOCOL_VERSION, for_peer
from weightsync.controller import metrics
from weightsync.controller.agents.view import AgentView

ReplyT = TypeVar("ReplyT", bound=BaseModel)


@dataclass(frozen=True, slots=True)
class AgentAddress:
    pod: str
    host: str
    port: int

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


class AgentClient:
    """Talks to agents; `close()` it when the operator stops."""

    def __init__(self, timeout_seconds: float) -> None:
        self._timeout = aiohttp.ClientTimeout(total=timeout_seconds)
        self._session: aiohttp.ClientSession | None = None

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(timeout=self._timeout)
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    async def _call(
        self,
        method: str,
        url: str,
        token: str,
        reply_model: type[ReplyT],
        *,
        label: str,
        expect: int,
        body: str | None = None,
        pod: str | None = None,
    ) -> ReplyT | str:
        """One control-API request; the parsed reply, or why there is none (counted by label).
        `pod`: the reply must name it (its `pod` field)."""
        headers = {**_auth(token), HEADER: str(PROTOCOL_VERSION)}
        if body is not None:
            headers["Content-Type"] = "application/json"
        try:
            async with self._client().request(method, url, data=body, headers=headers) as reply:
                raw = await reply.read()
                if reply.status != expect:
                    metrics.AGENT_REQUESTS.labels(label, metrics.AgentRequestResult.REJECTED).inc()
                    return _describe_error(reply.status, raw)
            parsed = reply_model.model_validate_json(raw)
        except (aiohttp.ClientError, TimeoutError) as error:
            metrics.AGENT_REQUESTS.labels(label, metrics.AgentRequestResult.UNREACHABLE).inc()
            return f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
        except ValidationError as error:
            metrics.AGENT_REQUESTS.labels(label, metrics.AgentRequestResult.INVALID).inc()
            return f"unexpected reply to {method} {url}: {error.error_count()} errors"
        said = getattr(parsed, "pod", None)
        if pod is not None and said != pod:
            metrics.AGENT_REQUESTS.labels(label, metrics.AgentRequestResult.INVALID).inc()
            return f"unexpected reply to {method} {url}: the agent of pod {said}"
        metrics.AGENT_REQUESTS.labels(label, metrics.AgentRequestResult.OK).inc()
        return parsed

    async def status(self, agent: AgentAddress, token: str) -> AgentStatus | str:
        """The agent's status, or why it could not be had. An answer for another pod is
        none: the address passed to a new pod while this pod's view of it was older (an
        agent says whose it is; a stale answer would open a gate on another's weights)."""
        # The fields this operator reads beyond the first release's (`api.control`); an
        # older agent ignores the query and leaves them at their defaults.
        url = f"{agent.url}/v1/status?with={','.join(STATUS_ADDITIONS)}"
        return await self._call(
            "GET", url, token, AgentStatus,
            label="status", expect=200, pod=agent.pod,
        )  # fmt: skip

    async def statuses(
        self, agents: Iterable[AgentAddress], token: str
    ) -> tuple[dict[str, AgentStatus], dict[str, str]]:
        """Statuses of many agents at once: (answers by pod, errors by pod)."""
        targets = list(agents)
        results = await asyncio.gather(*(self.status(agent, token) for agent in targets))
        answers: dict[str, AgentStatus] = {}
        errors: dict[str, str] = {}
        for agent, result in zip(targets, results, strict=True):
            if isinstance(result, AgentStatus):
                answers[agent.pod] = result
            else:
                errors[agent.pod] = result
        return answers, errors

    async def poll(
        self, view: AgentView, agents: Iterable[AgentAddress], token: str, *, sweep: bool = False
    ) -> None:
        """Ask `agents` for their status now and record the answers in `view`; a `sweep`
        (every agent of a WeightSync) is timed in `agent_poll_duration_seconds`."""
        targets = list(agents)
        if not targets:
            return
        asked = time.monotonic()
        answers, errors = await self.statuses(targets, token)
        view.record(answers, errors, asked)
        if sweep:
            metrics.AGENT_POLL_DURATION.observe(time.monotonic() - asked)

    async def put_plan(
        self, agent: AgentAddress, plan: MembershipPlan, token: str, *, peer_version: int
    ) -> str | None:
        """Deliver `plan` to an agent of protocol version `peer_version`; None when accepted, else
        why not."""
        body = for_peer(plan, peer_version)
        if body.lost:
            metrics.AGENT_REQUESTS.labels("plan", metrics.AgentRequestResult.REJECTED).inc()
            return _too_old(peer_version, body.lost)
        text = body.json()
        metrics.PLAN_BYTES.inc(len(text))
        accepted = await self._call(
            "PUT", f"{agent.url}/v1/plan", token, PlanAccepted,
            label="plan", expect=202, body=text,
        )  # fmt: skip
        if isinstance(accepted, str):
            return accepted
        if (accepted.generation, accepted.rank) != (plan.generation, plan.rank):
            metrics.AGENT_REQUESTS.labels("plan", metrics.AgentRequestResult.INVALID).inc()
            return f"accepted generation {accepted.generation} rank {accepted.rank} instead"
        return None

    async def recover(
        self, agent: AgentAddress, request: RecoverRequest, token: str, *, peer_version: int
    ) -> RecoveryStatus | str:
        """Ask a sink agent (of protocol version `peer_version`) to pull `request.version` from
        holders; its status, or why not."""
        body = for_peer(request, peer_version)
        if body.lost:
            metrics.AGENT_REQUESTS.labels("recover", metrics.AgentRequestResult.REJECTED).inc()
            return _too_old(peer_version, body.lost)
        return await self._call(
            "POST", f"{agent.url}/v1/recover", token, RecoveryStatus,
            label="recover", expect=202, body=body.json(),
        )  # fmt: skip

    async def deliver(
        self,
        plans: Mapping[str, tuple[AgentAddress, MembershipPlan]],
        token: str,
        versions: Mapping[str, int],
    ) -> dict[str, str]:
        """Deliver one plan per pod at once, each for its agent's protocol version
        (`versions`, by pod; an agent missing there is taken for the oldest); the errors by
        pod (empty: all accepted)."""
        items = list(plans.items())
        results = await asyncio.gather(
            *(
                self.put_plan(address, plan, token, peer_version=versions.get(pod, OLDEST))
                for pod, (address, plan) in items
            )
        )
        return {pod: error for (pod, _), error in zip(items, results, strict=True) if error}


def _auth(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def _describe_error(status: int, body: bytes) -> str:
    try:
        error = ErrorResponse.model_validate_json(body)
    except ValidationError:
        return f"HTTP {status}"
    return (
        f"HTTP {status} {error.error}: {error.detail}"
        if error.detail
        else f"HTTP {status} {error.error}"
    )


def _too_old(peer_version: int, lost: tuple[str, ...]) -> str:
    return (
        f"the agent speaks protocol version {peer_version}, which lacks {', '.join(lost)}:"
        " recreate its pod to upgrade it"
    )
