"""The leader-election Lease's reads and writes (`leadership.lease` decides what to write).

One Lease in the operator's namespace, read through the official client (`Kube.get_lease`,
in a thread) and written through the operator's one writer (`apiwriter`): created when
there is none, else replaced conditionally on the `resourceVersion` read, so that of two
replicas writing at once one gets 409. Every call is cut off after `timeout` seconds: a
holder must learn that it could not renew in time to give up before a standby may take
over (`LeaseTiming`).
"""

from __future__ import annotations

import asyncio
from typing import Any

from weightsync.controller.cluster.apiwriter import api_path
from weightsync.controller.cluster.kube import Kube
from weightsync.controller.leadership.lease import LeaseRecord

GROUP, VERSION = "coordination.k8s.io", "v1"
# The writes (through `Kube.writer`), for the chart's RBAC check (tests/unit/chart). The
# read is `read_namespaced_lease`, which the check finds by name.
API_CALLS = (
    ("coordination.k8s.io", "leases", "create"),
    ("coordination.k8s.io", "leases", "update"),
)


class Leases:
    """The Lease `name` in `namespace`."""

    def __init__(self, kube: Kube, namespace: str, name: str) -> None:
        self.kube = kube
        self.namespace = namespace
        self.name = name

    async def read(self, within: float) -> LeaseRecord | None:
        """The Lease as stored, None if there is none."""
        found = await asyncio.wait_for(
            asyncio.to_thread(self.kube.get_lease, self.namespace, self.name), within
        )
        return None if found is None else LeaseRecord.from_object(found)

    async def write(self, record: LeaseRecord, within: float) -> LeaseRecord:
        """Create the Lease (`record` has no version) or replace the version `record` was
        read at; the record as stored. `ApiException` 409: another replica wrote first."""
        metadata: dict[str, Any] = {"name": self.name, "namespace": self.namespace}
        body = {"apiVersion": f"{GROUP}/{VERSION}", "kind": "Lease", "metadata": metadata}
        body["spec"] = record.spec()
        leases = api_path(GROUP, VERSION, "leases", namespace=self.namespace)
        if record.resource_version is None:
            sent = self.kube.writer.create(leases, body, resource="leases")
        else:
            metadata["resourceVersion"] = record.resource_version
            sent = self.kube.writer.replace(f"{leases}/{self.name}", body, resource="leases")
        return LeaseRecord.from_object(await asyncio.wait_for(sent, within))
