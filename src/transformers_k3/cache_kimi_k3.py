"""The K3 hybrid cache: a paged latent cache for the MLA layers and fixed-size states for the KDA layers.

MLA layers keep only `[c_kv | k_pe]` (`kv_lora_rank + qk_rope_head_dim` values a token) in pages of
`mla_page_size` tokens. One block table `[B, n_blocks]` maps each sequence's logical blocks to page ids; every
MLA layer has its own page pool indexed by the same ids, so a page id names one span of tokens in all layers
(what prefix sharing across requests needs). Pages are allocated exactly when a sequence crosses a page
boundary, so the cache grows by the latent bytes per token (rounded up to a page) and no more.

KDA layers keep three conv states `[B, H*K, W-1]` (the last inputs of q, k, v) and the fp32 recurrent state
`[B, H, K, V]`, updated in place of the previous ones.

Rolling back (`crop`, what assisted / speculative decoding does after verifying draft tokens): a recurrent state
cannot be un-updated, so a cache built with `rollback_tokens=R` (generate does so for assisted decoding) keeps, for
each KDA layer, the state as it was R tokens before the end of the last forward plus those tokens' inputs (the
projections before the convs, and q, k, v, g, beta as the recurrence consumed them). `crop` then replays the
kept tokens through the torch reference recurrence and rebuilds the conv states; MLA layers only shorten their
length (the pages stay and are overwritten). Cropping further back than R tokens raises. Without
`rollback_tokens` the cache is not croppable and costs nothing extra.

Static (`KimiK3Cache(config, max_cache_len=N)`, what `generate(..., cache_implementation="static")` builds): every
page up to N tokens is allocated at the first write, the write positions live on the device (`device_lengths`,
one `[B]` tensor per MLA layer, with `key_valid [B, N]`, which keys are real tokens), and KDA states are updated in
place. Nothing in a decode step then depends on a host-side length, so the step can be captured once in a CUDA
graph and replayed (`cuda_graph.DecodeGraph`; generate does so on CUDA with `attn_implementation="k3_mla_paged"`).
Static caches cannot be cropped back across rollback windows, reordered (beam search) or grown past N: those raise.

Prefix reuse across calls: `KimiK3PrefixStore` (below) keeps each generate call's cache for the next prompt that
starts with its tokens (multi-turn chat).
"""

from __future__ import annotations

import math

import torch
from transformers.cache_utils import Cache

from .configuration_kimi_k3 import FULL_ATTENTION, LINEAR_ATTENTION


