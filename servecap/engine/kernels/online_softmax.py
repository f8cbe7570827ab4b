"""The online-softmax update shared by the attention kernels (flash-attention's running max and sum)."""
import triton
import triton.language as tl


@triton.jit
def online_softmax_step(acc, l_i, m_i, s, v, DOT_PRECISION: tl.constexpr):
    """Fold one key tile into the running output: s [M, N] the tile's base-2 scores, masked keys at -inf; v [N, D].

    acc [M, D] holds the unnormalised output, l_i [M] the sum of exponentials and m_i [M] the running max, all
    fp32; the caller divides acc by l_i at the end. m_i must start finite, or be finite after the first tile for
    every row, so that a tile masked out for a row rescales it by exp2(0), not exp2(nan).
    """
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return acc, l_i, m_new
