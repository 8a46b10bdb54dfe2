"""Per-response LM-head-gradient proxy features (SALT Eq. 19) and last-token hidden states (GeoAlign input).

SALT's Gram is built from G_i = (1/T_i) Σ_t e_t h_tᵀ / τ, the gradient of response i's mean action log-prob
log_softmax(z_t/τ)[y_t] w.r.t. lm_head.weight (V, d), with e_t = onehot(y_t) − softmax(z_t/τ) and h_t the lm_head
input. `method="exact"` returns vec(G_i) (tiny models, tests). `method="sketch"` returns the Kronecker sketch
φ_i = vec(S_e G_i S_hᵀ) = (1/T_i) Σ_t (S_e e_t) ⊗ (S_h h_t) / τ with fixed seeded Rademacher projections S_e (k, V),
S_h (k, d), k = sqrt(dim): E⟨φ_i, φ_j⟩ = ⟨G_i, G_j⟩_F, and no V×d tensor is ever formed (docs/architecture.md §4).

Both run on the tensors the experience forward already has (logits, final hidden states), chunked over tokens so
the extra memory is O(chunk_size·V + B·S) (+ R·D for the output).
"""

import functools
import math
import operator
from contextlib import contextmanager
from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np
import torch

METHODS = ("sketch", "exact")
# `exact` returns R rows of V·d floats; above this V·d the sketch is the only sensible choice.
EXACT_MAX_NUMEL = 2**26
# Masked tokens per chunk: amortizes streaming S_e (V×k floats) once per chunk; a float32 chunk of probabilities
# is 156 MB at V=151936 (the caller's logits for the same tokens are as large). benchmarks/salt_overhead.py sweeps it.
DEFAULT_CHUNK_SIZE = 256


@functools.lru_cache(maxsize=4)
def _projection_storage(seed: int, vocab_size: int, hidden_size: int, k: int, device: torch.device):
    """(S_eᵀ (V, k), S_hᵀ (d, k)) float32 on `device`, drawn on the CPU so every process/device gets the same bits."""
    gen = torch.Generator().manual_seed(seed)
    # S_h first: it then depends on (seed, d, k) only, whatever the vocabulary size.
    sh_t = torch.randint(0, 2, (hidden_size, k), generator=gen, dtype=torch.int8)
    se_t = torch.randint(0, 2, (vocab_size, k), generator=gen, dtype=torch.int8)
    scale = 1.0 / math.sqrt(k)
    return tuple((2 * m.float() - 1).mul_(scale).to(device) for m in (se_t, sh_t))


