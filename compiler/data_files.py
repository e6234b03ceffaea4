"""Where the project's data folders (targets/, tuning_logs/, native/) are: beside the package in a checkout, and under
<prefix>/share/mobilec/ in an installed wheel (pyproject.toml's data-files put them there)."""

from __future__ import annotations

import sys
from pathlib import Path

CHECKOUT = Path(__file__).resolve().parent.parent


def data_dir(name: str) -> Path:
    """The folder `name` of a checkout, or of the installation when the package is not in a checkout."""
    if (CHECKOUT / "pyproject.toml").is_file():
        return CHECKOUT / name
    return Path(sys.prefix) / "share" / "mobilec" / name
