"""Which row-locality rule each op takes (:mod:`.row_local`): the ops that keep rows
apart by kind (pointwise, shape moves, reshapes, constant factories, size queries),
the ops that work along a dimension, and the rule of every other op by name. An op
in none of them is refused."""
from __future__ import annotations

from .row_indexing import getitem, setitem
from .row_rules import (along_dim, batch_norm, convolution, dropout, einsum, embedding, group_norm,
                        index_along_dim, indexed_along_dim, layer_norm, local_response_norm, matmul, maxmin,
                        outer, pad, pooling, random_draw, reshape)

POINTWISE = frozenset({
    "add", "sub", "mul", "truediv", "div", "floordiv", "mod", "remainder", "neg", "pos", "pow", "abs",
    "exp", "exp2", "expm1", "log", "log2", "log10", "log1p", "sqrt", "rsqrt", "reciprocal", "square", "sign",
    "sigmoid", "silu", "relu", "relu6", "gelu", "tanh", "softplus", "mish", "elu", "selu", "celu", "leaky_relu",
    "hardtanh", "hardswish", "hardsigmoid", "logsigmoid", "softsign", "tanhshrink", "threshold", "erf", "erfc",
    "sin", "cos", "tan", "atan", "atan2", "asin", "acos", "sinh", "cosh", "floor", "ceil", "round", "trunc", "frac",
    "clamp", "clamp_min", "clamp_max", "clip", "maximum", "minimum", "fmax", "fmin", "where", "masked_fill",
    "lerp", "addcmul", "addcdiv", "hypot", "logaddexp", "isnan", "isinf", "isfinite", "logit", "xlogy",
    "eq", "ne", "lt", "le", "gt", "ge", "logical_and", "logical_or", "logical_not", "logical_xor",
    "and_", "or_", "xor", "invert", "lshift", "rshift", "bitwise_and", "bitwise_or", "bitwise_xor", "bitwise_not",
    "float", "double", "half", "bfloat16", "int", "long", "bool", "to", "type", "type_as", "clone", "contiguous",
    "detach", "nan_to_num", "polar", "real", "imag", "conj",
    "iadd", "isub", "imul", "itruediv", "add_", "sub_", "mul_", "div_", "copy_", "fill_", "zero_",
})
# Shape ops that move or split dimensions but keep the token dimension whole: the
# checks every call passes (one whole token dimension in and out) are their proof.
MOVES = frozenset({"unsqueeze", "squeeze", "transpose", "permute", "t", "expand", "expand_as", "movedim",
                   "moveaxis", "swapaxes", "swapdims", "broadcast_to", "repeat", "tile", "view_as_complex",
                   "view_as_real", "T", "mT", "H", "mH", "adjoint"})
# Reshapes: row-local when as many elements precede the token dimension before and after.
RESHAPES = frozenset({"view", "reshape", "flatten", "unflatten", "view_as", "reshape_as", "_unsafe_view"})
# Ops whose values are the same for every row, whatever shape they are given.
CONSTANT_FACTORIES = frozenset({"zeros", "ones", "full", "empty", "empty_strided", "new_zeros", "new_ones",
                                "new_full", "new_empty", "zeros_like", "ones_like", "full_like", "empty_like"})
# Reading no rows, they make the same values for every row of the token dimension they make.
SAME_FOR_EVERY_ROW = CONSTANT_FACTORIES | {"expand", "expand_as", "broadcast_to"}
SIZES = frozenset({"aten::sym_size", "aten::sym_numel", "aten::sym_stride", "size", "dim", "numel", "stride",
                   "shape", "ndim", "dtype", "device", "layout", "is_cuda", "requires_grad"})
ALONG_DIM = frozenset({
    "sum", "nansum", "mean", "nanmean", "amax", "amin", "prod", "var", "std", "var_mean", "std_mean",
    "logsumexp", "all", "any", "argmax", "argmin", "median", "nanmedian", "mode", "kthvalue", "quantile",
    "nanquantile", "count_nonzero", "aminmax", "norm", "linalg_vector_norm", "vector_norm", "linalg_norm",
    "normalize", "cosine_similarity", "softmax", "log_softmax", "softmin", "cumsum", "cumprod", "cummax",
    "cummin", "logcumsumexp", "sort", "argsort", "topk", "flip", "roll", "diff", "glu", "unfold",
    "cat", "concat", "concatenate", "stack", "chunk", "split", "split_with_sizes", "tensor_split", "unbind",
    "narrow", "select", "slice",
})
RULES = {
    **{n: along_dim for n in ALONG_DIM},
    "max": maxmin, "min": maxmin,
    "fliplr": lambda c: along_dim(c, fixed=1), "flipud": lambda c: along_dim(c, fixed=0),
    "msort": lambda c: along_dim(c, fixed=0),
    **{n: indexed_along_dim for n in ("gather", "scatter", "scatter_add", "scatter_reduce", "take_along_dim")},
    **{n: index_along_dim for n in ("index_select", "index_add", "index_copy", "index_fill")},
    "layer_norm": layer_norm, "rms_norm": layer_norm, "group_norm": group_norm,
    "batch_norm": batch_norm, "instance_norm": batch_norm, "local_response_norm": local_response_norm,
    "pad": pad, "constant_pad_nd": pad,
    **{f"{p}{k}d": convolution for p in ("conv", "conv_transpose") for k in (1, 2, 3)},
    **{f"{p}{k}d": pooling for p in ("avg_pool", "max_pool", "adaptive_avg_pool", "adaptive_max_pool", "lp_pool")
       for k in (1, 2, 3)},
    **{f"max_pool{k}d_with_indices": pooling for k in (1, 2, 3)},
    **{f"upsample_{m}": pooling for m in ("nearest1d", "nearest2d", "nearest3d", "linear1d", "bilinear2d",
                                          "bicubic2d", "trilinear3d", "nearest_exact1d", "nearest_exact2d")},
    "interpolate": pooling, "upsample": pooling,
    **{n: matmul for n in ("matmul", "mm", "bmm", "baddbmm", "addmm", "addbmm", "mv", "addmv", "linear")},
    "outer": outer, "ger": outer, "einsum": einsum, "embedding": embedding, "getitem": getitem, "setitem": setitem,
    **{n: random_draw for n in ("rand_like", "randn_like", "randint_like", "bernoulli", "normal", "uniform_")},
    **{n: dropout for n in ("dropout", "alpha_dropout", "feature_alpha_dropout", "dropout1d", "dropout2d")},
    **{n: reshape for n in RESHAPES},
}
# Parameters whose symbolic values are sizes (the row count may size a shape, but a
# value computed from it differs between a step and its replay rows, or padded rows).
SHAPE_PARAMS = frozenset({"size", "shape", "sizes", "normalized_shape", "split_size", "split_size_or_sections",
                          "split_sizes", "indices_or_sections", "sections", "length", "start", "end", "pad",
                          "output_size", "chunks", "repeats", "stride"})
