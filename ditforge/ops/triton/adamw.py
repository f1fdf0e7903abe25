"""Triton kernel of a whole AdamW step in one memory pass: gradient scaling (clipping), the moments (fp32 or 8-bit
blockwise codes), the weight (fp32, or bf16 with a Kahan compensation or stochastic rounding) and the EMA.

Only ``@triton.jit`` functions live here; the pointer tables, grouping and launching are in
``ditforge.ops.fused_adamw``.

Multi-tensor layout: one launch serves a list of tensors of one kind (same dtypes and options). ``TABLE`` holds
one row of 8 addresses per tensor (weight, first state, second state, first absmax, second absmax, compensation,
EMA, step counter; unused ones are 0), ``GRADS`` the gradients' addresses, ``NUMEL`` the element counts, ``INDEX``
each tensor's position among the optimizer's (its random stream then does not depend on which launch serves it).
A program owns ``BLOCK`` consecutive elements of one tensor (``CHUNK_T``, ``CHUNK_START``), laid out as
BLOCK / QBLOCK rows of QBLOCK elements so that a row is one 8-bit quantization block (bitsandbytes' 256). All
arithmetic is float32.

Math (sources):
- AdamW, Loshchilov & Hutter 2019, Algorithm 2, in the order of torch's fused kernel
  (aten/src/ATen/native/cuda/fused_adam_utils.cuh, ADAMW mode): w -= lr * wd * w; m = b1 m + (1 - b1) g;
  v = b2 v + (1 - b2) g^2; w -= lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps).
- 8-bit blockwise moments, Dettmers et al. 2022, "8-bit Optimizers via Block-wise Quantization", section 2: a
  moment is code[q] * absmax of its block of 256; after the update each block's absmax is its largest |value|
  and each value is stored as the index of the nearest entry of the sorted 256-entry dynamic map (signed for m,
  unsigned for v), bitsandbytes' state layout.
- Kahan-compensated bf16 weights (Zamirai et al. 2021, "Revisiting BFloat16 Training", section 4): the master is
  w = p + c; after the update p = bf16(w) rounded to nearest even, c = bf16(w - p).
- Stochastic rounding (Gupta et al. 2015, eq. 2): add 16 uniform random bits below bf16's last bit of the fp32
  pattern and truncate; E[p] = w.
- EMA (Polyak averaging): e += rate * (w - e) on the fp32 master w, torch.lerp's formula for rate < 0.5.
"""

import triton
import triton.language as tl


@triton.jit
def _bf16_nearest(x):
    """fp32 -> the fp32 value of its bf16 rounding to nearest even, done on the bits (so the GPU and Triton's
    interpreter, whose casts truncate, agree with torch's ``.to(torch.bfloat16)`` for finite values)."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _address(row, k):
    """Field k of a tensor's row of the address table, known to be a multiple of 16 bytes."""
    return tl.multiple_of(tl.load(row + k), 16)


@triton.jit
def _quantize(x, CODE):
    """Index (uint8) of the entry of the sorted 256-entry map ``CODE`` nearest to ``x``: a binary search for the
    last entry <= x (8 loads), then the nearer of it and the next one (ties to the lower)."""
    lo = tl.zeros(x.shape, tl.int32)
    for k in tl.static_range(8):
        cand = lo + (128 >> k)
        lo = tl.where(tl.load(CODE + cand) <= x, cand, lo)
    hi = tl.minimum(lo + 1, 255)
    upper = (tl.load(CODE + hi) - x) < (x - tl.load(CODE + lo))
    return tl.where(upper, hi, lo).to(tl.uint8)


