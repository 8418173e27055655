"""Type stub of the native module (cpp/module.cc)."""

from typing import Any

def registrations() -> dict[str, dict[str, Any]]:
    """{target name: {stage name: PyCapsule of the XLA FFI handler}}."""

def type_registrations() -> dict[str, dict[str, Any]]:
    """{type name: {"type_id": PyCapsule, "type_info": PyCapsule}}."""

def ffi_api_version() -> tuple[int, int]:
    """(major, minor) XLA FFI API of the headers this module was built against; a jaxlib
    refuses handlers of a newer API than its own (jaxlib 0.11.2 speaks 0.4, 0.12 speaks 0.5)."""

def driver_error() -> str:
    """Empty if libcuda.so.1 loads and initializes, else why not."""

def driver_version() -> int:
    """cuDriverGetVersion(); raises RuntimeError without a driver."""

def tune_records() -> list[tuple[str, int, int, list[float]]]:
    """(tune_key, device, chosen config, per-config median ms) per tuning."""

def launch_counts() -> tuple[int, int]:
    """(direct, captured): launches issued on a stream vs recorded into a CUDA graph."""

def hash_image(image: bytes) -> int:
    """The 64-bit FNV-1a hash the module cache keys images by."""
