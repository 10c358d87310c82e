"""The one place a trainer is built: from settings to the policy, its frozen reference and its optimizer.

Every job that trains or serves the policy builds it here: the trainer job, the loop's trainer and policy
server, the per-org adapters, the local cluster's first checkpoint, the experiments on simulated time and the
GPU bench. So a model built by any of them has the same layout, precision and initial weights. Tests and CPU
benches that need a bare model with megatron's init call :func:`trainer.model.build_model` directly.

- :func:`model_config` turns the settings' ``model``, ``parallel`` and ``precision`` sections into a model.
- :func:`build` gives a model with ``cfg``'s initial weights. Those are megatron's seeded init, or with
  ``cfg.hf_path`` that Hugging Face checkpoint's, read by the import (:mod:`trainer.hf.load`).
- :func:`build_policy` starts the parallel groups and builds the policy with its reference.
- :func:`optimizer` is the AdamW over exactly the parameters a run trains.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from rtrl.sections.trainer import ModelSettings, PrecisionSettings, TrainConfig
from rtrl.settings import Settings
from trainer.dedup import TrainedSet
from trainer.hf.config import config_from_settings
from trainer.hf.load import load_hf
from trainer.model import ParallelInfo, build_model, init_parallel


def model_config(settings: Settings) -> tuple[ModelSettings, PrecisionSettings]:
    """The trainer's model and precision from the settings' ``model``, ``parallel`` and ``precision``
    sections: the one place those sections become a model (the trainer job, the loop and the
    policy server all call it). The model is the ``model`` section split over the ``parallel`` one.
    A shape that does not fit the layout or the precision is a ConfigError naming the settings.

    With ``model.hf_path`` set the architecture comes from that checkpoint's config.json
    (:func:`trainer.hf.config.config_from_settings`). A shape setting the user also set that disagrees is
    refused."""
    m, p, pr = settings.model, settings.parallel, settings.precision
    cfg = config_from_settings(m, p) if m.hf_path else m.replace(parallel=p)
    cfg.check_precision(pr)
    return cfg, pr


def build(cfg: ModelSettings, precision: PrecisionSettings | None = None) -> Any:
    """A megatron-core ``GPTModel`` with ``cfg``'s initial weights, for this rank's stage and shard.

    The weights are megatron's init seeded with ``cfg.seed`` (:func:`trainer.model.build_model`). With
    ``cfg.hf_path`` they are that Hugging Face checkpoint's, this rank's shards only. Two calls give the same
    model. Call :func:`trainer.model.init_parallel` first."""
    model = build_model(cfg, precision)
    if cfg.hf_path:
        load_hf(model, cfg)
    return model


@dataclass
class Policy:
    """What a training run updates: the model, its frozen KL reference and its optimizer.

    :func:`trainer.train.train` takes one; :func:`build_policy` builds one from a model config."""

    model: Any
    reference: Any
    """The frozen KL reference: the run's initial weights. None only for an adapter run: its reference is the
    same model with no adapter active, the base alone."""
    optimizer: torch.optim.Optimizer | None = None
    """An AdamW over exactly the parameters the run trains (:func:`optimizer`), kept by a caller that trains in
    several calls without checkpoints (the in-process experiments), so its moments carry over as a resumed
    run's do. None: each run makes a new one, or resumes its checkpoint's."""
    version: int = 0
    """The policy version a sample's lag is measured against. A resumed checkpoint's version wins."""
    trained: TrainedSet = field(default_factory=TrainedSet)
    """Micro-batches and samples already trained, kept in every checkpoint: the batch flow may send some again
    after a crash, and a run skips them (:mod:`trainer.dedup`)."""
    parallel: ParallelInfo | None = None
    """This process's place in the parallel layout, where :func:`build_policy` started it."""


def build_policy(cfg: ModelSettings, precision: PrecisionSettings) -> Policy:
    """Start the parallel groups for ``cfg`` and build the policy, then its reference from the same weights."""
    info = init_parallel(cfg)
    model = build(cfg, precision)
    return Policy(model, build(cfg, precision), parallel=info)


def optimizer(params: Iterable[torch.nn.Parameter], cfg: TrainConfig) -> torch.optim.AdamW:
    """The run's AdamW over ``params``, from the ``train`` section's betas and weight decay. Its learning rate is
    set again before every step from ``cfg``."""
    return torch.optim.AdamW(list(params), lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), weight_decay=cfg.weight_decay)
