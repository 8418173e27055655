"""pallas_tpu: the Pallas TPU kernel language and TPU interpret mode.

``import pallas_tpu as pltpu`` gives the API of
JAX's Pallas TPU module: memory spaces, DMAs, semaphores,
``PrefetchScalarGridSpec``, ``CompilerParams``, ``emit_pipeline``... Kernels
run on any machine with ``interpret=pltpu.InterpretParams()``, which models
a TPU's memories, DMAs, semaphores, cores and devices.
"""

from pallas import backend as _plb
from pallas_tpu._src import pallas_call_registration as _registration
from pallas_tpu._src.estimate import EstimateError as EstimateError
from pallas_tpu._src.estimate import estimate as estimate
from pallas_tpu._src.executor.run import MosaicError as MosaicError
from pallas_tpu._src.executor.run import run_mosaic as run_mosaic
from pallas_tpu._src.interpret.interpreter import InterpretParams as InterpretParams
from pallas_tpu._src.interpret.interpreter import KernelError as KernelError
from pallas_tpu._src.interpret.interpreter import force_tpu_interpret_mode as force_tpu_interpret_mode
from pallas_tpu._src.interpret.interpreter import set_tpu_interpret_mode as set_tpu_interpret_mode
from pallas_tpu._src.interpret.sessions import (
    reset_tpu_interpret_mode_state as reset_tpu_interpret_mode_state,
)
from pallas_tpu._src.language import core as core
from pallas_tpu._src.language.bits import join_bits as join_bits
from pallas_tpu._src.language.bits import pack_fp6 as pack_fp6
from pallas_tpu._src.language.bits import split_bits as split_bits
from pallas_tpu._src.language.bits import unpack_fp6 as unpack_fp6
from pallas_tpu._src.language.conv import conv as conv
from pallas_tpu._src.language.core import ARBITRARY as ARBITRARY
from pallas_tpu._src.language.core import CMEM as CMEM
from pallas_tpu._src.language.core import CORE_PARALLEL as CORE_PARALLEL
from pallas_tpu._src.language.core import HBM as HBM
from pallas_tpu._src.language.core import PARALLEL as PARALLEL
from pallas_tpu._src.language.core import SEMAPHORE as SEMAPHORE
from pallas_tpu._src.language.core import SMEM as SMEM
from pallas_tpu._src.language.core import SUBCORE_PARALLEL as SUBCORE_PARALLEL
from pallas_tpu._src.language.core import VMEM as VMEM
from pallas_tpu._src.language.core import VMEM_SHARED as VMEM_SHARED
from pallas_tpu._src.language.core import CompilerParams as CompilerParams
from pallas_tpu._src.language.core import CoreType as CoreType
from pallas_tpu._src.language.core import GridDimensionSemantics as GridDimensionSemantics
from pallas_tpu._src.language.core import MemorySpace as MemorySpace
from pallas_tpu._src.language.core import PrefetchScalarGridSpec as PrefetchScalarGridSpec
from pallas_tpu._src.language.core import SemaphoreType as SemaphoreType
from pallas_tpu._src.language.core import SideEffectType as SideEffectType
from pallas_tpu._src.language.core import TensorCoreMesh as TensorCoreMesh
from pallas_tpu._src.language.core import dma_semaphore as dma_semaphore
from pallas_tpu._src.language.einshape import einshape as einshape
from pallas_tpu._src.language.helpers import core_barrier as core_barrier
from pallas_tpu._src.language.helpers import run_on_first_core as run_on_first_core
from pallas_tpu._src.language.helpers import sync_copy as sync_copy
from pallas_tpu._src.language.memory_query import has_memory_space as has_memory_space
from pallas_tpu._src.language.mxu import ACC as ACC
from pallas_tpu._src.language.mxu import matmul_acc_lhs as matmul_acc_lhs
from pallas_tpu._src.language.mxu import matmul_lhs_fifo as matmul_lhs_fifo
from pallas_tpu._src.language.mxu import matmul_pop as matmul_pop
from pallas_tpu._src.language.mxu import matmul_pop_fifo as matmul_pop_fifo
from pallas_tpu._src.language.mxu import matmul_push_rhs as matmul_push_rhs
from pallas_tpu._src.language.pipeline import PipelineStep as PipelineStep
from pallas_tpu._src.language.pipeline import emit_pipeline as emit_pipeline
from pallas_tpu._src.language.pipeline import emit_pipeline_with_allocations as emit_pipeline_with_allocations
from pallas_tpu._src.language.pipeline import (
    emit_pipeline_with_async_prefetch as emit_pipeline_with_async_prefetch,
)
from pallas_tpu._src.language.pipeline_buffers import BufferedRef as BufferedRef
from pallas_tpu._src.language.pipeline_buffers import BufferedRefBase as BufferedRefBase
from pallas_tpu._src.language.pipeline_buffers import BufferType as BufferType
from pallas_tpu._src.language.primitives import AsyncCopyDescriptor as AsyncCopyDescriptor
from pallas_tpu._src.language.primitives import async_copy as async_copy
from pallas_tpu._src.language.primitives import async_remote_copy as async_remote_copy
from pallas_tpu._src.language.primitives import get_barrier_semaphore as get_barrier_semaphore
from pallas_tpu._src.language.primitives import load as load
from pallas_tpu._src.language.primitives import make_async_copy as make_async_copy
from pallas_tpu._src.language.primitives import make_async_remote_copy as make_async_remote_copy
from pallas_tpu._src.language.primitives import request_p_state as request_p_state
from pallas_tpu._src.language.primitives import store as store
from pallas_tpu._src.language.random import prng_random_bits as prng_random_bits
from pallas_tpu._src.language.random import prng_seed as prng_seed
from pallas_tpu._src.language.random import sample_block as sample_block
from pallas_tpu._src.language.random import stateful_bernoulli as stateful_bernoulli
from pallas_tpu._src.language.random import stateful_bits as stateful_bits
from pallas_tpu._src.language.random import stateful_normal as stateful_normal
from pallas_tpu._src.language.random import stateful_uniform as stateful_uniform
from pallas_tpu._src.language.random import to_pallas_key as to_pallas_key
from pallas_tpu._src.language.tpu_info import ChipVersion as ChipVersion
from pallas_tpu._src.language.tpu_info import Tiling as Tiling
from pallas_tpu._src.language.tpu_info import TpuInfo as TpuInfo
from pallas_tpu._src.language.tpu_info import get_tpu_info as get_tpu_info
from pallas_tpu._src.language.tpu_info import get_tpu_info_for_chip as get_tpu_info_for_chip
from pallas_tpu._src.language.tpu_info import is_tpu_device as is_tpu_device
from pallas_tpu._src.language.vector_primitives import annotate as annotate
from pallas_tpu._src.language.vector_primitives import bitcast as bitcast
from pallas_tpu._src.language.vector_primitives import pack_elementwise as pack_elementwise
from pallas_tpu._src.language.vector_primitives import reciprocal as reciprocal
from pallas_tpu._src.language.vector_primitives import roll as roll
from pallas_tpu._src.language.vector_primitives import stochastic_round as stochastic_round
from pallas_tpu._src.language.vector_primitives import touch as touch
from pallas_tpu._src.language.vector_primitives import trace_value as trace_value
from pallas_tpu._src.language.vector_primitives import unpack_elementwise as unpack_elementwise
from pallas_tpu._src.language.vector_primitives import (
    with_memory_space_constraint as with_memory_space_constraint,
)
from pallas_tpu._src.mosaic.compile_check import CompileCheckError as CompileCheckError
from pallas_tpu._src.mosaic.compile_check import KernelCompile as KernelCompile
from pallas_tpu._src.mosaic.compile_check import MosaicCompileError as MosaicCompileError
from pallas_tpu._src.mosaic.compile_check import compile_check as compile_check
from pallas_tpu._src.pallas_call_registration import LoweringException as LoweringException
from pallas_tpu._src.pallas_call_registration import mosaic_modules as mosaic_modules
from pallas_tpu._src.removed import PALLAS_TPU as _REMOVED
from pallas_tpu._version import __version__ as __version__

_plb.register_internal_dir(__file__)
_plb.register_backend("tpu", _registration)

# Names JAX's Pallas TPU API removed (pltpu.semaphore_signal, pltpu.repeat, ...): JAX's words and where they went;
# pltpu.create_tensorcore_mesh works on, with JAX's deprecation warning.
__getattr__ = _plb.module_getattr(__name__, _REMOVED)
