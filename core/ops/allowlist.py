"""The aten operators nimble lowers to device tasks, grouped as docs/supported-ops.md lists them (generated from here by tools/gen_docs.py).

An op outside this list is rejected at compile time with its name and the model's source line,
and an artifact naming one is rejected at load time. What an artifact may name is narrower still:
an exact overload of these names that is not an `out=` overload (`targets.device_ops` builds that
table). No op here makes a view of arbitrary geometry: every view op derives its result from its
input's own sizes and strides, and torch checks that it stays inside the input's storage
(`_reshape_alias` and `as_strided` do not, so they are not here). Host-side scalar and list work (aten::size,
aten::Int, prim::ListConstruct, ...) never reaches the op list: the frontend folds it.
"""

SUPPORTED: dict[str, tuple[str, ...]] = {
    "convolution and linear algebra": (
        "_convolution", "convolution", "conv1d", "conv2d", "conv3d", "conv_transpose1d",
        "conv_transpose2d", "linear", "addmm", "mm", "bmm", "matmul", "baddbmm", "einsum",
        "scaled_dot_product_attention",
    ),
    "normalization": (
        "batch_norm", "_native_batch_norm_legit_no_training", "layer_norm", "native_layer_norm",
        "group_norm", "native_group_norm", "instance_norm", "rms_norm",
    ),
    "activations": (
        "relu", "relu6", "leaky_relu", "elu", "selu", "gelu", "silu", "mish", "sigmoid", "tanh",
        "hardtanh", "hardswish", "hardsigmoid", "softplus", "clamp", "clamp_min", "clamp_max",
        "softmax", "_softmax", "log_softmax", "_log_softmax",
    ),
    "pooling and resizing": (
        "max_pool1d", "max_pool2d", "max_pool2d_with_indices", "avg_pool1d", "avg_pool2d",
        "adaptive_avg_pool1d", "adaptive_avg_pool2d", "_adaptive_avg_pool2d", "adaptive_max_pool2d",
        "max_pool3d", "avg_pool3d", "adaptive_avg_pool3d",
        "upsample_nearest2d", "upsample_bilinear2d", "pixel_shuffle",
    ),
    "pointwise arithmetic": (
        "add", "sub", "rsub", "mul", "div", "neg", "pow", "sqrt", "rsqrt", "exp", "log", "abs",
        "reciprocal", "erf", "sin", "cos", "floor", "ceil", "round", "sign", "where", "lerp",
        "addcmul", "addcdiv", "maximum", "minimum", "eq", "ne", "lt", "le", "gt", "ge",
        "logical_and", "logical_or", "logical_not", "masked_fill", "bitwise_not", "bitwise_and", "bitwise_or",
        "__and__", "__or__",
    ),
    "reductions": (
        "mean", "sum", "prod", "amax", "amin", "max", "min", "argmax", "argmin", "var", "std",
        "norm", "linalg_vector_norm", "cumsum", "logsumexp", "topk", "sort",
    ),
    "shape, views and copies": (
        "view", "reshape", "flatten", "unflatten", "squeeze", "unsqueeze",
        "permute", "transpose", "swapaxes", "swapdims", "movedim", "moveaxis", "t", "contiguous", "expand",
        "expand_as", "repeat", "select",
        "slice", "narrow", "chunk", "split", "split_with_sizes", "unbind", "cat", "concat", "stack",
        "flip", "roll", "index_select", "gather", "embedding", "to", "_to_copy", "type_as",
        "clone", "detach", "alias", "pad", "constant_pad_nd", "reflection_pad2d",
        "replication_pad2d", "zeros_like", "ones_like", "full_like", "new_zeros", "new_ones", "new_full", "copy", "channel_shuffle",
        "native_channel_shuffle", "tril", "triu", "index",
    ),
    "in-place variants kept after mutation removal": (
        "add_", "sub_", "mul_", "div_", "relu_", "relu6_", "hardtanh_", "hardswish_",
        "hardsigmoid_", "sigmoid_", "silu_", "clamp_", "clamp_min_", "copy_", "masked_fill_",
        "fill_", "zero_", "leaky_relu_", "gelu_", "tanh_",
    ),
}

