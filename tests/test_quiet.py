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


LOG_PROBE = """
import logging, sys
logging.basicConfig(level=logging.WARNING, format="%(name)s|%(message)s", stream=sys.stderr)
from rtrl.quiet import quiet_known_warnings
quiet_known_warnings()
quiet_known_warnings()  # idempotent: one filter
assert len(logging.getLogger().filters) == 1
import apache_beam  # warns about apitools through the root logger, from apache_beam/io/gcp/.../bigquery
BEAM = apache_beam.__file__.replace("__init__.py", "io/gcp/internal/clients/bigquery/__init__.py")
APITOOLS = "apitools not found, and bigquery client libraries are not available despite the import not raising"

def emit(name, path, message):
    logger = logging.getLogger(name)
    logger.handle(logger.makeRecord(logger.name, logging.WARNING, path, 1, message, None, None))

emit(None, BEAM, APITOOLS + " an ImportError.")  # the known one again: silenced
emit(None, BEAM, "a new beam warning")  # same file, another message: shown
emit(None, "/srv/ourcode.py", APITOOLS)  # same message from elsewhere: shown
emit("apache_beam.io.gcp", BEAM, APITOOLS)  # same message and file, another logger: shown
"""


def test_only_beams_known_log_record_is_silenced():
    """Beam's import-time root-logger warning about its optional BigQuery clients (apitools) is dropped; the
    same message from another file or logger, and another message from the same file, still show."""
    proc = subprocess.run([sys.executable, "-c", LOG_PROBE], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    apitools = "apitools not found, and bigquery client libraries are not available despite the import not raising"
    assert proc.stderr.splitlines() == [
        "root|a new beam warning",
        f"root|{apitools}",
        f"apache_beam.io.gcp|{apitools}",
    ], proc.stderr[-3000:]
