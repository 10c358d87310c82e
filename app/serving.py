"""The policy server every runner of the loop starts: its model, its settings and how long it serves.

:func:`loop_model_config` is the policy every part of the loop builds. :func:`policy_server` builds the server
over that model, or over an external one at ``serving.url``. :func:`serve_until` serves until a stop.
"""

from __future__ import annotations

import threading
from pathlib import Path

from app.loop_config import (
    loop_settings,
)
from client.screening import screen_for
from client.sdk import RtrlClient
from rtrl.errors import ConfigError
from rtrl.kafka import connection
from rtrl.sections.trainer import ModelSettings, PrecisionSettings
from rtrl.settings import Settings
from simulator.serve import PolicyServer
from simulator.tasks import VOCAB, conventions_for
from simulator.tasks import decode as decode_tokens
from trainer import checkpoint
from trainer.factory import build, model_config


def loop_model_config(settings: Settings) -> tuple[ModelSettings, PrecisionSettings]:
    """The policy every part of the loop builds (trainer, reference, policy server): the settings'
    ``model`` and ``precision`` sections (the tiny fp32 CPU model by default) over the simulator's
    vocabulary."""
    cfg, precision = model_config(loop_settings(settings, trains=False))  # train.* is not the model's
    if cfg.vocab_size != VOCAB:  # only with model.hf_path: otherwise LOOP_FIXED set it
        raise ConfigError(
            f"model.hf_path {settings.model.hf_path} has a vocabulary of {cfg.vocab_size:,} tokens; the closed loop's "
            f"tasks use the simulator's {VOCAB}-token vocabulary; fix: give a checkpoint with vocab_size {VOCAB} "
            "(`rtrl model init DIR` writes one), or train other models with rtrl train"
        )
    return cfg.replace(seed=cfg.seed + settings.loop.seed), precision


def policy_server(settings: Settings, bootstrap: str, client: RtrlClient, seed: int) -> PolicyServer:
    """The loop's policy server (a candidate arm's model too in A/B mode). It samples over HTTP from
    ``serving.url`` (vLLM, SGLang), or with that empty from the project's own completions server over the
    policy built here (:mod:`simulator.openai_server`)."""
    ls, sv = settings.loop, settings.serving
    cfg, precision = loop_model_config(settings)
    if client.screen is None:  # its rollouts are screened for secrets in the tokens the model reads
        client.screen = screen_for(settings.governance.secret_scanner, settings.model.hf_path, decode_tokens)
    own = not sv.url  # an external server holds the weights: nothing to build here
    api_key = None
    if sv.api_key_file:
        try:
            api_key = Path(sv.api_key_file).read_text(encoding="utf-8").strip()
        except OSError as e:
            raise ConfigError(
                f"serving.api_key_file {sv.api_key_file} cannot be read ({e.strerror or e}); fix: name a readable "
                "file holding the server's API key, or leave serving.api_key_file empty"
            ) from None
    return PolicyServer(
        connection(settings.kafka, bootstrap),
        settings.kafka.topic_prefix,
        client,
        build(cfg, precision) if own else None,
        [f"org-{i}" for i in range(ls.orgs)],
        seed=seed,
        users_per_org=ls.users_per_org,
        conventions=conventions_for(ls.orgs, ls.specialised_orgs),  # orgs whose reviewers have habits of their own
        max_adapters=settings.adapters.max_loaded,
        hard_share=ls.hard_share,
        compression=settings.kafka.compression,
        # A/B mode's candidates, and the final A/B's v0
        candidate_model=build(cfg, precision) if own and (ls.ab_share > 0 or ls.final_ab_trajectories) else None,
        model_config=cfg if own and cfg.hf_config is not None else None,  # its server reloads registry exports
        url=sv.url,
        model_name=sv.model,
        candidate_name=sv.candidate_model,
        timeout_s=sv.timeout_s,
        retries=sv.retries,
        api_key=api_key,
        ab=ls.ab_share > 0,
    )


def serve_until(server: PolicyServer, ls, stop: threading.Event) -> None:
    """Serve ``loop.rate`` tasks/s with a quota of ``loop.samples_per_cycle`` per decision until ``stop``."""
    server.run(
        stop,
        lambda m, p: checkpoint.load(p, m, restore_rng=False),
        ls.rate,
        ls.group_size,
        quota=ls.samples_per_cycle,
        candidate_share=ls.ab_share,
    )
