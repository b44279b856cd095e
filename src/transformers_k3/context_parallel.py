"""Context parallelism (SPEC 7): one long sequence split across ranks, each holding a contiguous segment.

    with context_parallel(group):                      # torch.distributed initialised, one segment a rank
        out = model(input_ids=segment, shift_labels=segment_shift_labels)

Rank r holds tokens [r * T, (r + 1) * T) of every row (same T on every rank). The per-token parts of the model
(embeddings, AttnRes, the MoE, norms) need nothing; three things cross segment boundaries:

- **KDA's short convs** read the W - 1 inputs before the segment: every rank gets its predecessor's tail.
- **KDA's recurrence**: the state entering a segment depends on every earlier token. The recurrence is linear in
  its state, `S_end = M S_in + S~` with `M = prod_t (I - beta_t k_t k_t^T) Diag(alpha_t)` (K x K a head), so each
  rank runs its segment twice through the chunked kernel: its values from a zero state (output o0, final state
  S~), and zero values from the identity state (V = K: output `P_t^T q_t`, final state M). One all-gather of
  (M, S~), a prefix scan over the ranks before this one gives S_in, and `o_t = o0_t + S_in^T P_t^T q_t`. Twice
  the local recurrence work, no sequential dependence between ranks.
- **MLA** attends over every earlier token: the latents (r + dr numbers a token, shared by all heads) are
  all-gathered and expanded locally, under a causal mask offset by the segment's start.

The collectives are autograd-aware (`torch.distributed.nn.functional`), so training works: each rank's parameter
gradients are its segment's share, to be summed over the group (an all-reduce sum; DDP averages instead, so under
DDP over the same group multiply the loss by the group size). The loss of
a segment's last token needs the next segment's first token: build `shift_labels` on the whole sequence and pass
each rank its slice (transformers' loss takes `shift_labels`).

Prefill for generation: with `use_cache=True` every rank ends with the cache of the whole sequence (all the MLA
latents, the KDA states after the last segment, the last segment's conv inputs), so one rank can go on decoding
alone, outside the block. Not supported (raises): a cache that already holds tokens, a static or rollback cache,
padding, packed sequences.
"""

from __future__ import annotations

import contextlib
from contextvars import ContextVar

import torch
import torch.distributed as dist

__all__ = ["context_parallel", "context_parallel_group", "prefill"]

_GROUP: ContextVar = ContextVar("k3_context_parallel_group", default=None)


@contextlib.contextmanager
def context_parallel(group=None):
    """Run the K3 forward (and backward) inside as one sequence split across `group` (default: the world)."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("context_parallel needs torch.distributed initialised (one process a segment)")
    token = _GROUP.set(dist.group.WORLD if group is None else group)
    try:
        yield
    finally:
        _GROUP.reset(token)


def context_parallel_group():
    """The active context-parallel group, or None outside `context_parallel`."""
    return _GROUP.get()


@torch.no_grad()
def prefill(model, input_ids: torch.Tensor, group=None):
    """Prefill a long prompt across the ranks of `group` (every rank passes the same `input_ids [B, N]`) and return
    the cache of its first `n` tokens, the same on every rank: `n` is the largest multiple of the group size below
    N, so `model.generate(input_ids, <cache>=cache)` on any one rank still has a token to feed (plus any rest)."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)  # group None: the default group
    seg = (input_ids.shape[1] - 1) // world
    if seg < 1:
        raise ValueError(f"prefill over {world} ranks needs at least {world + 1} tokens, got {input_ids.shape[1]}")
    from .modeling_kimi_k3 import CACHE_KWARG

    with context_parallel(group):
        out = model(input_ids=input_ids[:, rank * seg:(rank + 1) * seg], use_cache=True, logits_to_keep=1)
    return getattr(out, CACHE_KWARG)


def _gather(t: torch.Tensor, group) -> list[torch.Tensor]:
    """Every rank's `t` in rank order, differentiable (the backward sums each slot's gradients to its owner).

    The backward is a collective too, so every rank must build the same graph around it (the same ops on the
    gathered tensors, whatever its rank), or the ranks' backward passes reach their collectives in different
    orders and hang: what a rank takes by its rank goes through `_pick`, never through a Python branch."""
    from torch.distributed.nn.functional import all_gather

    return list(all_gather(t.contiguous(), group=group))


def _pick(tensors: list[torch.Tensor], group) -> torch.Tensor:
    """`tensors[rank]`, by indexing a stack, so the graph is the same on every rank (see `_gather`)."""
    index = torch.tensor([dist.get_rank(group)], device=tensors[0].device)
    return torch.stack(tensors).index_select(0, index)[0]


