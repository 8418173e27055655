"""Placeholder until the multi-device interpreter lands (remote DMAs, remote
semaphore signals, barrier semaphores, race detection)."""

from __future__ import annotations

from pallas import backend as plb
from pallas_tpu._src import primitives as tpu_prims
from pallas_tpu._src.interpret import Interpreter


def needs_multi_device(jaxpr) -> bool:
    from pallas_tpu._src.interpret_pallas_call import _kernel_uses

    return _kernel_uses(jaxpr, {tpu_prims.get_barrier_semaphore_p}) or _has_remote(jaxpr)


def _has_remote(jaxpr) -> bool:
    import jax

    stack = [jaxpr.jaxpr if hasattr(jaxpr, "jaxpr") else jaxpr]
    while stack:
        j = stack.pop()
        for eqn in j.eqns:
            if eqn.primitive in (tpu_prims.dma_start_p, tpu_prims.dma_wait_p):
                if eqn.params["layout"].device_id_tree is not None:
                    return True
            if eqn.primitive is plb.semaphore_signal_p:
                if eqn.params["device_id_tree"] is not None or eqn.params["has_core_index"]:
                    return True
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                stack.append(sub.jaxpr if hasattr(sub, "jaxpr") else sub)
    return False


class MultiDeviceInterpreter(Interpreter):
    pass
