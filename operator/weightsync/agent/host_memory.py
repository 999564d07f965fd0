"""Model-sized page-locked host buffers, pinned a slice at a time.

`torch.empty(..., pin_memory=True)` pins the whole buffer in one driver call, which
holds the CUDA driver's lock for its whole duration: 16 GB took about 7 s on an H200
host, and a round running beside it in the same process stood still that long (a first
round of 14.2 s for two buffers). Here the buffer is anonymous memory mapped by Python
and registered with `cudaHostRegister` in `_SLICE_BYTES` slices from a worker thread
(ctypes releases the GIL during the call), so a round's own CUDA calls wait for one
slice at most (measured, 16 GiB on an H200 host: 6.3 s of stall with `pin_memory=True`,
at most 37 ms in 64 MiB slices with a 2 ms pause between them). A device-to-host copy
must stay inside one slice: the driver refuses one that crosses into the next
(`invalid argument`), so the holder cuts its copies there (`host_copies.within_slices`).

Pinning also waits while a round runs (`PinGate`): a round then pays at most the one
slice being pinned when it started, instead of a stall per slice for its whole length
(rounds beside a pinning of two 16 GB buffers took 230-440 ms against 65 ms).
"""

from __future__ import annotations

import ctypes
import mmap
import threading
import time

import torch

_SLICE_BYTES = 64 << 20
# A pause between slices, so a thread waiting for the driver's lock gets it between two
# (a lock taken again at once by the same thread can starve the waiter).
_SLICE_PAUSE_SECONDS = 0.002
_PORTABLE = 1  # cudaHostRegisterPortable: page-locked for every device's context
_CUDART_NAMES = ("libcudart.so.13", "libcudart.so.12", "libcudart.so")


class PinningError(RuntimeError):
    pass


class PinGate:
    """Whether pinning may go on: closed while a round runs (thread-safe)."""

    def __init__(self) -> None:
        self._open = threading.Event()
        self._open.set()

    def pause(self) -> None:
        self._open.clear()

    def resume(self) -> None:
        self._open.set()

    def wait(self) -> None:
        self._open.wait()


class PinnedBuffer:
    """A 1-D uint8 host tensor (`tensor`), page-locked until `release`; each slice is
    pinned once `gate` is open."""

    def __init__(self, nbytes: int, device: torch.device, gate: PinGate | None = None) -> None:
        size = -(-max(nbytes, 1) // mmap.PAGESIZE) * mmap.PAGESIZE
        self._map = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self.tensor = torch.frombuffer(self._map, dtype=torch.uint8)[:nbytes]
        self._slices: list[int] = []
        self.slice_bytes = _SLICE_BYTES  # a copy into `tensor` must stay inside one slice
        self._cudart = _cudart()
        base = self.tensor.data_ptr()
        with torch.cuda.device(device):  # this thread's calls go to the agent's device
            try:
                for start in range(0, size, self.slice_bytes):
                    if gate is not None:
                        gate.wait()
                    self._pin(base + start, min(self.slice_bytes, size - start))
                    time.sleep(_SLICE_PAUSE_SECONDS)
            except BaseException:
                self.release()
                raise

    def _pin(self, address: int, length: int) -> None:
        code = self._cudart.cudaHostRegister(
            ctypes.c_void_p(address), ctypes.c_size_t(length), _PORTABLE
        )
        if code != 0:
            raise PinningError(f"cudaHostRegister failed with CUDA error {code}")
        self._slices.append(address)

    def release(self) -> None:
        for address in self._slices:
            self._cudart.cudaHostUnregister(ctypes.c_void_p(address))
        self._slices = []


def _cudart() -> ctypes.CDLL:
    """The CUDA runtime torch already loaded (dlopen finds a loaded library by soname)."""
    for name in _CUDART_NAMES:
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    raise PinningError(f"no CUDA runtime library found ({', '.join(_CUDART_NAMES)})")
