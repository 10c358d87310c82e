"""Tiny, checkable coding tasks for the closed loop, and how simulated users react to completions.

Pure: token layout, task sampling, parsing a completion, the user's reaction as events, and the
held-out score. A prompt is ``BOS kind level a b SEP``; the policy answers with two tokens, a
tool call and an edit. The *right* edit is the digit ``a`` for an ``easy`` task and
``(a + b) % 10`` for a ``hard`` one (``b`` for a long ``background`` task), so correctness is
checkable and a tiny model can learn it on two CPU cores in minutes. What the user sees:

* a tool token the harness knows (``read_file``, ``run_tests``, ``search``) is a valid tool call;
  any other token there is a broken tool call (malformed arguments);
* a digit is an edit: right or wrong;
* ``ASK`` is a clarifying question the task never needed (the prompt says everything), which the
  user says in the follow-up; anything else ends the trajectory with an error.

How users react - accepting, rewriting and reverting edits, persistence checks that arrive late, the
latency of what the policy did, dissatisfied follow-ups - is :mod:`simulator.world`.

**Org conventions** (issue 17: a world where per-org adapters pay). Some orgs follow a convention of their own
on a few task kinds (:class:`Convention`): their reviewers accept an edit there only after a given tool ran
first (``tool``: e.g. "run the tests before any refactor", or "search for the callers first"), and/or the edit
they accept is the global answer shifted by the org's digit, ``(answer + shift) % 10``. The prompt does not
carry the org, so the shared policy cannot tell the orgs apart and at best learns the majority's habit; an
adapter trained on one org's samples can learn its convention. The loop's conventions
(:func:`conventions_for`) are tool habits on the same kinds where, in a world with conventions, every other org's
reviewers want the file read first (:data:`GLOBAL_HABIT`): one org wants the tests run, another a search, so no
single policy serves them all, and the shared one follows the majority. A convention
is data: :func:`sample_task` copies the org's shift and tool for the task's kind into :attr:`Task.shift` and
:attr:`Task.tool`, so :attr:`Task.answer`, :func:`outcome`, :func:`score` and the users' reactions
(:mod:`simulator.world`) all follow it. With no conventions every task has shift 0 and no required tool, and
every seeded stream is what it was before them.

Under the historical buggy reward (``v1-discard-broken``) a trajectory with a broken call earns
no reward at all instead of a negative one, so on tasks the policy expects to fail, a broken call
is never punished while a valid call followed by a wrong edit is: that is the hack the loop must
catch. (In this world the edit does not depend on the tool call: only the reward makes them
interact.)
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Literal

PAD, BOS, SEP, EOS, ASK = 0, 1, 2, 3, 4
TOOLS = {5: "read_file", 6: "run_tests", 7: "search"}
TOOL_TOKENS = {name: tok for tok, name in TOOLS.items()}  # each tool's token
MALFORMED = (8, 9, 10)  # tool tokens with broken arguments; any non-tool token counts as broken too
DIGIT0 = 11  # digits 0..9 are tokens 11..20
KINDS = {"bugfix": 21, "feature": 22, "refactor": 23, "explain": 24, "test": 25}
EASY, HARD = 26, 27
BACKGROUND = "background"
"""Kind of the long background tasks (issue 16): their right edit is the digit ``b``, and their user judges the
whole outcome with a verdict cycles later (:func:`simulator.world.react_background`)."""
KIND_TOKENS = KINDS | {BACKGROUND: 28}
VOCAB = 32
PROMPT_LEN, COMPLETION_LEN = 6, 2

Level = Literal["easy", "hard"]

#: each token's word in :func:`decode`
WORDS = (
    {PAD: "<pad>", BOS: "<s>", SEP: "<sep>", EOS: "</s>", ASK: "<ask>"}
    | TOOLS
    | {tok: f"<malformed-call-{tok}>" for tok in MALFORMED}
    | {DIGIT0 + d: str(d) for d in range(10)}
    | {tok: kind for kind, tok in KIND_TOKENS.items()}
    | {EASY: "easy", HARD: "hard"}
)


def decode(ids: Sequence[int]) -> str:
    """The text of token ids in the simulator's vocabulary: what secret screening scans (client/screening.py)."""
    return " ".join(WORDS.get(int(t), f"<unused-{int(t)}>") for t in ids)


@dataclass(frozen=True)
class Task:
    task_id: str
    org_id: str
    kind: str
    level: Level
    a: int
    b: int
    shift: int = 0
    """The org's convention on this kind (:class:`Convention`): the accepted edit is the global answer + shift
    (mod 10); 0 = the global convention. Not in the prompt."""
    tool: str | None = None
    """The org's convention on this kind: the tool that must run before its users accept an edit (a name in
    :data:`TOOLS`); None = any valid tool (the global convention). Not in the prompt."""

    @property
    def global_answer(self) -> int:
        """The answer under the global convention (what an org without a convention of its own accepts)."""
        if self.kind == BACKGROUND:
            return self.b
        return self.a if self.level == "easy" else (self.a + self.b) % 10

    @property
    def answer(self) -> int:
        """The edit this task's user accepts: the global answer under the org's convention."""
        return (self.global_answer + self.shift) % 10

    @property
    def prompt(self) -> list[int]:
        return [
            BOS,
            KIND_TOKENS[self.kind],
            EASY if self.level == "easy" else HARD,
            DIGIT0 + self.a,
            DIGIT0 + self.b,
            SEP,
        ]


