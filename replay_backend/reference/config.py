"""Configuration of the DSv4.1-mini reference model and its presets."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a DeepSeek-V4.1-style model.

    Layer roles follow from ``kv_source_layer_ids``: layers below the first source
    have sliding-window attention only, each source owns a compressor writing the
    global KV (ratio 2, except the last source which has ratio 1), and the layers
    after the last source (the *cut*) are the decoder replay layers.
    """

    name: str = "tiny"
    vocab_size: int = 512
    hidden_size: int = 256
    num_layers: int = 40
    hc_mult: int = 4
    window: int = 128
    kv_source_layer_ids: tuple[int, ...] = (2, 8, 14, 20)
    num_heads: int = 4
    head_dim: int = 64
    rope_dim: int = 32
    q_lora_rank: int = 128
    o_groups: int = 2
    o_lora_rank: int = 64
    num_experts: int = 4
    top_k: int = 2
    moe_intermediate_size: int = 128
    shared_intermediate_size: int = 128
    rms_eps: float = 1e-6
    hc_eps: float = 1e-6
    sinkhorn_iters: int = 20
    rope_theta: float = 10000.0
    seed: int = 0
    # "auto": the Triton kernel on CUDA when triton is importable, else the PyTorch
    # reference; "reference" / "triton" force one (triton on CPU needs TRITON_INTERPRET=1);
    # "flashinfer": FlashInfer's prefill kernels (CUDA, 16-bit models, the ``gpu`` extra).
    attention_impl: str = "auto"
    # "auto": grouped GEMMs on CUDA when torch._grouped_mm exists, else dense.
    moe_impl: str = "auto"
    # The grouped path's sort, SwiGLU and combine: "auto" Triton kernels where triton
    # is importable (four launches, the same results to the bit), "reference" the
    # PyTorch ops (about twelve launches), "triton" the kernels or an error.
    moe_permute_impl: str = "auto"
    # The Triton attention may split a call's global keys into chunks walked in parallel
    # (few row blocks over many keys, as in a long prompt's replay rows); False keeps
    # every call whole (one kernel, as before the split).
    attention_split: bool = True
    # "fused": the mHC Sinkhorn as one op, one Triton kernel on CUDA (the reference math
    # inside the op elsewhere); "reference": PyTorch ops, ~2 kernels per iteration after
    # Inductor and ~160 more graph nodes per layer for Dynamo to trace.
    sinkhorn_impl: str = "fused"

    def __post_init__(self) -> None:
        wrong = [f"{f.name} must be {_TYPE_NAMES[f.type]}, got {getattr(self, f.name)!r}"
                 for f in dataclasses.fields(self) if not _of_type(getattr(self, f.name), f.type)]
        if wrong:  # the checks below compare values, which a wrong type would break first
            raise ValueError("invalid ModelConfig: " + "; ".join(wrong))
        problems = []
        srcs = list(self.kv_source_layer_ids)
        if not srcs:
            problems.append("kv_source_layer_ids must name at least one layer")
        if srcs != sorted(set(srcs)):
            problems.append(f"kv_source_layer_ids must be strictly increasing, got {srcs}")
        if srcs and (srcs[0] < 0 or srcs[-1] >= self.num_layers):
            problems.append(f"kv_source_layer_ids {srcs} out of range for num_layers={self.num_layers}")
        if self.num_heads % self.o_groups:
            problems.append(f"num_heads={self.num_heads} is not a multiple of o_groups={self.o_groups}")
        if self.rope_dim % 2 or not 0 < self.rope_dim <= self.head_dim:
            problems.append(f"rope_dim={self.rope_dim} must be even and in (0, head_dim={self.head_dim}]")
        if not 0 < self.top_k <= self.num_experts:
            problems.append(f"top_k={self.top_k} must be in [1, num_experts={self.num_experts}]")
        for key in ("vocab_size", "hidden_size", "num_layers", "hc_mult", "window", "num_heads",
                    "head_dim", "q_lora_rank", "o_lora_rank", "moe_intermediate_size",
                    "shared_intermediate_size", "sinkhorn_iters"):
            if getattr(self, key) <= 0:
                problems.append(f"{key} must be positive, got {getattr(self, key)}")
        if self.attention_impl not in ("auto", "reference", "triton", "flashinfer"):
            problems.append(f"attention_impl must be auto, reference, triton or flashinfer, got {self.attention_impl!r}")
        if self.moe_impl not in ("auto", "dense", "grouped"):
            problems.append(f"moe_impl must be auto, dense or grouped, got {self.moe_impl!r}")
        if self.moe_permute_impl not in ("auto", "reference", "triton"):
            problems.append(f"moe_permute_impl must be auto, reference or triton, got {self.moe_permute_impl!r}")
        if self.sinkhorn_impl not in ("reference", "fused"):
            problems.append(f"sinkhorn_impl must be reference or fused, got {self.sinkhorn_impl!r}")
        if problems:
            raise ValueError("invalid ModelConfig: " + "; ".join(problems))

    # ---- derived layer roles -------------------------------------------------------
    @property
    def cut(self) -> int:
        """Index of the last KV source layer: the decoder-replay boundary follows it."""
        return max(self.kv_source_layer_ids)

    @property
    def replay_layers(self) -> range:
        return range(self.cut + 1, self.num_layers)

    def compress_ratio(self, layer: int) -> int:
        """Compressor ratio of a KV source layer (2 for early sources, 1 for the last)."""
        if layer not in self.kv_source_layer_ids:
            raise ValueError(f"layer {layer} is not a KV source")
        return 1 if layer == self.cut else 2

    @property
    def global_ratios(self) -> set[int]:
        """The ratios of the global caches the layers read (every source reads its own)."""
        return {self.compress_ratio(s) for s in self.kv_source_layer_ids}

    def global_source(self, layer: int) -> int | None:
        """The latest KV source at or below ``layer`` (None for SWA-only layers)."""
        below = [s for s in self.kv_source_layer_ids if s <= layer]
        return below[-1] if below else None

    def layer_kind(self, layer: int) -> str:
        if layer in self.kv_source_layer_ids:
            return "source"
        return "global" if self.global_source(layer) is not None else "swa"

    def with_layers(self, num_layers: int, kv_source_layer_ids: tuple[int, ...] | list[int]) -> "ModelConfig":
        """Shrunk copy keeping the layer roles (e.g. 8 layers, sources (1, 3))."""
        return dataclasses.replace(self, num_layers=num_layers,
                                   kv_source_layer_ids=tuple(kv_source_layer_ids))

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    def differs_beyond_implementation(self, other: "ModelConfig") -> list[str]:
        """The fields in which ``other`` is another model, not another implementation
        of this one (``IMPLEMENTATION_FIELDS`` aside)."""
        return [f.name for f in dataclasses.fields(self)
                if f.name not in IMPLEMENTATION_FIELDS and getattr(self, f.name) != getattr(other, f.name)]