# Lowered only for `Nimble(module).prepare(..., training=True)`: random ops run on every call.
TRAINING_ONLY: tuple[str, ...] = (
    "dropout", "feature_dropout", "alpha_dropout", "feature_alpha_dropout", "native_dropout",
    "dropout_", "feature_dropout_", "alpha_dropout_", "feature_alpha_dropout_",
    "bernoulli", "bernoulli_", "rand", "rand_like", "randn", "randn_like", "empty", "empty_like",
    "uniform_", "normal_",
    # a training step's own ops (`frontend/joint.py`): batch norm that returns its new running
    # statistics, the losses, the backward ops torch's joint trace records whole, and attention as
    # the CPU runs it and as a CUDA step traces it (`frontend/joint.attention_kernels`: the
    # memory-efficient kernel; the flash and cuDNN kernels are not listed)
    "_native_batch_norm_legit_functional", "scatter", "scalar_tensor", "full", "zeros", "ones", "fill",
    "nll_loss_forward", "nll_loss_backward", "mse_loss", "mse_loss_backward",
    "convolution_backward", "threshold_backward", "native_batch_norm_backward", "native_layer_norm_backward",
    "native_group_norm_backward", "max_pool2d_with_indices_backward", "avg_pool2d_backward",
    "_adaptive_avg_pool2d_backward", "embedding_dense_backward", "gelu_backward", "sigmoid_backward",
    "tanh_backward", "silu_backward", "hardswish_backward", "hardsigmoid_backward", "hardtanh_backward",
    "leaky_relu_backward", "elu_backward", "softplus_backward", "_softmax_backward_data",
    "_log_softmax_backward_data", "native_dropout_backward", "select_backward", "slice_backward",
    "index_put", "_unsafe_index_put", "new_empty_strided", "upsample_nearest2d_backward",
    "upsample_bilinear2d_backward", "_unsafe_view", "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_flash_attention_for_cpu_backward", "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_efficient_attention_backward",
    # a slice written in place, functionalised (Swin's attention mask, built on zeros, and V2's
    # query-key-value bias with its key's third zeroed): run every step, as they read parameters
    "slice_scatter", "zero",
)

SUPPORTED_ATEN = frozenset(name for group in SUPPORTED.values() for name in group)

# Host-side ops that read only a tensor's metadata: folded at compile time for static shapes.
METADATA_OPS = frozenset({
    "aten::size", "aten::dim", "aten::len", "aten::numel", "aten::stride",
    "aten::is_floating_point", "aten::is_contiguous", "prim::shape", "prim::is_cuda",
    "aten::is_complex", "aten::__isnot__", "aten::__is__",
})

# Ops that may run on the host while a `.pt2` is lowered, besides the allowlisted ones: factories
# and integer arithmetic that index and mask computations fold to constants. Every fold is sized on
# the meta device first and refused above `GraphBuilder.fold_limit` bytes. Any other op in a program is
# refused before it runs (`aten::from_file` would read or map a file, `aten::_print` write to the
# terminal).
HOST_FOLDABLE = frozenset({
    "zeros", "ones", "full", "arange", "scalar_tensor", "eye", "linspace", "empty", "lift_fresh_copy",
    "floor_divide", "remainder", "fmod", "bitwise_xor", "__xor__",
    "diff",  # GPT-2 without a mask diffs its constant positions to find packed sequences
})

# Ops whose result changes from call to call; a constant-folded copy would be wrong.
NONDETERMINISTIC = frozenset({
    "rand", "randn", "randint", "rand_like", "randn_like", "randint_like", "bernoulli",
    "normal", "uniform", "multinomial", "randperm", "empty", "empty_like", "empty_strided",
})

# Ops whose result's shape depends on the values of their input (and on a device tensor, say,
# the boxes that survive detection post-processing): nimble's shapes follow from input shapes
# alone. `aten::where` with one argument is `nonzero`; `aten::index` with a boolean mask is too.
DATA_DEPENDENT = frozenset({
    "aten::nonzero", "aten::nonzero_numpy", "aten::argwhere", "aten::masked_select", "aten::unique",
    "aten::_unique", "aten::_unique2", "aten::unique_dim", "aten::unique_consecutive", "aten::bincount",
    "aten::repeat_interleave", "aten::masked_scatter", "torchvision::nms", "torchvision::batched_nms",
})
