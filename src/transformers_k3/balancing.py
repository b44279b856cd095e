"""Router-bias balancing for the K3 latent MoE (SPEC 5): Quantile Balancing and the DeepSeek-V3 sign step.

Both methods only move `e_score_correction_bias`, which changes which experts a token *selects*; the mixing
weights use the unbiased scores, so no gradient flows through the bias and it is frozen at inference.

Quantile Balancing. While training, each router picks the top-(k+1) experts on the biased scores `s + b`; the
(k+1)-th biased score `a_i` is token i's admission cutoff: expert j is admitted when `s_ij + b_j > a_i`, i.e.
when `b_j > a_i - s_ij`. The bias that gives expert j exactly its target load `N k / n` is therefore the
`k / n` quantile of `a_i - s_ij` over the tokens. It is estimated from a per-expert histogram over
`[min(b) - 1, max(b) + 1]` (which holds every `a_i - s_ij`, since `a_i` lies in `[min(b), max(b) + 1]` and
`s_ij` in `[0, 1]`). Histogram counts are integers and add: micro-batches accumulate into one histogram, and
one `all_reduce(SUM)` pools the ranks, so the result equals the whole-batch estimate however tokens are split.
Only real tokens count: the model passes its padding mask down (`valid`), and padded rows, though routed, add
nothing to either method's statistics.

Sign step (DeepSeek-V3, aux-loss-free): `b_j += speed * sign(mean_load - load_j)` with the top-k loads.

Using it: set `moe_balancing="quantile"` (or `"sign"`) in the text config, then either add
`MoEBalancingCallback()` to a `transformers.Trainer`, or call `update_moe_balancing(model)` after every
optimizer step in a custom loop. With balancing on but neither used, the routers keep accumulating statistics
and the bias never moves: calling the update is the training loop's job.
"""

from __future__ import annotations

import torch
from transformers import TrainerCallback

BALANCING_METHODS = ("none", "quantile", "sign")


def histogram_range(bias: torch.Tensor) -> tuple[float, float]:
    """`[min(b) - 1, max(b) + 1]`: the interval that holds every `a_i - s_ij` for sigmoid scores."""
    b = bias.detach().float()
    return float(b.min()) - 1.0, float(b.max()) + 1.0


def histogram_counts(values: torch.Tensor, lo: float, hi: float, bins: int = 256,
                     valid: torch.Tensor | None = None) -> torch.Tensor:
    """Per-column integer histogram of `values [N, E]` over `[lo, hi]` in `bins` equal bins -> `[E, bins]` int64.

    Values outside `[lo, hi]` (only rounding can put them there for router statistics) are clamped into the
    first or last bin, so every value is counted exactly once and counts of disjoint batches add up. `valid [N]`
    bool: only those rows count (padding tokens do not); without a host sync, so a training step keeps its pace.
    """
    if values.dim() != 2:
        raise ValueError(f"`values` must be [N, E], got shape {tuple(values.shape)}")
    if not isinstance(bins, int) or bins < 1:
        raise ValueError(f"`bins` must be a positive integer, got {bins!r}")
    if not hi > lo:
        raise ValueError(f"`hi` ({hi}) must be greater than `lo` ({lo})")
    N, E = values.shape
    scale = bins / (hi - lo)
    idx = ((values.float() - lo) * scale).floor().clamp_(0, bins - 1).long()  # [N, E] bin of each value
    flat = idx + torch.arange(E, device=values.device) * bins  # [N, E] index into the [E * bins] table
    return _bincount(flat, E * bins, valid).view(E, bins)


def _bincount(idx: torch.Tensor, n: int, valid: torch.Tensor | None) -> torch.Tensor:
    """`bincount` of `idx [N, ...]` over `n` slots, the rows where `valid [N]` is False sent to a dropped extra slot."""
    if valid is None:
        return torch.bincount(idx.reshape(-1), minlength=n)
    if valid.shape != idx.shape[:1]:
        raise ValueError(f"`valid` must be [N] = [{idx.shape[0]}], got {list(valid.shape)}")
    idx = torch.where(valid.to(torch.bool).view(-1, *[1] * (idx.dim() - 1)), idx, n)
    return torch.bincount(idx.reshape(-1), minlength=n + 1)[:n]


