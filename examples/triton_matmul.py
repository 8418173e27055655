"""bf16 matmul with `triton.autotune` through jax_triton.triton_call.

On a GPU the runtime times every config on the first call and keeps the
fastest (cached per process and on disk); on the CPU the interpreter runs the
first config.
"""

import jax
import jax.numpy as jnp
import triton
import triton.language as tl

import jax_triton as jt

# Tile configs for Hopper/Ampere; the first is also the CPU interpreter's.
CONFIGS = [
    triton.Config({"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 64, "GROUP_M": 8}, num_warps=8, num_stages=3),
    triton.Config({"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8}, num_warps=4, num_stages=4),
    triton.Config({"BLOCK_M": 256, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8}, num_warps=8, num_stages=3),
    triton.Config({"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8}, num_warps=4, num_stages=4),
]  # fmt: skip


@triton.autotune(configs=CONFIGS, key=["M", "N", "K"])
@triton.jit
def matmul_kernel(
    a_ptr, b_ptr, c_ptr, M, N, K,
    stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    # Grouped ordering: programs that share A rows run together (L2 reuse).
    num_pid_in_group = GROUP_M * num_pid_n
    group_id = pid // num_pid_in_group
    first_pid_m = group_id * GROUP_M
    group_size_m = min(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + ((pid % num_pid_in_group) % group_size_m)
    pid_n = (pid % num_pid_in_group) // group_size_m
    offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)) % M
    offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)) % N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + offs_m[:, None] * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = b_ptr + offs_k[:, None] * stride_bk + offs_n[None, :] * stride_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(tl.cdiv(K, BLOCK_K)):
        a = tl.load(a_ptrs, mask=offs_k[None, :] < K - k * BLOCK_K, other=0.0)
        b = tl.load(b_ptrs, mask=offs_k[:, None] < K - k * BLOCK_K, other=0.0)
        acc = tl.dot(a, b, acc)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    c = acc.to(c_ptr.dtype.element_ty)
    offs_cm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_cn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    c_ptrs = c_ptr + offs_cm[:, None] * stride_cm + offs_cn[None, :] * stride_cn
    tl.store(c_ptrs, c, mask=(offs_cm[:, None] < M) & (offs_cn[None, :] < N))


def matmul(a: jax.Array, b: jax.Array) -> jax.Array:
    (m, k), (_, n) = a.shape, b.shape
    return jt.triton_call(
        a, b,
        kernel=matmul_kernel,
        out_shape=jax.ShapeDtypeStruct((m, n), a.dtype),
        grid=lambda meta: (jt.cdiv(m, meta["BLOCK_M"]) * jt.cdiv(n, meta["BLOCK_N"]),),
        M=m, N=n, K=k,
        stride_am=k, stride_ak=1, stride_bk=n, stride_bn=1, stride_cm=n, stride_cn=1,
    )  # fmt: skip


def main(m: int = 200, n: int = 160, k: int = 96) -> None:
    ka, kb = jax.random.split(jax.random.key(2))
    a = jax.random.normal(ka, (m, k), jnp.float32).astype(jnp.bfloat16)
    b = jax.random.normal(kb, (k, n), jnp.float32).astype(jnp.bfloat16)
    out = jax.jit(matmul)(a, b).astype(jnp.float32)
    ref = jnp.dot(a, b, preferred_element_type=jnp.float32)
    err = float(jnp.max(jnp.abs(out - ref) / (1 + jnp.abs(ref))))
    status = "PASS" if err < 1e-2 else "FAIL"
    print(f"triton_matmul: {status}  max_rel_err={err:.1e} (tol 1e-2)  backend={jax.default_backend()}")
    if status != "PASS":
        raise SystemExit(1)


if __name__ == "__main__":
    main()
