"""The README's two opening commands are the ones CI runs, byte for byte."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_ci_runs_the_readme_commands() -> None:
    blocks = re.findall(r"```bash\n(.*?)\n```", (ROOT / "README.md").read_text(), flags=re.S)
    install, test = blocks[0].strip(), blocks[1].strip()
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert install in ci, "README command 1 must appear verbatim in .ci/run"
    assert test in ci, "README command 2 must appear verbatim in .ci/run"