def quantile_from_histogram(counts: torch.Tensor, q: float, lo: float, hi: float) -> torch.Tensor:
    """The `q` quantile of each row of a histogram `counts [E, bins]` over `[lo, hi]` -> `[E]` fp32.

    The target rank is `r = q * N` (N = values per row). The bin where the cumulative count reaches `r` holds the
    exact quantile (see `exact_quantile`); inside it the values are taken as uniform, so the estimate is within
    one bin width `(hi - lo) / bins` of the exact one.
    """
    if counts.dim() != 2:
        raise ValueError(f"`counts` must be [E, bins], got shape {tuple(counts.shape)}")
    if not 0.0 < q <= 1.0:
        raise ValueError(f"`q` must be in (0, 1], got {q!r}")
    E, bins = counts.shape
    total = counts.sum(-1)  # [E]
    if bool((total == 0).any()):
        raise ValueError("`counts` has an empty row: no values to take a quantile of")
    c = counts.double()
    cum = c.cumsum(-1)  # [E, bins]
    r = q * total.double()  # [E] target rank
    # First bin whose cumulative count reaches r (ties: the earliest, where the r-th value lives).
    b = torch.searchsorted(cum, r[:, None]).clamp_(max=bins - 1).squeeze(-1)  # [E]
    below = torch.where(b > 0, cum.gather(1, (b - 1).clamp(min=0)[:, None]).squeeze(-1), torch.zeros_like(r))
    inside = c.gather(1, b[:, None]).squeeze(-1)  # > 0 by construction
    frac = ((r - below) / inside).clamp(0.0, 1.0)
    width = (hi - lo) / bins
    return (lo + width * (b.double() + frac)).float()


def histogram_quantile(values: torch.Tensor, q: float, lo: float, hi: float, bins: int = 256) -> torch.Tensor:
    """Histogram estimate of the per-column `q` quantile of `values [N, E]` -> `[E]` fp32."""
    return quantile_from_histogram(histogram_counts(values, lo, hi, bins), q, lo, hi)


def exact_quantile(values: torch.Tensor, q: float) -> torch.Tensor:
    """Exact per-column `q` quantile of `values [N, E]`: the `ceil(q N)`-th smallest value (inverted CDF).

    This is the convention the balancer needs: a bias just above it admits `ceil(q N)` tokens.
    """
    if values.dim() != 2 or values.shape[0] == 0:
        raise ValueError(f"`values` must be a non-empty [N, E], got shape {tuple(values.shape)}")
    if not 0.0 < q <= 1.0:
        raise ValueError(f"`q` must be in (0, 1], got {q!r}")
    N = values.shape[0]
    rank = min(max(int(torch.tensor(q * N, dtype=torch.float64).ceil()), 1), N)
    return values.float().sort(dim=0).values[rank - 1]


def _all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.SUM)
    return t


