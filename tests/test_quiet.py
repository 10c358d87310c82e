"""The warning filter is narrow: megatron's TE/Apex fallbacks and torch's checkpoint deprecations are
silenced; any other warning, even from the same module, still shows (rtrl/quiet.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

PROBE = """
import warnings
from rtrl.quiet import quiet_known_warnings
quiet_known_warnings()
import megatron.core.optimizer, megatron.core.models.backends  # each warns about TE/Apex at import
from megatron.core.models.gpt import gpt_layer_specs
warnings.warn_explicit("Apex is not installed. Falling back to Torch Norm", UserWarning, "a.py", 1, module="megatron.core.x")
warnings.warn_explicit("a new megatron warning", UserWarning, "b.py", 2, module="megatron.core.x")
warnings.warn_explicit("Apex is not installed. Falling back to Torch Norm", UserWarning, "c.py", 3, module="ourcode")
"""


def test_only_the_known_warnings_are_silenced():
    proc = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    shown = [line for line in proc.stderr.splitlines() if "Warning:" in line]
    assert shown == [
        "b.py:2: UserWarning: a new megatron warning",  # same module, another message: shown
        "c.py:3: UserWarning: Apex is not installed. Falling back to Torch Norm",  # same message, our module
    ], proc.stderr[-3000:]
