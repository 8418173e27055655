"""``run_mosaic``'s rules, one module per MLIR dialect (``tpu`` in two: its
memory and synchronization ops, and its vector ops). Each registers its ops
with ``framework.rule`` when imported; ``run.py`` imports them all."""
