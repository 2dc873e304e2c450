"""Reference engine: mirrors engine/src/{geometry,kv_state,admission,transfer,attention,engine}.cpp op for op.

KV-cache layout (frozen): ``[num_blocks, num_kv_heads, 2, block_size, head_size]`` (2: 0 = K, 1 = V).
Counters use the native snapshot's names, so a snapshot and ``RefEngine.counters`` compare key by key.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

# Counters that are exact event counts (compared bit for bit); the native snapshot also carries histograms and info.
COUNTERS = (
    "build_calls",
    "kv_update_calls",
    "forward_calls",
    "forward_skipped",
    "request_rows",
    "tokens_written",
    "padding_slots",
    "write_through_tokens",
    "blocks_admitted",
    "blocks_evicted",
    "blocks_hit",
    "bytes_h2d",
    "bytes_d2h",
    "tiles_computed",
    "host_rebinds",
    "compressed_rows",
    "compressed_context_blocks",
    "selected_blocks",
    "union_blocks",
    "planned_blocks",
    "planned_tiles",
    "blocks_in_place",
    "decode_batch_rows",  # the CUDA decode batch (the native kernel's); the ATen path the reference mirrors: always 0
)


@dataclass
class RefPlan:
    """A step plan: query_start_loc [B + 1], seq_lens [B], block_table [B, W], all int32 on CPU."""

    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    num_reqs: int
    num_actual_tokens: int


@dataclass
class RefLayer:
    pool: torch.Tensor
    key_min: torch.Tensor | None = None
    key_max: torch.Tensor | None = None
    host: torch.Tensor | None = None
    host_blocks: int = 0
    slot_of_block: list[int] = field(default_factory=list)
    block_of_slot: list[int] = field(default_factory=list)
    last_use: list[int] = field(default_factory=list)
    pins: list[int] = field(default_factory=list)


def group_query(q: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """[Lq, H, D] -> float32 [KVH, G * Lq, D] (attention.cpp group_query)."""
    lq, h, d = q.shape
    g = h // num_kv_heads
    return q.to(torch.float32).reshape(lq, num_kv_heads, g, d).permute(1, 2, 0, 3).reshape(num_kv_heads, g * lq, d)


def ungroup_output(out: torch.Tensor, num_q_tokens: int) -> torch.Tensor:
    """[KVH, G * Lq, D] -> [Lq, H, D] (attention.cpp ungroup_output)."""
    kvh, rows, d = out.shape
    g = rows // num_q_tokens
    return out.view(kvh, g, num_q_tokens, d).permute(2, 0, 1, 3).reshape(num_q_tokens, kvh * g, d)


def tile_mask(first_query_pos: int, num_q_tokens: int, key_start: int, num_keys: int,
              device: torch.device | str = "cpu") -> torch.Tensor:
    """bool [Lq, num_keys]: True where key_pos > query_pos (attention.cpp tile_mask)."""
    qpos = torch.arange(first_query_pos, first_query_pos + num_q_tokens, dtype=torch.int64, device=device)
    kpos = torch.arange(key_start, key_start + num_keys, dtype=torch.int64, device=device)
    return kpos.unsqueeze(0).gt(qpos.unsqueeze(1))


def online_softmax_init(kvh: int, rows: int, d: int, device: torch.device | str = "cpu") -> list[torch.Tensor]:
    return [
        torch.full((kvh, rows, 1), float("-inf"), dtype=torch.float32, device=device),
        torch.zeros((kvh, rows, 1), dtype=torch.float32, device=device),
        torch.zeros((kvh, rows, d), dtype=torch.float32, device=device),
    ]


def gather_tile(kv: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """[nb, KVH, 2, bs, D] at slots -> [KVH, 2, n, bs, D] (attention.cpp gather_tile)."""
    return kv.permute(1, 2, 0, 3, 4).index_select(2, slots)


def online_softmax_tile(st: list[torch.Tensor], qg: torch.Tensor, tile: torch.Tensor, mask: torch.Tensor,
                        scale: float) -> None:
    """Fold one head-major tile [KVH, 2, n, bs, D] into st = [m, l, acc] (attention.cpp online_softmax_tile)."""
    kvh, rows, d = qg.shape
    n, bs = tile.shape[2], tile.shape[3]
    lq = mask.shape[-2]
    g = rows // lq
    k = tile.select(1, 0).reshape(kvh, n * bs, d).to(torch.float32)
    unseen = mask.all(-2).reshape(-1, n * bs, 1)  # keys no query row sees: V = 0 (their slots may hold anything)
    v = tile.select(1, 1).reshape(kvh, n * bs, d).to(torch.float32).masked_fill(unseen, 0.0)
    s = torch.matmul(qg, k.transpose(1, 2))
    s.mul_(scale)
    s.view(kvh, g, lq, n * bs).masked_fill_(mask, float("-inf"))
    m, l, acc = st
    m_new = torch.maximum(m, s.amax(-1, True))
    m_safe = m_new.masked_fill(m_new.isneginf(), 0.0)
    p = torch.sub(s, m_safe).exp_()
    alpha = torch.sub(m, m_safe).exp_()
    st[1] = torch.add(torch.mul(l, alpha), p.sum(-1, True))
    st[2] = torch.add(torch.mul(acc, alpha), probs_times_values(p, v, mask, g))
    st[0] = m_new


def probs_times_values(p: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, g: int) -> torch.Tensor:
    """P x V of one tile, where a key some rows see and others do not, with a NaN or inf in its V, reaches only the
    rows that see it (attention.cpp probs_times_values)."""
    kvh, rows, keys = p.shape
    lq = mask.shape[-2]
    if lq == 1:
        return torch.matmul(p, v)
    bad = v.isfinite().all(-1).logical_not().logical_and(mask.any(-2).reshape(-1, keys))
    if not bad.any().item():
        return torch.matmul(p, v)
    pv = torch.matmul(p, v.masked_fill(bad.unsqueeze(-1), 0.0))
    idx = bad.nonzero()
    heads, cols = idx.select(1, 0), idx.select(1, 1)
    seen = mask.logical_not().expand(kvh, g, lq, keys).reshape(kvh, rows, keys)
    seen_bad = seen[heads, :, cols].unsqueeze(-1)
    p_bad = p[heads, :, cols].unsqueeze(-1)
    v_bad = v[heads, cols].unsqueeze(1)
    return pv.index_add_(0, heads, torch.where(seen_bad, p_bad * v_bad, 0.0))


def tiled_attention(q: torch.Tensor, kv: torch.Tensor, seq_len: int, tile_blocks: int, scale: float) -> torch.Tensor:
    """One request row over a block-layout KV without a pool (attention.cpp tiled_attention)."""
    lq = q.shape[0]
    kvh, bs = kv.shape[1], kv.shape[3]
    qg = group_query(q, kvh)
    st = online_softmax_init(kvh, qg.shape[1], q.shape[2], q.device)
    nb = (seq_len + bs - 1) // bs
    for start in range(0, nb, tile_blocks):
        n = min(nb, start + tile_blocks) - start
        mask = tile_mask(seq_len - lq, lq, start * bs, n * bs, q.device)
        online_softmax_tile(st, qg, kv.narrow(0, start, n).permute(1, 2, 0, 3, 4), mask, scale)
    return ungroup_output(torch.div(st[2], st[1]), lq)


def quest_scores(q: torch.Tensor, key_min: torch.Tensor, key_max: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Quest bound of candidate blocks -> float32 [KVH, C] (admission.cpp quest_scores)."""
    kvh, d = key_min.shape[1], key_min.shape[2]
    g = q.shape[1] // kvh
    kmin = key_min.index_select(0, ids).to(torch.float32).permute(1, 2, 0)
    kmax = key_max.index_select(0, ids).to(torch.float32).permute(1, 2, 0)
    qf = q.to(torch.float32).reshape(kvh, g, d)
    bound = torch.add(torch.matmul(qf.clamp_min(0.0), kmax), torch.matmul(qf.clamp_max(0.0), kmin))
    return bound.amax(1)