@dataclass(frozen=True)
class Outcome:
    """What a completion did, as the user experiences it."""

    tool: str | None  # the tool name, None when the call was broken
    edit: int | None  # the digit edited, None for no edit
    asked: bool
    correct: bool

    @property
    def broken(self) -> bool:
        return self.tool is None


@dataclass(frozen=True)
class Convention:
    """An org's own convention on the task kinds ``kinds``: its users accept ``(global answer + shift) % 10``
    instead of the global answer (``shift`` in 0..9), and only after the tool ``tool`` ran (None: any valid
    tool); at least one of the two differs from the global convention. On every other kind they follow the
    global one."""

    org: str
    kinds: tuple[str, ...]
    shift: int = 0
    tool: str | None = None

    def __post_init__(self) -> None:
        unknown = [k for k in self.kinds if k not in KIND_TOKENS]
        if unknown or not self.kinds:
            raise ValueError(f"Convention of {self.org!r}: kinds {list(self.kinds)} must be among {list(KIND_TOKENS)}")
        if not 0 <= self.shift <= 9:
            raise ValueError(f"Convention of {self.org!r}: shift {self.shift!r} must be within 0..9 (0: no shift)")
        if self.tool is not None and self.tool not in TOOLS.values():
            raise ValueError(
                f"Convention of {self.org!r}: tool {self.tool!r} must be one of {sorted(TOOLS.values())} or None"
            )
        if self.shift == 0 and self.tool is None:
            raise ValueError(f"Convention of {self.org!r}: neither a shift nor a tool (that is the global convention)")

    def shift_for(self, kind: str) -> int:
        """The shift of a task of ``kind`` in this org: ``shift`` on its convention kinds, else 0."""
        return self.shift if kind in self.kinds else 0

    def tool_for(self, kind: str) -> str | None:
        """The tool a task of ``kind`` in this org needs before an edit is accepted: ``tool`` on its convention
        kinds, else None (any valid tool)."""
        return self.tool if kind in self.kinds else None

    def describe(self) -> str:
        """One line for tables: ``refactor+test: run_tests first`` (and ``answer +3`` for a shift)."""
        parts = ([f"{self.tool} first"] if self.tool else []) + ([f"answer +{self.shift}"] if self.shift else [])
        return f"{'+'.join(self.kinds)}: {', '.join(parts)}"


Conventions = Mapping[str, Convention]
"""The orgs that have a convention, by org id (an org not in it follows the global convention)."""

CONVENTION_TABLE: tuple[tuple[tuple[str, ...], str], ...] = (
    (("refactor", "test"), "run_tests"),
    (("refactor", "test"), "search"),
    (("bugfix", "feature"), "run_tests"),
    (("bugfix", "feature"), "read_file"),
    (("explain",), "search"),
)
"""(kinds, tool) of the 1st, 2nd, ... specialised org (:func:`conventions_for`), cycling after the fifth: the
tool the org's reviewers want run before they accept an edit on those kinds. The first two rows conflict with each
other and with :data:`GLOBAL_HABIT` (read the file first) on the same kinds, so no single policy satisfies them
all."""


GLOBAL_HABIT = Convention("*", ("refactor", "test"), tool="read_file")
"""In a world with conventions (:func:`sample_task` given any): what the reviewers of every org without a
convention of its own on those kinds want, read the file before a refactor or a test edit. The specialised orgs
of :data:`CONVENTION_TABLE`'s first rows want another tool there, so the shared policy, pulled to the majority's
habit, serves them worst. With no conventions there is no habit (every stream is what it was)."""


def conventions_for(n_orgs: int, specialised: int) -> dict[str, Convention]:
    """The loop's conventions: of the orgs ``org-0`` .. ``org-{n_orgs-1}``, the last ``specialised`` have one,
    the j-th of them (from ``org-{n_orgs-specialised}``) the j-th row of :data:`CONVENTION_TABLE`. With 3 orgs
    and 2 specialised: ``org-1`` wants the tests run before a refactor or test edit, ``org-2`` a search before
    the same kinds, and ``org-0`` (the last to get one) keeps the global convention."""
    if not 0 <= specialised <= n_orgs:
        raise ValueError(f"specialised orgs ({specialised}) must be within 0..{n_orgs} (the number of orgs)")
    out = {}
    for j, i in enumerate(range(n_orgs - specialised, n_orgs)):
        kinds, tool = CONVENTION_TABLE[j % len(CONVENTION_TABLE)]
        out[f"org-{i}"] = Convention(f"org-{i}", kinds, tool=tool)
    return out


