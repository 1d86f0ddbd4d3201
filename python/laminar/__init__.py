"""laminar: trajectory-level asynchronous RL building blocks, from Python.

The C++ components (TrajectoryQueue, ...) live in the extension laminar._laminar; this package
re-exports them. Every failed call raises a subclass of laminar.Error, one per StatusCode.
"""

from laminar._laminar import *  # noqa: F401,F403
from laminar._laminar import __version__  # noqa: F401

__all__ = [name for name in dir() if not name.startswith("_")]
