"""CPU tests of jax-kernel-runtime's Python side: descriptors, attribute
encoding, determinism of the lowered HLO, cubin compilation without a GPU."""

import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_kernel_runtime as jkr

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource


@triton.jit
def scale_kernel(x_ptr, out_ptr, n, alpha, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=mask) * alpha, mask=mask)


def compile_scale(cc: int, num_warps: int = 4):
    src = ASTSource(
        scale_kernel,
        {
            "x_ptr": "*fp32",
            "out_ptr": "*fp32",
            "n": "i32",
            "alpha": "fp32",
            "BLOCK": "constexpr",
        },
        constexprs={"BLOCK": 256},
        attrs={(0,): [["tt.divisibility", 16]], (1,): [["tt.divisibility", 16]]},
    )
    return triton.compile(src, target=GPUTarget("cuda", cc, 32), options={"num_warps": num_warps})


@pytest.mark.parametrize("cc", [80, 90])
def test_config_from_triton_compiles_cubin_without_gpu(cc):
    compiled = compile_scale(cc, num_warps=8)
    cfg = jkr.config_from_triton(compiled)
    assert cfg.image[:4] == b"\x7fELF"  # a cubin is an ELF file
    assert cfg.function == "scale_kernel"
    assert cfg.block_dims == (256, 1, 1)
    assert cfg.cluster_dims == (1, 1, 1)
    assert cfg.triton_scratch_params
    assert cfg.shared_memory_bytes == compiled.metadata.shared
    assert len(cfg.launch_fields()) == 12


def test_config_rejects_bad_fields():
    with pytest.raises(ValueError, match="non-empty bytes"):
        jkr.KernelConfig(image=b"", function="f")
    with pytest.raises(ValueError, match="block_dims"):
        jkr.KernelConfig(image=b"x", function="f", block_dims=(0, 1, 1))


def test_scalar_encoding_roundtrips():
    rng = np.random.default_rng(0)
    v = float(rng.normal())
    size, bits = jkr.Scalar("fp32", v).encode()
    raw = (bits & (2**64 - 1)).to_bytes(8, "little")[:size]
    assert size == 4 and np.frombuffer(raw, np.float32)[0] == np.float32(v)
    size, bits = jkr.Scalar("i64", -(2**40) - 3).encode()
    assert size == 8 and bits == -(2**40) - 3
    size, bits = jkr.Scalar("i32", -5).encode()
    assert size == 4 and bits & 0xFFFFFFFF == (-5) & 0xFFFFFFFF
    with pytest.raises(TypeError, match="unsupported scalar"):
        jkr.Scalar("complex64", 1)


@pytest.mark.parametrize(
    "grid, err",
    [((0,), ValueError), ((-1,), ValueError), ((1, 70000), ValueError), ((2.0,), TypeError),
     ("abc", TypeError), ((1, 2, 3, 4), TypeError), ((2**31,), ValueError)],
)  # fmt: skip
def test_normalize_grid_errors(grid, err):
    with pytest.raises(err, match="grid"):
        jkr.normalize_grid(grid, "k")


def test_normalize_grid_pads():
    assert jkr.normalize_grid(7, "k") == (7, 1, 1)
    assert jkr.normalize_grid((3, 4), "k") == (3, 4, 1)


def _lowered_text(cfg):
    x = jax.ShapeDtypeStruct((1000,), jnp.float32)

    def f(x):
        (out,) = jkr.kernel_call(
            x,
            configs=[cfg],
            grid=(4,),
            out_shapes=[x],
            params=[
                jkr.Buffer(0),
                jkr.Buffer(1),
                jkr.Scalar("i32", 1000),
                jkr.Scalar("fp32", 2.5),
            ],
            name="scale",
        )
        return out

    return jax.jit(f).trace(x).lower(lowering_platforms=("cuda",)).as_text()


def test_kernel_call_lowers_to_ffi_custom_call():
    text = _lowered_text(jkr.config_from_triton(compile_scale(90)))
    assert "stablehlo.custom_call @jax_kernel_runtime_launch" in text
    assert 'function_0 = "scale_kernel"' in text
    assert "param_kinds = dense<[0, 0, 4, 4]>" in text


def test_kernel_call_validates_operands():
    cfg = jkr.KernelConfig(image=b"\x7fELF", function="f")
    x = jnp.ones(4)
    with pytest.raises(ValueError, match="operand 5"):
        jkr.kernel_call(x, configs=[cfg], grid=1, out_shapes=[x], params=[jkr.Buffer(5)])
    with pytest.raises(ValueError, match="at least one"):
        jkr.kernel_call(x, configs=[], grid=1, out_shapes=[x])


def test_lowered_hlo_is_identical_across_processes(tmp_path):
    script = textwrap.dedent(
        f"""
        import sys; sys.path.insert(0, {str(__file__.rsplit("/", 1)[0])!r})
        from test_runtime_cpu import _lowered_text, compile_scale
        import jax_kernel_runtime as jkr
        print(_lowered_text(jkr.config_from_triton(compile_scale(90))))
        """
    )
    outs = [
        subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout
        for _ in range(2)
    ]
    assert "jax_kernel_runtime_launch" in outs[0]
    assert outs[0] == outs[1]


def test_scratch_output_added_for_triton_global_scratch():
    cfg = jkr.KernelConfig(image=b"\x7fELF", function="f", global_scratch_bytes=100, cluster_dims=(2, 1, 1))
    assert cfg.scratch_bytes((3, 1, 1)) == 768  # 3 programs * 2 CTAs * 100 B, 256-aligned
    x = jax.ShapeDtypeStruct((8,), jnp.float32)
    text = (
        jax.jit(lambda x: jkr.kernel_call(x, configs=[cfg], grid=3, out_shapes=[x])[0])
        .trace(x)
        .lower(lowering_platforms=("cuda",))
        .as_text()
    )
    assert "tensor<768xui8>" in text and "scratch_output = 1" in text


def test_import_without_driver_reports_clearly():
    if jkr.driver_error() == "":
        pytest.skip("a CUDA driver is present")
    assert "libcuda.so.1" in jkr.driver_error()


def test_native_registrations_have_all_stages():
    from jax_kernel_runtime import _jax_kernel_runtime as native

    stages = native.registrations()[jkr.TARGET_NAME]
    assert set(stages) == {"instantiate", "initialize", "execute"}
    assert native.hash_image(b"abc") == native.hash_image(b"abc") != native.hash_image(b"abd")