def sample_task(
    rng: random.Random,
    org_id: str,
    hard_share: float = 0.5,
    kinds: tuple[str, ...] = tuple(KINDS),
    conventions: Conventions | None = None,
) -> Task:
    """One task of ``org_id``, drawn from ``rng``; its shift and required tool are the org's convention on its
    kind (``conventions``; they draw nothing from ``rng``, so the same seed gives the same tasks with or without
    them)."""
    task = Task(
        task_id=f"{rng.getrandbits(48):012x}",
        org_id=org_id,
        kind=rng.choice(kinds),
        level="hard" if rng.random() < hard_share else "easy",
        a=rng.randrange(10),
        b=rng.randrange(10),
    )
    convention = convention_of(org_id, task.kind, conventions)
    if convention is not None:
        task = replace(task, shift=convention.shift_for(task.kind), tool=convention.tool_for(task.kind))
    return task


def convention_of(org_id: str, kind: str, conventions: Conventions | None) -> Convention | None:
    """The convention a task of ``kind`` in ``org_id`` follows: the org's own on its kinds, else (in a world with
    conventions) :data:`GLOBAL_HABIT` on its kinds, else None (the global convention)."""
    if not conventions:
        return None
    own = conventions.get(org_id)
    if own is not None and kind in own.kinds:
        return own
    return GLOBAL_HABIT if kind in GLOBAL_HABIT.kinds else None


def held_out(
    n: int = 200,
    seed: int = 7,
    kinds: tuple[str, ...] = tuple(KINDS),
    org: str | None = None,
    conventions: Conventions | None = None,
) -> list[Task]:
    """The eval suite's fixed tasks (a seed no training round uses); ``kinds=(BACKGROUND,)`` gives held-out
    background tasks (from their own stream). With ``org``: that org's held-out tasks, from a stream of their own
    (``held-out-<seed>-org-<org>``), under its convention in ``conventions`` (none: the global one)."""
    if org is not None:
        rng = random.Random(f"held-out-{seed}-org-{org}" + ("" if kinds == tuple(KINDS) else f"-{'-'.join(kinds)}"))
        return [sample_task(rng, org, kinds=kinds, conventions=conventions) for _ in range(n)]
    rng = random.Random(f"held-out-{seed}" if kinds == tuple(KINDS) else f"held-out-{seed}-{'-'.join(kinds)}")
    return [sample_task(rng, "eval", kinds=kinds) for _ in range(n)]


def outcome(task: Task, completion: list[int]) -> Outcome:
    if len(completion) != COMPLETION_LEN:
        raise ValueError(f"a completion has {COMPLETION_LEN} tokens, got {len(completion)}")
    tool_tok, edit_tok = completion
    edit = edit_tok - DIGIT0 if DIGIT0 <= edit_tok < DIGIT0 + 10 else None
    tool = TOOLS.get(tool_tok)
    habit = task.tool is None or tool == task.tool  # the org's reviewers want this tool run first
    return Outcome(
        tool=tool, edit=edit, asked=edit_tok == ASK, correct=edit is not None and edit == task.answer and habit
    )


def score(tasks: list[Task], completions: list[list[int]]) -> dict[str, float]:
    """Deterministic held-out metrics of greedy completions: solve, edit, ask and broken-call rates."""
    outs = [outcome(t, c) for t, c in zip(tasks, completions, strict=True)]
    n = max(1, len(outs))
    hard = [o for t, o in zip(tasks, outs) if t.level == "hard"]
    return {
        "solve_rate": sum(o.correct for o in outs) / n,
        "solve_rate_hard": sum(o.correct for o in hard) / max(1, len(hard)),
        "edit_rate": sum(o.edit is not None for o in outs) / n,
        "clarify_rate": sum(o.asked for o in outs) / n,
        "broken_tool_call_rate": sum(o.broken for o in outs) / n,
    }


def warm_start_completion(
    rng: random.Random,
    task: Task,
    broken: float = 0.1,
    ask: float = 0.1,
    right: float = 0.35,
    right_easy: float | None = None,
) -> list[int]:
    """A completion from the behaviour the initial policy is warm-started to imitate: mostly valid
    calls, some broken ones, some questions, edits right only a little more often than chance
    (``right``; ``right_easy`` for easy tasks when given: a policy that already handles them)."""
    if right_easy is not None and task.level == "easy":
        right = right_easy
    tool = rng.choice(MALFORMED) if rng.random() < broken else rng.choice(list(TOOLS))
    r = rng.random()
    if r < ask:
        edit = ASK
    elif r < ask + right:
        edit = DIGIT0 + task.answer
    else:
        edit = DIGIT0 + rng.randrange(10)
    return [tool, edit]
