"""DSv4.1-mini over several ranks: tensor parallelism and data-parallel attention with
expert-parallel MoE (DEP), on ``torch.distributed`` groups the user gives.

What is split and what is replicated, and why:

* **Attention heads** are split over the tensor-parallel (TP) group: ``wq_b`` by rows
  (its heads), the sink per head, the output groups ``wo_a`` by group, ``wo_b`` by the
  columns of those groups (row-parallel), then one all-reduce. A head's attention needs
  nothing of another head's, and the groups are whole heads, so no other exchange.
* **The shared latent KV** (one KV head), **the compressors** and **the mHC stream**
  are replicated: one latent head cannot be split by head, the compressors write the
  global cache every rank reads, and the mixes are a few numbers per row. Every rank
  keeps the same caches, which is also why each rank can check its own against the
  single-process model.
* **The experts** are split over the expert-parallel (EP) group: the TP group, or with
  ``enable_expert_parallel`` the TP group times the data-parallel (DP) group. A rank
  runs its experts only; a routed expert's output is one row's alone, so the partial
  sums add up. The shared expert is split by its intermediate size over the TP group
  (column- then row-parallel) and replicated over DP.
* **The embedding and the head** are replicated: they are a small share of this
  model, and splitting the vocabulary would add a gather before every logit.

Under DEP every DP rank runs its own batch through attention; the MoE gathers the
tokens of every DP rank (all padded to the agreed size, agree.py), runs its experts on
all of them and reduce-scatters the sums back to their ranks: one custom op,
``dsv41::dep_moe``, declared row-local (each row's result is its own), captured inside
the graph pieces. The TP all-reduces are torch's functional collectives, which
Dynamo and Inductor trace as they are.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from ..compat import collectives
from ..oplib import define_op
from ..parallel import check_same
from ..passes.roles import declare_row_local


@dataclass(frozen=True)
class Parallel:
    """This rank's place: its TP group (the ranks that share its batch), its DP group
    (the ranks whose batches its MoE exchanges with under ``enable_expert_parallel``)."""

    tp_size: int = 1
    tp_rank: int = 0
    tp_group: Any = None
    dp_size: int = 1
    dp_rank: int = 0
    dp_group: Any = None
    enable_expert_parallel: bool = False

    def __deepcopy__(self, memo) -> "Parallel":
        """A copy of a sharded model (an fp32 copy, say) runs on the same ranks and groups:
        a process group is a handle to them, not a thing to copy."""
        return self

    @property
    def exchanges(self) -> bool:
        """The MoE exchanges tokens between DP ranks (DEP); with a group of one rank too,
        so that one GPU runs the collectives inside its graphs."""
        return self.enable_expert_parallel and self.dp_group is not None

    @property
    def ep_size(self) -> int:
        return self.tp_size * (self.dp_size if self.enable_expert_parallel else 1)

    @property
    def ep_rank(self) -> int:
        return (self.dp_rank * self.tp_size if self.enable_expert_parallel else 0) + self.tp_rank

    def check(self, cfg) -> None:
        """Refuse a split this model cannot take, naming the sizes, before anything is
        built or traced."""
        import torch.distributed as dist

        problems = []
        for name, size, rank, group in (("tp", self.tp_size, self.tp_rank, self.tp_group),
                                        ("dp", self.dp_size, self.dp_rank, self.dp_group)):
            if isinstance(size, bool) or not isinstance(size, int) or size < 1:
                problems.append(f"{name}_size must be an integer >= 1, got {size!r}")
                continue
            if not 0 <= rank < size:
                problems.append(f"{name}_rank={rank} is outside [0, {name}_size={size})")
            if size > 1 and group is None:
                problems.append(f"{name}_size={size} needs a {name}_group")
            elif group is not None and dist.get_world_size(group) != size:
                problems.append(f"{name}_group has {dist.get_world_size(group)} ranks, {name}_size is {size}")
            elif group is not None and dist.get_rank(group) != rank:
                # A rank's share of the weights and its rows in the exchanges follow the
                # rank given here, while the collectives order the ranks by the group:
                # another number gives this rank another's weights or rows.
                problems.append(f"{name}_rank={rank}, but this process is rank {dist.get_rank(group)} of "
                                f"{name}_group")
        tp = self.tp_size if isinstance(self.tp_size, int) and self.tp_size >= 1 else 1
        if cfg.num_heads % tp:
            problems.append(f"tp_size={tp} does not divide num_heads={cfg.num_heads}")
        if cfg.o_groups % tp:
            problems.append(f"tp_size={tp} does not divide o_groups={cfg.o_groups} (a rank's heads must be whole "
                            "output groups)")
        if cfg.shared_intermediate_size % tp:
            problems.append(f"tp_size={tp} does not divide shared_intermediate_size={cfg.shared_intermediate_size}")
        if not problems and cfg.num_experts % self.ep_size:
            problems.append(f"the expert-parallel group of {self.ep_size} ranks does not divide "
                            f"num_experts={cfg.num_experts}")
        if tp > 1 and cfg.attention_impl == "flashinfer":
            problems.append("attention_impl='flashinfer' plans every head of the model: with tp_size > 1 use the "
                            "Triton or reference attention")
        if problems:
            raise ValueError("parallel: " + "; ".join(problems))


def shard(model, parallel: Parallel):
    """Cut ``model`` (a DSv41Mini with every weight, in place) down to this rank's share,
    so every rank starts from the same weights as the single-process model."""
    parallel.check(model.cfg)
    for group in (parallel.tp_group, parallel.dp_group):  # every rank the same model
        if group is not None:
            check_same(dataclasses.asdict(model.cfg), group, "the ranks were given different model configs")
    model.parallel = parallel
    for blk in model.layers:
        blk.attn.shard(parallel)
        blk.ffn.moe.shard(parallel)
    return model


def tp_all_reduce(x: torch.Tensor, parallel: Parallel | None) -> torch.Tensor:
    """The sum over the TP group (a functional collective, traced as it is); with a group
    of one rank too, so that one GPU runs the collective inside its graphs."""
    if parallel is None or parallel.tp_group is None:
        return x
    return collectives.all_reduce_sum(x, parallel.tp_group)


def _dep_moe(x: torch.Tensor, router: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor,
             first_expert: int, top_k: int, group: str) -> torch.Tensor:
    from .layers import mm_fp32
    from .moe import local_experts, route

    every = collectives.all_gather_rows(x.contiguous(), group)  # every DP rank's rows, rank order
    top_w, top_i = route(torch.softmax(mm_fp32(every, router), dim=-1), top_k)
    partial = local_experts(every, top_w, top_i, w_gate_up, w_down, first_expert)
    return collectives.reduce_scatter_rows(partial, group)  # each rank's rows, summed over ranks


def _dep_moe_fake(x, router, w_gate_up, w_down, first_expert, top_k, group):
    return torch.empty_like(x)


dep_moe = define_op("dsv41::dep_moe",
                    "(Tensor x, Tensor router, Tensor w_gate_up, Tensor w_down, int first_expert, int top_k, "
                    "str group) -> Tensor", _dep_moe, _dep_moe_fake)
# Each row's result is its own (its experts' outputs, summed): the exchange moves rows
# between ranks and back, which the row-locality analysis cannot see through.
declare_row_local(dep_moe)