_TYPE_NAMES = {"int": "an integer", "float": "a number", "str": "a string", "bool": "true or false",
               "tuple[int, ...]": "a tuple of layer ids"}


def _of_type(value, annotation: str) -> bool:
    """Whether ``value`` is of a field's declared type (bool is not an integer here)."""
    if annotation == "tuple[int, ...]":
        return isinstance(value, tuple) and all(_of_type(v, "int") for v in value)
    if annotation in ("int", "float") and isinstance(value, bool):
        return False
    kinds = {"int": int, "float": (int, float), "str": str, "bool": bool}
    return isinstance(value, kinds[annotation])


# The fields that choose how the model computes, not what: two configs that differ only
# in these compute the same function (up to rounding).
IMPLEMENTATION_FIELDS = ("attention_impl", "moe_impl", "moe_permute_impl", "attention_split", "sinkhorn_impl")


PRESETS: dict[str, ModelConfig] = {
    "tiny": ModelConfig(),
    "mini-1k": ModelConfig(
        name="mini-1k", vocab_size=16384, hidden_size=1024, num_heads=8, head_dim=128,
        rope_dim=64, q_lora_rank=384, o_groups=4, o_lora_rank=256, num_experts=8, top_k=2,
        moe_intermediate_size=512, shared_intermediate_size=512),
    "mini-2k": ModelConfig(
        name="mini-2k", vocab_size=32768, hidden_size=2048, num_heads=16, head_dim=128,
        rope_dim=64, q_lora_rank=768, o_groups=8, o_lora_rank=512, num_experts=16, top_k=2,
        moe_intermediate_size=1024, shared_intermediate_size=1024),
}


def preset(name: str, **overrides) -> ModelConfig:
    """A named preset, optionally with fields replaced (``layers=8, sources=(1, 3)``
    style shrinking is done with :meth:`ModelConfig.with_layers`)."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
    cfg = PRESETS[name]
    return dataclasses.replace(cfg, **overrides) if overrides else cfg
