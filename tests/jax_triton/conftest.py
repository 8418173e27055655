"""The jax_triton tests import the example kernels from examples/."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[2] / "examples"))
sys.path.insert(0, str(Path(__file__).parent))