class KimiK3Cache(Cache):
    def __init__(self, config, rollback_tokens: int = 0, max_cache_len: int | None = None):
        # `layers=[]`: the per-layer bookkeeping of the base class does not fit a paged hybrid; every method
        # generate and the model use is implemented here.
        super().__init__(layers=[])
        config = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
        self.config = config
        self.layer_types = list(config.layer_types)
        self.page_size = int(config.mla_page_size)
        self.latent_dim = config.kv_lora_rank + config.qk_rope_head_dim
        self.mla_layers = [i for i, t in enumerate(self.layer_types) if t == FULL_ATTENTION]
        self.kda_layers = [i for i, t in enumerate(self.layer_types) if t == LINEAR_ATTENTION]
        if int(rollback_tokens) < 0:
            raise ValueError(f"rollback_tokens must be >= 0, got {rollback_tokens}")
        self.rollback_tokens = int(rollback_tokens)
        if max_cache_len is not None:
            if isinstance(max_cache_len, bool) or not isinstance(max_cache_len, int) or max_cache_len <= 0:
                raise ValueError(f"max_cache_len must be a positive int or None, got {max_cache_len!r}")
            if self.rollback_tokens:
                raise ValueError("a static KimiK3Cache (max_cache_len) cannot keep rollback windows (rollback_tokens)")
        self.static_len = max_cache_len
        self.reset()

    # bookkeeping -------------------------------------------------------------------------------------------
    def reset(self) -> None:
        self.block_table: torch.Tensor | None = None  # [B, n_blocks] page ids
        # device -> (block_table, its copy there), for MLA layers on other GPUs (see block_table_on)
        self._tables: dict[torch.device, tuple] = {}
        self.num_pages = 0
        self.pools: dict[int, torch.Tensor] = {}  # layer -> [num_pages, page_size, latent_dim]
        self.lengths: dict[int, int] = {i: 0 for i in self.mla_layers}
        self.conv_states: dict[int, tuple[torch.Tensor, ...]] = {}
        self.recurrent_states: dict[int, torch.Tensor] = {}
        self.rollback_windows: dict[int, dict] = {}  # KDA layer -> the last forward's window (see save_rollback)
        self._seen_tokens = 0
        # Static caches only: the lengths again as [B] int64 device tensors, and which cached keys are real tokens.
        self.device_lengths: dict[int, torch.Tensor] = {}
        self._key_valid: dict[torch.device, torch.Tensor] = {}  # [B, static_len] bool per device (key_valid_on)
        self.decode_graph = None  # the captured decode step (cuda_graph.DecodeGraph) of a static cache

    def __len__(self) -> int:
        return len(self.layer_types)

    # Layers may sit on several GPUs (`device_map="auto"`): the page table and the key-padding flags, shared by the
    # MLA layers, are read on each layer's own device.
    def block_table_on(self, device: torch.device) -> torch.Tensor | None:
        """`block_table` on `device`: the table itself, or a copy made once per table (a grown or reordered table
        is a new tensor, so a stale copy is never returned)."""
        table = self.block_table
        if table is None or table.device == device:
            return table
        copy = self._tables.get(device)
        if copy is None or copy[0] is not table:
            copy = self._tables[device] = (table, table.to(device))
        return copy[1]

    def key_valid_on(self, device: torch.device) -> torch.Tensor | None:
        """Static caches: which cached keys are real tokens, `[B, static_len]` bool on `device`. Each device keeps
        its own flags, written by its own layers (every MLA layer writes the same positions and flags)."""
        return self._key_valid.get(device)

    @property
    def key_valid(self) -> torch.Tensor | None:
        return next(iter(self._key_valid.values()), None)

    @property
    def is_sliding(self) -> list[bool]:
        return [False] * len(self.layer_types)

    @property
    def is_linear(self) -> list[bool]:
        return [t == LINEAR_ATTENTION for t in self.layer_types]

    @property
    def is_croppable(self) -> bool:
        return not self.kda_layers or self.rollback_tokens > 0

    @property
    def is_static(self) -> bool:
        return self.static_len is not None

    @property
    def is_compileable(self) -> bool:
        # What transformers' generate asks before it swaps the decode step for `get_compiled_call` (a CUDA graph
        # replay here, see the K3 generation mixin).
        return self.is_static

    @property
    def max_batch_size(self):
        if self.block_table is not None:
            return self.block_table.shape[0]
        return self._state_batch() or None

    def check_batch(self, batch: int) -> None:
        held = self.max_batch_size
        if held is not None and held != batch:
            raise ValueError(f"KimiK3Cache holds {held} sequences but the input has batch size {batch}")

    @property
    def max_cache_len(self):
        return self.static_len if self.is_static else -1

    def get_seq_length(self, layer_idx: int | None = 0) -> int:
        # Sequence length is counted on attention layers only: KDA layers have no length.
        if self.mla_layers:
            return self.lengths[self.mla_layers[0]]
        return self._seen_tokens

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return -1

    def get_max_cache_shape(self, layer_idx: int = 0) -> int:
        return -1

    def has_previous_state(self, layer_idx: int | None = None, state_idx: int | None = None) -> bool:
        if layer_idx is None:
            return bool(self.recurrent_states) or self.get_seq_length() > 0
        return layer_idx in self.recurrent_states

    def get_mask_sizes(self, query_length, layer_idx: int = 0) -> tuple[int, int]:
        if isinstance(query_length, torch.Tensor):  # older releases pass cache_position
            query_length = query_length.shape[0]
        return self.get_seq_length() + int(query_length), 0

    def get_query_offset(self, layer_idx: int = 0) -> int:
        return self.get_seq_length()

    # MLA: paged latent --------------------------------------------------------------------------------------
    def _ensure_blocks(self, batch: int, end: int, device) -> None:
        if self.is_static:
            if end > self.static_len:
                raise ValueError(f"KimiK3Cache(max_cache_len={self.static_len}) cannot hold {end} tokens")
            end = self.static_len  # every page at once: nothing is allocated inside a captured step
        need = math.ceil(end / self.page_size)
        if self.block_table is None:
            self.block_table = torch.empty(batch, 0, dtype=torch.long, device=device)
        if self.block_table.shape[0] != batch:
            raise ValueError(
                f"KimiK3Cache holds {self.block_table.shape[0]} sequences but the input has batch size {batch}"
            )
        have = self.block_table.shape[1]
        if need > have:
            new = torch.arange(self.num_pages, self.num_pages + batch * (need - have), device=self.block_table.device)
            self.block_table = torch.cat([self.block_table, new.view(batch, need - have)], dim=1)
            self.num_pages += batch * (need - have)

    def _pool(self, layer_idx: int, like: torch.Tensor) -> torch.Tensor:
        pool = self.pools.get(layer_idx)
        if pool is None:
            pool = like.new_zeros(0, self.page_size, self.latent_dim)
        if pool.shape[0] < self.num_pages:
            grow = like.new_zeros(self.num_pages - pool.shape[0], self.page_size, self.latent_dim)
            pool = torch.cat([pool, grow], dim=0)
        self.pools[layer_idx] = pool
        return pool

    def append_latent(self, layer_idx: int, latent: torch.Tensor, key_valid: torch.Tensor | None = None) -> None:
        """Write `latent [B, T, latent_dim]` into `layer_idx`'s pages. Kernels that read the pages through the block
        table (the `k3_mla_paged` attention) need nothing more; `update_latent` also gathers the whole latent.
        `key_valid [B, T]` bool (None: all real) marks padding; static caches keep it for their decode steps."""
        batch, t, dim = latent.shape
        if dim != self.latent_dim:
            raise ValueError(f"latent must have {self.latent_dim} channels, got {dim}")
        start = self.lengths[layer_idx]
        end = start + t
        self._ensure_blocks(batch, end, latent.device)
        pool = self._pool(layer_idx, latent)
        if self.is_static:
            # Positions from the device lengths, so a captured step writes where the replayed step is.
            if layer_idx not in self.device_lengths:
                self.device_lengths[layer_idx] = torch.full((batch,), start, dtype=torch.long, device=latent.device)
            if latent.device not in self._key_valid:
                self._key_valid[latent.device] = torch.ones(batch, self.static_len, dtype=torch.bool,
                                                            device=latent.device)
            pos = self.device_lengths[layer_idx][:, None] + torch.arange(t, device=latent.device)  # [B, T]
        else:
            pos = torch.arange(start, end, device=latent.device).expand(batch, t)  # [B, T]
        pages = self.block_table_on(latent.device).gather(1, pos // self.page_size)  # [B, T]
        pool[pages, pos % self.page_size] = latent.to(pool.dtype)
        if self.is_static:
            valid = torch.ones_like(pos, dtype=torch.bool) if key_valid is None else key_valid.to(torch.bool)
            self._key_valid[latent.device].scatter_(1, pos, valid)
            self.device_lengths[layer_idx] += t
        self.lengths[layer_idx] = end

    def advance(self, tokens: int) -> None:
        """Host-side bookkeeping of `tokens` more tokens written on the device by a replayed decode step (the step's
        device work, `device_lengths` included, is in the graph; its Python side ran once, at capture)."""
        for layer in self.mla_layers:
            self.lengths[layer] += tokens

    def update_latent(self, layer_idx: int, latent: torch.Tensor, key_valid: torch.Tensor | None = None) -> torch.Tensor:
        """Append `latent [B, T, latent_dim]` for `layer_idx`; return all of that layer's latent `[B, L, latent_dim]`."""
        self.append_latent(layer_idx, latent, key_valid)
        end, batch = self.lengths[layer_idx], latent.shape[0]
        n_blocks = math.ceil(end / self.page_size)
        gathered = self.pools[layer_idx][self.block_table_on(latent.device)[:, :n_blocks]]  # [B, n_blocks, page, dim]
        return gathered.reshape(batch, n_blocks * self.page_size, self.latent_dim)[:, :end]

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        raise NotImplementedError(
            "KimiK3Cache stores MLA latents, not expanded keys and values: use `update_latent`."
        )

    # KDA: conv and recurrent state ---------------------------------------------------------------------------
    def get_kda_state(self, layer_idx: int):
        return self.conv_states.get(layer_idx), self.recurrent_states.get(layer_idx)

    def update_kda_state(self, layer_idx: int, conv_states: tuple[torch.Tensor, ...], recurrent: torch.Tensor):
        held = self.conv_states.get(layer_idx)
        if self.is_static and held is not None:
            # In place: a captured step must leave the states where the next replay reads them.
            for dst, src in zip(held, conv_states):
                dst.copy_(src)
            if recurrent is not self.recurrent_states[layer_idx]:  # the Triton decode already wrote it in place
                self.recurrent_states[layer_idx].copy_(recurrent)
            return
        self.conv_states[layer_idx] = tuple(s.float() for s in conv_states)
        self.recurrent_states[layer_idx] = recurrent.float()

    def save_rollback(self, layer_idx: int, conv_states, recurrent, conv_inputs, kda_inputs) -> None:
        """What `crop` needs to roll layer `layer_idx` back into its last `len` tokens: the conv states
        `[B, D, W-1]` and recurrent state `[B, H, K, V]` (or None: fresh) before them, their pre-conv projections
        `(x_q, x_k, x_v)` `[B, n, D]` and the recurrence inputs `(q, k, v, g, beta)` `[B, n, ...]`."""
        self.rollback_windows[layer_idx] = {
            "conv": conv_states, "recurrent": recurrent, "conv_inputs": conv_inputs, "kda_inputs": kda_inputs,
            "len": kda_inputs[0].shape[1],
        }

    def _roll_back_kda(self, layer_idx: int, remove: int) -> None:
        from k3_kernels.kda.reference import fused_recurrent_kda  # the exact recurrence, on any device

        win = self.rollback_windows.get(layer_idx)
        if win is None or remove > win["len"]:
            raise ValueError(
                f"KimiK3Cache.crop: cannot roll KDA layer {layer_idx} back {remove} tokens; it keeps the last "
                f"{0 if win is None else win['len']} (rollback_tokens={self.rollback_tokens} of the last forward)"
            )
        keep = win["len"] - remove
        conv = []
        for state, x in zip(win["conv"], win["conv_inputs"]):  # state [B, D, W-1], x [B, n, D]
            full = torch.cat([state, x[:, :keep].float().transpose(1, 2)], dim=-1)  # [B, D, W-1 + keep]
            conv.append(full[..., full.shape[-1] - state.shape[-1]:].contiguous())
        q, k, v, g, beta = (t[:, :keep] for t in win["kda_inputs"])
        if keep:
            _, recurrent = fused_recurrent_kda(q, k, v, g, beta, initial_state=win["recurrent"],
                                               output_final_state=True, use_qk_l2norm_in_kernel=True)
        elif win["recurrent"] is not None:
            recurrent = win["recurrent"].clone()
        else:
            B, _, H, K = q.shape
            recurrent = torch.zeros(B, H, K, v.shape[-1], dtype=torch.float32, device=q.device)
        self.conv_states[layer_idx] = tuple(conv)
        self.recurrent_states[layer_idx] = recurrent.float()
        # The window now ends where the cache does: a second crop can go further back inside it.
        win["conv_inputs"] = tuple(x[:, :keep] for x in win["conv_inputs"])
        win["kda_inputs"] = (q, k, v, g, beta)
        win["len"] = keep

    def get_conv_state(self, layer_idx: int, state_idx: int = 0):
        states = self.conv_states.get(layer_idx)
        return None if states is None else states[state_idx]

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0):
        return self.recurrent_states.get(layer_idx)

    def snapshot_kda(self) -> dict:
        """A copy of every KDA state (conv and recurrent): what prefix reuse stores at a block boundary."""
        return {
            "conv": {i: tuple(s.clone() for s in v) for i, v in self.conv_states.items()},
            "recurrent": {i: v.clone() for i, v in self.recurrent_states.items()},
        }

    def restore_kda(self, snapshot: dict) -> None:
        self.conv_states = {i: tuple(s.clone() for s in v) for i, v in snapshot["conv"].items()}
        self.recurrent_states = {i: v.clone() for i, v in snapshot["recurrent"].items()}

    # batch operations (beam search, contrastive search, num_return_sequences) -----------------------------
    def _select_rows(self, index: torch.Tensor) -> None:
        if self.is_static and (self.block_table is not None or self.recurrent_states):
            raise NotImplementedError(
                "a static KimiK3Cache cannot reorder or select its rows (beam search, contrastive search): its "
                "buffers are captured by the decode graph; use the default cache for those generation modes"
            )
        if self.block_table is not None:
            n_blocks = self.block_table.shape[1]
            table = self.block_table.index_select(0, index.to(self.block_table.device))  # [B', n_blocks]
            # Rows may now share pages; copy them into fresh, private pages so later appends cannot collide.
            for layer, pool in self.pools.items():
                self.pools[layer] = pool[table.reshape(-1).to(pool.device)].clone()
            self.num_pages = table.numel()
            self.block_table = torch.arange(self.num_pages, device=table.device).view(-1, n_blocks)
        for layer, states in self.conv_states.items():
            self.conv_states[layer] = tuple(s.index_select(0, index.to(s.device)) for s in states)
        for layer, state in self.recurrent_states.items():
            self.recurrent_states[layer] = state.index_select(0, index.to(state.device))
        self.rollback_windows = {}  # they describe the old rows: a later crop raises instead of mixing them

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._select_rows(beam_idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        rows = self.block_table.shape[0] if self.block_table is not None else self._state_batch()
        self._select_rows(torch.arange(rows).repeat_interleave(repeats))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._select_rows(indices)

    def _state_batch(self) -> int:
        for state in self.recurrent_states.values():
            return state.shape[0]
        return 0

    def crop(self, tokens: int) -> None:
        """`crop(-n)` removes the last n tokens (what transformers' generate calls; `crop(0)` is a no-op);
        `crop(n)` with n > 0, transformers' legacy form, keeps the first n."""
        length = self.get_seq_length()
        if tokens == 0:
            return
        max_length = max(length + tokens, 0) if tokens < 0 else tokens
        if max_length >= length:
            return
        if self.kda_layers:
            if not self.rollback_tokens:
                raise NotImplementedError(
                    "KimiK3Cache cannot crop: KDA recurrent states cannot be un-updated; build the cache with "
                    "KimiK3Cache(config, rollback_tokens=N) to keep what rolling back the last N tokens needs "
                    "(generate does this for assisted decoding)"
                )
            for layer in self.kda_layers:
                self._roll_back_kda(layer, length - max_length)
        for layer in self.mla_layers:
            self.lengths[layer] = max_length
            if layer in self.device_lengths:
                self.device_lengths[layer].fill_(max_length)

    # memory accounting ----------------------------------------------------------------------------------------
    def nbytes(self) -> dict[str, int]:
        mla = sum(p.numel() * p.element_size() for p in self.pools.values())
        kda = sum(s.numel() * s.element_size() for v in self.conv_states.values() for s in v)
        kda += sum(s.numel() * s.element_size() for s in self.recurrent_states.values())
        return {"mla": mla, "kda": kda}


class KimiK3PrefixStore:
    """Reuse what earlier `generate` calls computed (SPEC 7's prefix caching, within one process).

    A multi-turn chat re-sends the whole conversation each turn, which would be prefilled again every time. The
    store keeps each call's cache keyed by the tokens it holds (the prompt and every generated token but the last,
    which was never fed); a later prompt that starts with stored tokens gets a copy of that cache, so only the rest
    is prefilled (bit for bit the same output: tested). KDA states can only resume where they were kept, so an
    entry is a whole processed sequence (a turn's end), and a hit is the longest stored prefix of the prompt.
    Entries are compared token by token (a handful of conversations; a serving engine would hash 512-token blocks)
    and evicted least recently used beyond `max_entries` (each holds a cache: MLA latents and KDA states).

        store = KimiK3PrefixStore()
        out = store.generate(model, input_ids, max_new_tokens=256)   # as model.generate, one row

    Not with a static cache, assisted decoding or several rows (those raise).
    """

    def __init__(self, max_entries: int = 4):
        if isinstance(max_entries, bool) or not isinstance(max_entries, int) or max_entries < 1:
            raise ValueError(f"max_entries must be a positive int, got {max_entries!r}")
        self.max_entries = max_entries
        self._entries: dict[tuple[int, ...], KimiK3Cache] = {}  # insertion order = least recently used first

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, ids: list[int]) -> tuple[KimiK3Cache | None, int]:
        """(a copy of the cache of the longest stored prefix of `ids` shorter than `ids`, its length), or (None, 0)."""
        import copy

        best = max((key for key in self._entries if len(key) < len(ids) and tuple(ids[: len(key)]) == key),
                   key=len, default=None)
        if best is None:
            return None, 0
        self._entries[best] = self._entries.pop(best)  # most recently used
        return copy.deepcopy(self._entries[best]), len(best)

    def generate(self, model, input_ids: torch.Tensor, **kwargs):
        from .modeling_kimi_k3 import CACHE_KWARG

        if input_ids.dim() != 2 or input_ids.shape[0] != 1:
            raise ValueError(f"KimiK3PrefixStore.generate takes one row of input_ids, got {tuple(input_ids.shape)}")
        supplied = [k for k in ("past_key_values", "cache", "cache_implementation", "assistant_model",
                                "prompt_lookup_num_tokens") if kwargs.get(k) is not None]
        if supplied:
            raise ValueError(f"KimiK3PrefixStore.generate supplies the cache itself; it does not take {supplied}")
        if kwargs.get("num_beams", 1) != 1 or kwargs.get("num_return_sequences", 1) != 1:
            raise ValueError("KimiK3PrefixStore.generate produces one sequence (num_beams = num_return_sequences = 1)")
        want_dict = kwargs.pop("return_dict_in_generate", False)
        cache, _ = self.lookup(input_ids[0].tolist())
        if cache is not None:
            kwargs[CACHE_KWARG] = cache
        out = model.generate(input_ids, return_dict_in_generate=True, **kwargs)
        key = tuple(out.sequences[0, :-1].tolist())
        self._entries.pop(key, None)
        # The output's field follows the keyword's rename (`past_key_values` -> `cache`), not always in step.
        returned = getattr(out, "cache", None)
        self._entries[key] = returned if returned is not None else out.past_key_values
        while len(self._entries) > self.max_entries:
            self._entries.pop(next(iter(self._entries)))
        return out if want_dict else out.sequences


__all__ = ["KimiK3Cache", "KimiK3PrefixStore"]
