"""Device functions shared by the Triton and Gluon decode kernels."""

import triton
import triton.language as tl


@triton.jit
def local_len(glens_ptr, s, dcp_size, dcp_rank, interleave):
    """Tokens of sequence s this rank holds (`DCPLayout.local_lengths` of its global length). A length
    past int32 is clamped to 2^31 - 1 before it is narrowed (not wrapped to a small valid one), so that
    the kernels' table check sees it past the table and reports it."""
    g = tl.minimum(tl.load(glens_ptr + s), 2147483647).to(tl.int32)
    base = (g // (interleave * dcp_size)) * interleave
    return base + tl.minimum(tl.maximum(g - base * dcp_size - dcp_rank * interleave, 0), interleave)


@triton.jit
def global_pos(j, dcp_size, dcp_rank, interleave):
    """Global token positions of this rank's local tokens j (`DCPLayout`'s interleave)."""
    return (j // interleave) * (interleave * dcp_size) + dcp_rank * interleave + j % interleave
