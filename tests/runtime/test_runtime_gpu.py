"""GPU tests of jax-kernel-runtime: launches, errors, autotuning, command buffers."""

import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_runtime_cpu import compile_scale

import jax_kernel_runtime as jkr


def _has_gpu():
    try:
        return bool(jax.devices("cuda"))
    except RuntimeError:
        return False


pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not _has_gpu(), reason="needs a CUDA GPU"),
]


def _cc():
    major, minor = jax.devices("cuda")[0].compute_capability.split(".")
    return int(major) * 10 + int(minor)


def _scale(x, cfg, alpha, **kw):
    (out,) = jkr.kernel_call(
        x,
        configs=[cfg] if isinstance(cfg, jkr.KernelConfig) else cfg,
        grid=(x.size + 255) // 256,
        out_shapes=[jax.ShapeDtypeStruct(x.shape, x.dtype)],
        params=kw.pop("params", None)
        or [
            jkr.Buffer(0),
            jkr.Buffer(1),
            jkr.Scalar("i32", x.size),
            jkr.Scalar("fp32", alpha),
        ],
        name="scale",
        **kw,
    )
    return out


def test_launch_matches_jnp():
    cfg = jkr.config_from_triton(compile_scale(_cc()))
    x = jax.random.normal(jax.random.key(0), (10_007,))
    out = jax.jit(lambda x: _scale(x, cfg, 1.5))(x)
    np.testing.assert_allclose(out, x * 1.5, rtol=1e-6)


def test_bad_image_is_a_python_error():
    cfg = jkr.KernelConfig(image=b"not a cubin at all", function="scale_kernel", block_dims=(128, 1, 1))
    with pytest.raises(Exception, match=r"kernel 'scale'.*cuModuleLoadData.*CUDA_ERROR"):
        jax.block_until_ready(jax.jit(lambda x: _scale(x, cfg, 1.0))(jnp.ones(256)))


def test_unknown_function_is_a_python_error():
    good = jkr.config_from_triton(compile_scale(_cc()))
    cfg = jkr.KernelConfig(image=good.image, function="no_such_kernel", block_dims=good.block_dims,
                           triton_scratch_params=True)  # fmt: skip
    with pytest.raises(Exception, match=r"no function 'no_such_kernel'.*CUDA_ERROR_NOT_FOUND"):
        jax.block_until_ready(jax.jit(lambda x: _scale(x, cfg, 1.0))(jnp.ones(256)))


def test_too_much_shared_memory_is_a_python_error():
    good = jkr.config_from_triton(compile_scale(_cc()))
    cfg = jkr.KernelConfig(image=good.image, function=good.function, block_dims=good.block_dims,
                           shared_memory_bytes=1 << 20, triton_scratch_params=True)  # fmt: skip
    with pytest.raises(Exception, match=r"kernel 'scale'.*shared memory"):
        jax.block_until_ready(jax.jit(lambda x: _scale(x, cfg, 1.0))(jnp.ones(256)))


def test_misaligned_buffer_is_a_python_error():
    cfg = jkr.config_from_triton(compile_scale(_cc()))
    params = [
        jkr.Buffer(0, alignment=1 << 40),
        jkr.Buffer(1),
        jkr.Scalar("i32", 256),
        jkr.Scalar("fp32", 1.0),
    ]
    with pytest.raises(Exception, match=r"not aligned"):
        jax.block_until_ready(jax.jit(lambda x: _scale(x, cfg, 1.0, params=params))(jnp.ones(256)))


def test_launch_error_names_kernel():
    good = jkr.config_from_triton(compile_scale(_cc()))
    cfg = jkr.KernelConfig(image=good.image, function=good.function, block_dims=(4096, 1, 1),
                           triton_scratch_params=True)  # fmt: skip
    with pytest.raises(Exception, match=r"kernel 'scale'"):
        jax.block_until_ready(jax.jit(lambda x: _scale(x, cfg, 1.0))(jnp.ones(256)))


def test_autotune_picks_a_config_and_records_it():
    cfgs = [jkr.config_from_triton(compile_scale(_cc(), num_warps=w)) for w in (1, 4, 8)]
    x = jax.random.normal(jax.random.key(1), (1 << 20,))
    before = len(jkr.tune_records())
    out = jax.jit(lambda x: _scale(x, cfgs, 3.0, tune_key="scale-test"))(x)
    np.testing.assert_allclose(out, x * 3.0, rtol=1e-6)
    records = jkr.tune_records()[before:]
    assert [r[0] for r in records] == ["scale-test"]
    key, device, chosen, times = records[0]
    assert 0 <= chosen < 3 and len(times) == 3 and min(t for t in times if t >= 0) == times[chosen]


def test_autotune_restores_aliased_inputs():
    cfgs = [jkr.config_from_triton(compile_scale(_cc(), num_warps=w)) for w in (2, 4)]
    x = jax.random.normal(jax.random.key(2), (4096,))

    def f(x):
        y = x + 1.0  # the aliased buffer is an intermediate, overwritten in place
        return _scale(y, cfgs, 2.0, input_output_aliases={0: 0}, tune_key="alias-test")

    np.testing.assert_allclose(jax.jit(f)(x), (x + 1.0) * 2.0, rtol=1e-6)


_CAPTURE_SCRIPT = """
import sys; sys.path.insert(0, {here!r})
import jax, jax.numpy as jnp, numpy as np, jax_kernel_runtime as jkr
from test_runtime_cpu import compile_scale
from test_runtime_gpu import _scale, _cc
cfg = jkr.config_from_triton(compile_scale(_cc()))
def f(x):
    for i in range(6):
        x = _scale(jnp.sin(x), cfg, 1.0 + i)
    return x
x = jax.random.normal(jax.random.key(0), (8192,))
compiled = jax.jit(f).lower(x).compile()
ref = x
for i in range(6):
    ref = jnp.sin(ref) * (1.0 + i)
before = jkr.launch_counts()
for _ in range(5):
    np.testing.assert_allclose(compiled(x), ref, rtol=1e-5)
direct, captured = (a - b for a, b in zip(jkr.launch_counts(), before))
print(f"launches direct={{direct}} captured={{captured}}")
"""


def _launches_under(xla_flags: str) -> tuple[int, int]:
    env = {
        **__import__("os").environ,
        "XLA_FLAGS": xla_flags,
        "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.1",  # the test process holds most of the GPU
    }
    script = _CAPTURE_SCRIPT.format(here=__file__.rsplit("/", 1)[0])
    r = subprocess.run([sys.executable, "-c", script], check=False, capture_output=True, text=True, env=env)
    print(r.stdout)
    m = re.search(r"launches direct=(\d+) captured=(\d+)", r.stdout)
    assert m, r.stderr[-3000:]
    return int(m.group(1)), int(m.group(2))


def test_command_buffers_capture_the_call():
    # 5 runs of 6 calls. With command buffers XLA records the calls into a
    # CUDA graph (the runtime sees the stream capturing) and replays it
    # without calling the runtime again; results are checked in the script.
    direct, captured = _launches_under(
        "--xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL --xla_gpu_graph_min_graph_size=1"
    )
    assert captured >= 6 and direct + captured < 30, (direct, captured)
    # Without command buffers every call is a direct launch.
    assert _launches_under("--xla_gpu_enable_command_buffer=") == (30, 0)
