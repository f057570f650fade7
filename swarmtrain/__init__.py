"""swarmtrain: decentralized peer-to-peer volunteer training.

This package is the launcher only (the ``swarmtrain`` command); the work lives in
``protocol`` (the wire), ``peer`` (the training node) and ``coordinator`` (the service).
"""

from protocol.version import __version__

__all__ = ["__version__"]
