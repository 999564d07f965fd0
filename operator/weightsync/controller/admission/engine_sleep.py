"""What a Colocated engine's command line needs to free memory between rounds. Pure.

With `spec.colocated.memoryRelease` other than None, `Publisher.release()` has the agent
put the engine to sleep, which the engine allows only when started for it: vLLM with
`--enable-sleep-mode` (and `VLLM_SERVER_DEV_MODE=1`, which the webhook sets anyway, for
`/sleep`, `/wake_up` and `/is_sleeping`), SGLang with `--enable-memory-saver`
(`weightsync.api.engines.EngineInjection.release_flag`). The webhook adds the flag to the
engine container's `args` when its command line does not already name it (`--x`,
`--x=...`, and for vLLM `--x_y`), or refuses the pod, naming the field, when it cannot:

* the container sets neither `command` nor `args` (`args` alone would replace the
  image's CMD, which weightsync cannot see);
* the engine runs through a shell (`sh -c '<script>'`, `bash start.sh`): arguments after
  a script become the shell's positional parameters, which the engine never sees, and a
  script is not edited; a script that names the flag itself is accepted;
* the command line turns it off (vLLM's `--no-enable-sleep-mode`, when it comes last),
  or sets `VLLM_SERVER_DEV_MODE` to anything but `1`.

Refusing is what a user who asked for memoryRelease gets earlier and more clearly than
the alternative: a pod that starts, serves, and fails the first `release()` call of the
training loop. The refusal reaches the ReplicaSet's or StatefulSet's FailedCreate Event.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import PurePosixPath
from typing import Any

from weightsync.api.engines import EngineInjection, flag_name
from weightsync.api.v1alpha1.colocated import MemoryRelease

DEV_MODE = "VLLM_SERVER_DEV_MODE"
SHELLS = frozenset({"sh", "bash", "dash", "zsh", "ash", "ksh"})


class EngineCannotSleepError(ValueError):
    """The engine container cannot be made to free memory; the message names the field
    and what to do."""


def release_args(
    container: Mapping[str, Any],
    injection: EngineInjection,
    release: MemoryRelease,
    *,
    engine: str,
    index: int = 0,
) -> list[str]:
    """The args to append so the engine can free memory as `release` asks (none when it
    asks nothing or the command line has the flag). Raises `EngineCannotSleepError`."""
    flag = injection.release_flag
    if release is MemoryRelease.NONE or flag is None:
        return []
    field = f"spec.containers[{index}]"
    why = f"spec.colocated.memoryRelease {release.value} needs {engine} started with {flag.name}"
    _check_env(container, injection, field, why)
    command = [str(a) for a in container.get("command") or []]
    args = [str(a) for a in container.get("args") or []]
    if not command and not args:
        raise EngineCannotSleepError(
            f"{field} ({container.get('name')}) sets neither command nor args, so weightsync"
            f" cannot add {flag.name} without replacing the image's CMD; {why}: write the"
            " engine's command line in the pod template"
        )
    argv = [*command, *args]
    if PurePosixPath(argv[0]).name in SHELLS:
        script = _shell_script(argv)
        if script is not None and _names_flag(script, flag.name):
            return []
        where = "command" if command else "args"
        raise EngineCannotSleepError(
            f"{field}.{where} runs {engine} through a shell ({' '.join(argv[:2])} ...), whose"
            f" script weightsync does not edit (arguments after it never reach {engine});"
            f" {why}: add {flag.name} to the engine's command line in the script"
        )
    last = _last_setting(argv, flag.name, injection.release_flag_off)
    if last is False:
        raise EngineCannotSleepError(
            f"{field} turns it off ({', '.join(injection.release_flag_off)}); {why}: remove it"
        )
    return [] if last else flag.argv()


def _check_env(
    container: Mapping[str, Any], injection: EngineInjection, field: str, why: str
) -> None:
    """Refuse a user's `VLLM_SERVER_DEV_MODE` other than the one the routes need (one from
    a `valueFrom` cannot be read here, and is taken on trust)."""
    wanted = injection.env.get(DEV_MODE)
    if wanted is None:
        return
    for position, item in enumerate(container.get("env") or []):
        value = item.get("value")
        if item.get("name") == DEV_MODE and "valueFrom" not in item and value != wanted:
            raise EngineCannotSleepError(
                f"{field}.env[{position}] sets {DEV_MODE}={value!r}, which hides /sleep"
                f" and /wake_up; {why} and {DEV_MODE}={wanted}: remove the variable"
            )


def _shell_script(argv: list[str]) -> str | None:
    """The script of `sh -c <script>` (or `-ec`, `-lc`...); None for a script file."""
    for position, arg in enumerate(argv[1:], start=1):
        if not arg.startswith("-") or arg.startswith("--"):
            return None
        if "c" in arg[1:] and position + 1 < len(argv):
            return argv[position + 1]
    return None


def _names_flag(script: str, name: str) -> bool:
    """Whether `script` passes `name` as a word of its own (`--x`, `--x=1`, `--x_y`)."""
    spelled = re.escape(name[2:]).replace("\\-", "[-_]")
    return re.search(rf"(^|[\s'\"])--{spelled}(?=$|[\s=;'\"&|)])", script) is not None


def _last_setting(argv: list[str], name: str, off: tuple[str, ...]) -> bool | None:
    """True if the last of `name` and its `off` spellings in `argv` is `name`, False if it
    is an `off` one, None if neither appears."""
    last: bool | None = None
    for arg in argv:
        if not arg.startswith("--"):
            continue
        seen = flag_name(arg)
        if seen == name:
            last = True
        elif seen in off:
            last = False
    return last
