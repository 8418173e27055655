"""Kernels inside JAX's multi-process runtime: two processes on localhost joined by
``jax.distributed.initialize``, two CPU devices each, a mesh over all four.

The processes (``distributed_worker.py``) run a pallas-core kernel (``interpret=True``)
and a pallas-tpu kernel in TPU interpret mode under ``jax.shard_map`` over the global
mesh, each checked against ``jnp`` on fresh random data, plus a ``psum`` of the
results across the processes. Remote DMAs run over a mesh of one process's devices;
over the global mesh they are refused with an error that says why (TPU interpret
mode keeps what devices share in one Python process). Both processes run once per
module, under a timeout, so a hang fails the test instead of CI.
"""

from __future__ import annotations

import os
import random
import re
import socket
import subprocess
import sys

import pytest

pytestmark = pytest.mark.interpret_only("jax.distributed on the CPU: TPU interpret mode only")

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "distributed_worker.py")
TIMEOUT_S = 150  # both processes together; they take about 15 s on an idle machine


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def job():
    """The two processes' outputs: [(returncode, stdout, stderr)] by process id, and the seed."""
    seed = random.randrange(2**31)
    env = dict(os.environ)
    env["XLA_FLAGS"] = re.sub(r"--xla_force_host_platform_device_count=\S+", "", env.get("XLA_FLAGS", ""))
    env["JAX_PLATFORMS"] = "cpu"
    # Were the refusal to fail, a kernel waiting for the other process's devices gives up after this.
    env["PALLAS_TPU_INTERPRET_DEADLOCK_TIMEOUT"] = "20"
    port = _free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, WORKER, str(i), str(port), str(seed)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            start_new_session=True,
        )
        for i in range(2)
    ]
    outs = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=TIMEOUT_S)
            outs.append((p.returncode, out, err))
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        for p in procs:
            p.communicate()
        pytest.fail(f"the two-process job (seed {seed}) did not finish in {TIMEOUT_S} s")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return outs, seed


def _lines(job, prefix):
    outs, seed = job
    for i, (rc, out, err) in enumerate(outs):
        assert rc == 0, f"process {i} (seed {seed}) failed:\n{out}\n{err[-4000:]}"
    return [
        [line[len(prefix) :] for line in out.splitlines() if line.startswith(prefix)] for _, out, _ in outs
    ]


@pytest.mark.parametrize(
    "case",
    [
        "pallas-core kernel",
        "psum across processes",
        "pallas-tpu kernel",
        "remote DMAs on this process's devices",
    ],
)
def test_kernel_over_two_processes(job, case):
    for process, passed in enumerate(_lines(job, "PASS ")):
        assert case in passed, f"process {process}: {case!r} did not pass (passed: {passed})"


def test_remote_dma_across_processes_is_a_clear_error(job):
    for refused in _lines(job, "REFUSED "):
        assert len(refused) == 2, refused
        for msg, mesh, axes in zip(refused, ("all devices", "one device of each process"), ("x=4", "x=2")):
            assert msg.startswith(f"remote DMAs across processes ({mesh}): in TPU kernel 'ring_kernel'")
            assert "cannot simulate remote DMAs" in msg and "between processes" in msg
            assert f"the mesh of this shard_map (axes {axes}) spans processes [0, 1]" in msg
            assert "jax.local_devices()" in msg
