"""How long kopf retries a handler, how long it waits between tries, how long a pass may
run, and how long a watch or a request of the API server may take: each value once, for
`handlers` and `main` to register, `scheduling` to use, and kopf (`main`) and the operator's
own watch and writer (`cluster.podwatch`, `cluster.apiwriter`) to share.

kopf owns retries (crate-operator's way: `timeout=` and `backoff=` at registration, no
retry loop of ours). A handler that raises anything but a `PermanentError` is called
again `HANDLER_BACKOFF_SECONDS` later, until `HANDLER_TIMEOUT_SECONDS` after its first
call; then kopf gives it up for that change (a timer's next tick starts afresh, and the
drift timer's pass comes by anyway: level-based, nothing is lost).

kopf does not cancel a handler that hangs: a pass's own deadline does
(`PASS_TIMEOUT_SECONDS`, `scheduling.PassScheduler`). A reconcile handler's call waits at
most for the pass running when it came and then for its own, so each call ends within
two pass deadlines, and the retry window leaves room for a few calls after that.
"""

from __future__ import annotations

from typing import Final

# A pass takes up to ~3 s at 1,000 pods and each of its API and agent calls has a
# timeout of its own; one still running after this is stuck, and would hold every later
# pass of its object behind it: it is cancelled (TimeoutError to its callers).
PASS_TIMEOUT_SECONDS: Final = 120.0
# Between two calls of a handler that raised: kopf's own default
# (`settings.execution.default_backoff`), the operator's behaviour before it was explicit.
HANDLER_BACKOFF_SECONDS: Final = 60.0
# A WeightSync applied with its workloads may come first: a workload it names that is
# missing this long after its creation is the user's error (a Warning), not before.
WORKLOAD_GRACE_SECONDS: Final = 10.0
# How long kopf keeps calling a handler that raises, from its first call.
HANDLER_TIMEOUT_SECONDS: Final = 600.0
# A WeightSync deleted while one of its timers runs keeps its finalizer until that call
# returns; kopf looks again only this often (its default, 60 s, held a delete that long).
TIMER_EXIT_POLL_SECONDS: Final = 1.0

# The API server ends a watch after WATCH_SERVER_TIMEOUT_SECONDS and the watcher resumes it;
# a watch silent 30 s longer is a dead connection. Connecting takes
# API_CONNECT_TIMEOUT_SECONDS at most; a plain request (a patch, an Event) fails after
# API_REQUEST_TIMEOUT_SECONDS. kopf's watches and requests and the operator's own alike.
WATCH_SERVER_TIMEOUT_SECONDS: Final = 300
WATCH_CLIENT_TIMEOUT_SECONDS: Final = WATCH_SERVER_TIMEOUT_SECONDS + 30
API_CONNECT_TIMEOUT_SECONDS: Final = 10
API_REQUEST_TIMEOUT_SECONDS: Final = 30.0
