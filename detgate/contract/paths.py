"""Where detgate keeps its state on this machine: prepared models, the gateway's spool, logs.

One folder, `DETGATE_STATE_DIR` or ~/.cache/detgate, shared by every process of one user, so
that a model prepared by one worker is found by the next.
"""

from __future__ import annotations

import os
from pathlib import Path


def state_dir() -> Path:
    return Path(os.environ.get("DETGATE_STATE_DIR", Path.home() / ".cache" / "detgate"))
