"""The main job, ``rtrl run``: every part on threads in one process, or each in its own process.

:func:`run_loop` runs ``loop.cycles`` cycles on the configured services, then the table and plots. With
``loop.processes`` every part is its own process under :mod:`app.supervisor`.
In one process each flow part of :data:`app.parts.PART_LIST` runs on a thread, and so does the policy server.
The trainer runs on the main thread.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch
from rich.console import Console

from app.deployments import end_running_experiments
from app.job import cycle_progress, final_report, fresh_start, preflight
from app.loop import CycleResult, Loop
from app.loop_config import (
    loop_settings,
)
from app.parts import PART_LIST
from rtrl import clickhouse, metrics
from rtrl.settings import Settings

if TYPE_CHECKING:
    from app.services import Services


def run_loop(settings: Settings, console: Console | None = None, resume: bool = False) -> list[dict]:
    """The main job: ``loop.cycles`` cycles on the configured services, then the table and plots
    (with ``loop.processes``, every part in its own process: :func:`app.supervisor.run_processes`).
    Without ``resume`` it starts afresh (:func:`fresh_start`); with it, it continues the run the data
    folder holds - its decisions, the flows' recovery state, the topics and tables - up to ``loop.cycles``."""
    from app.services import Services

    console = console or Console()
    settings = loop_settings(settings)  # refuses settings the loop cannot honour before anything starts
    if settings.loop.processes:
        from app.supervisor import run_processes

        return run_processes(settings, console, resume=resume)
    console.rule("[bold]rtrl main job: the closed loop")
    if resume:
        preflight(settings)
    else:
        fresh_start(settings)
    torch.set_num_threads(1)  # the policy server, the flows and the broker share the cores
    t0 = time.monotonic()
    services = Services(settings)
    try:  # the local broker stops whatever ends the run (Ctrl-C included, a metrics port in use too)
        with metrics.serve_part(settings, "run") as endpoint:  # one process: every part's metrics on one endpoint
            endpoint.ready()
            return _run_in_process(settings, services, console, resume, t0)
    finally:
        services.close()


def _run_in_process(settings: Settings, services: Services, console: Console, resume: bool, t0: float) -> list[dict]:
    loop = Loop(settings, services.bootstrap, services.ch)
    ls, rv = loop.settings.loop, loop.settings.rewards.train_version
    try:
        console.print(
            f"broker {services.bootstrap} · ClickHouse {clickhouse.redact(settings.clickhouse_dsn)} · "
            f"training on reward {rv} · {ls.cycles} cycles of {ls.samples_per_cycle:,} samples"
            + (f" · model from {loop.settings.model.hf_path}" if loop.settings.model.hf_path else "")
        )
        # before anything serves (the policy server reads the experiments once its thread starts)
        for key in end_running_experiments(loop.settings, services.bootstrap, loop.producer):
            console.print(f"ended experiment {key}, left running by an earlier run", highlight=False)
        console.print(loop.begin(resume))
        loop.start_flows([p.flow for p in PART_LIST if p.flow is not None])  # each flow part on a thread
        loop.start_server()  # the serve part on a thread; the train part is this thread's run_cycles
        with cycle_progress(console) as bar:
            task = bar.add_task("loop", total=ls.cycles, completed=loop.version, info="")

            def report(r: CycleResult) -> None:
                head, *adapters = r.lines(markup=True)
                bar.console.print(head)
                for line in adapters:
                    bar.console.print(line, highlight=False)
                bar.update(
                    task,
                    advance=1,
                    info=f"serving v{loop.serving}, held-out solve {loop.evals[loop.serving]['solve_rate']:.3f}",
                )

            loop.run_cycles(report)
        ab = loop.final_ab(console)  # the seed's table: the final version against v0, live
        loop.drain_flows()  # every event served has its reward before anything reads the rewards
    finally:
        loop.close()
    if loop.threads:  # the flows ran (and have stopped): what they moved
        for line in loop.flow_summaries():
            console.print(line, highlight=False, soft_wrap=True)
    return final_report(settings, services.ch, console, t0, ab)
