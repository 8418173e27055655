"""The shared Triton layer of pallas-gpu and jax-triton.

Both packages turn a Triton kernel into a ``KernelConfig`` the runtime
launches, and both run it on a CPU with Triton's interpreter; this layer does
it once for the two:

* compiling (``compile_triton``, ``compile_gluon``; deterministic cubins,
  works without a GPU), generated source run from memory (``load_source``),
  and the size limits of the GPUs (``SHARED_MEMORY_LIMITS``);
* caches: compiled configs in memory and on disk (``cached_config``,
  ``DiskCache``), autotuning winners (``WinnerCache``, ``flush_records``),
  and their keys (``sha256``, ``triton_versions``);
* Triton's interpreter on host arrays (``interpret``, ``Pointer``), one
  kernel at a time per process, bounds-checked, with bf16 computed as on the
  GPU and many programs per pass;
* Triton's front end at trace time (``check_frontend``,
  ``TritonFrontendError``);
* a cheaper first compile (``prepare_triton``, ``memoize_triton_key``,
  ``key_memo_dir``) and ``config_from_triton``.

Importing this module does not import Triton: each function imports it when
called. RUNTIME.md describes the layer; its private modules import one way
(``_state`` below the interpreter's ``_patches`` and ``_batched``, which
``_interpret`` applies).
"""

from jax_kernel_runtime.triton._cache import DiskCache as DiskCache
from jax_kernel_runtime.triton._cache import WinnerCache as WinnerCache
from jax_kernel_runtime.triton._cache import cached_config as cached_config
from jax_kernel_runtime.triton._cache import clear_configs as clear_configs
from jax_kernel_runtime.triton._cache import flush_records as flush_records
from jax_kernel_runtime.triton._cache import sha256 as sha256
from jax_kernel_runtime.triton._compile import SHARED_MEMORY_LIMITS as SHARED_MEMORY_LIMITS
from jax_kernel_runtime.triton._compile import clear_modules as clear_modules
from jax_kernel_runtime.triton._compile import compile_gluon as compile_gluon
from jax_kernel_runtime.triton._compile import compile_triton as compile_triton
from jax_kernel_runtime.triton._compile import load_source as load_source
from jax_kernel_runtime.triton._compile import triton_versions as triton_versions
from jax_kernel_runtime.triton._frontend import TritonFrontendError as TritonFrontendError
from jax_kernel_runtime.triton._frontend import check_frontend as check_frontend
from jax_kernel_runtime.triton._interpret import Pointer as Pointer
from jax_kernel_runtime.triton._interpret import interpret as interpret
from jax_kernel_runtime.triton._prepare import config_from_triton as config_from_triton
from jax_kernel_runtime.triton._prepare import key_memo_dir as key_memo_dir
from jax_kernel_runtime.triton._prepare import memoize_triton_key as memoize_triton_key
from jax_kernel_runtime.triton._prepare import prepare_triton as prepare_triton
