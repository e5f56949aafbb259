"""Trainer side of a weight update: plan buckets, then broadcast them to the engines.

Owns: `WeightSender` (the object a trainer rank keeps across syncs) and `broadcast_buckets` (the
same for any named-tensor stream: benchmarks, tools). Buckets hold whole Megatron parameters (all
the HF tensors one parameter maps to), up to `bucket_bytes`; each is broadcast from rank 0 as one
uint8 tensor in SGLang's `flattened_bucket` layout (`hpc_rl.weights.bucket_layout`), into a buffer
reused across buckets and syncs (fresh memory is 5x slower to fill: notes/cpu-baselines.md).

Protocol (driven by the controller, `hpc_rl.controller.transports.broadcast`)::

    every rank:  plan = sender.plan_buckets()          # metadata only; rank 0 sends it as WeightPlan
    rank 0:      sender.connect(addr, port, world_size, group_name, backend)   # blocks until engines join
    every rank:  for i in range(len(plan)): sender.send_bucket(i)   # TP ranks of DP rank 0 gather
    rank 0:      sender.close()                        # when the engine set changes / at exit
    rank 0:      sender.abort_group()                  # an engine broke a sync (the controller says so)

Every rank of the first TP group (DP rank 0) takes part in each gather of a dense parameter; under
expert parallelism every rank of the first expert replica (expert-DP rank 0: expert TP x EP) takes part
in each routed expert's gather (its EP rank gathers it, then broadcasts it over the EP group:
`export.gather_expert`), one expert parameter at a time. Other ranks return at once. A family whose engine reads
some tensors only fused (gpt-oss: each layer's experts, as SGLang's loader does) plans each such group as one
entry and sends it fused (`engine_fusion`): one layer's experts gathered on rank 0 at a time.

Pipeline parallel: rank 0 (stage 0) holds only its stage's parameters. `plan_buckets` then gathers
each stage's (name, full shape, dtype) over the pipeline group once per sender, so every rank plans
the same buckets over the whole model; in `send_bucket` the stage that owns a parameter gathers it
over its TP group and its TP rank 0 sends the full tensor to rank 0 (p2p on the pipeline group,
gloo or NCCL), which maps it to HF names and packs it. At PP=1 nothing of this runs: no metadata
exchange, no extra copy.

One module (~420 lines) on purpose: planning the buckets and sending them share the plan's state on the sender
(the bucket list, the pipeline's source metadata, the reused buffer, the open group), and the protocol above is
one sequence of its methods; the pieces with a life of their own already live apart (`bucket_layout`, `export`,
`engine_fusion`, `fp8_blocks`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from hpc_rl.config.fp8_scheme import SCALE_SUFFIX, Fp8Blocks
from hpc_rl.config.model import ModelArchitecture
from hpc_rl.weights.bucket_layout import dtype_from_name, dtype_name, pack_bucket
from hpc_rl.weights.collective_stream import CollectiveStream
from hpc_rl.weights.engine_fusion import fuse_named, fusion_of, group_plan_entries
from hpc_rl.weights.fp8_blocks import FP8_DTYPE, quantize_named, send_entries
from hpc_rl.weights.json_collectives import all_gather_json
from hpc_rl.weights import hf_mapping
from hpc_rl.weights.export import (
    ExpertLayout,
    export_param,
    full_shape_and_dtype,
    full_tensor,
    gather_full,
    named_megatron_params,
)
from hpc_rl.weights.process_group import (
    DEFAULT_GROUP_NAME,
    destroy_weight_update_group,
    init_weight_update_group,
)
from hpc_rl.weights.stage import stage_layout, stage_name_map

LOAD_FORMAT = "flattened_bucket"


@dataclass(frozen=True)
class BucketMeta:
    """One broadcast: the `/update_weights_from_distributed` fields, plus its Megatron sources."""

    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    num_bytes: int
    megatron_names: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        """The WeightPlan entry (names, dtypes, shapes, num_bytes)."""
        return {"names": self.names, "dtypes": self.dtypes, "shapes": self.shapes, "num_bytes": self.num_bytes}


def _plan(entries: Iterable[tuple[str | list[str], list[tuple[str, tuple[int, ...]]]]], dtype: torch.dtype,
          bucket_bytes: int, fp8: Fp8Blocks | None = None) -> list[BucketMeta]:
    """Whole Megatron parameters per bucket, up to `bucket_bytes` (an entry of several parameters, a fusion group
    of `engine_fusion`, stays whole too); each HF tensor in its export dtype
    (`hf_mapping.tensor_send_dtype`; with `fp8`, each weight the FP8 engine checkpoint quantizes as e4m3 plus
    its float32 `weight_scale_inv`: `fp8_blocks.send_entries`), a bucket of mixed dtypes ordered by falling
    dtype size (aligned)."""
    buckets: list[BucketMeta] = []
    current: list[tuple[str, list[int], torch.dtype]] = []
    sources: list[str] = []
    size = 0

    def flush() -> None:
        nonlocal size
        if current:
            ordered = sorted(current, key=lambda item: -torch.empty((), dtype=item[2]).element_size())
            buckets.append(BucketMeta(names=[n for n, _, _ in ordered], dtypes=[dtype_name(d) for _, _, d in ordered],
                                      shapes=[s for _, s, _ in ordered], num_bytes=size,
                                      megatron_names=list(sources)))
        current.clear()
        sources.clear()
        size = 0

    for source, hf_entries in entries:
        typed = send_entries(hf_entries, lambda name: hf_mapping.tensor_send_dtype(name, dtype), fp8)
        nbytes = sum(torch.empty((), dtype=d).element_size() * int(torch.Size(s).numel()) for _, s, d in typed)
        if size and size + nbytes > bucket_bytes:
            flush()
        sources.extend([source] if isinstance(source, str) else source)
        current.extend(typed)
        size += nbytes
    flush()
    return buckets


def wire_tensors(named: list[tuple[str, torch.Tensor]], dtype: torch.dtype, fp8: Fp8Blocks | None
                 ) -> list[tuple[str, torch.Tensor]]:
    """HF tensors as a plan sends them: with `fp8` (the engines' checkpoint is block-FP8), each weight it
    quantizes as e4m3 + float32 weight_scale_inv, quantized from the trainer's own precision (slime quantizes
    the bf16 export); every other tensor in its export dtype (`hf_mapping.tensor_send_dtype`)."""
    if fp8 is not None:
        named = quantize_named(named, fp8)
    return [(name, tensor if tensor.dtype == FP8_DTYPE or name.endswith(SCALE_SUFFIX)
             else tensor.to(hf_mapping.tensor_send_dtype(name, dtype))) for name, tensor in named]


class _PipelinedBroadcaster:
    """Two reused uint8 buffers: bucket i+1 is packed while bucket i is still being broadcast.

    gloo (and NCCL) run an async broadcast on their own thread/stream, so the copy into the other
    buffer overlaps the transfer; `wait()` before a buffer is refilled and at the end of a sync. With a
    `CollectiveStream` (the weight group's), waits complete as NCCL's do: the CPU moves on, and on the
    gloo twin a buffer whose broadcast is still in flight is replaced, not overwritten (on a GPU the
    refill would queue behind the broadcast on the stream).
    """

    def __init__(self, stream: CollectiveStream | None = None) -> None:
        self.buffers: list[torch.Tensor | None] = [None, None]
        self.pending: list[Any] = [None, None]
        self.turn = 0
        self.stream = stream

    def send(self, named: list[tuple[str, torch.Tensor]], nbytes: int, group: dist.ProcessGroup,
             capacity: int) -> list[str]:
        slot = self.turn
        self.turn ^= 1
        work = self.pending[slot]
        if work is not None:
            if self.stream is None:
                work.wait()
            elif self.stream.reusable(work):
                self.stream.wait(work)
            else:
                self.buffers[slot] = None  # still in flight (twin): a new buffer, the old one stays its input
            self.pending[slot] = None
        buffer = self.buffers[slot]
        if buffer is None or buffer.numel() < nbytes:
            device = named[0][1].device if named else "cpu"
            buffer = self.buffers[slot] = torch.empty(max(nbytes, capacity), dtype=torch.uint8, device=device)
        packed, layout = pack_bucket(named, out=buffer)
        work = self.pending[slot] = dist.broadcast(packed, src=0, group=group, async_op=True)
        if self.stream is not None:
            self.stream.issued(work, f"broadcast of {len(named)} tensor(s)")
        return layout.request_fields()["names"]

    def wait(self) -> None:
        for slot, work in enumerate(self.pending):
            if work is not None:
                work.wait() if self.stream is None else self.stream.wait(work)
                self.pending[slot] = None


class WeightSender:
    """Broadcasts a Megatron model's weights, HF-named and unsharded, from trainer rank 0."""

    def __init__(self, model: torch.nn.Module, arch: ModelArchitecture, *, tp_group: dist.ProcessGroup | None,
                 tp_size: int, dp_rank: int, rank: int, bucket_bytes: int, dtype: torch.dtype | None = None,
                 pp_group: dist.ProcessGroup | None = None, pp_rank: int = 0, pp_size: int = 1,
                 experts: ExpertLayout | None = None, fp8: Fp8Blocks | None = None) -> None:
        self.params = named_megatron_params(model)
        self.fp8 = fp8
        """The engines' checkpoint is block-FP8: each weight it quantizes is sent as e4m3 + weight_scale_inv."""
        self.arch, self.tp_group, self.tp_size = arch, tp_group, tp_size
        self.fusion = fusion_of(arch)
        """The family's tensors sent fused (gpt-oss: each layer's experts, as SGLang reads them); None: none."""
        self.experts = experts if experts is not None else ExpertLayout.current(arch)
        """Where the routed experts live (None: from Megatron's groups; a dense model has none)."""
        self.dp_rank, self.rank, self.bucket_bytes = dp_rank, rank, bucket_bytes
        self.pp_group, self.pp_rank, self.pp_size = pp_group, pp_rank, pp_size
        if pp_size > 1 and pp_group is None:
            raise ValueError("pipeline_model_parallel_size > 1 needs the pipeline group")
        self.tp_rank = dist.get_rank(tp_group) if tp_group is not None else 0
        self._in_first_pipeline = pp_group is None or dist.get_global_rank(pp_group, 0) == 0
        """This rank's pipeline group holds rank 0: under PP its member at a stage sends that stage's tensors."""
        self.dtype = dtype or next(iter(self.params.values())).dtype
        self._model = model
        self._comm_device = next(iter(self.params.values())).device  # NCCL needs CUDA tensors, gloo CPU ones
        self.group: dist.ProcessGroup | None = None
        self.stream: CollectiveStream | None = None
        """The group's collectives as NCCL completes them (gloo: its twin); set by `connect`."""
        self._broadcaster = _PipelinedBroadcaster()
        self._plan: list[BucketMeta] | None = None
        self._sources: dict[str, tuple[int, tuple[int, ...], str]] | None = None
        """Megatron name -> (owning pipeline stage, full shape, dtype name), over the whole model."""

    def set_bucket_bytes(self, bucket_bytes: int) -> None:
        """Change the bucket size for the next sync (the group and buffers are kept)."""
        if bucket_bytes != self.bucket_bytes:
            self.bucket_bytes, self._plan = bucket_bytes, None

    def plan_buckets(self) -> list[BucketMeta]:
        """The buckets' metadata, the same on every rank. No communication at PP=1; under PP the
        first call is a collective over the pipeline group (every rank calls it, as the loop does)."""
        if self._plan is None:
            sources = self._source_metadata()
            entries = []
            for megatron_name, _ in hf_mapping.name_map(self.arch):
                if megatron_name not in sources:
                    raise KeyError(f"no pipeline stage holds {megatron_name}")
                shape = sources[megatron_name][1]
                entries.append((megatron_name, hf_mapping.hf_param_shapes(self.arch, megatron_name, shape)))
            self._plan = _plan(group_plan_entries(entries, self.fusion), self.dtype, self.bucket_bytes, self.fp8)
        return self._plan

    def _source_metadata(self) -> dict[str, tuple[int, tuple[int, ...], str]]:
        if self._sources is None:
            names = [name for name, _ in stage_name_map(self.arch, stage_layout(self._model))]  # all at PP=1
            local = {}
            for name in names:  # another EP rank's experts too: shaped like this rank's
                shape, dtype = full_shape_and_dtype(name, self.params, self.tp_size, self.experts)
                local[name] = (self.pp_rank, shape, dtype_name(dtype))
            if self.pp_size > 1:
                stages = all_gather_json(local, group=self.pp_group, device=self._comm_device)
                local = {name: (int(owner), tuple(shape), dtype)
                         for stage in stages for name, (owner, shape, dtype) in stage.items()}
            self._sources = local
        return self._sources

    def connect(self, master_address: str, master_port: int, world_size: int, *,
                group_name: str = DEFAULT_GROUP_NAME, backend: str = "gloo", timeout_s: float = 600.0,
                give_up: Callable[[], str] | None = None) -> None:
        """Rank 0 hosts the weight-update group (rank 0 of `world_size`); other ranks do nothing. `give_up`
        is asked while the engines join (WeightGroupJoinAbandoned when it answers why to stop waiting)."""
        if self.rank != 0:
            return
        self.close()
        self.group = init_weight_update_group(master_address=master_address, master_port=master_port, rank=0,
                                              world_size=world_size, group_name=group_name, backend=backend,
                                              timeout_seconds=timeout_s, give_up=give_up)
        self.stream = CollectiveStream(backend, timeout_s=timeout_s)
        self._broadcaster = _PipelinedBroadcaster(self.stream)

    def send_bucket(self, index: int, *, broadcast: bool = True) -> None:
        """Gather, pack, and broadcast bucket `index` (rank 0). Dense parameters are gathered by the TP
        ranks of DP rank 0, routed experts by the ranks of expert-DP rank 0 (expert TP x EP). Without
        `broadcast` (rank 0 has no group: the engines never all joined) the gathers still run, so the peers
        that wait on rank 0 in them do not hang, and nothing is sent."""
        named = self.bucket_tensors(index)
        if self.rank != 0 or not broadcast:
            return
        if self.group is None:
            raise RuntimeError("send_bucket before connect(): rank 0 has no weight-update group")
        meta = self.plan_buckets()[index]
        named = wire_tensors(named, self.dtype, self.fp8)
        position = {name: i for i, name in enumerate(meta.names)}
        named = sorted(named, key=lambda item: position.get(item[0], -1))
        if [n for n, _ in named] != meta.names or [list(t.shape) for _, t in named] != meta.shapes:
            raise RuntimeError(f"bucket {index}: the gathered tensors' names or shapes differ from the announced plan")
        capacity = max(b.num_bytes for b in self.plan_buckets())
        self._broadcaster.send(named, meta.num_bytes, self.group, capacity)

    def bucket_tensors(self, index: int) -> list[tuple[str, torch.Tensor]]:
        """Bucket `index`'s HF tensors on rank 0, in the trainer's dtype, before packing: each parameter gathered
        (a collective: the TP ranks of DP rank 0 for a dense one, expert-DP rank 0's ranks for a routed expert;
        under PP its stage sends it to rank 0), then the family's fusion groups fused (`engine_fusion`). Other
        ranks take part in the gathers and get what they gathered (nothing useful to send)."""
        dense_turn, expert_turn = self.dp_rank == 0, self.experts.dp_rank == 0
        if not (dense_turn or expert_turn):
            return []
        meta = self.plan_buckets()[index]
        named: list[tuple[str, torch.Tensor]] = []
        for source in meta.megatron_names:
            if not (expert_turn if hf_mapping.is_expert_param(source) else dense_turn):
                continue
            if self.pp_size == 1:
                named.extend(export_param(source, self.params, self.arch, self.tp_group, self.experts))
            else:
                named.extend(self._from_pipeline(source))
        if self.rank != 0:
            return named
        return fuse_named(named, self.fusion)

    def _from_pipeline(self, source: str) -> list[tuple[str, torch.Tensor]]:
        """Under PP: the HF tensors of `source` on rank 0 (empty elsewhere); the owning stage gathers it
        (TP group, or expert replica) and its rank in rank 0's pipeline group sends it to rank 0."""
        owner, shape, dtype = self._source_metadata()[source]
        assert self.pp_group is not None
        if owner == self.pp_rank:
            full = full_tensor(source, self.params, self.tp_group, self.experts)
            if owner == 0:
                return hf_mapping.to_hf(source, full, self.arch)
            if self._in_first_pipeline:
                dist.send(full.contiguous(), dst=dist.get_global_rank(self.pp_group, 0), group=self.pp_group)
            return []
        if self.rank != 0:
            return []
        full = torch.empty(shape, dtype=dtype_from_name(dtype), device=self._comm_device)
        dist.recv(full, src=dist.get_global_rank(self.pp_group, owner), group=self.pp_group)
        return hf_mapping.to_hf(source, full, self.arch)

    def export_everywhere(self, source: str) -> list[tuple[str, torch.Tensor]]:
        """The HF tensors of `source` on every rank (colocated: each rank feeds the engine on its own GPU), a
        collective over the TP group (a routed expert: over the expert replica, `export.gather_expert`) and,
        under PP, over the pipeline group. At PP=1 the gather; under PP, as slime's colocated path: a TP-split
        dense parameter's shards go from the owning stage to every stage over the pipeline groups (each carries
        one TP rank's shard), then every stage gathers them over its TP group; any other parameter (a routed
        expert gathered on the owning stage included) goes whole from the owning stage."""
        if self.pp_size == 1:
            return export_param(source, self.params, self.arch, self.tp_group, self.experts)
        assert self.pp_group is not None
        owner, shape, dtype = self._source_metadata()[source]
        src = dist.get_global_rank(self.pp_group, owner)
        split = hf_mapping.tp_split(source).dim
        if split is not None and self.tp_size > 1 and not hf_mapping.is_expert_param(source):
            shard_shape = list(shape)
            shard_shape[split] //= self.tp_size
            shard = (self.params[source].detach().contiguous() if owner == self.pp_rank else
                     torch.empty(shard_shape, dtype=dtype_from_name(dtype), device=self._comm_device))
            dist.broadcast(shard, src=src, group=self.pp_group)
            full = gather_full(source, shard, self.tp_group, self.arch)
        else:
            full = (full_tensor(source, self.params, self.tp_group, self.experts).contiguous()
                    if owner == self.pp_rank else
                    torch.empty(shape, dtype=dtype_from_name(dtype), device=self._comm_device))
            dist.broadcast(full, src=src, group=self.pp_group)
        return hf_mapping.to_hf(source, full, self.arch)

    def export_bucket_everywhere(self, index: int) -> list[tuple[str, torch.Tensor]]:
        """Bucket `index`'s HF tensors on every rank (colocated: `export_everywhere` per parameter), the family's
        fusion groups fused as `bucket_tensors` does."""
        named: list[tuple[str, torch.Tensor]] = []
        for source in self.plan_buckets()[index].megatron_names:
            named.extend(self.export_everywhere(source))
        return fuse_named(named, self.fusion)

    def finish(self) -> None:
        """The end of a sync: its last broadcasts are waited for as the group's backend does (NCCL: the GPU
        stream waits, the CPU moves on)."""
        self._broadcaster.wait()

    def synchronize(self) -> None:
        """Where the GPU would next make this rank wait for the group's broadcasts (the gloo twin blocks
        here, and hangs until the group's timeout on a broadcast that broke; see `collective_stream`)."""
        if self.stream is not None:
            self.stream.synchronize()

    def abort_group(self) -> None:
        """Abort the group (an engine broke the sync): pending broadcasts are dropped; the next sync builds a
        new group. Nothing waits on the broken one (on NCCL, waiting would hang until the watchdog)."""
        if self.stream is not None:
            self.stream.abort(self.group)
        self.group, self.stream = None, None
        self._broadcaster = _PipelinedBroadcaster()

    def send_all(self) -> list[BucketMeta]:
        """Every bucket in order, for a caller that drives the receiving side itself (the one-GPU check
        tools/gpu_check_weights.py: `weight_stream`)."""
        plan = self.plan_buckets()
        for index in range(len(plan)):
            self.send_bucket(index)
        self.finish()
        return plan

    def close(self) -> None:
        self.finish()
        self.synchronize()  # the twin's pending broadcasts end before their group does
        if self.group is not None:
            destroy_weight_update_group(self.group)
            self.group = None
        self.stream = None


def broadcast_buckets(named_tensors: Iterable[tuple[str, torch.Tensor]], group: dist.ProcessGroup,
                      bucket_bytes: int, *, broadcaster: _PipelinedBroadcaster | None = None) -> list[BucketMeta]:
    """Pack a stream of tensors into buckets of <= `bucket_bytes` and broadcast each from rank 0.

    Pipelined (pack the next bucket while the previous one is on the wire) into two reused buffers;
    pass the same `broadcaster` to later calls to keep reusing them. Tensors should share one dtype
    (mixed dtypes need `order_for_alignment` per bucket). Receivers must know the metas in advance
    to size their buffers: use `WeightSender.plan_buckets` for models.
    """
    broadcaster = broadcaster or _PipelinedBroadcaster()
    metas: list[BucketMeta] = []
    pending: list[tuple[str, torch.Tensor]] = []
    size = 0

    def flush() -> None:
        nonlocal size
        if not pending:
            return
        names = broadcaster.send(pending, size, group, bucket_bytes)
        metas.append(BucketMeta(names=names, dtypes=[dtype_name(t.dtype) for _, t in pending],
                                shapes=[list(t.shape) for _, t in pending], num_bytes=size))
        pending.clear()
        size = 0

    for name, tensor in named_tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if size and size + nbytes > bucket_bytes:
            flush()
        pending.append((name, tensor))
        size += nbytes
    flush()
    broadcaster.wait()
    return metas
