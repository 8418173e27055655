"""What a Pallas backend package (pallas-gpu, pallas-tpu) may use of pallas-core.

Backends lower ``pallas_call_p`` for their platform. They need the kernel
language's own primitives (to register lowering rules for them), the block
dimension types of a ``GridMapping`` and the error helpers that name the
user's kernel and source line, and ``register_backend`` to register
themselves when imported (the ``pallas.backends`` entry point finds them when
they are not). This module is that contract: backends import from here,
never from ``pallas._src``. A backend implements ``Backend`` and receives one
``PallasCall`` record per call (the kernel, its grid mapping, every option
and its ``KernelFacts``).
"""

from typing import Any

from pallas._src.backends import Backend as Backend
from pallas._src.backends import register_backend as register_backend
from pallas._src.call import KernelFacts as KernelFacts
from pallas._src.call import PallasCall as PallasCall
from pallas._src.call import kernel_facts as kernel_facts
from pallas._src.compat import broadcast_to_p as broadcast_to_p
from pallas._src.compat import lax_primitive as lax_primitive
from pallas._src.compat import register_discharge_rule as register_discharge_rule
from pallas._src.compat import register_neutral_memory_space as register_neutral_memory_space
from pallas._src.core import ANY as ANY
from pallas._src.core import Blocked as Blocked
from pallas._src.core import BlockMapping as BlockMapping
from pallas._src.core import Element as Element
from pallas._src.core import GridMapping as GridMapping
from pallas._src.core import MemoryRef as MemoryRef
from pallas._src.core import Mesh as Mesh
from pallas._src.core import SemaphoreKind as SemaphoreKind
from pallas._src.core import SemaphoreSpace as SemaphoreSpace
from pallas._src.core import Squeezed as Squeezed
from pallas._src.core import constrain_memory_space as constrain_memory_space
from pallas._src.core import dynamic_grid_dim as dynamic_grid_dim
from pallas._src.core import register_memory_space_type as register_memory_space_type
from pallas._src.core import semaphore_kind as semaphore_kind
from pallas._src.errors import ValueOrTypeError as ValueOrTypeError
from pallas._src.errors import describe as describe
from pallas._src.errors import is_internal_file as is_internal_file
from pallas._src.errors import kernel_error as kernel_error
from pallas._src.errors import record_runtime_error as record_runtime_error
from pallas._src.errors import register_internal_dir as register_internal_dir
from pallas._src.errors import user_source as user_source
from pallas._src.helpers import SelectedRef as SelectedRef
from pallas._src.interpret import grid_point as grid_point
from pallas._src.interpret import grid_table as grid_table
from pallas._src.interpret import num_steps as num_steps
from pallas._src.interpret import uninitialized_value as uninitialized_value
from pallas._src.lowering_kit import SKIP as SKIP
from pallas._src.lowering_kit import RuleTable as RuleTable
from pallas._src.lowering_kit import trace_composite as trace_composite
from pallas._src.lowering_kit import uninitialized_fill as uninitialized_fill
from pallas._src.lowering_kit import walk_jaxpr as walk_jaxpr
from pallas._src.math import digamma_f32 as digamma_f32
from pallas._src.math import erf_inv_f32 as erf_inv_f32
from pallas._src.math import in_float32 as in_float32
from pallas._src.math import lgamma_f32 as lgamma_f32
from pallas._src.poison import poison_buffers_enabled as poison_buffers_enabled
from pallas._src.poison import poison_value as poison_value
from pallas._src.primitives import KernelContext as KernelContext
from pallas._src.primitives import debug_print_p as debug_print_p
from pallas._src.primitives import dynamic_grid_size_p as dynamic_grid_size_p
from pallas._src.primitives import eval_index_map as eval_index_map
from pallas._src.primitives import grid_axis_index_p as grid_axis_index_p
from pallas._src.primitives import kernel_context as kernel_context
from pallas._src.primitives import multiple_of_p as multiple_of_p
from pallas._src.primitives import run_scoped_p as run_scoped_p
from pallas._src.primitives import symbolic_shape_message as symbolic_shape_message
from pallas._src.ref_padding import PadTransform as PadTransform
from pallas._src.removed import module_getattr as module_getattr
from pallas._src.semaphores import DeviceIdType as DeviceIdType
from pallas._src.semaphores import debug_check_p as debug_check_p
from pallas._src.semaphores import delay_p as delay_p
from pallas._src.semaphores import flatten_device_id as flatten_device_id
from pallas._src.semaphores import flatten_ref as flatten_ref
from pallas._src.semaphores import semaphore_read_p as semaphore_read_p
from pallas._src.semaphores import semaphore_signal_p as semaphore_signal_p
from pallas._src.semaphores import semaphore_wait_p as semaphore_wait_p
from pallas._src.semaphores import transformed_aval as transformed_aval
from pallas._src.semaphores import unflatten_transforms as unflatten_transforms
from pallas._src.validate import check_bool_fields as check_bool_fields
from pallas._src.validate import inner_invars as inner_invars
from pallas._src.zero_stride import broadcast_zero_stride_reads as broadcast_zero_stride_reads
from pallas._src.zero_stride import check_zero_stride_writes as check_zero_stride_writes


def forced_interpret() -> Any:
    """The default ``interpret`` of every ``pallas_call`` that passes none: a JAX config state
    (part of the jit cache key), ``with forced_interpret()(params):`` forces ``params`` in a
    block, ``forced_interpret().set_global(params)`` from now on, ``.value`` reads it."""
    from pallas._src import pallas_call

    return pallas_call.forced_interpret_state
