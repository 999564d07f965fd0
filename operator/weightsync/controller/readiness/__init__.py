"""The `weightsync.io/weights-current` readiness gate: which inference pods may serve
(`gates`). Pure; the writes are `cluster.gatesync`'s."""
