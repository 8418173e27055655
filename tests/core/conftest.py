"""pytest configuration for the pallas-core tests.

Puts this folder on ``sys.path`` so test modules can import the shared base class
(``pallas_test_base``) under both pytest import modes (prepend and importlib).
"""

import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)
