"""Record what ActiveKV's attention layers see during an in-process vLLM run, and replay it on a fresh engine.

`with capture(keep=...) as rec: engine.generate(...)` (a `tools.vllm_run.VllmEngine` with backend ACTIVEKV, engine
core in this process) wraps the patched vLLM classes `ActiveKVMetadataBuilder.build` and `ActiveKVImpl.forward` for the
duration of the block. For every layer forward of a kept step it records a `LayerCall`: the query, the output the
engine wrote, the step plan, the selections of compressed rows, and a copy of every KV-cache block the plan's rows
reference (not the whole cache). Nothing is recorded for vLLM's warm-up forwards (no metadata).

`replay(call, engine)` runs one recorded layer forward again on a fresh single-layer engine: `activekv._backend.Engine`
or `tests.reference.engine.RefEngine` (same methods: update_kv, build, forward, selection). Why a fresh engine gives
the same outputs and selections as the engine that served the run:
- The cache is rebuilt from the recorded blocks (bit-identical bytes, stale tails of last blocks included), then each
  row's tokens 0 .. seq_len - 1 are written again with `update_kv` (same values, so the cache does not change). That
  write is what rebuilds each block's key minimum / maximum: in the run, a block's metadata is reset when its offset 0
  is written (every block vLLM hands a request is filled from offset 0) and then folded with amin/amax over exactly
  the tokens written to it since, which are the row's tokens in that block. amin/amax are exact, so the order and
  grouping of the writes does not matter: a prefill split into chunks (chunked prefill) folds the same tokens. The
  same holds under vLLM's lifecycle events (tests/test_lifecycle_vllm.py replays every step of them): a preempted
  request's recomputation writes its blocks from offset 0 again; an aborted or finished request's block handed to
  another request is reset by that request's first write; a prefix-cache hit re-uses a full block whose metadata
  was folded over exactly its block_size tokens when it was written (vLLM caches full blocks only).
- Attention reads pool copies of host blocks that write-through keeps coherent, so which pool slot a block sits in,
  which blocks were resident, and the LRU order change the telemetry but not the values attended; the tile order is
  the row's block order (exact) or the selection order (compressed), both functions of the plan and the metadata.
- Block ids are renumbered densely (selection ties break by position in the row, never by block id); `replay` maps
  selections back to the run's ids.
- ATen's intra-op parallelism splits work by the thread count; a `LayerCall` records `torch.get_num_threads()` and
  `replay` refuses to run under a different count. (vLLM's CPU worker replaces `torch.set_num_threads` with a no-op
  for the rest of the process, so the count seen after a run is the run's.)
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class LayerCall:
    """One recorded layer forward of one vLLM step.

    step: index of the step among the steps the capture saw (0 = first metadata build inside the block).
    layer / layer_name: the engine's layer index and vLLM's layer name.
    query / output: float [T, H, D], the first num_actual_tokens rows.
    query_start_loc [B + 1], seq_lens [B], block_table [B, W]: int32, the step plan.
    block_ids: int64 [U], sorted ids of the KV blocks the rows reference (their first ceil(seq_len / block_size)).
    blocks: [U, KVH, block_size, 2 * D] copies of those blocks (vLLM's per-layer cache shape, whose bytes ActiveKV reads
        as [U, KVH, 2, block_size, D]: K then V per block and KV head), after the step's KV
        update (the forward reads the cache after do_kv_cache_update).
    selection: {row: int64 [KVH, per_head] block ids} of the rows the engine ran compressed.
    scale: the softmax scale vLLM passed; num_threads: torch.get_num_threads() during the forward.
    """

    step: int
    layer: int
    layer_name: str
    query: torch.Tensor
    output: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    block_ids: torch.Tensor
    blocks: torch.Tensor
    selection: dict[int, torch.Tensor]
    scale: float
    num_threads: int
    mode: str

    @property
    def num_reqs(self) -> int:
        return int(self.seq_lens.shape[0])

    @property
    def block_size(self) -> int:
        return int(self.blocks.shape[2])

    @property
    def is_decode(self) -> bool:
        """True when every row has exactly one query token."""
        return bool((self.query_start_loc[1:] - self.query_start_loc[:-1]).eq(1).all())

    def row_blocks(self, r: int) -> torch.Tensor:
        """int64 [nb]: the run's block ids of row r, in order."""
        nb = -(-int(self.seq_lens[r]) // self.block_size)
        return self.block_table[r, :nb].to(torch.int64)

    def dense_block_table(self) -> torch.Tensor:
        """int32 [B, W]: block_table renumbered into positions of block_ids (entries past each row's blocks: 0)."""
        out = torch.zeros_like(self.block_table)
        for r in range(self.num_reqs):
            ids = self.row_blocks(r)
            out[r, : ids.numel()] = torch.searchsorted(self.block_ids, ids).to(torch.int32)
        return out

    def row_kv(self, r: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(keys [seq, KVH, D], values [seq, KVH, D], dense slots int64 [seq]) of row r's tokens 0 .. seq_len - 1."""
        seq, bs = int(self.seq_lens[r]), self.block_size
        dense = torch.searchsorted(self.block_ids, self.row_blocks(r))
        u, kvh, _, d2 = self.blocks.shape
        # ActiveKV's view of the same bytes: [U, KVH, 2, bs, D] (docs/design.md, "KV-cache layout").
        kv = self.blocks.view(u, kvh, 2, bs, d2 // 2).index_select(0, dense)
        keys = kv[:, :, 0].permute(0, 2, 1, 3).reshape(-1, kvh, d2 // 2)[:seq]
        values = kv[:, :, 1].permute(0, 2, 1, 3).reshape(-1, kvh, d2 // 2)[:seq]
        slots = dense.repeat_interleave(bs) * bs + torch.arange(dense.numel() * bs) % bs
        return keys, values, slots[:seq]


@dataclass
class Recorder:
    """What `capture` collected: `calls` in call order, plus the engines the builders used (for telemetry)."""

    keep: Callable[[int, Any], bool]
    calls: list[LayerCall] = field(default_factory=list)
    steps_seen: int = 0
    engines: list[Any] = field(default_factory=list)
    _step_engine: Any = None
    _keep_step: bool = False


def _record(rec: Recorder, layer: Any, query: torch.Tensor, kv_cache: torch.Tensor, plan: Any,
            output: torch.Tensor, scale: float) -> None:
    engine = rec._step_engine
    idx = int(engine.layer_index(layer.layer_name))
    n = int(plan.num_actual_tokens)
    seq_lens = plan.seq_lens.clone()
    table = plan.block_table.clone()
    bs = int(kv_cache.shape[2])
    rows = [table[r, : -(-int(seq_lens[r]) // bs)].to(torch.int64) for r in range(int(plan.num_reqs))]
    ids = torch.unique(torch.cat(rows)) if rows else torch.zeros(0, dtype=torch.int64)
    rec.calls.append(LayerCall(
        step=rec.steps_seen - 1, layer=idx, layer_name=str(layer.layer_name),
        query=query[:n].clone(), output=output[:n].clone(),
        query_start_loc=plan.query_start_loc.clone(), seq_lens=seq_lens, block_table=table,
        block_ids=ids, blocks=kv_cache.index_select(0, ids).clone(),
        selection={int(r): t.clone() for r, t in engine.selection(idx).items()},
        scale=float(scale), num_threads=torch.get_num_threads(), mode=str(engine.mode),
    ))


@contextlib.contextmanager
def capture(keep: Callable[[int, Any], bool] = lambda step, plan: True) -> Iterator[Recorder]:
    """Record ActiveKV layer forwards of the vLLM steps run inside the block.

    keep(step, plan) -> bool decides per step (step: 0-based count of metadata builds in the block; plan: the
    activekv StepPlan with num_reqs, num_actual_tokens, query_start_loc, seq_lens, block_table) whether its layer
    forwards are recorded. Needs the patched vLLM (module vllm.v1.attention.backends.activekv) and an engine core in
    this process (VLLM_ENABLE_V1_MULTIPROCESSING=0, as tools.vllm_run sets).
    """
    from vllm.v1.attention.backends import activekv as backend_module

    builder_cls, impl_cls = backend_module.ActiveKVMetadataBuilder, backend_module.ActiveKVImpl
    build, forward = builder_cls.build, impl_cls.forward
    rec = Recorder(keep=keep)

    def recording_build(self: Any, *args: Any, **kwargs: Any) -> Any:
        plan = build(self, *args, **kwargs)
        engine = self._native.engine
        if not any(e is engine for e in rec.engines):
            rec.engines.append(engine)
        rec._step_engine = engine
        rec._keep_step = bool(keep(rec.steps_seen, plan))
        rec.steps_seen += 1
        return plan

    def recording_forward(self: Any, layer: Any, query: torch.Tensor, key: Any, value: Any, kv_cache: torch.Tensor,
                          attn_metadata: Any, output: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        result = forward(self, layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs)
        if attn_metadata is not None and rec._keep_step:
            _record(rec, layer, query, kv_cache, attn_metadata, output, self.scale)
        return result

    builder_cls.build, impl_cls.forward = recording_build, recording_forward
    try:
        yield rec
    finally:
        builder_cls.build, impl_cls.forward = build, forward


@dataclass
class Replay:
    """A replayed layer forward: output [T, H, D] and selection {row: int64 [KVH, per_head]} in the run's block ids."""

    output: torch.Tensor
    selection: dict[int, torch.Tensor]


def replay(call: LayerCall, engine: Any, rows: list[int] | None = None) -> Replay:
    """Run `call` again on `engine`, a fresh single-layer engine of the call's geometry (native Engine or RefEngine).

    rows: the request rows to replay (default all); with a subset, the plan holds only those rows, in that order, and
    the result's output and selection are indexed by the subset's order.
    Raises RuntimeError when the thread count differs from the one recorded (outputs would not be comparable bit for
    bit).
    """
    if torch.get_num_threads() != call.num_threads:
        raise RuntimeError(f"recorded under {call.num_threads} threads, replaying under {torch.get_num_threads()}")
    rows = list(range(call.num_reqs)) if rows is None else rows
    cache = call.blocks.clone()
    dense = call.dense_block_table()
    qsl = call.query_start_loc.tolist()
    for r in rows:
        keys, values, slots = call.row_kv(r)
        engine.update_kv(0, keys.contiguous(), values.contiguous(), cache, slots)
    starts = [0]
    for r in rows:
        starts.append(starts[-1] + qsl[r + 1] - qsl[r])
    query = torch.cat([call.query[qsl[r]:qsl[r + 1]] for r in rows])
    plan = engine.build(torch.tensor(starts, dtype=torch.int32), call.seq_lens[rows].clone(),
                        dense[rows].contiguous(), len(starts) - 1, int(query.shape[0]))
    output = torch.zeros_like(query)
    engine.forward(0, plan, query.contiguous(), cache, output, call.scale)
    selection = {int(r): call.block_ids.index_select(0, ids.reshape(-1)).view(ids.shape)
                 for r, ids in _selection_of(engine).items()}
    return Replay(output, selection)


def replay_mismatches(calls: list[LayerCall], make_engine: Callable[[], Any]) -> list[str]:
    """Replay every call on a fresh engine from `make_engine` (see `replay`): one line per call whose output or
    selection is not equal bit for bit to the recorded one; empty when all are."""
    out: list[str] = []
    for call in calls:
        got = replay(call, make_engine())
        if not torch.equal(got.output, call.output):
            worst = float((got.output - call.output).abs().max())
            out.append(f"step {call.step} layer {call.layer}: output differs (max abs {worst:.3g})")
        if sorted(got.selection) != sorted(call.selection) or not all(
            torch.equal(got.selection[r], call.selection[r]) for r in call.selection
        ):
            out.append(f"step {call.step} layer {call.layer}: selection differs")
    return out


def _selection_of(engine: Any) -> dict[int, torch.Tensor]:
    sel = engine.selection
    return dict(sel(0) if callable(sel) else sel[0])
