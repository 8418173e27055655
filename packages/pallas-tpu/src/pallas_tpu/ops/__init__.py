"""TPU kernels written with pallas-tpu, with the module names and call signatures of
JAX's Pallas TPU ops (its experimental ``pallas.ops.tpu``): moving over is the import
change of that package to ``pallas_tpu.ops``. Each family is its own
module (``from pallas_tpu.ops import flash_attention``), imported on first use.

Every family is a package of the same shape (``docs/tpu_ops.md``, "One skeleton"):

* **The API**: the public modules, with JAX's module names, public names and signatures
  (``matmul``, ``megablox.gmm``, ``paged_attention.paged_attention_kernel``,
  ``ragged_paged_attention.kernel``, ...); the argument checks live here, each error
  naming the op and the argument. What JAX lacks is an extra keyword with JAX's defaults
  unchanged, and every op takes ``interpret=``.
* **The kernel bodies**: private modules (``_kernel``; ``_forward``, ``_backward`` and
  ``_tiles`` where a family has several kernels; ``_schedule``, ``_update`` for their scalar
  side), each with the ``pallas_call`` that runs them. The API calls them with every block
  and flag decided.
* **The blocks**: ``_blocks`` (ragged paged attention: JAX's ``tuned_block_sizes``) asks
  ``ops._policy``: the chip's measured rows, else the family's rule from the chip's facts,
  fitted by ``_policy.fit_block``; the VMEM budget and limit are ``_policy``'s too.
* **The reference**: a plain-JAX function of the same arithmetic, under JAX's name where
  JAX has one (``paged_attention.util``, ``ref_ragged_paged_attention``, ``mha_reference``),
  else named in the API module's docstring (``jnp.dot``, ``jax.lax.ragged_dot``,
  ``jax.random``).
"""
