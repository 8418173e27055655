"""Puts this folder on sys.path: the GPU tests reuse helpers of the CPU tests
(pytest runs with --import-mode=importlib, which does not)."""

import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)
