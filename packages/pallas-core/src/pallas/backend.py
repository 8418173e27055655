"""What a Pallas backend package (pallas-gpu, pallas-tpu) may use of pallas-core.

Backends lower ``pallas_call_p`` for their platform. They need the kernel
language's own primitives (to register lowering rules for them), the block
dimension types of a ``GridMapping`` and the error helpers that name the
user's kernel and source line, and ``register_backend`` to register
themselves when imported (the ``pallas.backends`` entry point finds them when
they are not). This module is that contract: backends import from here,
never from ``pallas._src``.
"""

from pallas._src.backends import register_backend as register_backend
from pallas._src.core import Blocked as Blocked
from pallas._src.core import BlockMapping as BlockMapping
from pallas._src.core import Element as Element
from pallas._src.core import GridMapping as GridMapping
from pallas._src.core import Squeezed as Squeezed
from pallas._src.errors import kernel_error as kernel_error
from pallas._src.errors import register_internal_dir as register_internal_dir
from pallas._src.primitives import debug_print_p as debug_print_p
from pallas._src.primitives import multiple_of_p as multiple_of_p
from pallas._src.primitives import run_scoped_p as run_scoped_p
