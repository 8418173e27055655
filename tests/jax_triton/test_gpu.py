"""jax_triton on a CUDA GPU: correctness of the examples at real sizes,
export round trip, concurrency and multi-GPU shard_map."""

import subprocess
import sys
import textwrap
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest


def _gpus():
    try:
        return jax.devices("cuda")
    except RuntimeError:
        return []


pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not _gpus(), reason="needs a CUDA GPU"),
]


def rand(shape, seed, dtype=jnp.float32):
    return jax.random.normal(jax.random.key(seed), shape, jnp.float32).astype(dtype)


def test_add_softmax_matmul_attention_match_jnp():
    import triton_add
    import triton_flash_attention
    import triton_matmul
    import triton_softmax

    x, y = rand((1 << 22,), 0), rand((1 << 22,), 1)
    np.testing.assert_array_equal(jax.jit(triton_add.add)(x, y), x + y)
    s = rand((1024, 3000), 2) * 3
    np.testing.assert_allclose(jax.jit(triton_softmax.softmax)(s), jax.nn.softmax(s, -1), atol=1e-6)
    a, b = rand((1024, 512), 3, jnp.bfloat16), rand((512, 768), 4, jnp.bfloat16)
    ref = jnp.dot(a, b, preferred_element_type=jnp.float32)
    np.testing.assert_allclose(
        jax.jit(triton_matmul.matmul)(a, b).astype(jnp.float32),
        ref,
        rtol=2e-2,
        atol=1e-1,
    )
    q, k, v = (rand((2, 4, 512, 64), 5 + i, jnp.bfloat16) for i in range(3))
    for causal in (False, True):
        out = triton_flash_attention.attention(q, k, v, causal=causal, num_warps=4)
        ref = triton_flash_attention.reference(q, k, v, causal)
        np.testing.assert_allclose(out.astype(jnp.float32), ref, atol=2e-2)


def test_vmap_on_gpu():
    import triton_add

    x, y = rand((4, 5000), 8), rand((4, 5000), 9)
    np.testing.assert_array_equal(jax.jit(jax.vmap(triton_add.add))(x, y), x + y)


def test_export_round_trip_in_fresh_process(tmp_path):
    import triton_softmax

    import jax_kernel_runtime as jkr

    x = rand((256, 1000), 10)
    exp = jax.export.export(
        jax.jit(triton_softmax.softmax),
        platforms=["cuda"],
        disabled_checks=jkr.export_disabled_checks(),
    )(jax.ShapeDtypeStruct(x.shape, x.dtype))
    (tmp_path / "f.bin").write_bytes(exp.serialize())
    np.save(tmp_path / "x.npy", np.asarray(x))
    script = textwrap.dedent(
        f"""
        import jax, numpy as np, jax_kernel_runtime
        jax_kernel_runtime.register()
        exp = jax.export.deserialize(open({str(tmp_path / "f.bin")!r}, "rb").read())
        np.save({str(tmp_path / "y.npy")!r}, np.asarray(exp.call(np.load({str(tmp_path / "x.npy")!r}))))
        """
    )
    env = {**__import__("os").environ, "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.1"}
    subprocess.run([sys.executable, "-c", script], check=True, env=env)
    np.testing.assert_allclose(np.load(tmp_path / "y.npy"), triton_softmax.softmax(x), rtol=1e-6)


def test_eight_threads_different_kernels():
    import triton_add
    import triton_softmax

    errors = []

    def work(i):
        try:
            for _ in range(5):
                if i % 2:
                    x = rand((1000 + i, 100 + i), i)
                    np.testing.assert_allclose(triton_softmax.softmax(x), jax.nn.softmax(x, -1), atol=1e-6)
                else:
                    x, y = rand((10000 + i,), i), rand((10000 + i,), i + 100)
                    np.testing.assert_array_equal(triton_add.add(x, y, block_size=256 << (i % 4)), x + y)
        except Exception as e:  # noqa: BLE001 - collected and re-raised below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


@pytest.mark.skipif(len(_gpus()) < 2, reason="needs two GPUs")
def test_shard_map_over_all_gpus():
    import triton_add
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    n = len(_gpus())
    mesh = jax.make_mesh((n,), ("x",))
    f = jax.jit(jax.shard_map(triton_add.add, mesh=mesh, in_specs=P("x"), out_specs=P("x")))
    sharding = NamedSharding(mesh, P("x"))
    x, y = rand((n * 4096,), 11), rand((n * 4096,), 12)
    out = f(jax.device_put(x, sharding), jax.device_put(y, sharding))
    np.testing.assert_array_equal(out, x + y)
    for shard in out.addressable_shards:
        i = shard.index[0]
        np.testing.assert_array_equal(shard.data, (x + y)[i])