def sketch_projections(vocab_size: int, hidden_size: int, dim: int = 4096, seed: int = 0, device="cpu"):
    """The fixed sketch projections S_e (k, V) and S_h (k, d), k = sqrt(dim), float32.

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
        raise ValueError(f"dim must be a perfect square >= 16 (the sketch is k×k with k = sqrt(dim)); got {dim!r}")
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


def lm_head_features(
    logits: torch.Tensor,
    hidden: torch.Tensor,
    tokens: torch.Tensor,
    mask: torch.Tensor,
    method: str = "sketch",
    dim: int = 4096,
    seed: int = 0,
    *,
    temperature: float = 1.0,
    segment_ids: torch.Tensor | None = None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> torch.Tensor:
    """SALT Eq. 19: one LM-head-gradient feature row per response, exact (R, V·d) or Kronecker-sketched (R, dim).

    Inputs are aligned: `logits[b, t]` (B, S, V), pre-temperature, any float dtype, is the distribution that
    produced `tokens[b, t]` (B, S); `hidden[b, t]` (B, S, d) is the lm_head input there; `mask` (B, S), bool or 0/1,
    marks the response tokens that count (nothing at unmasked positions is read).
    Padded layout: row i = response b = i, R = B. Packed layout (typically B = 1): `segment_ids` (B, S) long gives
    each token's response index (−1 = none), R = max id + 1. A response with no masked token gets a zero row.

    Row i, in lm_head.weight's (V, d) layout flattened: exact = vec(G_i), G_i = (1/T_i) Σ_t e_t h_tᵀ / τ with
    e_t = onehot(y_t) − softmax(z_t/τ) — autograd's gradient of the mean of log_softmax(z_t/τ)[y_t] w.r.t. the
    weight; sketch = vec(S_e G_i S_hᵀ) (see `sketch_projections`). If your logits are already divided by τ,
    pass temperature=1: every row then scales by the same τ, to which SALT's PR, P_k and n_eff are invariant.
    `dim` is ignored by `exact`. Softmax runs in float32 per chunk of `chunk_size` masked tokens.
    Logits of −inf (masked vocabulary entries) are probability 0; NaN, +inf or a row without a finite logit at a
    masked position raises ValueError, as do NaN/inf in `hidden` there.
    Returns float32 (R, D) on logits.device.
    """
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}; got {method!r}")
    if logits.dim() != 3 or hidden.dim() != 3:
        raise ValueError(
            f"logits (B, S, V) and hidden (B, S, d) must be 3-D; got {tuple(logits.shape)} and {tuple(hidden.shape)}"
        )
    batch_shape, (vocab_size, hidden_size) = logits.shape[:2], (logits.shape[2], hidden.shape[2])
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
    chunk_size = _as_int(chunk_size, "chunk_size", 1)
    if method == "exact":
        if vocab_size * hidden_size > EXACT_MAX_NUMEL:
            raise ValueError(
                f'method="exact" would return V*d = {vocab_size}*{hidden_size} floats per response '
                f'(limit {EXACT_MAX_NUMEL}); use method="sketch" for models of this size'
            )
        left_size, right_size = vocab_size, hidden_size
    else:
        s_e, s_h = sketch_projections(vocab_size, hidden_size, dim, seed, logits.device)
        se_t, sh_t = s_e.T, s_h.T  # (V, k), (d, k): row-gather S_e[:, y] and right-multiply without copies
        left_size = right_size = se_t.shape[1]

    rows, cols, response, num_responses = _response_positions(mask, segment_ids, batch_shape)
    device = logits.device
    out = torch.zeros(num_responses, left_size * right_size, dtype=torch.float32, device=device)
    if len(rows) == 0:
        return out
    # Index bookkeeping on the CPU, moved to the device once: per token its 1/(T_i τ) weight and the position of
    # its response among the responses present in its chunk (`local`); per chunk those responses (`chunk_ids`).
    counts = np.bincount(response, minlength=num_responses)
    starts = range(0, len(rows), chunk_size)
    chunk_ids, local = [], np.empty_like(response)
    for start in starts:
        ids, inverse = np.unique(response[start : start + chunk_size], return_inverse=True)
        local[start : start + chunk_size] = inverse
        chunk_ids.append(torch.from_numpy(ids).to(device))
    rows_dev, cols_dev, local_dev = (torch.from_numpy(a).to(device) for a in (rows, cols, local))
    weight_dev = torch.from_numpy(1.0 / (counts[response] * temperature)).to(device=device, dtype=torch.float32)
    y_all = tokens.to(device)[rows_dev, cols_dev].long()
    if bool(((y_all < 0) | (y_all >= vocab_size)).any()):
        raise ValueError(f"tokens at masked positions must lie in [0, V={vocab_size})")
    token_index = torch.arange(chunk_size, device=device)

    for start, ids in zip(starts, chunk_ids):
        sl = slice(start, start + chunk_size)
        y = y_all[sl]
        n = len(y)
        z = _take(logits, rows[sl], cols[sl], rows_dev[sl], cols_dev[sl]).float()  # (n, V); a view if float32 run
        if temperature != 1.0:
            z = z / temperature
        p = torch.softmax(z, dim=-1)
        h = _take(hidden, rows[sl], cols[sl], rows_dev[sl], cols_dev[sl]).float()  # (n, d)
        if method == "exact":
            left = p.neg_()  # e_t = onehot(y_t) − p_t, (n, V)
            left[token_index[:n], y] += 1.0
            right = h
        else:
            left = se_t[y] - p @ se_t  # S_e e_t = S_e[:, y_t] − S_e p_t, (n, k)
            right = h @ sh_t  # S_h h_t, (n, k)
        # Σ_t per response present in the chunk, without atomics (deterministic on every device):
        # (u, n) weights × per-token outer products left_t right_tᵀ.
        assign = torch.zeros(len(ids), n, device=device)
        assign[local_dev[sl], token_index[:n]] = weight_dev[sl]
        block = (assign[:, :, None] * left[None]).transpose(1, 2) @ right  # (u, left_size, right_size)
        out.index_add_(0, ids, block.reshape(len(ids), -1))  # ids are unique: one add per row

    if not bool(torch.isfinite(out).all()):
        _raise_non_finite(logits, hidden, rows, cols)
    return out


def _raise_non_finite(logits, hidden, rows, cols):
    """Name the argument whose masked positions hold the NaN/inf that reached the features (error path only)."""
    idx = (torch.from_numpy(rows).to(logits.device), torch.from_numpy(cols).to(logits.device))
    z = logits[idx].float()
    if bool(torch.isnan(z).any() | torch.isposinf(z).any() | (~torch.isfinite(z).any(-1)).any()):
        raise ValueError("logits hold NaN, +inf or a row without a finite value at a masked position")
    if not bool(torch.isfinite(hidden[idx]).all()):
        raise ValueError("hidden holds NaN or inf at a masked position")
    raise ValueError("features overflowed float32 although logits and hidden are finite; check their scale")


def last_token_hidden(hidden: torch.Tensor, mask: torch.Tensor, segment_ids: torch.Tensor | None = None):
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
    """What an experience forward returns per response besides log-probs (built by `GeometryPipeline.spec`)."""

    features: str | None = None  # SALT proxy features, "sketch" | "exact"; None: not needed
    dim: int = 4096  # sketch dimension (k x k)
    seed: int = 0  # sketch projections
    entropy: bool = False  # normalized token-entropy sums (SALT --salt.variant entropy-alpha)
    hidden: bool = False  # last-response-token final hidden state (GeoAlign)


@contextmanager
def lm_head_input(model, enabled=True):
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
def response_geometry(spec, logits, hidden, labels, producing, response, temperature=1.0, segment_ids=None, rows=None):
    """Per-response geometry of one forward, small float32 CPU tensors: {"features" (R, D), "hidden" (R, d),
    "entropy" (R,)}, each only when `spec` asks for it. Both engines call this on their own layouts.

    logits (B, S, V) padded or (1, T, V) packed: the temperature-scaled logits (the sampling distribution);
    hidden: the lm_head input of the same forward, same layout; labels: label at position s = token s+1;
    producing (B, S) bool: positions whose logits produced a response token; response (B, S) bool: positions holding
    a response token; segment_ids: response id per position (packed; None = padded, R = B); rows: R (responses past
    the last one with a token get zero rows).
    features: `lm_head_features` of each response's tokens with `hidden / temperature`, the exact gradient of the
    temperature-scaled log-probs (SALT Eq. 19). hidden: the lm_head input at the response's last token (GeoAlign
    §4: the last-token hidden state). entropy: sum over the response's tokens of H(softmax(z)) / log V (SALT App.
    F.3 entropy-alpha's H_t is its token-weighted mean, computed by the pipeline).
    """
    rows = rows if rows is not None else producing.shape[0]
    out = {}
    if spec.features is not None:
        scaled = hidden / temperature if temperature != 1.0 else hidden
        feats = lm_head_features(
            logits, scaled, labels, producing, spec.features, spec.dim, spec.seed, segment_ids=segment_ids
        )
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
