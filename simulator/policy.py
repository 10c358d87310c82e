"""The simulated agent's policy: a tiny Megatron-Core GPTModel over the task vocabulary.

The model's shape comes from settings (``app.serving.loop_model_config``); ``warm_start`` imitates a plausible initial
agent (mostly valid tool calls, some broken ones, some questions, edits right a little more often
than chance) so that the loop starts from a policy worth improving; ``sample`` draws completions
from the full softmax with the log-prob of every sampled token (what the trainer recomputes for
its importance ratio); ``greedy`` is what the eval suite scores.
"""

from __future__ import annotations

import random

import torch

from simulator.tasks import (
    COMPLETION_LEN,
    PROMPT_LEN,
    Task,
    warm_start_completion,
)
from trainer.model import causal_mask


def _logits(model, tokens: torch.Tensor) -> torch.Tensor:
    n, s = tokens.shape
    pos = torch.arange(s).expand(n, s)
    return model(tokens, pos, causal_mask(s)).float()  # [N, S, V]


@torch.no_grad()
def sample(model, tasks: list[Task], generator: torch.Generator) -> tuple[list[list[int]], list[list[float]]]:
    """One completion per task, token by token from the full softmax; (completions, log-probs)."""
    model.eval()
    seqs = torch.tensor([t.prompt for t in tasks], dtype=torch.long)
    logps = []
    for _ in range(COMPLETION_LEN):
        lp = torch.log_softmax(_logits(model, seqs)[:, -1], dim=-1)
        tok = torch.multinomial(lp.exp(), 1, generator=generator)
        logps.append(lp.gather(1, tok))
        seqs = torch.cat([seqs, tok], dim=1)
    return seqs[:, PROMPT_LEN:].tolist(), torch.cat(logps, dim=1).tolist()


@torch.no_grad()
def greedy(model, tasks: list[Task]) -> list[list[int]]:
    model.eval()
    seqs = torch.tensor([t.prompt for t in tasks], dtype=torch.long)
    for _ in range(COMPLETION_LEN):
        tok = _logits(model, seqs)[:, -1].argmax(-1, keepdim=True)
        seqs = torch.cat([seqs, tok], dim=1)
    return seqs[:, PROMPT_LEN:].tolist()


@torch.no_grad()
def solve_probability(model, tasks: list[Task]) -> list[float]:
    """Each task's probability that a sampled completion solves it (its edit is right, as
    :func:`simulator.tasks.score` counts), exactly: the sum over first tokens t of P(t) x P(right edit | t),
    over the one tool token its org's convention requires where it requires one (:attr:`Task.tool`).
    A smoother measure of a policy's success than a solve rate of draws."""
    from simulator.tasks import DIGIT0, TOOL_TOKENS

    model.eval()
    prompts = torch.tensor([t.prompt for t in tasks], dtype=torch.long)
    p_first = torch.softmax(_logits(model, prompts)[:, -1], dim=-1)  # [N, V]
    vocab = p_first.shape[1]
    seqs = torch.cat(
        [prompts.repeat_interleave(vocab, 0), torch.arange(vocab).repeat(len(tasks)).unsqueeze(1)], dim=1
    )  # every task followed by every first token: [N * V, prompt + 1]
    p_edit = torch.softmax(_logits(model, seqs)[:, -1], dim=-1).view(len(tasks), vocab, -1)
    right = torch.tensor([DIGIT0 + t.answer for t in tasks])
    p_right = p_edit.gather(2, right.view(-1, 1, 1).expand(-1, vocab, 1))[..., 0]  # [N, V]
    allowed = torch.ones(len(tasks), vocab)  # first tokens after which a right edit is accepted
    for i, t in enumerate(tasks):
        if t.tool is not None:
            allowed[i] = 0.0
            allowed[i, TOOL_TOKENS[t.tool]] = 1.0
    return (p_first * p_right * allowed).sum(1).tolist()


def warm_start(
    model, tasks: list[Task], steps: int = 150, seed: int = 0, lr: float = 3e-3, right_easy: float | None = None
) -> float:
    """Supervised steps on warm-start completions for ``tasks`` (``right_easy``: see
    :func:`simulator.tasks.warm_start_completion`); returns the last loss."""
    rng = random.Random(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    loss = torch.tensor(0.0)
    for _ in range(steps):
        batch = [rng.choice(tasks) for _ in range(64)]
        seqs = torch.tensor(
            [t.prompt + warm_start_completion(rng, t, right_easy=right_easy) for t in batch], dtype=torch.long
        )
        logits = _logits(model, seqs[:, :-1])
        target = seqs[:, 1:]
        lp = torch.log_softmax(logits, dim=-1).gather(2, target[..., None])[..., 0]
        loss = -lp[:, PROMPT_LEN - 1 :].mean()  # the completion tokens only
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    model.eval()
    return float(loss.detach())
