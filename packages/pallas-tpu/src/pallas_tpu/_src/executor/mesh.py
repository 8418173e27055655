"""The devices and cores of one ``run_mosaic`` call (see ``run.py``): their
allocations, and the condition variable their semaphores wait on."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from pallas_tpu._src.executor.errors import MosaicError


class Mesh:
    """The devices of one ``run_mosaic`` call: each device's allocations by
    key, and one condition variable for semaphores. Devices run in threads; a
    wait blocks until its semaphore holds enough, and is a deadlock error when
    no running device can signal it any more.

    The devices form a mesh of ``shape`` (1-D: ``(num_devices,)``). A device
    is named by its logical id, its position in the mesh in row-major order:
    what ``tpu.device_id`` gives and what a remote DMA or signal's
    ``device_id`` operand takes (a kernel's ``DeviceIdType.MESH`` coordinates
    are flattened to it by the lowering, ours and JAX's)."""

    def __init__(
        self,
        num_devices: int,
        timeout: float = 60.0,
        shape: tuple[int, ...] | None = None,
        num_cores: int = 1,
    ):
        import threading

        self.shape = tuple(shape) if shape is not None else (num_devices,)
        if int(np.prod(self.shape)) != num_devices:
            raise ValueError(f"run_mosaic: a mesh of shape {self.shape} does not have {num_devices} devices")
        self.num_devices = num_devices
        # Each device runs num_cores TensorCores; a "unit" (device * num_cores + core)
        # is one running core, with its own allocations (the cores of a device share
        # the HBM arrays: the same array is registered for each of them).
        self.num_cores = num_cores
        self.num_units = num_devices * num_cores
        self.cv = threading.Condition()
        self.roots: list[dict[Any, np.ndarray]] = [{} for _ in range(self.num_units)]
        self.blocked: dict[int, tuple[Callable[[], bool], str]] = {}
        self.done: set[int] = set()
        self.error: str | None = None
        self.timeout = timeout

    def register(self, device: int, key, array: np.ndarray) -> None:
        with self.cv:
            self.roots[device][key] = array
            self.cv.notify_all()

    def name(self, unit: int) -> str:
        """``device 3``, with its mesh coordinates on an N-D mesh; with two or
        more cores ``core 1`` (one device) or ``device 3, core 1``."""
        device, core = divmod(unit, self.num_cores)
        if self.num_cores == 1:
            return self._device_name(device)
        if self.num_devices == 1:
            return f"core {core}"
        return f"{self._device_name(device)}, core {core}"

    def check_device(self, device: int) -> None:
        if not 0 <= device < self.num_devices:
            mesh = f"mesh of shape {self.shape}: " if len(self.shape) > 1 else ""
            raise MosaicError(
                f"run_mosaic: device id {device} is outside the {mesh}{self.num_devices} devices "
                f"(ids 0..{self.num_devices - 1})"
            )

    def _device_name(self, device: int) -> str:
        if len(self.shape) == 1:
            return f"device {device}"
        coords = tuple(int(c) for c in np.unravel_index(device, self.shape))
        return f"device {device} (mesh coordinates {coords})"

    def root(self, device: int, key) -> np.ndarray:
        """The allocation ``key`` of unit ``device`` (a device and core)."""
        if not 0 <= device < self.num_units:
            self.check_device(device // self.num_cores)
        with self.cv:
            self.wait(device, lambda: key in self.roots[device], f"allocating {key}", who=None)
            return self.roots[device][key]

    def fail(self, msg: str) -> MosaicError:
        with self.cv:
            if self.error is None:
                self.error = msg
            self.cv.notify_all()
        return MosaicError(msg)

    def wait(self, device, pred, desc: str, who=-1) -> None:
        """Blocks (``cv`` held) until ``pred()``; ``who`` is the waiting device
        (``None``: a lookup on behalf of another device, never a deadlock)."""
        import time

        deadline = time.monotonic() + self.timeout
        while not pred():
            if self.error is not None:
                raise MosaicError(f"run_mosaic: stopped because another device failed: {self.error}")
            if who is not None:
                self.blocked[who] = (pred, desc)
                self.cv.notify_all()
                if all(
                    d in self.done or (d in self.blocked and not self.blocked[d][0]())
                    for d in range(self.num_units)
                ):
                    others = "; ".join(
                        self.blocked[d][1] if d in self.blocked else f"{self.name(d)} finished"
                        for d in range(self.num_units)
                        if d != who
                    )
                    raise self.fail(f"run_mosaic: deadlock: {desc}" + (f" ({others})" if others else ""))
            if time.monotonic() > deadline:
                raise self.fail(f"run_mosaic: {desc}: still waiting after {self.timeout:g} s")
            self.cv.wait(0.05)
        if who is not None:
            self.blocked.pop(who, None)