class RouterBalancer:
    """Balancing state of one MoE router: statistics of the training forwards since the last update.

    `observe` is called by the router; `local_stats` / `apply` split an update so many layers can share one
    all-reduce (`update_moe_balancing`); `step` does one layer on its own.
    """

    def __init__(self, method: str, num_experts: int, top_k: int, bins: int = 256, speed: float = 1e-3):
        if method not in ("quantile", "sign"):
            raise ValueError(f"`method` must be 'quantile' or 'sign', got {method!r}")
        if not 0 < top_k < num_experts:
            raise ValueError(f"`top_k` ({top_k}) must be in [1, num_experts) for balancing")
        self.method, self.num_experts, self.top_k = method, num_experts, top_k
        self.bins, self.speed = bins, speed
        self.reset()

    def reset(self) -> None:
        self.stats: torch.Tensor | None = None  # int64: quantile [E, bins] counts, sign [E] loads
        self.lo = self.hi = None

    @property
    def stats_shape(self) -> tuple[int, ...]:
        return (self.num_experts, self.bins) if self.method == "quantile" else (self.num_experts,)

    @torch.no_grad()
    def observe(self, scores: torch.Tensor, cutoff: torch.Tensor | None, top_idx: torch.Tensor,
                bias: torch.Tensor, valid: torch.Tensor | None = None) -> None:
        """Add one forward's tokens.

        `scores [N, E]` unbiased sigmoid scores, `cutoff [N]` the (k+1)-th biased score (quantile only),
        `top_idx [N, k]` the selected experts (sign only), `bias [E]` the bias they were routed with,
        `valid [N]` bool the real tokens (None: all; padding is routed but not counted).
        """
        if self.method == "quantile":
            if self.lo is None:
                # Fixed for the whole step (the bias only moves in `apply`), so all micro-batches and ranks
                # count into the same bins.
                self.lo, self.hi = histogram_range(bias)
            new = histogram_counts(cutoff.float()[:, None] - scores.float(), self.lo, self.hi, self.bins, valid)
        else:
            new = _bincount(top_idx, self.num_experts, valid)
        self.stats = new if self.stats is None else self.stats + new.to(self.stats.device)

    def local_stats(self, device: torch.device) -> torch.Tensor:
        if self.stats is None:
            # A rank that saw no tokens still joins the all-reduce, with zeros.
            return torch.zeros(self.stats_shape, dtype=torch.long, device=device)
        return self.stats.to(device)

    @torch.no_grad()
    def apply(self, pooled: torch.Tensor, bias: torch.Tensor) -> bool:
        """Write the new bias from pooled statistics into `bias` (in place, fp32). False when there were no tokens."""
        lo, hi = self.lo, self.hi
        self.reset()
        if self.method == "quantile":
            if int(pooled[0].sum()) == 0:
                return False
            if lo is None:  # this rank saw no tokens, the others did: the range is the same on every rank
                lo, hi = histogram_range(bias)
            new = quantile_from_histogram(pooled, self.top_k / self.num_experts, lo, hi)
            new = new - new.mean()  # a common shift changes no routing; centring keeps b bounded
        else:
            load = pooled.double()
            if float(load.sum()) == 0:
                return False
            new = bias.double() + self.speed * torch.sign(load.mean() - load)
        bias.copy_(new.to(device=bias.device, dtype=bias.dtype))
        return True

    def step(self, bias: torch.Tensor) -> bool:
        pooled = _all_reduce_sum(self.local_stats(bias.device))
        return self.apply(pooled, bias)


def _balanced_routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in model.modules() if callable(getattr(m, "moe_balancer", None))]


@torch.no_grad()
def update_moe_balancing(model: torch.nn.Module) -> int:
    """Update the router bias of every MoE layer in `model` from the statistics of the forwards since the last call.

    Call it once after each optimizer step (after all gradient-accumulation micro-batches). Under
    `torch.distributed` every rank must call it: all layers' statistics travel in one integer all-reduce.
    Returns the number of routers whose bias changed (0 when balancing is "none").
    """
    pairs = [(r, r.moe_balancer()) for r in _balanced_routers(model)]
    pairs = [(r, b) for r, b in pairs if b is not None]
    if not pairs:
        return 0
    device = pairs[0][0].e_score_correction_bias.device
    local = [b.local_stats(device) for _, b in pairs]
    pooled = _all_reduce_sum(torch.cat([s.reshape(-1) for s in local]))  # one collective for all layers
    updated = 0
    for (router, balancer), part in zip(pairs, pooled.split([s.numel() for s in local])):
        updated += balancer.apply(part.view(balancer.stats_shape), router.e_score_correction_bias)
    return updated


class MoEBalancingCallback(TrainerCallback):
    """`Trainer` callback: `update_moe_balancing` after every optimizer step (`on_step_end`).

    The model comes from the Trainer (`kwargs["model"]`), or from the constructor when given. Under a wrapped
    model (DDP, PEFT) the routers are found through `.modules()`.
    """

    def __init__(self, model: torch.nn.Module | None = None):
        self.model = model

    def on_step_end(self, args, state, control, model=None, **kwargs):
        target = self.model if self.model is not None else model
        if target is not None:
            update_moe_balancing(target)
        return control


__all__ = [
    "BALANCING_METHODS", "MoEBalancingCallback", "RouterBalancer", "exact_quantile", "histogram_counts",
    "histogram_quantile", "histogram_range", "quantile_from_histogram", "update_moe_balancing",
]
