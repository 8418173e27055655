"""pallas_tpu: the Pallas TPU backend. NOT IMPLEMENTED YET.

This package reserves the name and the layout (core.py, primitives.py,
lowering.py, pallas_call_registration.py, as in pallas_gpu). Every public
name raises NotImplementedError until the Mosaic lowering lands.
"""

__version__ = "0.0.1"

_MESSAGE = (
    "pallas-tpu is not implemented yet: the Mosaic (TPU) lowering has not been written. "
    "Run kernels with interpret=True (pallas-core) or on NVIDIA GPUs with pallas-gpu."
)


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    raise NotImplementedError(f"pallas_tpu.{name}: {_MESSAGE}")
