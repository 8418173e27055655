"""pytest configuration for the pallas-tpu tests.

Puts this folder on ``sys.path`` so test modules can import the shared
three-way harness (``three_way``) under both pytest import modes.
"""

import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)
