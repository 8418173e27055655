"""Entry point of the `pallas.backends` group for platform 'tpu'.

Loading it raises, so that pallas-core's "no backend for platform 'tpu'"
error says plainly that pallas-tpu is installed but not implemented.
"""

from pallas_tpu import _MESSAGE

raise NotImplementedError(_MESSAGE)
