"""The kernel library: generated Triton kernels (`codegen.py`, `generated.py`, launched without
Triton from a recalled binary: `binaries.py`), cuDNN graphs (`cudnn_graph.py`), the float32
product (`gemm.py`), attention (`small_attention.py`), reductions and pooling (`reductions.py`,
`fused_mean.py`), convolutions of a 1x1 map, depthwise and 1x1 (`pooled_conv.py`,
`depthwise_conv.py`, `pointwise_conv.py`), roll (`movement.py`), and the fused op's dispatcher
over them (`fused.py`, with `on_load.py`). Measured choices are kept across processes
(`recall.py`). It imports only `base/` and the IR."""
