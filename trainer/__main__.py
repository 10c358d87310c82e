"""``python -m trainer`` / ``torchrun --nproc_per_node N -m trainer``: the trainer job from rtrl settings.

Settings come from ``--config FILE`` (or ``RTRL_CONFIG``) and ``RTRL_*`` variables, like every rtrl
command; ``kafka.bootstrap`` must name the cluster (the application's ``rtrl train`` starts the
local broker on the embedded defaults, this entry point never does).
"""

from __future__ import annotations

import argparse
import sys

from rtrl.errors import ConfigError, RtrlError
from rtrl.quiet import quiet_known_warnings
from rtrl.settings import load_settings


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m trainer", description="train on rtrl.batches (DP/TP/PP from settings)")
    p.add_argument("--config", help="TOML settings file (default: $RTRL_CONFIG)")
    args = p.parse_args(argv)
    quiet_known_warnings()
    try:
        settings = load_settings(args.config)
        if not settings.kafka.bootstrap:
            raise ConfigError(
                "kafka.bootstrap is empty; fix: set kafka.bootstrap (RTRL_KAFKA__BOOTSTRAP) to the "
                "cluster, or use `rtrl train`, which starts the local broker"
            )
        from rtrl.kafka import connection
        from trainer.run import run

        run(settings, connection(settings.kafka))
    except RtrlError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
