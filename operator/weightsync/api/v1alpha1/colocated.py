"""`spec.mode` and what Colocated mode adds: one engine, one source rank or every rank of
one trainer pod, and `spec.colocated`, what the engine gives back while the trainer trains.

In Colocated mode the trainer and the engine share GPUs. RL loops put the engine to
sleep while training (vLLM sleep/wake, SGLang release/resume memory occupation) and wake
it inside the round: weights first (when released), then the sync writes them, then the
KV cache, so the GPU never holds the engine's KV cache beside the trainer's activations,
nor a second copy of the model.
"""

from __future__ import annotations

from enum import StrEnum

from weightsync.api.base import ApiModel
from weightsync.api.cel import CelRule, RuleReason


class SyncMode(StrEnum):
    """How weights travel from the trainer to the engines."""

    DISAGGREGATED = "Disaggregated"
    COLOCATED = "Colocated"


class MemoryRelease(StrEnum):
    """What a Colocated engine frees between rounds (`Publisher.release()`)."""

    NONE = "None"
    KV_CACHE = "KVCache"
    KV_CACHE_AND_WEIGHTS = "KVCacheAndWeights"


MODE_IMMUTABLE = CelRule(
    rule="self == oldSelf",
    message="mode is immutable: create a new WeightSync to change it",
    reason=RuleReason.FORBIDDEN,
)
COLOCATED_ONE_INFERENCE = CelRule(
    rule="self.mode != 'Colocated' || (has(self.inference) && size(self.inference) == 1)",
    message=(
        "Colocated mode needs exactly one inference entry: the engine that shares the"
        " trainer's GPUs"
    ),
    field_path=".inference",
)
COLOCATED_ONE_SOURCE = CelRule(
    rule="self.mode != 'Colocated' || !has(self.trainer.sourceRanks)"
    " || (size(self.trainer.sourceRanks) == 1 && type(self.trainer.sourceRanks[0]) == int)"
    " || (has(self.trainer.ranksPerPod) && (self.trainer.sourceRanks == ['all']"
    " || (size(self.trainer.sourceRanks) == self.trainer.ranksPerPod"
    " && self.trainer.sourceRanks.all(r, type(r) == int"
    " && int(r) / self.trainer.ranksPerPod"
    " == int(self.trainer.sourceRanks[0]) / self.trainer.ranksPerPod))))",
    message=(
        "Colocated mode hands the engine on the trainer pod's GPUs either one rank's full"
        " tensors (list one rank) or every rank of that one pod (set ranksPerPod and list all"
        " of the pod's ranks, or [all] with one trainer pod): the engine runs tensor parallel"
        " over the same GPUs"
    ),
    field_path=".trainer.sourceRanks",
)
# `mode` defaults to Disaggregated, so an absent mode is Disaggregated here too.
COLOCATED_ONLY = CelRule(
    rule="!has(self.colocated) || (has(self.mode) && self.mode == 'Colocated')",
    message=(
        "colocated is only for mode Colocated: a Disaggregated engine has GPUs of its own"
        " and nothing to give back while the trainer trains"
    ),
    field_path=".colocated",
)


class ColocatedSpec(ApiModel):
    """What the engine that shares the trainer's GPUs does between rounds."""

    memory_release: MemoryRelease = MemoryRelease.NONE
    """memoryRelease is what the engine frees when the trainer calls Publisher.release()
    before training: None (the default: the engine keeps its memory and release() does
    nothing), KVCache (the KV cache; vLLM sleeps at level 1, which also moves its weights
    to host memory), or KVCacheAndWeights (the weights too: vLLM level 2, SGLang's
    weights tag). The next publish() wakes the engine in order: its weights, the sync,
    then its KV cache, so the GPU never holds a second copy of the model. vLLM needs
    --enable-sleep-mode, SGLang --enable-memory-saver: the admission webhook adds the flag
    to the engine container's args, or refuses an engine pod whose command line cannot
    take it (no command or args, a shell script without the flag)."""