def check_segment(T: int, min_tokens: int, group, device) -> None:
    """Every rank holds T tokens, at least `min_tokens` (the short convs' reach back); the same error everywhere.
    `device`: where the group's collectives run (NCCL takes CUDA tensors only)."""
    sizes = [torch.zeros((), dtype=torch.long, device=device) for _ in range(dist.get_world_size(group))]
    dist.all_gather(sizes, torch.tensor(T, dtype=torch.long, device=device), group=group)
    if len({int(s) for s in sizes}) != 1:
        raise ValueError(f"context parallel: every rank must hold the same number of tokens, got "
                         f"{[int(s) for s in sizes]}")
    if T < min_tokens:
        raise ValueError(f"context parallel: the short convs need at least {min_tokens} tokens a segment, got {T}")


def conv_halo(x: torch.Tensor, width: int, group) -> torch.Tensor:
    """x `[B, T, D]` (a short conv's input) -> the predecessor's last `width` inputs as the conv's initial state
    `[B, D, width]` fp32 (zeros on the first rank)."""
    tails = _gather(x[:, x.shape[1] - width:].float().transpose(1, 2), group)  # each [B, D, width]
    return _pick([torch.zeros_like(tails[0])] + tails[:-1], group)


def segment_summary(chunk_kda, q, k, v, g, beta, **kernel_kwargs):
    """What one segment contributes, from two runs of the chunked kernel: (o0 `[B, T, H, V]`, its outputs from a zero
    state; S~ `[B, H, K, V]`, its final state from there; P^T q `[B, T, H, K]`, each output's response to the
    incoming state; M `[B, H, K, K]`, the segment's transition)."""
    B, T, H, K = k.shape
    o0, s_tilde = chunk_kda(q, k, v, g, beta, initial_state=None, output_final_state=True, **kernel_kwargs)
    eye = torch.eye(K, device=k.device, dtype=torch.float32).expand(B, H, K, K).contiguous()  # [B, H, K, K]
    pq, transition = chunk_kda(q, k, torch.zeros_like(k), g, beta, initial_state=eye, output_final_state=True,
                               **kernel_kwargs)
    return o0, s_tilde, pq, transition


def join_segments(o0, pq, transitions, partials, pick):
    """This segment's outputs given every segment's (M, S~) in order: the scan gives the state entering each one
    (`pick` takes this segment's), and the state after the last. -> (`[B, T, H, V]`, `[B, H, K, V]` fp32)."""
    states = [torch.zeros_like(partials[0], dtype=torch.float32)]  # the state entering the first segment
    for m, s in zip(transitions, partials):
        states.append(m.float() @ states[-1] + s.float())  # the state leaving a segment is the one entering the next
    incoming = pick(states[:-1])
    return o0 + torch.einsum("bthk,bhkv->bthv", pq.float(), incoming).to(o0.dtype), states[-1]


def kda(chunk_kda, q, k, v, g, beta, group, **kernel_kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """The KDA core over this rank's segment of a sequence split across `group`: (`[B, T, H, V]` outputs, equal to
    running the whole sequence from a zero state; the state after the whole sequence `[B, H, K, V]` fp32, the same
    on every rank). See the module docstring for the algebra."""
    o0, s_tilde, pq, transition = segment_summary(chunk_kda, q, k, v, g, beta, **kernel_kwargs)
    return join_segments(o0, pq, _gather(transition.float(), group), _gather(s_tilde.float(), group),
                         lambda states: _pick(states, group))


def last_segment(t: torch.Tensor, group) -> torch.Tensor:
    """The last rank's `t` (a short conv's final state, for the cache a context-parallel prefill leaves)."""
    return _gather(t, group)[-1]


def mla_latents(latent: torch.Tensor, group) -> tuple[torch.Tensor, torch.Tensor]:
    """latent `[B, T, r + dr]` of this segment -> (every rank's latents `[B, world * T, r + dr]`, the causal mask
    of this segment's queries over them `[1, 1, T, world * T]`, True = attend)."""
    everything = torch.cat(_gather(latent, group), dim=1)
    T, L = latent.shape[1], everything.shape[1]
    start = dist.get_rank(group) * T
    rows = torch.arange(start, start + T, device=latent.device)
    mask = torch.arange(L, device=latent.device)[None, :] <= rows[:, None]  # [T, L]
    return everything, mask[None, None]
