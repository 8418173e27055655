"""What differs between the Triton releases the shared Triton layer supports.

The shared layer runs on Triton 3.6.0 (validated on an H200) and, with these shims, on
3.9.0 (the newest release, validated on the CPU).
Each difference is handled here, once, and named by the release that made it.
(The load/store cache-policy arguments, ``cache_modifier, eviction_policy`` in 3.6 and
``cache_policy`` in 3.9, are passed through as ``*policy`` by the interpreter patches.)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

StagesCallback = Callable[[Any, dict, Any, str, Any], None]


def stages_hook(previous: Any, on_stages: StagesCallback) -> Callable[..., Any]:
    """A ``knobs.runtime.add_stages_inspection_hook`` that runs ``previous`` (the
    hook installed before ours, or None) and then ``on_stages``.

    Triton 3.6 calls the hook with ``(backend, stages, options, language,
    capability)``. Newer releases (3.9) also call it with no arguments, before
    compiling and before each JIT launch, for a ``(key, hash)`` pair that goes into
    the compile cache key. Ours adds nothing to that key: it rewrites stages only
    inside ``compile_triton``, whose compiles carry their own cache-key entry
    (``_STABLE_ENV``); a previous hook's pair is passed through.
    """

    def hook(*args: Any) -> Any:
        if not args:
            if previous is not None:
                return previous()
            return "", ""
        if previous is not None:
            previous(*args)
        on_stages(*args)
        return None

    return hook
