"""Transitional: the TPU ways' helpers live in tests/ways (one module per engine); the two test
files that still import them from here (test_core_map_shared, test_races: edited by other work
in flight) move to ``ways.<module>`` with that work, and this file goes. Nothing else may import
it."""

from ways.chip import needs_devices as needs_devices
from ways.jax_mosaic import jax_namespaces as jax_namespaces
