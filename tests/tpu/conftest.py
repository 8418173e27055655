"""pytest configuration for the pallas-tpu tests.

Puts this folder on ``sys.path`` so test modules can import the shared
three-way harness (``three_way``) under both pytest import modes, and
registers the ``interpret_only`` marker: a test that checks what only TPU
interpret mode does (race detection, uninitialized-memory poisoning, DMA
execution order, the interpreter's error messages and ``InterpretParams``
knobs, deadlock detection) and so does not run the three ways of
``three_way.py``. ``pytest -m interpret_only --collect-only -q`` counts them.
"""

import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "interpret_only(reason): checks TPU-interpret-mode-only behaviour, so it does not run three ways",
    )
