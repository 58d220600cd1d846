"""Device functions shared by the Triton and Gluon decode kernels."""

import triton
import triton.language as tl


@triton.jit
def local_len(glens_ptr, s, dcp_size, dcp_rank, interleave):
    """Tokens of sequence s this rank holds (`DCPLayout.local_lengths` of its global length). A length
    past int32 is clamped to 2^31 - 1 before it is narrowed (not wrapped to a small valid one), so that
    the kernels' table check sees it past the table and reports it."""
    return local_of(tl.load(glens_ptr + s), dcp_size, dcp_rank, interleave)


@triton.jit
def local_of(g, dcp_size, dcp_rank, interleave):
    """`local_len` of global lengths g (loaded)."""
    g = tl.minimum(g, 2147483647).to(tl.int32)
    base = (g // (interleave * dcp_size)) * interleave
    return base + tl.minimum(tl.maximum(g - base * dcp_size - dcp_rank * interleave, 0), interleave)


@triton.jit
def global_pos(j, dcp_size, dcp_rank, interleave):
    """Global token positions of this rank's local tokens j (`DCPLayout`'s interleave)."""
    return (j // interleave) * (interleave * dcp_size) + dcp_rank * interleave + j % interleave


@triton.jit
def work_item(plan_ptr, v, o_ptr, lse_ptr, so_p, sl_p):
    """Launch slot v of a length plan (`triton_decode.LengthPlan`'s table: the split length, then
    (sequence, split, out row) per slot) -> (its sequence, its split of that sequence, the split
    length, o and lse moved so that a kernel's store at (split, sequence) lands on the out row: the
    launch passes the sequences' output strides as 0)."""
    split = tl.load(plan_ptr + 3 + 3 * v)
    lead = (tl.load(plan_ptr + 4 + 3 * v) - split).to(tl.int64)
    return (tl.load(plan_ptr + 2 + 3 * v), split, tl.load(plan_ptr), o_ptr + lead * so_p, lse_ptr + lead * sl_p)
