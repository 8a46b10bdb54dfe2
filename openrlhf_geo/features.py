"""Per-response LM-head-gradient proxy features (SALT Eq. 19) and last-token hidden states (GeoAlign input).

SALT's Gram is built from G_i = (1/T_i) Σ_t e_t h_tᵀ / τ, the gradient of response i's mean action log-prob
log_softmax(z_t/τ)[y_t] w.r.t. lm_head.weight (V, d), with e_t = onehot(y_t) − softmax(z_t/τ) and h_t the lm_head
input. SALT needs only the Gram ⟨G_i, G_j⟩_F of these (§3.2: the proxy must "preserve the sample-wise geometry";
App. E); the paper does not say how it forms them at LLM sizes. Three feature maps, all linear in G_i:

- `exact`: vec(G_i), V·d columns (tiny models, tests).
- `sketch` (default): a blocked TensorSketch (after Pham & Pagh 2013) of vec(G_i) into D = dim = L·P columns, P
  the smallest divisor of D that is ≥ d. A CountSketch C_V sends token v to bucket b_V(v) = q·L + r, i.e. position
  q of block r; a random injection b_d sends hidden coordinate c to [0, P); entry (v, c) of G_i goes to position
  (q + b_d(c)) mod P of block r with sign s_V(v)·s_d(c). So φ_i = (1/T_i) Σ_t (C_V e_t) ⊛_P (C_d h_t) / τ, a circular
  convolution within each of the L blocks, computed as a product of real FFTs of length P (with the plain
  TensorSketch's one FFT of length D the pass took 1.9× as long at D = 102400 on a CPU: cache). C_V e_t costs
  O(V) per token (one pass of exp over the logits, no V×k product), the rest O(D log P). With independent random
  signs E⟨φ_i, φ_j⟩ = ⟨G_i, G_j⟩_F; two token ids share a block with probability about 1/L, so on average an inner
  product's error has the variance of a Johnson-Lindenstrauss sketch of D rows, (‖G_i‖²‖G_j‖² + ⟨G_i, G_j⟩²)/D,
  and at most 4‖G_i‖²‖G_j‖²/(P − 1) (`sketch_hashes`; measured: benchmarks/README.md). When V·d ≤ D the sketch is
  exact: the features are vec(G_i) itself.
- `kronecker` (the default before the TensorSketch): φ_i = vec(S_e G_i S_hᵀ) = (1/T_i) Σ_t (S_e e_t) ⊗ (S_h h_t) / τ
  with fixed seeded Rademacher S_e (k, V), S_h (k, d), k = √dim (`kronecker_projections`). Also unbiased, but its
  D = k² entries share k rows and k columns, so the error of a rank-one term is ~√(2/k) rather than ~1/√D (its
  Gram cosines carry ~1.7× the TensorSketch's noise at the same D on the benchmark's rollouts), and S_e e_t costs
  O(k·V) per token. `sketch_gram` estimates its noise per entry (`--salt.gram shrink`).

All run on the tensors the experience forward already has (logits, final hidden states), chunked over tokens so
the extra memory is O(chunk_size·V + B·S) (+ R·D for the output), and never form a V×d tensor per response.
`lm_head_gram` gives the exact Gram without any feature vector, from token pairs (a reference at LLM sizes).
"""

import functools
import math
import operator
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from types import SimpleNamespace
from typing import NamedTuple, cast

import numpy as np
import torch

METHODS = ("sketch", "kronecker", "exact")
# The default sketch size D: JL-like noise ≈ 1/√D per Gram cosine, and the Gram costs O(m²·D) (benchmarks/README.md
# measures both). 320² (a perfect square: the --salt.dim contract since the Kronecker sketch's k × k) keeps a' within
# the fidelity target with shared prompt prefixes at m = 256 and Qwen2.5-1.5B's LM-head shape, where 160² and 256²
# fall short, and the Gram + solve at m = 1024 within 1 s on 2 cores.
DEFAULT_DIM = 102400
# `exact` returns R rows of V·d floats; above this V·d the sketch is the only sensible choice.
EXACT_MAX_NUMEL = 2**26
# Masked tokens per chunk: bounds the float32 buffers over the vocabulary (156 MB per chunk at V=151936; the
# caller's logits for the same tokens are as large). benchmarks/salt_overhead.py sweeps it.
DEFAULT_CHUNK_SIZE = 256
# Below this Σ_v exp(z_v/τ) (every z_v/τ < −50) the sketch's unshifted exp would lose the distribution's tail to
# float32 underflow: such rows are redone shifted by their maximum.
UNDERFLOW_TOTAL = math.exp(-50)
# Tokens per tile of the sketch on a CPU: its (tile, D) buffers (exp of a vocabulary block, the FFTs) stay in cache
# (benchmarks/salt_overhead.py sweeps it: at D = 102400, 8 tokens took 0.59× the time of 32).
EXP_TILE = 8


class SketchHashes(NamedTuple):
    """The TensorSketch's fixed hash functions (`sketch_hashes`): entry (v, c) of a (V, d) matrix goes to bucket
    P·r + (q + hidden_bucket[c]) mod P, where vocab_bucket[v] = q·L + r (L = D / P), with sign
    vocab_sign[v] · hidden_sign[c]."""

    vocab_bucket: torch.Tensor  # (V,) int64 in [0, D)
    vocab_sign: torch.Tensor  # (V,) float32 ±1
    hidden_bucket: torch.Tensor  # (d,) int64 in [0, P)
    hidden_sign: torch.Tensor  # (d,) float32 ±1
    block: int  # P: the length of the circular convolutions, D = L·P


def _block_length(dim: int, hidden_size: int) -> int:
    """P: the smallest divisor of D that is >= d (D itself when d > D)."""
    return next((p for p in range(hidden_size, dim) if dim % p == 0), dim)


