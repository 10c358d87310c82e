"""The few third-party warnings nobody running rtrl can act on, silenced one by one.

Each entry names the category, the module that warns (a regex on its ``__name__``) and the start of the
message; nothing else is filtered, so a new or different warning still shows. Installed by every process
entry point (``rtrl``, ``python -m app.parts``, ``python -m trainer``) through :func:`quiet_known_warnings`.

Why each is harmless here:

- megatron-core on a machine without Transformer Engine or Apex falls back to its local fused-op and
  norm implementations and says so once per module (the CPU path and the CI machine never have them;
  on a GPU, ``precision.fp8`` without TE is refused with its own error, so nothing is hidden there);
- megatron's ``dist_checkpointing`` still calls torch's ``load_state_dict`` and uses ``ShardedTensor``,
  which torch marks deprecated: megatron's choice, not a setting of ours.

Log records are filtered the same way (:data:`KNOWN_LOGS`: the logger's name, the path of the file that logs,
the start of the message), by a filter on that logger. Apache Beam 2.77 (the pinned backfill dependency) warns
on every ``import apache_beam`` through the root logger, from ``apache_beam/io/gcp/internal/clients/bigquery``,
that ``apitools`` and the BigQuery client libraries are missing: optional GCP clients of its BigQuery I/O,
which rtrl never uses (a backfill reads the Parquet archive or ClickHouse). Nothing else Beam says is hidden:
with ``-W default`` its import, ``beam.Pipeline`` on the FnApiRunner and ``ReadFromParquet`` emit no Python
warning, and its other records (the runner it picked, the Prism download the DirectRunner tries) are INFO,
below rtrl's WARNING level. Each local worker process of the backfill (FnApiRunner, multi-processing) warns,
forwarded through ``local_job_service``, that it has no ``semi_persistent_directory`` for user-registered schemas:
the backfill registers none. Being a root-logger
call, that warning also installs Python's default handler when logging is not configured yet, which makes a
later ``logging.basicConfig`` a no-op: configure logging before importing Beam, as ``rtrl`` does.
"""

from __future__ import annotations

import logging
import os
import re
import warnings

#: (category, module regex, message regex) of each silenced warning
KNOWN: tuple[tuple[type[Warning], str, str], ...] = (
    (UserWarning, r"megatron\.core(\.|$)", r"Transformer Engine and Apex are not installed\. Falling back"),
    (UserWarning, r"megatron\.core(\.|$)", r"Apex is not installed\. Falling back to Torch Norm"),
    (FutureWarning, r"megatron\.core\.dist_checkpointing(\.|$)", r"`load_state_dict` is deprecated"),
    (FutureWarning, r"torch\.distributed\.checkpoint(\.|$)", r"Please use DTensor instead and we are deprecating"),
    (DeprecationWarning, r"megatron\.core(\.|$)", r"Warning: tp_group is None, using default tp group"),
)


#: (logger name, regex on the path of the file that logs, message regex) of each silenced log record
KNOWN_LOGS: tuple[tuple[str, str, str], ...] = (
    (
        "root",
        r"apache_beam/io/gcp/internal/clients/bigquery/",
        r"apitools not found, and bigquery client libraries are not available",
    ),
    (
        "apache_beam.runners.portability.local_job_service",
        r"apache_beam/runners/portability/local_job_service\.py",
        r"Worker: severity: WARN .*No semi_persistent_directory found",
    ),
)


class KnownLogs(logging.Filter):
    """Drops the records of :data:`KNOWN_LOGS` logged through one logger (by its name, the file and the message)."""

    def __init__(self, logger: str):
        super().__init__()
        self.known = [(re.compile(where), re.compile(message)) for name, where, message in KNOWN_LOGS if name == logger]

    def filter(self, record: logging.LogRecord) -> bool:
        path = record.pathname.replace(os.sep, "/")
        return not any(where.search(path) and message.match(record.getMessage()) for where, message in self.known)


def quiet_known_warnings() -> None:
    """Ignore exactly the warnings in :data:`KNOWN` (by category, module and message) and the log records in
    :data:`KNOWN_LOGS` (by logger, file and message); idempotent."""
    for category, module, message in KNOWN:
        warnings.filterwarnings("ignore", message=message, category=category, module=module)
    for name in {name for name, _, _ in KNOWN_LOGS}:
        logger = logging.getLogger(None if name == "root" else name)
        if not any(isinstance(f, KnownLogs) for f in logger.filters):
            logger.addFilter(KnownLogs(name))
