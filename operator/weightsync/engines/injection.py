"""What the operator adds to an inference engine's container so weightsync can feed it.

Each engine module declares one `EngineInjection` as data (`SGLANG_INJECTION`,
`VLLM_INJECTION`). The admission webhook appends `args` to the engine container's
arguments unless the user already set the flag, and sets `env` unless already set.
This module imports neither torch nor an HTTP client.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class EngineFlag:
    """One command-line flag and its value (None for a bare switch), with why it is set."""

    name: str
    value: str | None
    why: str

    def argv(self) -> list[str]:
        return [self.name] if self.value is None else [self.name, self.value]


@dataclass(frozen=True, slots=True)
class EngineInjection:
    """Flags and environment an engine needs to accept weights from a weightsync agent."""

    flags: tuple[EngineFlag, ...] = ()
    env: dict[str, str] = field(default_factory=dict)
    env_why: dict[str, str] = field(default_factory=dict)

    @property
    def args(self) -> list[str]:
        return [part for flag in self.flags for part in flag.argv()]

    def merged_args(self, user_args: list[str]) -> list[str]:
        """`user_args` plus every injected flag the user did not set (`--x` or `--x=...`)."""
        present = {arg.split("=", 1)[0] for arg in user_args if arg.startswith("--")}
        extra = [part for flag in self.flags if flag.name not in present for part in flag.argv()]
        return [*user_args, *extra]

    def merged_env(self, user_env: dict[str, str]) -> dict[str, str]:
        """The injected environment under the user's own values."""
        return {**self.env, **user_env}