@triton.jit
def adamw_kernel(
    TABLE,  # (T, 8) int64 addresses
    GRADS,  # (T,) int64 addresses
    NUMEL,  # (T,) int64
    INDEX,  # (T,) int32: each tensor's position among the optimizer's (the stochastic rounding's stream)
    CHUNK_T,  # (programs,) int32: the tensor of each program
    CHUNK_START,  # (programs,) int64: its first element
    SCALE,  # (1,) float32 multiplier of the gradients (clipping), read on the device
    SKIP,  # (1,) float32: non-zero skips the whole step (found_inf): nothing is read or written
    CODE1,  # (256,) float32 sorted signed map (8-bit only)
    CODE2,  # (256,) float32 sorted unsigned map (8-bit only)
    lr,
    beta1,
    beta2,
    log2_beta1,
    log2_beta2,
    eps,
    weight_decay,
    ema_rate,
    seed,  # int32 base of the stochastic rounding's random stream
    W_TYPE: tl.constexpr,  # tl.float32 or tl.bfloat16
    G_TYPE: tl.constexpr,  # the gradients' element type
    EIGHTBIT: tl.constexpr,
    KAHAN: tl.constexpr,
    STOCHASTIC: tl.constexpr,
    EMA: tl.constexpr,
    BLOCK: tl.constexpr,
    QBLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    t = tl.load(CHUNK_T + pid).to(tl.int64)
    # alignment hints: addresses and offsets loaded from memory are otherwise assumed unaligned, and the loads
    # would not vectorize (the launcher checks that every address is a multiple of 16 bytes)
    start = tl.multiple_of(tl.load(CHUNK_START + pid), BLOCK)
    n = tl.where(tl.load(SKIP) == 0, tl.load(NUMEL + t), 0)  # a skipped step masks every element
    row = TABLE + t * 8
    rows = tl.arange(0, BLOCK // QBLOCK)
    offs = start + rows[:, None] * QBLOCK + tl.arange(0, QBLOCK)[None, :]
    mask = offs < n

    w_ptr = _address(row, 0).to(tl.pointer_type(W_TYPE))
    g_ptr = _address(GRADS + t, 0).to(tl.pointer_type(G_TYPE))
    step = tl.load(_address(row, 7).to(tl.pointer_type(tl.float32)))
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32) * tl.load(SCALE)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if KAHAN:
        c_ptr = _address(row, 5).to(tl.pointer_type(tl.bfloat16))
        w += tl.load(c_ptr + offs, mask=mask, other=0.0).to(tl.float32)

    if EIGHTBIT:
        q1_ptr = _address(row, 1).to(tl.pointer_type(tl.uint8))
        q2_ptr = _address(row, 2).to(tl.pointer_type(tl.uint8))
        a1_ptr = _address(row, 3).to(tl.pointer_type(tl.float32))
        a2_ptr = _address(row, 4).to(tl.pointer_type(tl.float32))
        blocks = start // QBLOCK + rows
        bmask = blocks * QBLOCK < n
        q1 = tl.load(q1_ptr + offs, mask=mask, other=0).to(tl.int32)
        q2 = tl.load(q2_ptr + offs, mask=mask, other=0).to(tl.int32)
        m = tl.load(CODE1 + q1) * tl.load(a1_ptr + blocks, mask=bmask, other=0.0)[:, None]
        v = tl.load(CODE2 + q2) * tl.load(a2_ptr + blocks, mask=bmask, other=0.0)[:, None]
    else:
        m_ptr = _address(row, 1).to(tl.pointer_type(tl.float32))
        v_ptr = _address(row, 2).to(tl.pointer_type(tl.float32))
        m = tl.load(m_ptr + offs, mask=mask, other=0.0)
        v = tl.load(v_ptr + offs, mask=mask, other=0.0)

    w = w - lr * weight_decay * w
    m = beta1 * m + (1.0 - beta1) * g
    v = beta2 * v + (1.0 - beta2) * g * g
    bias1 = 1.0 - tl.exp2(step * log2_beta1)
    bias2_sqrt = tl.sqrt(1.0 - tl.exp2(step * log2_beta2))
    w = w - (lr / bias1) * m / (tl.sqrt(v) / bias2_sqrt + eps)
    m = tl.where(mask, m, 0.0)
    v = tl.where(mask, v, 0.0)

    if EIGHTBIT:
        absmax1 = tl.max(tl.abs(m), axis=1)
        absmax2 = tl.max(v, axis=1)
        tl.store(a1_ptr + blocks, absmax1, mask=bmask)
        tl.store(a2_ptr + blocks, absmax2, mask=bmask)
        n1 = m / tl.where(absmax1 > 0, absmax1, 1.0)[:, None]
        n2 = v / tl.where(absmax2 > 0, absmax2, 1.0)[:, None]
        tl.store(q1_ptr + offs, _quantize(n1, CODE1), mask=mask)
        tl.store(q2_ptr + offs, _quantize(n2, CODE2), mask=mask)
    else:
        tl.store(m_ptr + offs, m, mask=mask)
        tl.store(v_ptr + offs, v, mask=mask)

    if KAHAN:
        p = _bf16_nearest(w)
        tl.store(w_ptr + offs, p.to(tl.bfloat16), mask=mask)
        tl.store(c_ptr + offs, _bf16_nearest(w - p).to(tl.bfloat16), mask=mask)
    elif STOCHASTIC:
        noise = tl.randint(seed + tl.load(INDEX + t) * 1000003, offs.to(tl.uint32)) & 0xFFFF
        bits = (w.to(tl.uint32, bitcast=True) + noise) & 0xFFFF0000
        tl.store(w_ptr + offs, bits.to(tl.float32, bitcast=True).to(tl.bfloat16), mask=mask)
    else:
        tl.store(w_ptr + offs, w.to(W_TYPE), mask=mask)

    if EMA:
        e_ptr = _address(row, 6).to(tl.pointer_type(tl.float32))
        e = tl.load(e_ptr + offs, mask=mask, other=0.0)
        tl.store(e_ptr + offs, e + ema_rate * (w - e), mask=mask)
