"""Seeded, reproducible simulation of coding-agent users: the events an SDK would send.

:func:`generate` is the pure core (no I/O); :mod:`simulator.population` holds the synthetic
orgs, users, task kinds and per-policy-version behaviour it samples from.
"""

from simulator.generate import DEFAULT_START_MS, Emission, generate, stats
from simulator.population import (
    TASK_KINDS,
    Org,
    PolicyProfile,
    Population,
    User,
    build_population,
    default_profile,
    hash_user,
    profile_for,
)

__all__ = [
    "DEFAULT_START_MS",
    "Emission",
    "generate",
    "stats",
    "TASK_KINDS",
    "Org",
    "PolicyProfile",
    "Population",
    "User",
    "build_population",
    "default_profile",
    "hash_user",
    "profile_for",
]
