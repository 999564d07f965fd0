"""kopf's diff base for WeightSyncs: the spec alone, so the user's own annotations (up to
the API server's 256 KB) are never copied into the operator's bookkeeping annotation."""

from __future__ import annotations

import json

import kopf

from weightsync.controller.main import OwnKindsDiffBase


def test_the_diff_base_of_a_weightsync_is_its_spec_and_pods_get_none() -> None:
    storage = OwnKindsDiffBase(prefix="weightsync.io", key="last-handled-configuration")
    big = "x" * 200_000
    body = kopf.Body({
        "apiVersion": "weightsync.io/v1alpha1", "kind": "WeightSync",
        "metadata": {"name": "sync", "namespace": "rl", "annotations": {"team/notes": big},
                     "labels": {"team": "rl"}},
        "spec": {"trainer": {"statefulSetRef": {"name": "trainer"}}},
        "status": {"currentVersion": 3},
    })  # fmt: skip
    essence = storage.build(body=body)
    assert dict(essence) == {"spec": {"trainer": {"statefulSetRef": {"name": "trainer"}}}}
    assert len(json.dumps(essence)) < 100
    pod = kopf.Body({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p"}, "spec": {}})
    assert dict(storage.build(body=pod)) == {}
