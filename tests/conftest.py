"""Shared fixtures: one real Kafka-protocol broker (noida-db) and one real ClickHouse engine per session.

Each test gets its own topic prefix (so its own topics) and its own ClickHouse database.
Set RTRL_TEST_CLICKHOUSE_DSN=http://... to run the ClickHouse tests against a server instead of chdb.
Under pytest-xdist each worker has its own broker and engine, and the modules holding slow tests go first.
"""

from __future__ import annotations

import os
import uuid

import pytest

from devservices.broker import LocalBroker
from rtrl.clickhouse import connect, migrate
from rtrl.kafka import ensure_topics


def pytest_configure(config):
    """Under pytest-xdist, torch in each worker and in what it starts uses the worker's share of the cores.

    With both workers' torch on every core, the in-process experiments ran six times slower than alone.
    """
    if config.pluginmanager.hasplugin("xdist"):
        config.pluginmanager.register(_SharedFixtureGroups(), "rtrl-shared-fixture-groups")
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if workers > 1:
        threads = max(1, (os.cpu_count() or 1) // workers)
        os.environ["OMP_NUM_THREADS"] = str(threads)  # the default of every process a test starts
        import torch

        torch.set_num_threads(threads)


def pytest_collection_modifyitems(session, config, items):
    """Slow tests first, then the other tests of modules that hold slow ones.

    Long units started first leave the short ones to fill the end, so neither worker idles while the other
    finishes a long run.
    """
    slow_modules = {item.nodeid.split("::")[0] for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: (not item.get_closest_marker("slow"), item.nodeid.split("::")[0] not in slow_modules))


class _SharedFixtureGroups:
    """`--dist loadgroup` on pytest-xdist, grouping by shared fixture.

    A module that defines a module- or class-scoped fixture runs on one worker, so that fixture's expensive run
    happens once. Every other test is its own unit, so one module's long independent tests can use every worker.
    xdist's own loadgroup marks no longer apply under pytest 9.2, whose node ids cannot be renamed.
    """

    @pytest.hookimpl(tryfirst=True)
    def pytest_xdist_make_scheduler(self, config, log):
        if config.getvalue("dist") != "loadgroup":
            return None
        from xdist.scheduler import LoadScopeScheduling

        shared: dict[str, bool] = {}

        def shares_a_fixture(module: str) -> bool:
            if module not in shared:
                text = (config.rootpath / module).read_text()
                shared[module] = 'scope="module"' in text or 'scope="class"' in text
            return shared[module]

        class Scheduling(LoadScopeScheduling):
            def _split_scope(self, nodeid: str) -> str:
                module = nodeid.split("::")[0]
                return module if shares_a_fixture(module) else nodeid

        return Scheduling(config, log)


@pytest.fixture(scope="session")
def broker(tmp_path_factory):
    b = LocalBroker(tmp_path_factory.mktemp("broker"))
    b.up()
    yield b
    b.down()


@pytest.fixture
def topic_prefix(broker) -> str:
    """A fresh prefix; ``ensure_topics`` under it creates this test's own topics."""
    prefix = f"test{uuid.uuid4().hex[:10]}."
    ensure_topics(broker.bootstrap, prefix, 2)
    return prefix


@pytest.fixture(scope="session")
def ch_dsn(tmp_path_factory) -> str:
    """The session's ClickHouse: one chdb folder per process (or a server from RTRL_TEST_CLICKHOUSE_DSN)."""
    return os.environ.get("RTRL_TEST_CLICKHOUSE_DSN") or f"chdb://{tmp_path_factory.mktemp('clickhouse')}"


@pytest.fixture(scope="session")
def ch_client(ch_dsn):
    return connect(ch_dsn)


@pytest.fixture
def ch_db(ch_client) -> str:
    db = f"test_{uuid.uuid4().hex[:10]}"
    migrate(ch_client, db)
    yield db
    ch_client.command(f"DROP DATABASE IF EXISTS {db}")
