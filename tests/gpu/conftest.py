"""pytest configuration for the pallas-gpu tests (shared helpers on sys.path)."""

import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)
