"""Where ClusterTwin keeps what it builds once and reuses: the executor's synthetic training corpus.

A user's cache, never the directory a command runs in: `$CLUSTERTWIN_CACHE` if set, else
`$XDG_CACHE_HOME/clustertwin`, else `~/.cache/clustertwin`. The executor's ranks inherit the variable from the
launcher, so every rank of a gang reads the same corpus.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Final

CACHE_ENV: Final = "CLUSTERTWIN_CACHE"
CORPUS_NAME: Final = "synthetic-bytes-v1"


def cache_dir() -> Path:
    """The cache directory (absolute; not created here)."""
    explicit = os.environ.get(CACHE_ENV)
    if explicit:
        return Path(os.path.abspath(os.path.expanduser(explicit)))
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(os.path.abspath(base)) / "clustertwin"


def default_corpus() -> Path:
    """The synthetic byte-level corpus the executor trains on unless given `--data`."""
    return cache_dir() / "corpus" / CORPUS_NAME
