"""Rewards: what a trajectory's events say (:mod:`rewards.features`) and the pure, versioned
reward functions that score them (:mod:`rewards.functions`).

``compute(events, version)`` is the one-call entry point; stream operators, the Beam backfill
and the simulator only wrap it.
"""

from rewards.features import TrajectoryFeatures, features
from rewards.functions import (
    COMPONENTS,
    CURRENT_VERSION,
    REWARD_VERSIONS,
    RewardConfig,
    RewardResult,
    UnknownRewardVersion,
    check_versions,
    compute,
    get_config,
    reward,
)

__all__ = [
    "COMPONENTS",
    "CURRENT_VERSION",
    "REWARD_VERSIONS",
    "RewardConfig",
    "RewardResult",
    "TrajectoryFeatures",
    "UnknownRewardVersion",
    "check_versions",
    "compute",
    "features",
    "get_config",
    "reward",
]
