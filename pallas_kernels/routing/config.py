"""Static configuration of the router kernel: the scoring rule and its constants, and the
tokens a program takes.

Hashable and validated at construction (a static argument of ``jax.jit``); nothing here imports
``atlas_jax`` (its ``RouterScoring`` and ``MoEConfig`` values coerce to these).
"""

from __future__ import annotations

import dataclasses

from jax.experimental import pallas as pl

from pallas_kernels._enums import CoercibleEnum


class Scoring(CoercibleEnum):
    """How router logits become the scores the top-k selects on and the weights come from."""

    SOFTMAX = "softmax"  # f32 softmax over all router outputs (Qwen2/3-MoE, Mixtral, LongCat)
    SIGMOID = "sigmoid"  # sigmoid per output (DeepSeek-V3, MiniMax-M2)
    SQRT_SOFTPLUS = "sqrt_softplus"  # sqrt(softplus(logit)) (DeepSeek-V4)
    TOPK_SOFTMAX = "topk_softmax"  # top-k on the logits, softmax over the k chosen (gpt-oss)


@dataclasses.dataclass(frozen=True)
class RouterRule:
    """One router's rule (transformers' semantics, as ``atlas_jax.moe.routing`` states them):
    scores from the logits; the top ``k`` of ``score + selection bias`` (with ``n_group`` > 1:
    only inside the ``topk_group`` groups of experts with the largest sum of their top-2, the
    other groups' choices 0); weights = the chosen unbiased scores (``TOPK_SOFTMAX``: a softmax
    over the chosen logits), divided by their sum + ``norm_eps`` where ``normalize``, times
    ``scale`` (and a per-expert scale where given)."""

    scoring: Scoring
    k: int
    normalize: bool = False
    norm_eps: float = 0.0
    scale: float = 1.0
    n_group: int = 1
    topk_group: int = 1

    def __post_init__(self) -> None:
        object.__setattr__(self, "scoring", Scoring.coerce(self.scoring))
        for name in ("k", "n_group", "topk_group"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"RouterRule.{name}: expected a positive int, got {v!r}")
        if self.topk_group > self.n_group:
            raise ValueError(f"RouterRule.topk_group: {self.topk_group} must be <= n_group "
                             f"{self.n_group}")
        if self.n_group > 1 and self.scoring is Scoring.TOPK_SOFTMAX:
            raise ValueError("RouterRule: group-limited selection needs scores (not "
                             "topk_softmax)")

    def check(self, num_outputs: int) -> None:
        """Raise ValueError where the rule cannot select from ``num_outputs`` router outputs."""
        if self.k > num_outputs:
            raise ValueError(f"RouterRule.k: {self.k} must be <= the {num_outputs} router "
                             "outputs")
        if self.n_group > 1:
            per_group, rest = divmod(num_outputs, self.n_group)
            if rest or per_group < 2:
                raise ValueError(f"RouterRule.n_group: {self.n_group} groups must split the "
                                 f"{num_outputs} router outputs evenly, 2 or more a group")
            if self.k > self.topk_group * per_group:
                raise ValueError(f"RouterRule.k: {self.k} must be <= topk_group x experts a "
                                 f"group = {self.topk_group * per_group}")


# Elements of a program's [tokens, outputs] block (registers: a few arrays of this size over
# the program's one warp).
BLOCK_ELEMENTS = 256
MAX_BLOCK_TOKENS = 16


def block_tokens(num_tokens: int, num_outputs: int) -> int:
    """Tokens a program routes: a power of two, its block at most ``BLOCK_ELEMENTS`` (at least
    one token), at most ``MAX_BLOCK_TOKENS``, no more than the tokens need."""
    fit = max(1, BLOCK_ELEMENTS // pl.next_power_of_2(num_outputs))
    return min(MAX_BLOCK_TOKENS, 1 << (fit.bit_length() - 1),  # the power of two <= fit
               pl.next_power_of_2(max(num_tokens, 1)))
