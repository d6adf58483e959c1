"""Graph -> Graph passes, one file each; `pipeline.py` lists the order in which they run.

A pass is a pure function over the IR: it takes a linted `Graph` and returns a linted `Graph`,
imports no runtime, and runs on a builder with no GPU. A pass that rewrites weights
(`fold_batch_norm`) takes and returns the weights beside the graph (`REWRITES_WEIGHTS`).
The rewrites come first (the frontends emit what the model says, no more), then dead-op removal,
a canonical op order and naming, then the layout passes and fusion. `reduce_precision` runs
between the rewrites and the layout passes where a compile asks for fp16 or bf16;
`precision.search` drives it, so the pipeline calls it directly rather than from a list.
"""

from .affine_batch_norm import affine_batch_norm
from .align_attention_masks import align_attention_masks
from .batch_constants import batch_constants
from .bias_into_broadcast import bias_into_broadcast
from .bias_into_epilogue import bias_into_epilogue
from .chain_loose_ops import chain_loose_ops
from .drop_identity_copies import drop_identity_copies
from .drop_view_clones import drop_view_clones
from .drop_precision_casts import drop_precision_casts
from .eliminate_common_subexpressions import eliminate_common_subexpressions
from .eliminate_dead_ops import eliminate_dead_ops
from .flatten_concats import flatten_concats
from .fold_constants import fold_constants
from .index_as_view import index_as_view
from .inline_scalar_constants import inline_scalar_constants
from .fold_batch_norm import fold_batch_norm
from .functionalise import functionalise
from .fuse_batch_norm_activation import fuse_batch_norm_activation
from .fuse_concats import fuse_concats
from .fuse_conv import fuse_conv
from .fuse_layer_norm_adds import fuse_layer_norm_adds
from .fuse_lone_convolutions import fuse_lone_convolutions
from .fuse_pointwise import fuse_pointwise
from .generate_broadcast_ops import generate_broadcast_ops
from .group_casts import group_casts
from .match_attention import match_attention
from .match_multi_head_attention import match_multi_head_attention
from .merge_sibling_convolutions import merge_sibling_convolutions
from .name_values import name_io, name_values
from .normalise_convolutions import normalise_convolutions
from .order_canonically import order_canonically
from .precompute_attention_masks import precompute_attention_masks
from .scatter_slice_gradients import scatter_slice_gradients
from .stack_select_gradients import stack_select_gradients
from .stack_views import stack_views

# (graph, weights) -> (graph, weights)
REWRITES_WEIGHTS = frozenset({fold_constants, index_as_view, fold_batch_norm, affine_batch_norm, match_attention,
                              inline_scalar_constants, align_attention_masks, drop_precision_casts,
                              bias_into_broadcast, merge_sibling_convolutions})

__all__ = ["REWRITES_WEIGHTS", "affine_batch_norm", "align_attention_masks", "batch_constants", "bias_into_broadcast",
           "bias_into_epilogue", "chain_loose_ops",
           "drop_identity_copies", "drop_precision_casts",
           "eliminate_common_subexpressions", "eliminate_dead_ops", "flatten_concats", "fold_constants",
           "fold_batch_norm", "functionalise", "fuse_batch_norm_activation", "fuse_concats", "fuse_conv", "fuse_layer_norm_adds", "fuse_lone_convolutions", "fuse_pointwise",
           "generate_broadcast_ops", "group_casts", "index_as_view", "inline_scalar_constants",
           "match_attention", "match_multi_head_attention", "merge_sibling_convolutions", "name_io", "name_values",
           "normalise_convolutions",
           "order_canonically", "precompute_attention_masks", "scatter_slice_gradients", "stack_select_gradients",
           "stack_views", "drop_view_clones"]
