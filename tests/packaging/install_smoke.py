"""Run by noxfile.py (sessions wheels and release) inside a fresh venv where one
distribution was installed alone from the built wheels: checks that exactly the
expected packages of ours (and Triton, CUDA) came with it, that its wheel carries
the license, and runs one small kernel against a NumPy reference on random data.

    python tests/packaging/install_smoke.py jax-pallas-gpu

Not a pytest module: it runs from an empty folder, with no source tree on the path.
"""

from __future__ import annotations

import importlib.util
import sys
from importlib import metadata

import numpy as np

IMPORT_NAME = {
    "jax-kernel-runtime": "jax_kernel_runtime",
    "jax-pallas-core": "pallas",
    "jax-pallas-gpu": "pallas_gpu",
    "jax-pallas-tpu": "pallas_tpu",
    "jax-triton-bridge": "jax_triton",
}
# What installing each distribution alone must bring of ours (ARCHITECTURE.md, "Packages").
BRINGS = {
    "jax-kernel-runtime": {"jax-kernel-runtime"},
    "jax-pallas-core": {"jax-pallas-core"},
    "jax-pallas-gpu": {"jax-pallas-gpu", "jax-pallas-core", "jax-kernel-runtime"},
    "jax-pallas-tpu": {"jax-pallas-tpu", "jax-pallas-core"},
    "jax-triton-bridge": {"jax-triton-bridge", "jax-kernel-runtime"},
}
NEEDS_TRITON = {"jax-pallas-gpu", "jax-triton-bridge"}


def _installed(name: str) -> bool:
    try:
        metadata.distribution(name)
        return True
    except metadata.PackageNotFoundError:
        return False


def check_contents(dist: str) -> None:
    ours = {d for d in IMPORT_NAME if _installed(d)}
    assert ours == BRINGS[dist], f"installing {dist} brought {sorted(ours)}, expected {sorted(BRINGS[dist])}"
    for d in ours:
        spec = importlib.util.find_spec(IMPORT_NAME[d])
        assert spec is not None and "site-packages" in (spec.origin or ""), (d, spec)
        files = [str(f) for f in metadata.distribution(d).files or ()]
        assert any(f.endswith("licenses/LICENSE") for f in files), f"{d}: no LICENSE in the wheel"
    assert _installed("triton") == (dist in NEEDS_TRITON), f"{dist}: triton installed: {_installed('triton')}"
    names = {(m.metadata["Name"] or "").lower() for m in metadata.distributions()}
    cuda = sorted(n for n in names if n.startswith(("nvidia-", "jax-cuda", "jax_cuda")))
    assert not cuda, f"{dist} pulled CUDA packages without the cuda extra: {cuda}"


def _random(shape, seed):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def _pallas_add(interpret):
    import jax

    import pallas as pl

    def kernel(x_ref, y_ref, o_ref):
        o_ref[...] = x_ref[...] + 2.0 * y_ref[...]

    x, y = _random((16, 128), 1), _random((16, 128), 2)
    spec = pl.BlockSpec((8, 128), lambda i: (i, 0))
    out = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
        grid=(2,),
        in_specs=[spec, spec],
        out_specs=spec,
        interpret=interpret,
    )(x, y)
    np.testing.assert_allclose(np.asarray(out), x + 2.0 * y, rtol=1e-6)


def run_kernel(dist: str) -> str:
    if dist == "jax-pallas-core":
        _pallas_add(True)
        return "pallas_call, interpret=True"
    if dist == "jax-pallas-gpu":
        import pallas_gpu as plgpu

        _pallas_add(plgpu.InterpretParams())
        return "pallas_call lowered to Triton, run by Triton's interpreter"
    if dist == "jax-pallas-tpu":
        import pallas_tpu as pltpu

        _pallas_add(pltpu.InterpretParams())
        return "pallas_call in TPU interpret mode"
    if dist == "jax-triton-bridge":
        import jax
        import triton
        import triton.language as tl

        import jax_triton as jt

        @triton.jit
        def axpy(x_ptr, y_ptr, n, o_ptr, BLOCK: tl.constexpr):
            offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
            mask = offs < n
            tl.store(
                o_ptr + offs,
                tl.load(x_ptr + offs, mask=mask) + 2.0 * tl.load(y_ptr + offs, mask=mask),
                mask=mask,
            )

        x, y = _random((1000,), 3), _random((1000,), 4)
        out = jt.triton_call(
            x, y, x.size, kernel=axpy, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), grid=(4,), BLOCK=256
        )
        np.testing.assert_allclose(np.asarray(out), x + 2.0 * y, rtol=1e-6)
        return "triton_call, run by Triton's interpreter"
    if dist == "jax-kernel-runtime":
        # No GPU here: lower a launch for CUDA and check the FFI custom call it becomes.
        import jax

        import jax_kernel_runtime as jkr
        from jax_kernel_runtime import _jax_kernel_runtime

        cfg = jkr.KernelConfig(image=b"\x7fELF", function="axpy")
        x = jax.ShapeDtypeStruct((1000,), np.float32)

        def f(a):
            return jkr.kernel_call(a, configs=[cfg], grid=(4,), out_shapes=[a], name="axpy")[0]

        hlo = jax.jit(f).trace(x).lower(lowering_platforms=("cuda",)).as_text()
        assert f"custom_call @{jkr.TARGET_NAME}" in hlo, hlo
        return f"kernel_call lowered for CUDA ({_jax_kernel_runtime.__file__.rsplit('/', 1)[-1]}, FFI API {_jax_kernel_runtime.ffi_api_version()})"
    raise SystemExit(f"unknown distribution {dist!r}; one of {sorted(IMPORT_NAME)}")


def main() -> None:
    (dist,) = sys.argv[1:]
    check_contents(dist)
    what = run_kernel(dist)
    print(f"{dist} {metadata.version(dist)} on Python {sys.version.split()[0]}: {what}: OK")


if __name__ == "__main__":
    main()
