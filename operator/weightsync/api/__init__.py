"""weightsync.api: the WeightSync resource, its CRD, conditions and validation.

Nothing here touches the network or torch; the controller, the admission webhook
and the tests all read WeightSyncs through these types.
"""

from weightsync.api.conditions import (
    Condition,
    ConditionStatus,
    ConditionType,
    ConditionUpdate,
    find_condition,
    is_true,
    set_condition,
    set_conditions,
)
from weightsync.api.group import CRD_NAME, GROUP, KIND, PLURAL
from weightsync.api.v1alpha1 import (
    API_VERSION,
    VERSION,
    WeightSync,
    WeightSyncSpec,
    WeightSyncStatus,
)
from weightsync.api.validation import (
    FieldError,
    WeightSyncInvalidError,
    check_update,
    parse_weightsync,
)

__all__ = [
    "API_VERSION",
    "CRD_NAME",
    "GROUP",
    "KIND",
    "PLURAL",
    "VERSION",
    "Condition",
    "ConditionStatus",
    "ConditionType",
    "ConditionUpdate",
    "FieldError",
    "WeightSync",
    "WeightSyncInvalidError",
    "WeightSyncSpec",
    "WeightSyncStatus",
    "check_update",
    "find_condition",
    "is_true",
    "parse_weightsync",
    "set_condition",
    "set_conditions",
]
