"""One device allocation for each group of tensors a load holds (the weights that stay whatever
the layout, the arena and the input buffers; the convolution weights in each layout), with every
tensor a view at an aligned offset inside it.

Allocated one by one, tensors land in the caching allocator's segments (2 MiB for those under
1 MiB, 20 MiB for those under 10 MiB) and leave the rest of each segment free but reserved: tens
of MiB for a conv net's weights (`footprint.py` counts it as `cached`). One allocation per group
reserves its size rounded up to 2 MiB (a group between 1 and 10 MiB asks for 10 MiB, which the
allocator gives a segment of its own, rather than a 20 MiB one), and where a group is dropped
(the weight layout tuning did not choose), the whole of it goes back to the device.
"""

from __future__ import annotations

from typing import Mapping

import torch

ALIGN = 512  # bytes: what the caching allocator aligns every block to, so kernels see the same alignment
# The caching allocator serves a request above SMALL and below SEGMENT_OF_ITS_OWN from a 20 MiB
# segment, and a larger one from a segment of its own size (rounded up to 2 MiB)
SMALL, SEGMENT_OF_ITS_OWN = 2**20, 10 * 2**20


def _dense_strides(t: torch.Tensor, memory_format: torch.memory_format) -> tuple[int, ...]:
    """The strides `t`'s copy takes: `memory_format`'s where it is channels_last (4-D), else those
    `t.to(device)` would give it (its own where they cover its elements once)."""
    if memory_format == torch.channels_last and t.dim() == 4:
        n, c, h, w = t.shape
        return (h * w * c, 1, w * c, c)
    return torch.empty_like(t, device="meta").stride()  # preserve_format: its own strides where dense


def pack(tensors: Mapping, device: torch.device, memory_format: torch.memory_format = torch.preserve_format,
         blank: Mapping | None = None, strides: Mapping | None = None) -> dict:
    """Copies of `tensors` on `device`, all views into one new allocation (which they keep alive),
    each at a multiple of ALIGN bytes; and for each key of `blank`, that many bytes left as they
    are (a uint8 view). A key of `strides` gets those strides (dense ones: the copy rearranges
    on the device). Raises the allocator's error when the device is full."""
    blank = blank or {}
    if not tensors and not blank:
        return {}
    layout, size = [], 0
    for key, t in tensors.items():
        strides_of = (strides or {}).get(key) or _dense_strides(t, memory_format)
        layout.append((key, t, strides_of, size))
        size += -(-t.numel() * t.element_size() // ALIGN) * ALIGN
    spaces = {}
    for key, nbytes in blank.items():
        spaces[key] = (size, nbytes)
        size += -(-nbytes // ALIGN) * ALIGN
    if SMALL < size < SEGMENT_OF_ITS_OWN:  # else a 20 MiB segment, whose rest stays reserved
        size = SEGMENT_OF_ITS_OWN
    region = torch.empty(size, dtype=torch.uint8, device=device)
    packed = {key: region[offset: offset + nbytes] for key, (offset, nbytes) in spaces.items()}
    for key, t, strides_of, offset in layout:
        nbytes = t.numel() * t.element_size()
        flat = region[offset: offset + nbytes].view(t.dtype)
        view = flat.as_strided(t.shape, strides_of, flat.storage_offset())
        view.copy_(t)
        packed[key] = view
    return packed
