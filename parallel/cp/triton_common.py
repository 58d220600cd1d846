"""Device functions shared by the Triton and Gluon decode kernels."""

import triton
import triton.language as tl


@triton.jit
def local_len(glens_ptr, s, dcp_size, dcp_rank, interleave):
    """Tokens of sequence s this rank holds (`DCPLayout.local_lengths` of its global length)."""
    g = tl.load(glens_ptr + s).to(tl.int32)
    base = (g // (interleave * dcp_size)) * interleave
    return base + tl.minimum(tl.maximum(g - base * dcp_size - dcp_rank * interleave, 0), interleave)


@triton.jit
def global_pos(j, dcp_size, dcp_rank, interleave):
    """Global token positions of this rank's local tokens j (`DCPLayout`'s interleave)."""
    return (j // interleave) * (interleave * dcp_size) + dcp_rank * interleave + j % interleave
