"""The synchronous lease queue: ``from lease import claim, finish, ...``.

Everything lives in :mod:`lease.worker`, which stands alone on the standard
library; this package only re-exports it. The list of names is kept once,
in ``lease.worker.__all__``.
"""

from lease import worker as _worker
from lease.worker import *  # noqa: F403

__all__ = list(_worker.__all__)
