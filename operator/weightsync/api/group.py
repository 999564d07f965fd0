"""Names of the WeightSync resource that do not change between API versions."""

from __future__ import annotations

from typing import Final

GROUP: Final = "weightsync.io"
KIND: Final = "WeightSync"
LIST_KIND: Final = "WeightSyncList"
PLURAL: Final = "weightsyncs"
SINGULAR: Final = "weightsync"
SHORT_NAMES: Final = ("wsync",)
CRD_NAME: Final = f"{PLURAL}.{GROUP}"