@functools.lru_cache(maxsize=4)
def _hash_storage(seed: int, vocab_size: int, hidden_size: int, dim: int, device: torch.device):
    """(SketchHashes on `device`, vocabulary block offsets as ints), drawn on the CPU: the same bits everywhere."""
    gen = torch.Generator().manual_seed(seed)
    # Hidden side first: it then depends on (seed, d, D) only, whatever the vocabulary size. d <= P: a random
    # injection, so no two entries of one vocabulary row share a bucket.
    block = _block_length(dim, hidden_size)
    hidden_bucket = torch.randperm(max(block, hidden_size), generator=gen)[:hidden_size] % block
    hidden_sign = 2 * torch.randint(0, 2, (hidden_size,), generator=gen) - 1
    # Vocabulary blocks of D consecutive ids, each cyclically shifted by a uniform offset: an exp pass over the
    # logits then adds whole slices (no scatter), ids in one block never share a bucket, ids in two blocks do with
    # probability 1/D. Bucket q·L + r is position q of convolution block r, so consecutive ids land in different
    # blocks.
    offsets = torch.randint(0, dim, (-(-vocab_size // dim),), generator=gen)
    vocab_sign = 2 * torch.randint(0, 2, (vocab_size,), generator=gen) - 1
    ids = torch.arange(vocab_size)
    vocab_bucket = (ids % dim + offsets[ids // dim]) % dim
    hashes = SketchHashes(
        vocab_bucket.to(device),
        vocab_sign.float().to(device),
        hidden_bucket.to(device),
        hidden_sign.float().to(device),
        block,
    )
    return hashes, tuple(offsets.tolist())


def sketch_hashes(
    vocab_size: int, hidden_size: int, dim: int = DEFAULT_DIM, seed: int = 0, device="cpu"
) -> SketchHashes:
    """The fixed hash functions of the TensorSketch of (V, d) matrices into D = dim buckets, as `SketchHashes`.

    Signs are independent Rademacher, so E[sign(a) sign(a')] = [a = a'] for entries a, a' of the (V, d) grid and the
    sketch's inner products are unbiased for ⟨G_i, G_j⟩_F. Buckets: D = L·P with P the smallest divisor of D that
    is ≥ d (P = D when d > D); b_d is a uniformly random injection of the d hidden coordinates into [0, P) (a
    balanced random map when d > P); b_V shifts each block of D consecutive token ids by its own uniform offset, and
    b_V(v) = q·L + r puts row v at position q of convolution block r (see `SketchHashes`).

    When two distinct entries a = (v, c), b = (v', c') share a bucket (d ≤ P): never for v = v'; with probability
    1/D for v, v' in different id blocks (b_V(v') is uniform given b_V(v)); for v' = v + δ in one id block, only if
    L divides δ (same convolution block), and then with probability ≤ 1/(P − 1) (b_d(c) − b_d(c') must equal δ/L
    mod P). Over token ids 1/L of the pairs are such, so the collision rate averages 1/D.
    Error (X = G_i, Y = G_j, H the bucket): ⟨φ_i, φ_j⟩ − ⟨X, Y⟩_F = Σ_{a≠b} s(a) s(b) X_a Y_b [H(a) = H(b)], mean 0.
    Its variance: Σ_{a≠b} P(H(a) = H(b)) (X_a² Y_b² + X_a Y_a X_b Y_b) ≤ 2‖X‖²‖Y‖²/(P − 1), about
    (‖X‖²‖Y‖² + ⟨X, Y⟩²)/D (a JL sketch's) when the mass of X and Y is spread over token ids; plus the sign products
    over four entries (v, c), (v', c'), (v, c'), (v', c), nonzero only when both pairs collide, ≤ 2‖X‖²‖Y‖²/(P − 1).
    In all ≤ 4‖X‖²‖Y‖²/(P − 1), a worst case reached only when the mass sits on token ids whose differences are
    multiples of L. `dim` must be a perfect square >= 16 (the --salt.dim contract; the sketch itself takes any D).
    Same arguments ⇒ bit-identical tensors in every process and on every device; cached per (seed, V, d, D,
    device). Read-only.
    """
    _sketch_side(dim)
    vocab_size, hidden_size = _as_int(vocab_size, "vocab_size", 1), _as_int(hidden_size, "hidden_size", 1)
    return _hash_storage(_as_int(seed, "seed", 0), vocab_size, hidden_size, dim, torch.device(device))[0]


@functools.lru_cache(maxsize=4)
def _projection_storage(seed: int, vocab_size: int, hidden_size: int, k: int, device: torch.device):
    """(S_eᵀ (V, k), S_hᵀ (d, k)) float32 on `device`, drawn on the CPU so every process/device gets the same bits."""
    gen = torch.Generator().manual_seed(seed)
    # S_h first: it then depends on (seed, d, k) only, whatever the vocabulary size.
    sh_t = torch.randint(0, 2, (hidden_size, k), generator=gen, dtype=torch.int8)
    se_t = torch.randint(0, 2, (vocab_size, k), generator=gen, dtype=torch.int8)
    scale = 1.0 / math.sqrt(k)
    return tuple((2 * m.float() - 1).mul_(scale).to(device) for m in (se_t, sh_t))


def kronecker_projections(
    vocab_size: int, hidden_size: int, dim: int = 4096, seed: int = 0, device="cpu"
) -> tuple[torch.Tensor, torch.Tensor]:
    """The fixed projections S_e (k, V) and S_h (k, d), k = sqrt(dim), float32, of the `kronecker` features.

    Entries are independent Rademacher ±1/sqrt(k), so E[S_eᵀS_e] = I_V and E[S_hᵀS_h] = I_d exactly (the sketch's
    inner products are unbiased) and ‖S_e onehot(y)‖ = 1 exactly (the one-hot part of e_t, which dominates
    low-entropy tokens, keeps its norm; vs Gaussian entries, Rademacher ones cut the variance of ‖φ_i‖² by 30-40 %
    and of ⟨φ_i, φ_j⟩ by ~5 % in a float64 check over 2,000 seeds, V=500, d=32, k=16). Same arguments ⇒ bit-identical
    matrices in every process and on every device; cached per (seed, V, d, k, device). Read-only views: do not
    modify them in place.
    """
    k = _sketch_side(dim)
    vocab_size, hidden_size = _as_int(vocab_size, "vocab_size", 1), _as_int(hidden_size, "hidden_size", 1)
    seed = _as_int(seed, "seed", 0)
    se_t, sh_t = _projection_storage(seed, vocab_size, hidden_size, k, torch.device(device))
    return se_t.T, sh_t.T


def _as_int(value, name: str, minimum: int) -> int:
    """`value` as a Python int >= minimum (numpy ints accepted), else ValueError naming `name`."""
    try:
        if isinstance(value, bool):
            raise TypeError
        number = operator.index(value)
    except TypeError:
        number = None
    if number is None or number < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}; got {value!r}")
    return number


def _sketch_side(dim) -> int:
    """k = sqrt(dim) for a perfect square dim >= 16, else ValueError naming `dim`."""
    try:
        number = -1 if isinstance(dim, bool) else operator.index(dim)
    except TypeError:
        number = -1
    side = math.isqrt(max(number, 0))
    if number < 16 or side * side != number:
        raise ValueError(f"dim must be a perfect square >= 16 (the --salt.dim contract, k×k); got {dim!r}")
    return side


def _response_positions(mask: torch.Tensor, segment_ids, batch_shape):
    """Masked positions in row-major order and the response each belongs to, as CPU numpy arrays.

    Returns (rows (N,), cols (N,), response (N,), num_responses). Padded layout: response = row, R = B.
    Packed layout: response = segment_ids[row, col] (masked tokens with id −1 are ignored), R = max id + 1.
    """
    if mask.shape != batch_shape:
        raise ValueError(
            f"mask must have shape (B, S) = {tuple(batch_shape)} like logits/hidden; got {tuple(mask.shape)}"
        )
    mask_cpu = mask.detach().cpu()
    if mask_cpu.dtype != torch.bool:
        if mask_cpu.is_complex() or not ((mask_cpu == 0) | (mask_cpu == 1)).all():
            raise ValueError("mask must be bool or hold only 0/1 values")
        mask_cpu = mask_cpu != 0
    if segment_ids is None:
        rows, cols = mask_cpu.nonzero(as_tuple=True)
        return rows.numpy(), cols.numpy(), rows.numpy(), batch_shape[0]
    if segment_ids.shape != batch_shape:
        raise ValueError(
            f"segment_ids must have the shape of mask {tuple(batch_shape)}; got {tuple(segment_ids.shape)}"
        )
    if segment_ids.is_floating_point() or segment_ids.is_complex() or segment_ids.dtype == torch.bool:
        raise ValueError(f"segment_ids must be an integer tensor (response index per token); got {segment_ids.dtype}")
    seg = segment_ids.detach().cpu().long()
    if seg.numel() and seg.min() < -1:
        raise ValueError(f"segment_ids must be >= -1 (-1 = not part of any response); got min {int(seg.min())}")
    num_responses = int(seg.max()) + 1 if seg.numel() else 0
    rows, cols = (mask_cpu & (seg >= 0)).nonzero(as_tuple=True)
    return rows.numpy(), cols.numpy(), seg[rows, cols].numpy(), max(num_responses, 0)


def _take(x: torch.Tensor, rows: np.ndarray, cols: np.ndarray, rows_dev: torch.Tensor, cols_dev: torch.Tensor):
    """x[rows, cols] (n, ·): a view when the chunk is one run of consecutive positions in one row, else a gather.

    `rows`/`cols` are the chunk's positions on the CPU (to decide without a device sync), `*_dev` the same on x's
    device (to gather without a host-to-device copy per chunk).
    """
    n = len(rows)
    if rows[0] == rows[-1] and cols[-1] - cols[0] == n - 1:
        return x[int(rows[0]), int(cols[0]) : int(cols[0]) + n]
    return x[rows_dev, cols_dev]


class _Tokens(NamedTuple):
    """The masked tokens of a validated (logits, hidden, tokens, mask), row-major (see `_masked_tokens`)."""

    rows: np.ndarray  # (N,) CPU positions
    cols: np.ndarray
    response: np.ndarray  # (N,) response index of each token
    num_responses: int  # R
    weight: np.ndarray  # (N,) float64 1/(T_i τ) of each token's response
    rows_dev: torch.Tensor  # rows, cols on the logits' device
    cols_dev: torch.Tensor
    y: torch.Tensor  # (N,) int64 token ids on the logits' device

    def take(self, x: torch.Tensor, part: slice) -> torch.Tensor:
        return _take(x, self.rows[part], self.cols[part], self.rows_dev[part], self.cols_dev[part])


def _masked_tokens(logits, hidden, tokens, mask, temperature, segment_ids) -> _Tokens:
    """Validate the common arguments of `lm_head_features` / `lm_head_gram`; ValueError naming the bad one."""
    if logits.dim() != 3 or hidden.dim() != 3:
        raise ValueError(
            f"logits (B, S, V) and hidden (B, S, d) must be 3-D; got {tuple(logits.shape)} and {tuple(hidden.shape)}"
        )
    batch_shape, vocab_size = logits.shape[:2], logits.shape[2]
    if hidden.device != logits.device:
        raise ValueError(f"hidden must be on logits' device {logits.device}; got {hidden.device}")
    if hidden.shape[:2] != batch_shape:
        raise ValueError(f"hidden must be (B, S, d) with (B, S) = {tuple(batch_shape)}; got {tuple(hidden.shape)}")
    if tokens.shape != batch_shape or tokens.is_floating_point() or tokens.dtype == torch.bool:
        raise ValueError(
            f"tokens must be an integer (B, S) = {tuple(batch_shape)} tensor; got {tokens.dtype} {tuple(tokens.shape)}"
        )
    if not (isinstance(temperature, (int, float)) and math.isfinite(temperature) and temperature > 0):
        raise ValueError(f"temperature must be a finite number > 0; got {temperature!r}")
    rows, cols, response, num_responses = _response_positions(mask, segment_ids, batch_shape)
    device = logits.device
    rows_dev, cols_dev = torch.from_numpy(rows).to(device), torch.from_numpy(cols).to(device)
    y = tokens.to(device)[rows_dev, cols_dev].long()
    if bool(((y < 0) | (y >= vocab_size)).any()):
        raise ValueError(f"tokens at masked positions must lie in [0, V={vocab_size})")
    counts = np.bincount(response, minlength=num_responses)
    weight = 1.0 / (counts[response] * temperature)
    return _Tokens(rows, cols, response, num_responses, weight, rows_dev, cols_dev, y)


def lm_head_features(
    logits: torch.Tensor,
    hidden: torch.Tensor,
    tokens: torch.Tensor,
    mask: torch.Tensor,
    method: str = "sketch",
    dim: int = DEFAULT_DIM,
    seed: int = 0,
    *,
    temperature: float = 1.0,
    segment_ids: torch.Tensor | None = None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    return_log_probs: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """SALT Eq. 19: one LM-head-gradient feature row per response: exact, TensorSketch or Kronecker sketch.

    Inputs are aligned: `logits[b, t]` (B, S, V), pre-temperature, any float dtype, is the distribution that
    produced `tokens[b, t]` (B, S); `hidden[b, t]` (B, S, d) is the lm_head input there; `mask` (B, S), bool or 0/1,
    marks the response tokens that count (nothing at unmasked positions is read).
    Padded layout: row i = response b = i, R = B. Packed layout (typically B = 1): `segment_ids` (B, S) long gives
    each token's response index (−1 = none), R = max id + 1. A response with no masked token gets a zero row.

    Row i, in lm_head.weight's (V, d) layout flattened: exact = vec(G_i), G_i = (1/T_i) Σ_t e_t h_tᵀ / τ with
    e_t = onehot(y_t) − softmax(z_t/τ) — autograd's gradient of the mean of log_softmax(z_t/τ)[y_t] w.r.t. the
    weight (V·d columns); sketch = the TensorSketch of vec(G_i) (dim columns, see `sketch_hashes`; V·d columns,
    exactly vec(G_i), when V·d ≤ dim); kronecker = vec(S_e G_i S_hᵀ) (dim = k·k columns, see
    `kronecker_projections`). If your logits are already divided by τ, pass temperature=1: every row then scales by
    the same τ, to which SALT's PR, P_k and n_eff are invariant. `dim` (a perfect square >= 16) is ignored by
    `exact`. The softmax (sketch: its exp) runs in float32 per chunk of `chunk_size` masked tokens.
    Logits of −inf (masked vocabulary entries) are probability 0; NaN, +inf or a row without a finite logit at a
    masked position raises ValueError, as do NaN/inf in `hidden` there.
    Returns float32 (R, D) on logits.device; with `return_log_probs`, (features, log_probs): log_probs (B, S)
    float32 holds log softmax(z_t/τ)[y_t] at the masked positions and 0 elsewhere, from the normalizer the
    features' own pass over the logits computes (the sketch's exp pass: no second pass over the (N, V) logits).
    """
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}; got {method!r}")
    masked = _masked_tokens(logits, hidden, tokens, mask, temperature, segment_ids)
    chunk_size = _as_int(chunk_size, "chunk_size", 1)
    if method != "exact":
        _sketch_side(dim)
    if method == "sketch" and logits.shape[2] * hidden.shape[2] <= dim:
        method = "exact"  # a sketch of a vector that fits in D entries is the vector itself
    log_probs = torch.zeros(logits.shape[:2], dtype=torch.float32, device=logits.device) if return_log_probs else None
    if method == "exact":
        out = _exact_features(logits, hidden, masked, temperature, chunk_size, log_probs)
    elif method == "sketch":
        out = _sketch_features(logits, hidden, masked, dim, seed, temperature, chunk_size, log_probs)
    else:
        out = _kronecker_features(logits, hidden, masked, dim, seed, temperature, chunk_size, log_probs)
    if len(masked.rows) and not bool(torch.isfinite(out).all()):
        _raise_non_finite(logits, hidden, masked.rows, masked.cols)
    # log_probs is the tensor made above exactly when return_log_probs
    return (out, cast(torch.Tensor, log_probs)) if return_log_probs else out


def _exact_features(logits, hidden, masked: _Tokens, temperature, chunk_size, log_probs) -> torch.Tensor:
    """SALT Eq. 19 (§3.2) itself: row i = vec(G_i) = vec((1/T_i) Σ_t e_t h_tᵀ / τ), V·d columns."""
    vocab_size, hidden_size = logits.shape[2], hidden.shape[2]
    if vocab_size * hidden_size > EXACT_MAX_NUMEL:
        raise ValueError(
            f'method="exact" would return V*d = {vocab_size}*{hidden_size} floats per response '
            f'(limit {EXACT_MAX_NUMEL}); use method="sketch" for models of this size'
        )
    out = torch.zeros(masked.num_responses, vocab_size * hidden_size, dtype=torch.float32, device=logits.device)
    for chunk in _chunks(masked, chunk_size, logits.device):
        p, h, y = _chunk_softmax(logits, hidden, masked, chunk.part, temperature, log_probs)
        left = p.neg_()  # e_t = onehot(y_t) − p_t, (n, V)
        left[chunk.index, y] += 1.0
        out.index_add_(0, chunk.ids, _response_sums(chunk.assign, left, h))  # ids are unique: one add per row
    return out


def _kronecker_features(logits, hidden, masked: _Tokens, dim, seed, temperature, chunk_size, log_probs):
    """SALT Eq. 19 (§3.2) through the Kronecker sketch: row i = vec(S_e G_i S_hᵀ), dim = k·k columns."""
    device = logits.device
    s_e, s_h = kronecker_projections(logits.shape[2], hidden.shape[2], dim, seed, device)
    se_t, sh_t = s_e.T, s_h.T  # (V, k), (d, k): row-gather S_e[:, y] and right-multiply without copies
    out = torch.zeros(masked.num_responses, dim, dtype=torch.float32, device=device)
    for chunk in _chunks(masked, chunk_size, device):
        p, h, y = _chunk_softmax(logits, hidden, masked, chunk.part, temperature, log_probs)
        left = se_t[y] - p @ se_t  # S_e e_t = S_e[:, y_t] − S_e p_t, (n, k)
        right = h @ sh_t  # S_h h_t, (n, k)
        out.index_add_(0, chunk.ids, _response_sums(chunk.assign, left, right))  # ids are unique: one add per row
    return out


def _sketch_features(logits, hidden, masked: _Tokens, dim, seed, temperature, chunk_size, log_probs):
    """SALT Eq. 19 (§3.2) through the blocked TensorSketch of vec(G_i) (`sketch_hashes`): dim columns."""
    device, R = logits.device, masked.num_responses
    hashes, offsets = _hash_storage(_as_int(seed, "seed", 0), logits.shape[2], hidden.shape[2], dim, device)
    tiles = _TensorSketchTiles(hashes, offsets, dim, temperature, chunk_size, device)
    # the real and imaginary parts of the L blocks' rfft spectra, summed per response
    width = 2 * (dim // hashes.block) * (hashes.block // 2 + 1)
    out = torch.zeros(R, width, dtype=torch.float32, device=device)
    if len(masked.rows) == 0:
        return out[:, :dim]
    new_run = np.ones(len(masked.rows), dtype=bool)  # where a run of consecutive positions in one row starts
    new_run[1:] = (masked.rows[1:] != masked.rows[:-1]) | (masked.cols[1:] != masked.cols[:-1] + 1)
    for chunk in _chunks(masked, chunk_size, device):
        start, y = chunk.part.start, masked.y[chunk.part]
        block = torch.zeros(len(chunk.ids), width, device=device)
        # tiles never cross a run of consecutive positions, so their logits are views: a gather of the chunk's
        # (n, V) logits cost more than the sketch itself (V = 151936)
        for tile in _run_tiles(new_run, start, start + len(y), tiles.size):
            part = slice(tile.start - start, tile.stop - start)
            z_tile, h_tile = masked.take(logits, tile), masked.take(hidden, tile).float()
            # of C_V e_t ⊛_P C_d h_t, (tile, L, P/2 + 1), and the tile's log-probs
            spectrum, tile_log_probs = tiles.spectrum(z_tile, y[part], h_tile)
            block.addmm_(chunk.assign[:, part], torch.view_as_real(spectrum).reshape(spectrum.shape[0], -1))
            if log_probs is not None:
                log_probs[masked.rows_dev[tile], masked.cols_dev[tile]] = tile_log_probs
        out.index_add_(0, chunk.ids, block)  # ids are unique: one add per row
    spectra = torch.view_as_complex(out.view(R, dim // hashes.block, -1, 2))
    return torch.fft.irfft(spectra, n=hashes.block).reshape(R, dim)


class _Chunk(NamedTuple):
    """One chunk of `chunk_size` masked tokens (see `_chunks`)."""

    part: slice  # its tokens among the masked ones
    ids: torch.Tensor  # (u,) the distinct responses present, on the device
    assign: torch.Tensor  # (u, n) float32: weight 1/(T_i τ) of token t in the row of its response, else 0
    # ignore: the field shadows tuple.index in the stub (never called on a _Chunk; `.index` reads the field)
    index: torch.Tensor  # type: ignore[assignment]  # (n,) arange(n) on the device


def _chunks(masked: _Tokens, chunk_size: int, device):
    """The masked tokens in chunks of `chunk_size`, as `_Chunk`s: Σ_t per response present in a chunk is then
    `assign @ ·`, without atomics (deterministic on every device). The position of each token's response among
    those present in its chunk, and those responses, move to the device once, before the first chunk."""
    response = masked.response
    starts = range(0, len(masked.rows), chunk_size)
    chunk_ids, local = [], np.empty_like(response)
    for start in starts:
        present, inverse = np.unique(response[start : start + chunk_size], return_inverse=True)
        local[start : start + chunk_size] = inverse
        chunk_ids.append(torch.from_numpy(present).to(device))
    local_dev = torch.from_numpy(local).to(device)
    weight_dev = torch.from_numpy(masked.weight).to(device=device, dtype=torch.float32)
    token_index = torch.arange(chunk_size, device=device)
    for start, ids in zip(starts, chunk_ids):
        part = slice(start, start + chunk_size)
        n = min(chunk_size, len(response) - start)
        assign = torch.zeros(len(ids), n, device=device)
        assign[local_dev[part], token_index[:n]] = weight_dev[part]
        yield _Chunk(part, ids, assign, token_index[:n])


def _chunk_softmax(logits, hidden, masked: _Tokens, part: slice, temperature, log_probs):
    """(softmax(z_t/τ) (n, V) float32, h_t (n, d) float32, y_t (n,)) of one chunk's tokens; writes their
    log softmax(z_t/τ)[y_t] into `log_probs` (B, S) unless it is None."""
    y = masked.y[part]
    z = masked.take(logits, part)  # (n, V), a view if one run: never written to
    h = masked.take(hidden, part).float()  # (n, d)
    scaled = z.float() / temperature if temperature != 1.0 else z.float()
    p = torch.softmax(scaled, dim=-1)
    if log_probs is not None:
        label = scaled.gather(1, y[:, None])[:, 0]
        log_probs[masked.rows_dev[part], masked.cols_dev[part]] = label - torch.logsumexp(scaled, dim=-1)
    return p, h, y


def _response_sums(assign: torch.Tensor, left: torch.Tensor, right: torch.Tensor) -> torch.Tensor:
    """Per response present in the chunk, Σ_t weight_t left_t right_tᵀ flattened: (u, left_size · right_size)."""
    return ((assign[:, :, None] * left[None]).transpose(1, 2) @ right).reshape(assign.shape[0], -1)


def _run_tiles(new_run: np.ndarray, start: int, stop: int, size: int):
    """Slices of at most `size` of the masked tokens [start, stop), none crossing the start of a run."""
    cuts = [start, *(np.flatnonzero(new_run[start + 1 : stop]) + start + 1).tolist(), stop]
    for first, last in zip(cuts[:-1], cuts[1:]):
        for tile_start in range(first, last, size):
            yield slice(tile_start, min(tile_start + size, last))


class _TensorSketchTiles:
    """The TensorSketch's per-token work, one tile of tokens at a time, in buffers reused across tiles and blocks.

    Fresh multi-megabyte buffers for every vocabulary block cost the CPU a page fault per 4 KiB, which took ~3× as
    long as the exp pass itself (measured with torch.profiler at V = 151936, D = 25600). A tile is EXP_TILE
    tokens on a CPU, so each (tile, D) buffer stays in cache, and the whole chunk on a GPU (there about four
    (chunk_size, D) float32 buffers: 0.4 GB at the defaults).
    """

    def __init__(self, hashes, offsets, dim, temperature, chunk_size, device):
        self.hashes, self.offsets, self.dim, self.temperature = hashes, offsets, dim, temperature
        self.size = min(chunk_size, EXP_TILE) if device.type == "cpu" else chunk_size
        self.block = torch.empty(self.size, dim, device=device)  # exp of one vocabulary block
        self.left = torch.empty(self.size, dim, device=device)  # C_V e_t
        self.right = torch.empty(self.size, hashes.block, device=device)  # C_d h_t
        blocks, half = dim // hashes.block, hashes.block // 2 + 1
        self.spectra = torch.empty(self.size, blocks, half, dtype=torch.complex64, device=device)
        self.hidden_spectra = torch.empty(self.size, half, dtype=torch.complex64, device=device)
        self.zero = torch.zeros((), device=device)  # a float32 shift: bf16 logits minus it are float32

    def spectrum(self, z, y, h) -> tuple[torch.Tensor, torch.Tensor]:
        """(rfft(C_V e_t) ∘ rfft(C_d h_t) per convolution block (n, L, P/2 + 1) complex64, a view of the buffers;
        log softmax(z_t/τ)[y_t] (n,) float32, from the same exp pass) for n ≤ size tokens: logits z (n, V) of any
        float dtype (read, never written), tokens y (n,), hidden h (n, d) float32."""
        n, hashes = z.shape[0], self.hashes
        right = self.right[:n].zero_().index_add_(1, hashes.hidden_bucket, h * hashes.hidden_sign)
        spectra, hidden_spectra = self.spectra[:n], self.hidden_spectra[:n]
        left, shift, log_total = self._vocab(z, y)
        # bucket b = q·L + r of the vocabulary side is position q of block r: consecutive token ids spread over the
        # L blocks (a block of consecutive ids would collide whole rows with each other)
        torch.fft.rfft(left.view(n, self.hashes.block, -1).transpose(1, 2), out=spectra)
        torch.fft.rfft(right, out=hidden_spectra)
        # subtract the shift before dividing by τ: large logits keep their float32 precision
        log_probs = (z.gather(1, y[:, None])[:, 0].float() - shift) / self.temperature - log_total
        return spectra.mul_(hidden_spectra[:, None]), log_probs

    def _vocab(self, z, y):
        """(C_V e_t = s_V(y_t) 1[b_V(y_t)] − C_V softmax(z_t/τ) (n, D) float32, the shift c_t of each row's exp
        pass and log Σ_v exp((z_v − c_t)/τ), both (n,) float32).

        One pass of exp over the logits (`_exp_pass`), unshifted: softmax is shift-invariant, and subtracting the
        row maximum would take a pass over the logits of its own. Rows where exp(z/τ) overflows (some z_v/τ > 88)
        or the normalizer underflows (every z_v/τ < −50, where float32 would lose the tail) are redone shifted by
        their maximum.
        """
        n, hashes = z.shape[0], self.hashes
        sketch, total = self.left[:n].zero_(), z.new_zeros(n, 1, dtype=torch.float32)
        self._exp_pass(z, None, sketch, total)
        shift = total.new_zeros(n, 1)
        redo = ~(total[:, 0] > UNDERFLOW_TOTAL) | torch.isinf(total[:, 0])
        if bool(redo.any()):
            shift[redo] = z[redo].amax(-1, keepdim=True).float()
            again, again_total = torch.zeros_like(sketch[redo]), torch.zeros_like(total[redo])
            self._exp_pass(z[redo], shift[redo], again, again_total)
            sketch[redo], total[redo] = again, again_total
        sketch.div_(total).neg_()
        sketch[torch.arange(n, device=z.device), hashes.vocab_bucket[y]] += hashes.vocab_sign[y]
        return sketch, shift[:, 0], total[:, 0].log()

    def _exp_pass(self, z, shift, sketch, total):
        """sketch += C_V exp((z − shift)/τ), total += Σ_v exp((z_v − shift)/τ) (shift None: 0), block by block of D
        vocabulary ids: block r lands on the buckets (j + offsets[r]) mod D, so it is added, signed, as two slices.
        The exp runs in float32 whatever z's dtype."""
        dim, n = self.dim, z.shape[0]
        direct = shift is None and z.dtype == torch.float32 and self.temperature == 1.0
        for block, offset in enumerate(self.offsets):
            start = block * dim
            x = self.block[:n, : min(dim, z.shape[1] - start)]
            if direct:
                torch.exp(z[:, start : start + dim], out=x)  # the one read of these logits
            else:
                torch.sub(z[:, start : start + dim], self.zero if shift is None else shift, out=x)
                if self.temperature != 1.0:
                    x.div_(self.temperature)
                x.exp_()
            total += x.sum(-1, keepdim=True)
            sign = self.hashes.vocab_sign[start : start + dim]
            head = min(x.shape[1], dim - offset)
            sketch[:, offset : offset + head].addcmul_(x[:, :head], sign[:head])
            if head < x.shape[1]:
                sketch[:, : x.shape[1] - head].addcmul_(x[:, head:], sign[head:])


@torch.no_grad()
def lm_head_gram(
    logits: torch.Tensor,
    hidden: torch.Tensor,
    tokens: torch.Tensor,
    mask: torch.Tensor,
    *,
    temperature: float = 1.0,
    segment_ids: torch.Tensor | None = None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> torch.Tensor:
    """The exact Gram ⟨G_i, G_j⟩_F (R, R), float64, of SALT Eq. 19's LM-head gradients, without any feature vector.

    Same inputs and G_i as `lm_head_features` (it equals F Fᵀ for F = lm_head_features(..., "exact")), from token
    pairs: ⟨G_i, G_j⟩_F = Σ_{t∈i, s∈j} w_t w_s (e_t·e_s)(h_t·h_s), w_t = 1/(T_i τ), with e_t·e_s = [y_t = y_s] −
    p_t[y_s] − p_s[y_t] + p_t·p_s. Per pair of chunks of `chunk_size` masked tokens one (c, V) × (V, c) product:
    O(N²·V) work for N masked tokens and O(chunk_size·V) memory, so it runs at any V·d (a reference at LLM shapes,
    where the exact features would be V·d floats per response). The products over V run in the logits' precision,
    at least float32 (float64 logits: float64); the sums over token pairs in float64. Not divided by R (SALT Eq.
    4's 1/m is diagnostics.gram's); exactly symmetric. NaN/inf at masked positions raise ValueError, as there.
    """
    masked = _masked_tokens(logits, hidden, tokens, mask, temperature, segment_ids)
    chunk_size = _as_int(chunk_size, "chunk_size", 1)
    device, R = logits.device, masked.num_responses
    dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    gram = torch.zeros(R, R, dtype=torch.float64, device=device)
    weight = torch.from_numpy(masked.weight).to(device)
    response = torch.from_numpy(masked.response).to(device)

    def chunk(part):
        z = masked.take(logits, part).to(dtype)
        p = torch.softmax(z / temperature if temperature != 1.0 else z, dim=-1)
        return p, masked.y[part], masked.take(hidden, part).to(dtype), weight[part], response[part]

    parts = [slice(s, s + chunk_size) for s in range(0, len(masked.rows), chunk_size)]
    for a, part_a in enumerate(parts):
        p_a, y_a, h_a, w_a, r_a = chunk(part_a)
        for part_b in parts[: a + 1]:
            p_b, y_b, h_b, w_b, r_b = (p_a, y_a, h_a, w_a, r_a) if part_b == part_a else chunk(part_b)
            ee = (p_a @ p_b.T).double() - p_a[:, y_b].double() - p_b[:, y_a].T.double()
            ee += (y_a[:, None] == y_b[None, :]).double()
            pair = ee * (h_a @ h_b.T).double() * w_a[:, None] * w_b[None, :]  # (c_a, c_b) token-pair terms
            block = torch.zeros(R, R, dtype=torch.float64, device=device)
            block.index_add_(
                1, r_b, torch.zeros(R, pair.shape[1], dtype=torch.float64, device=device).index_add_(0, r_a, pair)
            )
            gram += block if part_b == part_a else block + block.T
    if not bool(torch.isfinite(gram).all()):
        _raise_non_finite(logits, hidden, masked.rows, masked.cols)
    return (gram + gram.T) / 2  # the diagonal blocks are symmetric only up to rounding


def _raise_non_finite(logits, hidden, rows, cols):
    """Name the argument whose masked positions hold the NaN/inf that reached the features (error path only)."""
    idx = (torch.from_numpy(rows).to(logits.device), torch.from_numpy(cols).to(logits.device))
    z = logits[idx].float()
    if bool(torch.isnan(z).any() | torch.isposinf(z).any() | (~torch.isfinite(z).any(-1)).any()):
        raise ValueError("logits hold NaN, +inf or a row without a finite value at a masked position")
    if not bool(torch.isfinite(hidden[idx]).all()):
        raise ValueError("hidden holds NaN or inf at a masked position")
    raise ValueError("features overflowed float32 although logits and hidden are finite; check their scale")


def last_token_hidden(
    hidden: torch.Tensor, mask: torch.Tensor, segment_ids: torch.Tensor | None = None
) -> torch.Tensor:
    """Hidden state at each response's last masked token (GeoAlign's input), (R, d) in hidden's dtype.

    `hidden` (B, S, d), `mask` (B, S) and `segment_ids` as in `lm_head_features` (padded: R = B; packed: R = max
    id + 1). "Last" is the largest position in row-major order. A response with no masked token gets a zero row
    (callers can tell from `mask`); NaN/inf in a selected hidden state raises ValueError.
    """
    if hidden.dim() != 3:
        raise ValueError(f"hidden must be (B, S, d); got {tuple(hidden.shape)}")
    rows, cols, response, num_responses = _response_positions(mask, segment_ids, hidden.shape[:2])
    out = hidden.new_zeros(num_responses, hidden.shape[2])
    if len(rows) == 0:
        return out
    # Positions are row-major sorted, so the last occurrence of each response id is its last token.
    last = np.full(num_responses, -1)
    np.maximum.at(last, response, np.arange(len(response)))
    present = np.flatnonzero(last >= 0)
    pick = last[present]
    device = hidden.device
    out[torch.from_numpy(present).to(device)] = hidden[
        torch.from_numpy(rows[pick]).to(device), torch.from_numpy(cols[pick]).to(device)
    ]
    if not bool(torch.isfinite(out).all()):
        raise ValueError("hidden holds NaN or inf at a response's last masked token")
    return out


@dataclass(frozen=True)
class GeometrySpec:
    """What an experience forward returns per response besides log-probs (built by `GeometryConfig.spec`)."""

    features: str | None = None  # SALT proxy features, a METHODS name; None: not needed
    dim: int = DEFAULT_DIM  # sketch dimension D (GeometryConfig.spec sets it from SaltConfig.dim when features)
    seed: int = 0  # sketch hashes / projections
    entropy: bool = False  # normalized token-entropy sums (SALT --salt.variant entropy-alpha)
    hidden: bool = False  # last-response-token final hidden state (GeoAlign)


@contextmanager
def lm_head_input(model, enabled=True) -> Iterator[SimpleNamespace]:
    """Capture the lm_head input (final post-norm hidden states) of the forward run inside the block.

    Yields a namespace whose `.hidden` is (B, S, d) padded or (1, T, d) packed after the forward. The hook sits on
    `get_output_embeddings()` of the unwrapped model (DeepSpeed engine / PEFT both forward to it).
    """
    captured = SimpleNamespace(hidden=None)
    if not enabled:
        yield captured
        return
    head = getattr(model, "module", model).get_output_embeddings()
    if head is None:
        raise RuntimeError(f"{type(model).__name__} has no output embeddings (lm_head) to read hidden states from")
    handle = head.register_forward_hook(lambda _module, inputs, _output: setattr(captured, "hidden", inputs[0]))
    try:
        yield captured
    finally:
        handle.remove()


ENTROPY_CHUNK = 256  # positions per chunk of the token-entropy pass (peak extra memory: chunk x V floats)


@torch.no_grad()
def response_geometry(
    spec, logits, hidden, labels, producing, response, temperature=1.0, segment_ids=None, rows=None, log_probs=False
) -> dict[str, torch.Tensor]:
    """Per-response geometry of one forward, small float32 CPU tensors: {"features" (R, D), "hidden" (R, d),
    "entropy" (R,)}, each only when `spec` asks for it. Both engines call this on their own layouts.
    With `log_probs` and features, also "log_probs": log softmax(z_s)[labels_s] at the producing positions (0
    elsewhere), float32 in logits' (B, S) layout and device, from the features' own pass over the logits (the
    fork's Actor.forward then skips its own log-prob pass).

    logits (B, S, V) padded or (1, T, V) packed: the temperature-scaled logits (the sampling distribution);
    hidden: the lm_head input of the same forward, same layout; labels: label at position s = token s+1;
    producing (B, S) bool: positions whose logits produced a response token; response (B, S) bool: positions holding
    a response token; segment_ids: response id per position (packed; None = padded, R = B); rows: R (responses past
    the last one with a token get zero rows).
    features: `lm_head_features` of each response's tokens with `hidden / temperature`, the exact gradient of the
    temperature-scaled log-probs (SALT Eq. 19). hidden: the lm_head input at the response's last token (GeoAlign
    §3.1: the final generated token's; a multi-turn rollout's last action token, not the environment's tokens after
    it). entropy: sum over the response's tokens of H(softmax(z)) / log V (SALT App. F.3 entropy-alpha's H_t is its
    token-weighted mean, computed by the pipeline). All three read every position of `producing` / `response`,
    however many spans a row holds.
    """
    rows = rows if rows is not None else producing.shape[0]
    out = {}
    if spec.features is not None:
        scaled = hidden / temperature if temperature != 1.0 else hidden
        feats = lm_head_features(
            logits,
            scaled,
            labels,
            producing,
            spec.features,
            spec.dim,
            spec.seed,
            segment_ids=segment_ids,
            return_log_probs=log_probs,
        )
        if log_probs:
            feats, out["log_probs"] = feats
        out["features"] = _pad_rows(feats, rows).float().cpu()
    if spec.hidden:
        out["hidden"] = _pad_rows(last_token_hidden(hidden, response, segment_ids), rows).float().cpu()
    if spec.entropy:
        out["entropy"] = _entropy_sums(logits, producing, segment_ids, rows).cpu()
    return out


def _pad_rows(x, rows):
    """(R', ·) -> (rows, ·): responses after the last one with a token (packed layout) get zero rows."""
    missing = rows - x.shape[0]
    return torch.cat([x, x.new_zeros(missing, *x.shape[1:])]) if missing else x


def _entropy_sums(logits, mask, segment_ids, rows):
    """(rows,) float32: per response, sum over masked positions of token entropy / log V (chunks of positions)."""
    r, c = mask.nonzero(as_tuple=True)
    owner = r if segment_ids is None else segment_ids[r, c]
    sums = torch.zeros(rows, dtype=torch.float32, device=logits.device)
    for start in range(0, len(r), ENTROPY_CHUNK):
        part = slice(start, start + ENTROPY_CHUNK)
        z = logits[r[part], c[part]].float()
        entropy = torch.distributions.Categorical(logits=z, validate_args=False).entropy()
        sums.index_add_(0, owner[part], entropy)
    return sums / math.log(logits.shape[-1])