def top_blocks(score: torch.Tensor, k: int) -> torch.Tensor:
    """Positions of the k highest scores per head, ties by lowest position, ascending (admission.cpp top_blocks)."""
    inf = float("inf")
    s = torch.nan_to_num(score, inf, inf, -inf)
    kth = torch.topk(s, k, dim=1, largest=True, sorted=True)[0].narrow(1, k - 1, 1)
    above = s.gt(kth)
    tied = s.eq(kth)
    room = above.sum(1, keepdim=True).neg().add(k)
    chosen = above.logical_or(tied.logical_and(tied.cumsum(1).le(room)))
    return chosen.nonzero().select(1, 1).reshape(score.shape[0], k)


def select_blocks(q: torch.Tensor, key_min: torch.Tensor, key_max: torch.Tensor, row_blocks: torch.Tensor,
                  sink_blocks: int, recent_blocks: int, top_k: int) -> torch.Tensor:
    """Quest selection of one decode row -> int64 [KVH, sink + k + recent] positions (admission.cpp select_blocks)."""
    nb = row_blocks.shape[0]
    kvh = key_min.shape[1]
    cand = nb - sink_blocks - recent_blocks
    ids = row_blocks.narrow(0, sink_blocks, cand)
    top = top_blocks(quest_scores(q, key_min, key_max, ids), top_k)
    sinks = torch.arange(0, sink_blocks, dtype=torch.int64, device=q.device).expand(kvh, sink_blocks)
    recents = torch.arange(nb - recent_blocks, nb, dtype=torch.int64, device=q.device).expand(kvh, recent_blocks)
    return torch.cat([sinks, top.add(sink_blocks), recents], 1)


