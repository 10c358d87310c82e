"""The architecture diagram (docs/architecture.png): the parts, the topics and tables between them.

Drawn with matplotlib (Agg). ``--check`` does not compare it: its pixels depend on the fonts and matplotlib
version that draw it.
"""

from __future__ import annotations

from pathlib import Path


def draw_architecture(path: Path) -> None:
    """docs/architecture.png: the parts, the topics and tables between them, 1600 x 1000 px."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyArrowPatch, FancyBboxPatch

    plt.rcParams["svg.hashsalt"] = "rtrl"
    fig = plt.figure(figsize=(16, 10), dpi=100)
    ax = fig.add_axes((0, 0, 1, 1))
    ax.set_xlim(0, 16)
    ax.set_ylim(0, 10)
    ax.axis("off")
    colours = {
        "producer": "#dbe9f6",
        "kafka": "#fde3c8",
        "flow": "#d9f0d3",
        "trainer": "#e8dcf2",
        "clickhouse": "#fff3b0",
        "files": "#eeeeee",
    }
    boxes: dict[str, tuple[float, float, float, float]] = {}

    def box(key: str, x: float, y: float, w: float, h: float, title: str, sub: str = "", kind: str = "flow") -> None:
        boxes[key] = (x, y, w, h)
        ax.add_patch(
            FancyBboxPatch(
                (x, y),
                w,
                h,
                boxstyle="round,pad=0.02,rounding_size=0.12",
                linewidth=1.4,
                edgecolor="#444444",
                facecolor=colours[kind],
            )
        )
        if sub:
            ax.text(x + w / 2, y + h * 0.66, title, ha="center", va="center", fontsize=13, fontweight="bold")
            ax.text(x + w / 2, y + h * 0.3, sub, ha="center", va="center", fontsize=10.5, color="#333333")
        else:
            ax.text(x + w / 2, y + h / 2, title, ha="center", va="center", fontsize=12.5, fontweight="bold")

    def side(key: str, where: str, frac: float = 0.5) -> tuple[float, float]:
        x, y, w, h = boxes[key]
        return {
            "left": (x, y + h * frac),
            "right": (x + w, y + h * frac),
            "top": (x + w * frac, y + h),
            "bottom": (x + w * frac, y),
        }[where]

    def arrow(
        a: tuple[float, float],
        b: tuple[float, float],
        label: str = "",
        rad: float = 0.0,
        lpos: float = 0.5,
        both: bool = False,
    ) -> None:
        ax.add_patch(
            FancyArrowPatch(
                a,
                b,
                arrowstyle="<|-|>" if both else "-|>",
                mutation_scale=16,
                linewidth=1.5,
                color="#333333",
                connectionstyle=f"arc3,rad={rad}",
                shrinkA=2,
                shrinkB=2,
            )
        )
        if label:
            lx, ly = a[0] + (b[0] - a[0]) * lpos, a[1] + (b[1] - a[1]) * lpos
            ax.text(
                lx,
                ly + 0.13,
                label,
                ha="center",
                va="bottom",
                fontsize=10,
                color="#222222",
                bbox={"boxstyle": "round,pad=0.15", "facecolor": "white", "edgecolor": "none", "alpha": 0.85},
            )

    ax.text(
        8, 9.7, "rtrl: the closed loop, as data flows through it", ha="center", va="center", fontsize=17,
        fontweight="bold",
    )  # fmt: skip
    # column 1: where the data comes from
    box("sdk", 0.3, 7.9, 3.0, 1.2, "client SDK", "client/ (in the product backend)", "producer")
    box("users", 0.3, 5.6, 3.0, 1.2, "users", "simulator/tasks.py (simulated)", "producer")
    box(
        "server",
        0.3,
        2.5,
        3.0,
        1.9,
        "policy server",
        "simulator/serve.py\n(an inference fleet in production)",
        "producer",
    )
    # column 2: Kafka
    ax.text(5.3, 9.25, "Kafka", ha="center", fontsize=14, fontweight="bold", color="#a0522d")
    for name, y in (("events", 8.3), ("rewards", 7.1), ("rollouts", 5.9), ("batches", 4.7), ("deployments", 2.9)):
        box(f"t_{name}", 4.2, y, 2.2, 0.7, f"rtrl.{name}", kind="kafka")
    box("t_dead_letters", 4.2, 0.9, 2.2, 1.0, "rtrl.dead_letters", "bad input of every part", "kafka")
    # column 3: the parts that compute
    box("reward_flow", 7.6, 7.7, 3.0, 1.4, "reward flow", "flows/reward_flow.py (Bytewax)")
    box("batch_flow", 7.6, 5.4, 3.0, 1.4, "batch flow", "flows/batch_flow.py (Bytewax)")
    box("trainer", 7.6, 3.3, 3.0, 1.4, "trainer", "trainer/ (Megatron-Core)", "trainer")
    box("gate", 7.6, 1.0, 3.0, 1.4, "eval gate", "evalgate/ + monitors/", "trainer")
    # column 4: ClickHouse and files
    box("archive", 12.0, 8.3, 3.7, 1.0, "Parquet archive", "raw events by date", "files")
    box("clickhouse", 12.0, 2.9, 3.7, 4.9, "", kind="clickhouse")
    ax.text(13.85, 7.4, "ClickHouse", ha="center", va="center", fontsize=14, fontweight="bold")
    ch_lines = [
        "events, rewards,",
        "trajectories, dead_letters",
        "batch_stats",
        "train_metrics",
        "checkpoints",
        "views: behaviour,",
        "reward_stats (monitors)",
    ]
    for i, text in enumerate(ch_lines):
        ax.text(13.85, 6.8 - i * 0.52, text, ha="center", va="center", fontsize=11.5)
    box("ckpt", 12.0, 0.9, 3.7, 1.2, "checkpoints", "dist_checkpointing folders", "files")
    # producers -> Kafka, and back
    arrow(side("sdk", "right"), side("t_events", "left"), "events")
    arrow(side("server", "top"), side("users", "bottom"), "completions")
    arrow(side("users", "top"), side("sdk", "bottom"), "reactions")
    arrow(side("server", "right", 0.85), side("t_rollouts", "left", 0.3), "rollouts", lpos=0.45)
    arrow(side("t_deployments", "left"), side("server", "right", 0.45), "promotions", lpos=0.5)
    # Kafka -> parts -> Kafka
    arrow(side("t_events", "right"), side("reward_flow", "left", 0.6))
    arrow(side("reward_flow", "left", 0.2), side("t_rewards", "right", 0.7))
    arrow(side("t_rewards", "right", 0.3), side("batch_flow", "left", 0.8))
    arrow(side("t_rollouts", "right"), side("batch_flow", "left", 0.45))
    arrow(side("batch_flow", "left", 0.1), side("t_batches", "right", 0.7))
    arrow(side("t_batches", "right", 0.3), side("trainer", "left", 0.7), "micro-batches", lpos=0.55)
    arrow(side("gate", "left", 0.7), side("t_deployments", "right"), "decisions", lpos=0.5)
    arrow(side("trainer", "bottom"), side("gate", "top"), "candidate")
    # parts -> ClickHouse and files
    arrow(side("reward_flow", "right", 0.75), side("archive", "left", 0.4), "raw events", lpos=0.45)
    arrow(side("reward_flow", "right", 0.3), side("clickhouse", "left", 0.93), "rows", lpos=0.45)
    arrow(side("batch_flow", "right", 0.5), side("clickhouse", "left", 0.65), "counters", lpos=0.45)
    arrow(side("trainer", "right", 0.7), side("clickhouse", "left", 0.38), "metrics", lpos=0.45)
    arrow(side("trainer", "right", 0.15), side("ckpt", "top", 0.16), "weights", lpos=0.8)
    arrow(side("gate", "right", 0.9), side("clickhouse", "left", 0.03), "behaviour, decisions", lpos=0.28, both=True)
    ax.text(
        8,
        0.35,
        "app/: `rtrl run` wires these in one process, or one process per part under a supervisor (loop.processes)",
        ha="center",
        va="center",
        fontsize=11.5,
        style="italic",
        color="#333333",
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100, metadata={"Software": None})
    plt.close(fig)