class RefEngine:
    """Reference of activekv._backend.Engine, exact and compressed modes.

    ``device`` is the pool's device, as the engine's. On CUDA the host tier (kv_cache) is either on that device
    (resident) or pinned CPU memory (tiered); the reference copies the same bytes with plain ops (no staging stream),
    which changes no value.
    """

    def __init__(self, num_layers: int, num_heads: int, num_kv_heads: int, head_size: int, block_size: int,
                 dtype: torch.dtype, pool_blocks: int, tile_blocks: int, mode: str = "exact",
                 budget_tokens: int = 2048, sink_blocks: int = 1, recent_blocks: int = 2, kernel: str = "aten",
                 device: torch.device | str = "cpu", placement: str = "pool", dense_layers: int = 0) -> None:
        if kernel != "aten":
            raise ValueError(f"the reference mirrors the ATen tile path only, got kernel={kernel!r}")
        if placement not in ("pool", "in_place"):
            raise ValueError(f"placement must be 'pool' or 'in_place', got {placement!r}")
        if placement == "in_place" and (torch.device(device).type not in ("cpu", "cuda") or pool_blocks != 0):
            raise ValueError("placement 'in_place' needs the CPU or a CUDA device, and pool_blocks 0")
        # engine.h Placement: in place, a unit's blocks are read where they are in the host tier (no pool, no copy)
        self.in_place = placement == "in_place"
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:  # as the engine: pin the current device's index
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.mode, self.sink_blocks, self.recent_blocks = mode, sink_blocks, recent_blocks
        if mode == "compressed" and not 0 <= dense_layers <= num_layers:
            raise ValueError(f"dense_layers must be in [0, num_layers = {num_layers}], got {dense_layers}")
        self.dense_layers = dense_layers  # engine.h EngineConfig: the first layers attend every block
        self.top_k = budget_tokens // block_size - sink_blocks - recent_blocks
        self.selection: list[dict[int, torch.Tensor]] = [{} for _ in range(num_layers)]
        self.num_layers, self.num_heads, self.num_kv_heads = num_layers, num_heads, num_kv_heads
        self.head_size, self.block_size, self.dtype = head_size, block_size, dtype
        self.pool_blocks, self.tile_blocks = pool_blocks, tile_blocks
        self.counters = {name: 0 for name in COUNTERS}
        self.clock = 0
        shape = (pool_blocks, num_kv_heads, 2, block_size, head_size)
        self.layers = [
            RefLayer(pool=torch.zeros(shape, dtype=dtype, device=self.device), block_of_slot=[-1] * pool_blocks,
                     last_use=[0] * pool_blocks, pins=[0] * pool_blocks)
            for _ in range(num_layers)
        ]

    @property
    def bytes_per_block(self) -> int:
        elem = torch.empty((), dtype=self.dtype).element_size()
        return self.num_kv_heads * 2 * self.block_size * self.head_size * elem

    def blocks_for(self, length: int) -> int:
        return (length + self.block_size - 1) // self.block_size

    def _host(self, layer: int, kv_cache: torch.Tensor) -> torch.Tensor:
        """kv_state.cpp bind_host."""
        nb = kv_cache.shape[0]
        host = kv_cache.view(nb, self.num_kv_heads, 2, self.block_size, self.head_size)
        lay = self.layers[layer]
        if lay.host is None or lay.host.data_ptr() != host.data_ptr() or lay.host_blocks != nb:
            if lay.host is not None:
                self.counters["host_rebinds"] += 1
            lay.host, lay.host_blocks = host, nb
            lay.slot_of_block = [-1] * nb
            lay.block_of_slot = [-1] * self.pool_blocks
            lay.last_use = [0] * self.pool_blocks
            lay.pins = [0] * self.pool_blocks
            if self.mode != "compressed":  # exact mode never reads key metadata: the engine keeps none (kv_state.h)
                return host
            meta = {"dtype": self.dtype, "device": self.device}  # key metadata in the KV dtype (kv_state.h)
            lay.key_min = torch.full((nb, self.num_kv_heads, self.head_size), float("inf"), **meta)
            lay.key_max = torch.full((nb, self.num_kv_heads, self.head_size), float("-inf"), **meta)
        return host

    def build(self, query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor,
              num_reqs: int, num_actual_tokens: int) -> RefPlan:
        n = num_reqs
        self.counters["build_calls"] += 1
        self.counters["request_rows"] += n
        # step_plan.cpp plan_step: the block ids of every row with query tokens, and the exact tiles of the rows that
        # do not select, planned once per step.
        qsl, sl = query_start_loc[: n + 1].tolist(), seq_lens[:n].tolist()
        per_head = self.sink_blocks + self.top_k + self.recent_blocks
        for r in range(n):
            lq, nb = qsl[r + 1] - qsl[r], self.blocks_for(sl[r])
            if lq == 0:
                continue
            self.counters["planned_blocks"] += nb
            if not (self.mode == "compressed" and lq == 1 and nb > per_head):
                self.counters["planned_tiles"] += -(-nb // self.tile_blocks)
        return RefPlan(query_start_loc[: n + 1].to(torch.int32).clone(), seq_lens[:n].to(torch.int32).clone(),
                       block_table[:n].to(torch.int32).clone(), n, num_actual_tokens)

    def update_kv(self, layer: int, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                  slot_mapping: torch.Tensor) -> None:
        """engine.cpp update_kv + kv_state.cpp write."""
        host = self._host(layer, kv_cache)
        lay = self.layers[layer]
        self.counters["kv_update_calls"] += 1
        bs = self.block_size
        tok, blk, off, reset = [], [], [], []
        for i, s in enumerate(slot_mapping.to(torch.int64).tolist()):
            if s == -1:
                self.counters["padding_slots"] += 1
                continue
            tok.append(i)
            blk.append(s // bs)
            off.append(s % bs)
            if s % bs == 0:
                reset.append(s // bs)
        if not tok:
            return
        nt = len(tok)
        dev = self.device
        blk_t = torch.tensor(blk, dtype=torch.int64, device=dev)
        off_t = torch.tensor(off, dtype=torch.int64, device=dev)
        k = key.index_select(0, torch.tensor(tok, dtype=torch.int64, device=dev))
        v = value.index_select(0, torch.tensor(tok, dtype=torch.int64, device=dev))
        if host.device == dev:
            host.select(2, 0)[blk_t, :, off_t] = k
            host.select(2, 1)[blk_t, :, off_t] = v
        else:  # tiered: the new tokens go back to the pinned host tier
            hb, ho = blk_t.to(host.device), off_t.to(host.device)
            host.select(2, 0)[hb, :, ho] = k.to(host.device)
            host.select(2, 1)[hb, :, ho] = v.to(host.device)
            self.counters["bytes_d2h"] += 2 * k.numel() * k.element_size()
        self.counters["tokens_written"] += nt
        wt = [(i, lay.slot_of_block[b], off[i]) for i, b in enumerate(blk) if lay.slot_of_block[b] >= 0]
        if wt:
            pos = torch.tensor([w[0] for w in wt], dtype=torch.int64, device=dev)
            slot_t = torch.tensor([w[1] for w in wt], dtype=torch.int64, device=dev)
            woff_t = torch.tensor([w[2] for w in wt], dtype=torch.int64, device=dev)
            lay.pool.select(2, 0)[slot_t, :, woff_t] = k.index_select(0, pos)
            lay.pool.select(2, 1)[slot_t, :, woff_t] = v.index_select(0, pos)
            self.counters["write_through_tokens"] += len(wt)
        if lay.key_min is None:  # exact mode: no key metadata
            return
        if reset:
            reset_t = torch.tensor(reset, dtype=torch.int64, device=dev)
            lay.key_min.index_fill_(0, reset_t, float("inf"))
            lay.key_max.index_fill_(0, reset_t, float("-inf"))
        kvd = self.num_kv_heads * self.head_size
        kd = k.reshape(nt, kvd)
        index = blk_t.unsqueeze(1).expand(nt, kvd)
        lay.key_min.view(lay.host_blocks, kvd).scatter_reduce_(0, index, kd, "amin", include_self=True)
        lay.key_max.view(lay.host_blocks, kvd).scatter_reduce_(0, index, kd, "amax", include_self=True)

    def _admit(self, lay: RefLayer, blocks: list[int]) -> tuple[list[int], list[int], list[int], int, int]:
        """admission.cpp admit_tile: lowest free slot, else LRU unpinned (lowest slot on a tie)."""
        slots, miss_b, miss_s, hits, evicted = [], [], [], 0, 0
        for b in blocks:
            s = lay.slot_of_block[b]
            if s >= 0:
                hits += 1
            else:
                free = [i for i, x in enumerate(lay.block_of_slot) if x < 0]
                if free:
                    s = free[0]
                else:
                    s = -1
                    for i in range(self.pool_blocks):
                        if lay.pins[i] == 0 and (s < 0 or lay.last_use[i] < lay.last_use[s]):
                            s = i
                    lay.slot_of_block[lay.block_of_slot[s]] = -1
                    evicted += 1
                lay.block_of_slot[s] = b
                lay.slot_of_block[b] = s
                miss_b.append(b)
                miss_s.append(s)
            self.clock += 1
            lay.last_use[s] = self.clock
            lay.pins[s] += 1
            slots.append(s)
        return slots, miss_b, miss_s, hits, evicted

    def forward(self, layer: int, plan: RefPlan, query: torch.Tensor, kv_cache: torch.Tensor,
                output: torch.Tensor, scale: float) -> None:
        """engine.cpp forward."""
        host = self._host(layer, kv_cache)
        lay = self.layers[layer]
        self.counters["forward_calls"] += 1
        out3 = output.view(output.shape[0], self.num_heads, self.head_size)
        qsl, sl, bt = plan.query_start_loc.tolist(), plan.seq_lens.tolist(), plan.block_table
        self.selection[layer] = {}
        per_head = self.sink_blocks + self.top_k + self.recent_blocks
        for r in range(plan.num_reqs):
            q0, lq, seq = qsl[r], qsl[r + 1] - qsl[r], sl[r]
            if lq == 0:
                continue
            nb = self.blocks_for(seq)
            q = query.narrow(0, q0, lq)
            qg = group_query(q, self.num_kv_heads)
            st = online_softmax_init(self.num_kv_heads, qg.shape[1], self.head_size, self.device)
            row = bt[r, :nb].tolist()
            # engine.cpp forward: a dense layer takes the step's plan without selection (StepPlan::dense)
            if self.mode == "compressed" and layer >= self.dense_layers and lq == 1 and nb > per_head:
                self._attend_selected(layer, lay, host, row, seq, r, q, qg, st, scale)
            else:
                self._attend_exact(lay, host, row, seq, lq, qg, st, scale)
            out3.narrow(0, q0, lq).copy_(ungroup_output(torch.div(st[2], st[1]), lq))

    def _kv(self, lay: RefLayer, host: torch.Tensor) -> torch.Tensor:
        """What a unit's slots index (forward_path.h LayerStep::kv): the pool, or in place the host tier."""
        return host if self.in_place else lay.pool

    def _admit_and_copy(self, lay: RefLayer, host: torch.Tensor, blocks: list[int]) -> list[int]:
        """engine.cpp admit_unit; in place (engine.cpp forward), the blocks' own ids, nothing admitted."""
        if self.in_place:
            self.counters["blocks_in_place"] += len(blocks)
            return list(blocks)
        slots, miss_b, miss_s, hits, evicted = self._admit(lay, blocks)
        if miss_b:
            # transfer.cpp copy_blocks: one gather, one scatter.
            gathered = host.index_select(0, torch.tensor(miss_b, dtype=torch.int64, device=host.device))
            lay.pool.index_copy_(0, torch.tensor(miss_s, dtype=torch.int64, device=self.device),
                                 gathered.to(self.device))
            self.counters["bytes_h2d"] += len(miss_b) * self.bytes_per_block
            self.counters["blocks_admitted"] += len(miss_b)
        self.counters["blocks_hit"] += hits
        self.counters["blocks_evicted"] += evicted
        return slots

    def _attend_exact(self, lay: RefLayer, host: torch.Tensor, row: list[int], seq: int, lq: int,
                      qg: torch.Tensor, st: list[torch.Tensor], scale: float) -> None:
        """engine.cpp forward's ATen path over an exact row's tiles (plan_rows, admit_unit, attend_tile)."""
        tb, bs = self.tile_blocks, self.block_size
        for ti, start in enumerate(range(0, len(row), tb)):
            blocks = row[start:start + tb]
            slots = self._admit_and_copy(lay, host, blocks)
            tile = gather_tile(self._kv(lay, host), torch.tensor(slots, dtype=torch.int64, device=self.device))
            n = len(blocks)
            mask = tile_mask(seq - lq, lq, ti * tb * bs, n * bs, self.device)
            online_softmax_tile(st, qg, tile, mask, scale)
            self.counters["tiles_computed"] += 1
            for s in slots if not self.in_place else ():
                lay.pins[s] -= 1

    def _attend_selected(self, layer: int, lay: RefLayer, host: torch.Tensor, row: list[int], seq: int, r: int,
                         q: torch.Tensor, qg: torch.Tensor, st: list[torch.Tensor], scale: float) -> None:
        """engine.cpp select_row (called by plan_rows), admit_unit and attend_selected."""
        kvh, bs, tb, d = self.num_kv_heads, self.block_size, self.tile_blocks, self.head_size
        m = self.sink_blocks + self.top_k + self.recent_blocks
        nb = len(row)
        row_blocks = torch.tensor(row, dtype=torch.int64)
        pos = select_blocks(q, lay.key_min, lay.key_max, row_blocks.to(self.device), self.sink_blocks,
                            self.recent_blocks, self.top_k)
        pp = pos.reshape(-1).tolist()
        union_pos = sorted(set(pp))
        union_blocks = [row[p] for p in union_pos]
        slots = self._admit_and_copy(lay, host, union_blocks)
        slot_of_pos = dict(zip(union_pos, slots))
        flat = [slot_of_pos[pp[h * m + j]] * kvh + h for h in range(kvh) for j in range(m)]
        kv = self._kv(lay, host)
        per_head = (kv.view(kv.shape[0] * kvh, 2, bs, d)
                    .index_select(0, torch.tensor(flat, dtype=torch.int64, device=self.device))
                    .view(kvh, m, 2, bs, d)
                    .permute(0, 2, 1, 3, 4))
        offsets = torch.arange(bs, dtype=torch.int64, device=self.device)
        for t in range(0, m, tb):
            n = min(tb, m - t)
            kpos = pos.narrow(1, t, n).unsqueeze(2).mul(bs).add(offsets).reshape(kvh, n * bs)
            mask = kpos.gt(seq - 1).view(kvh, 1, 1, n * bs)
            online_softmax_tile(st, qg, per_head.narrow(2, t, n), mask, scale)
            self.counters["tiles_computed"] += 1
        for s in slots if not self.in_place else ():
            lay.pins[s] -= 1
        self.selection[layer][r] = row_blocks.index_select(0, pos.reshape(-1).cpu()).view(kvh, m)
        self.counters["compressed_rows"] += 1
        self.counters["compressed_context_blocks"] += nb
        self.counters["selected_blocks"] += kvh * m
        self.counters["union_blocks"] += len(union_blocks)
