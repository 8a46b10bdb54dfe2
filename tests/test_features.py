"""LM-head-gradient proxy features (SALT Eq. 19): exact = autograd's gradient; sketch (TensorSketch) and kronecker =
unbiased linear sketches of it; lm_head_gram = the exact Gram from token pairs."""

import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.special import softmax as np_softmax
from torch.testing import assert_close

from openrlhf_geo.features import (
    EXACT_MAX_NUMEL,
    METHODS,
    kronecker_projections,
    last_token_hidden,
    lm_head_features,
    lm_head_gram,
    sketch_hashes,
)


def random_batch(seed, B=3, S=6, V=13, d=5, p_mask=0.7, dtype=torch.float32, scale=2.0):
    """Aligned (logits, hidden, tokens, mask) with a random mask; row 0 always has a masked token."""
    g = torch.Generator().manual_seed(seed)
    logits = (scale * torch.randn(B, S, V, generator=g)).to(dtype)
    hidden = torch.randn(B, S, d, generator=g).to(dtype)
    tokens = torch.randint(0, V, (B, S), generator=g)
    mask = torch.rand(B, S, generator=g) < p_mask
    mask[0, 0] = True
    return logits, hidden, tokens, mask


def numpy_exact(logits, hidden, tokens, mask, temperature=1.0):
    """SALT Eq. 19 in float64, one token at a time: rows vec((1/T_i) Σ_t (onehot − softmax(z/τ)) h_tᵀ / τ)."""
    z, h = logits.double().numpy(), hidden.double().numpy()
    B, S, V = z.shape
    rows = np.zeros((B, V * h.shape[2]))
    for b in range(B):
        ts = [t for t in range(S) if mask[b, t]]
        for t in ts:
            e = -np_softmax(z[b, t] / temperature)
            e[int(tokens[b, t])] += 1.0
            rows[b] += np.outer(e, h[b, t]).ravel() / (len(ts) * temperature)
    return torch.from_numpy(rows)


def packed_from_padded(logits, hidden, tokens, mask, order, gap=1):
    """Concatenate padded rows (in `order`) into one (1, T) sequence, `gap` unmasked filler tokens between them."""
    B, S, V = logits.shape
    parts = {name: [] for name in ("logits", "hidden", "tokens", "mask", "seg")}
    for b in order:
        filler = torch.zeros(gap, dtype=torch.long)
        parts["logits"] += [logits[b], torch.full((gap, V), float("nan"))]  # filler is never read
        parts["hidden"] += [hidden[b], torch.full((gap, hidden.shape[2]), float("nan"))]
        parts["tokens"] += [tokens[b], filler]
        parts["mask"] += [mask[b], torch.ones(gap, dtype=torch.bool)]
        parts["seg"] += [torch.full((S,), b), torch.full((gap,), -1)]  # masked but id −1 ⇒ ignored
    return [torch.cat(parts[name])[None] for name in ("logits", "hidden", "tokens", "mask", "seg")]


# ---------------------------------------------------------------- exact: autograd and brute force


def tiny_qwen2(dtype):
    transformers = pytest.importorskip("transformers")
    config = transformers.Qwen2Config(
        vocab_size=40,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        attn_implementation="eager",
    )
    torch.manual_seed(0)
    return transformers.Qwen2ForCausalLM(config).to(dtype).eval()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_exact_features_equal_autograd_gradient_of_mean_action_logprob(dtype, temperature):
    model = tiny_qwen2(dtype)
    g = torch.Generator().manual_seed(1)
    lengths = [9, 6, 4]  # right padding to 9; prompt = first 3 tokens of every row
    seq = torch.randint(0, 40, (3, 9), generator=g)
    attn = torch.tensor([[1] * n + [0] * (9 - n) for n in lengths])
    captured = {}
    hook = model.lm_head.register_forward_hook(lambda mod, args, out: captured.update(h=args[0]))
    logits = model(input_ids=seq, attention_mask=attn).logits  # (B, S, V)
    hook.remove()
    # OpenRLHF's shift: action column j <-> logits/hidden at position j, label seq[:, j+1].
    labels, action_mask = seq[:, 1:], attn[:, 1:].bool()
    action_mask[:, :2] = False  # prompt tokens do not count
    logp = torch.log_softmax(logits[:, :-1] / temperature, -1).gather(-1, labels[..., None])[..., 0]
    grads = []
    for b in range(3):
        mean_logp = logp[b][action_mask[b]].mean()
        (grad,) = torch.autograd.grad(mean_logp, model.lm_head.weight, retain_graph=True)
        grads.append(grad.reshape(-1))
    features = lm_head_features(
        logits[:, :-1].detach(), captured["h"][:, :-1].detach(), labels, action_mask, "exact", temperature=temperature
    )
    assert features.dtype == torch.float32 and features.shape == (3, 40 * 16)
    assert_close(features, torch.stack(grads).float(), rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("temperature", [1.0, 1.7])
def test_exact_features_match_float64_numpy_bruteforce(seed, temperature):
    logits, hidden, tokens, mask = random_batch(seed, B=4, S=7, V=11, d=6)
    expected = numpy_exact(logits, hidden, tokens, mask, temperature)
    got = lm_head_features(logits, hidden, tokens, mask, "exact", temperature=temperature, chunk_size=3)
    assert_close(got.double(), expected, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------- sketches: linear maps of the exact gradient


def countsketch_matrix(vocab_size, hidden_size, dim, seed):
    """The TensorSketch as an explicit (V·d, D) float64 matrix from its hashes: with b_V(v) = q·L + r, entry (v, c)
    -> bucket P·r + (q + b_d(c)) mod P with sign s_V(v) s_d(c) (the definition, independent of the FFT
    implementation)."""
    hashes = sketch_hashes(vocab_size, hidden_size, dim, seed)
    P, b_V = hashes.block, hashes.vocab_bucket[:, None]
    L = dim // P
    bucket = P * (b_V % L) + (b_V // L + hashes.hidden_bucket[None, :]) % P
    sign = hashes.vocab_sign[:, None] * hashes.hidden_sign[None, :]
    matrix = torch.zeros(vocab_size * hidden_size, dim, dtype=torch.float64)
    matrix[torch.arange(vocab_size * hidden_size), bucket.reshape(-1)] = sign.reshape(-1).double()
    return matrix


@pytest.mark.parametrize(
    ("V", "d", "dim", "chunk"),
    [
        (50, 9, 64, 256),  # one vocabulary block
        (300, 40, 256, 5),  # two blocks, the second shorter, wrapping around
        (40, 30, 16, 3),  # d > D: the hidden side is hashed, not injected
        (37, 5, 36, 1),  # odd rfft length sizes: D = 36, V = 37 (a one-id last block)
    ],
)
def test_sketch_equals_its_hashes_applied_to_the_exact_gradient(V, d, dim, chunk):
    logits, hidden, tokens, mask = random_batch(5, B=4, S=8, V=V, d=d)
    expected = numpy_exact(logits, hidden, tokens, mask, 0.8) @ countsketch_matrix(V, d, dim, seed=3)
    got = lm_head_features(logits, hidden, tokens, mask, "sketch", dim, seed=3, temperature=0.8, chunk_size=chunk)
    assert got.shape == (4, dim) and got.dtype == torch.float32
    assert_close(got.double(), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("chunk", [13, 64])
def test_the_gpu_tile_forced_on_a_cpu_gives_the_cpu_tiles_features(monkeypatch, chunk):
    """On a GPU a tile is the whole chunk (`_TensorSketchTiles`: `EXP_TILE` applies to CPUs only), a branch no CPU
    run takes: forced here by lifting EXP_TILE past the chunk, against the float64 sketch of the exact gradient and
    the CPU's tiles of EXP_TILE tokens (the same sums in another order: float32 rounding apart)."""
    from openrlhf_geo import features

    logits, hidden, tokens, mask = random_batch(11, B=4, S=24, V=300, d=40, scale=20.0)
    logits[1, :3] += 400.0  # rows the exp pass redoes shifted, inside a tile
    expected = numpy_exact(logits, hidden, tokens, mask, 0.7) @ countsketch_matrix(300, 40, 256, seed=2)
    args = (logits, hidden, tokens, mask, "sketch", 256)
    assert int(mask.sum()) > chunk > features.EXP_TILE  # several chunks, each more than one CPU tile
    cpu_tiles = lm_head_features(*args, seed=2, temperature=0.7, chunk_size=chunk)
    monkeypatch.setattr(features, "EXP_TILE", 10**6)
    gpu_tile = lm_head_features(*args, seed=2, temperature=0.7, chunk_size=chunk)
    assert_close(gpu_tile.double(), expected, rtol=1e-5, atol=1e-6)
    assert_close(gpu_tile, cpu_tiles, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_sketch_redoes_rows_whose_unshifted_exp_overflows_or_underflows(temperature):
    logits, hidden, tokens, mask = random_batch(7, B=3, S=5, V=300, d=6, scale=20.0)
    logits[0, :2] += 400.0  # exp(z/τ) overflows float32
    logits[1, 1:4] -= 400.0  # exp(z/τ) underflows for the whole row
    expected = numpy_exact(logits, hidden, tokens, mask, temperature) @ countsketch_matrix(300, 6, 256, seed=2)
    got = lm_head_features(logits, hidden, tokens, mask, "sketch", 256, seed=2, temperature=temperature)
    assert_close(got.double(), expected, rtol=1e-5, atol=1e-6)
    half = lm_head_features(logits.bfloat16(), hidden, tokens, mask, "sketch", 256, seed=2, temperature=temperature)
    upcast = lm_head_features(
        logits.bfloat16().float(), hidden, tokens, mask, "sketch", 256, seed=2, temperature=temperature
    )
    assert torch.equal(half, upcast)  # bf16 logits: the exp of the float32 values, on either path


def numpy_log_probs(logits, tokens, mask, temperature=1.0):
    """log softmax(z/τ)[y] in float64 at masked positions, 0 elsewhere (scipy, one position at a time)."""
    from scipy.special import log_softmax

    z = logits.double().numpy()
    out = np.zeros(mask.shape)
    for b, t in zip(*np.nonzero(mask.numpy())):
        out[b, t] = log_softmax(z[b, t] / temperature)[int(tokens[b, t])]
    return torch.from_numpy(out)


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    method=st.sampled_from(METHODS),
    temperature=st.sampled_from([1.0, 0.6]),
    packed=st.booleans(),
    chunk=st.sampled_from([2, 1000]),
)
def test_log_probs_from_the_feature_pass_equal_log_softmax(seed, method, temperature, packed, chunk):
    """return_log_probs: log softmax(z/τ)[y] at masked positions from the features' own pass; features unchanged."""
    batch = random_batch(seed, B=4, S=5, V=40, d=4, p_mask=0.6, scale=4.0)
    kwargs = {"temperature": temperature, "chunk_size": chunk}
    if packed:
        *batch, kwargs["segment_ids"] = packed_from_padded(*batch, order=[2, 0, 3, 1])
    logits, _, tokens, mask = batch
    features, log_probs = lm_head_features(*batch, method, 64, return_log_probs=True, **kwargs)
    assert torch.equal(features, lm_head_features(*batch, method, 64, **kwargs))
    keep = mask & (kwargs["segment_ids"] >= 0) if packed else mask
    expected = numpy_log_probs(logits.nan_to_num(), tokens, keep, temperature)
    assert log_probs.dtype == torch.float32 and log_probs.shape == mask.shape
    assert_close(log_probs.double(), expected, rtol=1e-6, atol=1e-6)  # float32 rounding


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_log_probs_survive_the_overflow_and_underflow_redo(temperature):
    logits, hidden, tokens, mask = random_batch(7, B=3, S=5, V=300, d=6, scale=20.0)
    logits[0, :2] += 400.0  # the sketch's unshifted exp overflows: redone shifted by the row maximum
    logits[1, 1:4] -= 400.0  # underflows for the whole row: redone too
    for dtype in (torch.float32, torch.bfloat16):  # bf16: against the log_softmax of the bf16 values
        z = logits.to(dtype)
        _, got = lm_head_features(z, hidden, tokens, mask, "sketch", 256, seed=2, temperature=temperature,
                                  return_log_probs=True)  # fmt: skip
        # float32 rounding of |z/τ| up to ~900: the float32 log_softmax's own error is as large
        assert_close(got.double(), numpy_log_probs(z, tokens, mask, temperature), rtol=0, atol=1e-4)


def test_sketch_is_the_exact_gradient_when_it_fits():
    batch = random_batch(6, V=8, d=4)  # V·d = 32 <= D = 36
    assert torch.equal(lm_head_features(*batch, "sketch", 36), lm_head_features(*batch, "exact"))


def test_sketch_hashes_are_signs_and_spread_buckets():
    hashes = sketch_hashes(300, 40, 256, seed=0)
    assert [t.shape for t in hashes[:4]] == [(300,), (300,), (40,), (40,)]
    assert hashes.block == 64  # P: the smallest divisor of D = 256 that is >= d = 40; L = 4 blocks
    for sign in (hashes.vocab_sign, hashes.hidden_sign):
        assert sign.dtype == torch.float32 and set(sign.tolist()) == {-1.0, 1.0}
    for bucket, size in ((hashes.vocab_bucket, 256), (hashes.hidden_bucket, 64)):
        assert bucket.dtype == torch.int64 and 0 <= int(bucket.min()) and int(bucket.max()) < size
    assert len(set(hashes.hidden_bucket.tolist())) == 40  # d <= P: an injection
    first, second = hashes.vocab_bucket[:256], hashes.vocab_bucket[256:]
    assert len(set(first.tolist())) == 256 and len(set(second.tolist())) == 44  # a block never shares a bucket
    assert torch.equal((first - first[0]) % 256, torch.arange(256))  # each block: a cyclic shift of its ids
    # the hidden side depends on (seed, d, D) only; another seed draws other hashes
    assert torch.equal(sketch_hashes(99, 40, 256, seed=0).hidden_bucket, hashes.hidden_bucket)
    assert not torch.equal(sketch_hashes(300, 40, 256, seed=1).vocab_sign, hashes.vocab_sign)
    assert len(set(sketch_hashes(10, 40, 16).hidden_bucket.tolist())) == 16  # d > D: every bucket used
    assert [sketch_hashes(10, d, 102400).block for d in (1536, 2048, 3584, 200_000)] == [1600, 2048, 4096, 102400]


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10_000), V=st.integers(40, 400), d=st.integers(2, 24), dim=st.sampled_from([64, 144, 256]))
def test_rows_of_neighbouring_token_ids_never_share_a_bucket(seed, V, d, dim):
    """Token ids v, v + δ (0 < δ < L) of one block of D ids fall in different convolution blocks, so their rows never
    collide: the layout bug this guards against (blocks of consecutive ids) collided whole rows of neighbouring ids.
    (Ids in different blocks of D ids have independent offsets: their entries collide with probability 1/D.)"""
    hashes = sketch_hashes(V, d, dim, seed)
    L = dim // hashes.block
    buckets = countsketch_matrix(V, d, dim, seed).abs().reshape(V, d, dim).sum(1) > 0  # (V, D): row v's buckets
    same_id_block = torch.arange(V) // dim
    for delta in range(1, L):
        pairs = same_id_block[:-delta] == same_id_block[delta:]
        assert not (buckets[:-delta] & buckets[delta:])[pairs].any(), (L, delta)


@pytest.mark.parametrize("method", ["sketch", "kronecker"])
def test_sketch_inner_products_are_unbiased_over_seeds(method):
    """Mean over seeds of ⟨φ_i, φ_j⟩ matches ⟨G_i, G_j⟩_F within 4 standard errors estimated from the draws."""
    logits, hidden, tokens, mask = random_batch(11, B=4, S=6, V=24, d=6, scale=1.0)
    exact = lm_head_features(logits, hidden, tokens, mask, "exact").double()
    gram_exact = exact @ exact.T
    grams = torch.stack(
        [
            (phi := lm_head_features(logits, hidden, tokens, mask, method, 16, seed=s).double()) @ phi.T
            for s in range(600)
        ]
    )
    mean, stderr = grams.mean(0), grams.std(0) / len(grams) ** 0.5
    assert (mean - gram_exact).abs().le(4 * stderr).all(), (mean, gram_exact, stderr)
    # the check has power: 4 SE is a small fraction of the Gram's scale, so a biased sketch (e.g. S_e with
    # unscaled ±1 entries, ×k on every inner product) could not pass
    assert (4 * stderr).max() < 0.25 * gram_exact.diag().min()


@settings(max_examples=8, deadline=None)
@given(seed=st.integers(0, 10_000), V=st.integers(20, 80), d=st.integers(3, 12))
def test_sketch_gram_error_is_within_its_stated_variance(seed, V, d):
    """Over sketch seeds the squared error of every ⟨φ_i, φ_j⟩ stays within the bound `sketch_hashes` states,
    4‖G_i‖²‖G_j‖²/(P − 1), and is on average over the pairs of the order of a JL sketch's
    (‖G_i‖²‖G_j‖² + ⟨G_i, G_j⟩²)/D."""
    dim = 16
    batch = random_batch(seed, B=3, S=6, V=V, d=d, scale=1.0)
    exact = numpy_exact(*batch)  # float64, one token at a time
    gram = exact @ exact.T
    errors = torch.stack(
        [(phi := lm_head_features(*batch, "sketch", dim, seed=s).double()) @ phi.T - gram for s in range(400)]
    )
    norms = gram.diagonal()
    block = sketch_hashes(V, d, dim).block
    bound = 4 * norms[:, None] * norms[None, :] / (block - 1)
    jl = (norms[:, None] * norms[None, :] + gram.square()) / dim
    mse = errors.square().mean(0)
    assert (mse <= 1.3 * bound).all(), (mse, bound)  # 1.3: the sampling error of a 400-draw mean square
    assert 0.2 <= float((mse / jl).mean()) <= 3, (mse, jl)


@settings(max_examples=5, deadline=None)
@given(seed=st.integers(0, 10_000), V=st.integers(10, 60), d=st.integers(2, 10), dim=st.sampled_from([16, 25, 64]))
def test_sketch_gram_is_unbiased_for_any_batch(seed, V, d, dim):
    """E over sketch seeds of ⟨φ_i, φ_j⟩ = ⟨G_i, G_j⟩_F (float64 brute force) within 4 standard errors, for random
    shapes, including V·d close to D and an odd D."""
    batch = random_batch(seed, B=3, S=5, V=V, d=d, scale=1.0)
    exact = numpy_exact(*batch)
    gram = exact @ exact.T
    grams = torch.stack(
        [(phi := lm_head_features(*batch, "sketch", dim, seed=s).double()) @ phi.T for s in range(300)]
    )
    stderr = grams.std(0) / len(grams) ** 0.5
    assert (grams.mean(0) - gram).abs().le(4 * stderr + 1e-6).all()


@pytest.mark.parametrize("method", ["sketch", "kronecker"])
def test_sketch_features_are_bit_identical_in_a_fresh_process(tmp_path, method):
    batch = random_batch(2, V=97, d=10)
    here = lm_head_features(*batch, method, 64, seed=7)
    torch.save(batch, tmp_path / "batch.pt")
    code = textwrap.dedent(
        f"""
        import sys, torch
        from openrlhf_geo.features import lm_head_features
        phi = lm_head_features(*torch.load(sys.argv[1]), "{method}", 64, seed=7)
        torch.save(phi, sys.argv[2])
        """
    )
    subprocess.run([sys.executable, "-c", code, tmp_path / "batch.pt", tmp_path / "phi.pt"], check=True)
    assert torch.equal(torch.load(tmp_path / "phi.pt"), here)
    assert not torch.equal(lm_head_features(*batch, method, 64, seed=8), here)


@pytest.mark.parametrize("dim", [16, 64])
def test_kronecker_equals_projections_applied_to_exact_gradient(dim):
    logits, hidden, tokens, mask = random_batch(5, B=4, S=8, V=50, d=9)
    exact = numpy_exact(logits, hidden, tokens, mask, 0.8).reshape(4, 50, 9)
    s_e, s_h = kronecker_projections(50, 9, dim, seed=3)
    expected = (s_e.double() @ exact @ s_h.double().T).reshape(4, -1)  # S_e G_i S_hᵀ, (k, k) per response
    got = lm_head_features(logits, hidden, tokens, mask, "kronecker", dim, seed=3, temperature=0.8)
    assert got.shape == (4, dim)
    assert_close(got.double(), expected, rtol=1e-5, atol=1e-6)


def test_kronecker_projections_are_rademacher_with_unit_column_norm():
    s_e, s_h = kronecker_projections(30, 7, 64, seed=0)
    assert s_e.shape == (8, 30) and s_h.shape == (8, 7)
    for s in (s_e, s_h):
        assert_close(s.abs(), torch.full_like(s, 8**-0.5))  # ±1/sqrt(k), k = sqrt(dim) = 8
        assert 0.3 < (s > 0).float().mean() < 0.7
        assert_close(s.pow(2).sum(0), torch.ones(s.shape[1]))  # ‖S onehot(v)‖ = 1 for every v
    # S_h is drawn first, so models sharing d (and seed, dim) share S_h whatever their vocabulary
    assert torch.equal(kronecker_projections(99, 7, 64, seed=0)[1], s_h)
    assert not torch.equal(kronecker_projections(30, 7, 64, seed=1)[0], s_e)


# ---------------------------------------------------------------- the exact Gram from token pairs


def numpy_exact_gram(logits, hidden, tokens, mask, temperature=1.0):
    """⟨G_i, G_j⟩_F by the token-pair sum, float64, one pair at a time (independent of lm_head_gram's algebra)."""
    z, h = logits.double().numpy(), hidden.double().numpy()
    B = z.shape[0]
    per = []
    for b in range(B):
        ts = [t for t in range(z.shape[1]) if mask[b, t]]
        es = []
        for t in ts:
            e = -np_softmax(z[b, t] / temperature)
            e[int(tokens[b, t])] += 1.0
            es.append(e)
        per.append([(e, h[b, t] / (len(ts) * temperature)) for e, t in zip(es, ts)])
    gram = np.zeros((B, B))
    for i in range(B):
        for j in range(B):
            gram[i, j] = sum((e @ f) * (g @ k) for e, g in per[i] for f, k in per[j])
    return torch.from_numpy(gram)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_token_pair_gram_matches_float64_bruteforce(temperature):
    logits, hidden, tokens, mask = random_batch(3, B=4, S=6, V=11, d=5)
    expected = numpy_exact_gram(logits, hidden, tokens, mask, temperature)
    got = lm_head_gram(logits.double(), hidden.double(), tokens, mask, temperature=temperature, chunk_size=4)
    assert got.dtype == torch.float64 and got.shape == (4, 4)
    assert_close(got, expected, rtol=1e-10, atol=1e-12)
    assert torch.equal(got, got.T)
    # float32 logits: the products over V in float32, the same Gram to float32 rounding
    assert_close(lm_head_gram(logits, hidden, tokens, mask, temperature=temperature), expected, rtol=1e-5, atol=1e-6)


@settings(max_examples=30, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    chunk=st.integers(1, 12),
    order=st.permutations(range(4)),
    temperature=st.sampled_from([1.0, 0.6, 1.5]),
)
def test_token_pair_gram_equals_the_gram_of_the_exact_features(seed, chunk, order, temperature):
    batch = random_batch(seed, B=4, S=5, V=9, d=4, p_mask=0.6, dtype=torch.float64)
    exact = lm_head_features(*batch, "exact", temperature=temperature)
    expected = exact.double() @ exact.double().T
    assert_close(lm_head_gram(*batch, temperature=temperature, chunk_size=chunk), expected, rtol=1e-5, atol=1e-6)
    *packed, seg = packed_from_padded(*batch, order)
    got = lm_head_gram(*packed, temperature=temperature, segment_ids=seg, chunk_size=chunk)
    assert_close(got, expected, rtol=1e-5, atol=1e-6)


def test_token_pair_gram_validates_like_the_features():
    logits, hidden, tokens, mask = random_batch(10)
    logits[0, 0, 3] = float("nan")
    with pytest.raises(ValueError, match="^logits "):
        lm_head_gram(logits, hidden, tokens, mask)
    with pytest.raises(ValueError, match="tokens at masked positions"):
        lm_head_gram(*random_batch(0)[:2], random_batch(0)[2] + 13, random_batch(0)[3])
    mask[:] = False
    assert torch.equal(lm_head_gram(logits, hidden, tokens, mask), torch.zeros(3, 3, dtype=torch.float64))


# ---------------------------------------------------------------- layouts, chunks, dtypes, temperature


@settings(max_examples=40)
@given(seed=st.integers(0, 10_000), chunk=st.integers(1, 20), method=st.sampled_from(METHODS))
def test_chunked_equals_unchunked(seed, chunk, method):
    batch = random_batch(seed, B=3, S=6, V=17, d=4)
    whole = lm_head_features(*batch, method, 16, chunk_size=10_000)
    assert_close(lm_head_features(*batch, method, 16, chunk_size=chunk), whole, rtol=1e-5, atol=1e-6)


@settings(max_examples=40)
@given(seed=st.integers(0, 10_000), order=st.permutations(range(4)), method=st.sampled_from(METHODS))
def test_packed_and_padded_inputs_give_the_same_rows(seed, order, method):
    batch = random_batch(seed, B=4, S=5, V=9, d=4, p_mask=0.5)
    padded = lm_head_features(*batch, method, 16)
    *packed, seg = packed_from_padded(*batch, order)
    for chunk in (3, 1000):
        got = lm_head_features(*packed, method, 16, segment_ids=seg, chunk_size=chunk)
        assert_close(got, padded, rtol=1e-5, atol=1e-6)


def test_non_contiguous_logits_view_equals_its_copy():
    logits, hidden, tokens, mask = random_batch(4, B=3, S=9, V=12, d=4)
    view = logits[:, 1:]  # what a caller's shift produces; no copy of logits is made by the function
    assert not view.is_contiguous()
    expected = lm_head_features(view.contiguous(), hidden[:, 1:], tokens[:, 1:], mask[:, 1:], chunk_size=4, dim=16)
    assert_close(lm_head_features(view, hidden[:, 1:], tokens[:, 1:], mask[:, 1:], chunk_size=4, dim=16), expected)


@pytest.mark.parametrize("method", ["exact", "sketch", "kronecker"])
def test_bf16_logits_give_float32_features_close_to_full_precision(method):
    logits, hidden, tokens, mask = random_batch(6, B=3, S=8, V=30, d=8)
    full = lm_head_features(logits, hidden, tokens, mask, method, 64)
    half = lm_head_features(logits.bfloat16(), hidden.bfloat16(), tokens, mask, method, 64)
    assert half.dtype == torch.float32
    # softmax ran in float32 on the bf16 values: identical to passing those values as float32
    upcast = lm_head_features(logits.bfloat16().float(), hidden.bfloat16().float(), tokens, mask, method, 64)
    assert torch.equal(half, upcast)
    assert_close(half, full, rtol=0.05, atol=0.02 * full.abs().max().item())


@pytest.mark.parametrize("method", ["exact", "sketch", "kronecker"])
def test_temperature_divides_logits_and_scales_gradient(method):
    logits, hidden, tokens, mask = random_batch(8)
    tempered = lm_head_features(logits, hidden, tokens, mask, method, 16, temperature=0.5)
    assert_close(tempered, lm_head_features(logits / 0.5, hidden, tokens, mask, method, 16) / 0.5)
    assert not torch.allclose(tempered, lm_head_features(logits, hidden, tokens, mask, method, 16))


# ---------------------------------------------------------------- properties (hypothesis)


@settings(max_examples=50)
@given(seed=st.integers(0, 10_000), perm=st.permutations(range(4)), method=st.sampled_from(METHODS))
def test_permuting_responses_permutes_feature_rows(seed, perm, method):
    logits, hidden, tokens, mask = random_batch(seed, B=4, S=5, V=10, d=3)
    perm = torch.tensor(perm)
    base = lm_head_features(logits, hidden, tokens, mask, method, 16)
    permuted = lm_head_features(logits[perm], hidden[perm], tokens[perm], mask[perm], method, 16)
    assert_close(permuted, base[perm])


@settings(max_examples=50)
@given(seed=st.integers(0, 10_000), col=st.integers(1, 5), method=st.sampled_from(METHODS))
def test_masking_out_a_token_equals_removing_it(seed, col, method):
    logits, hidden, tokens, mask = random_batch(seed, B=3, S=6, V=10, d=3, p_mask=0.8)
    masked = mask.clone()
    masked[:, col] = False
    keep = [t for t in range(6) if t != col]
    removed = lm_head_features(logits[:, keep], hidden[:, keep], tokens[:, keep], mask[:, keep], method, 16)
    assert_close(lm_head_features(logits, hidden, tokens, masked, method, 16), removed)


@settings(max_examples=50)
@given(seed=st.integers(0, 10_000), c=st.floats(-3, 3), method=st.sampled_from(METHODS))
def test_features_are_linear_in_hidden_for_fixed_logits(seed, c, method):
    logits, h1, tokens, mask = random_batch(seed, V=10, d=4)
    h2 = random_batch(seed + 1, V=10, d=4)[1]
    lhs = lm_head_features(logits, h1 + c * h2, tokens, mask, method, 16)
    rhs = lm_head_features(logits, h1, tokens, mask, method, 16) + c * lm_head_features(
        logits, h2, tokens, mask, method, 16
    )
    assert_close(lhs, rhs, rtol=1e-4, atol=1e-5)


@settings(max_examples=50)
@given(
    seed=st.integers(0, 10_000),
    scale=st.sampled_from([1e-3, 1.0, 30.0, 1e4]),
    p_mask=st.floats(0.0, 1.0),
    neg_inf=st.booleans(),
    method=st.sampled_from(METHODS),
)
def test_finite_inputs_give_finite_features_and_zero_rows_for_empty_responses(seed, scale, p_mask, neg_inf, method):
    logits, hidden, tokens, mask = random_batch(seed, B=4, S=5, V=10, d=3, p_mask=p_mask, scale=scale)
    mask[3] = False
    if neg_inf:  # masked vocabulary entries: probability 0 (the sampled token keeps a finite logit)
        logits[..., 0] = float("-inf")
        tokens.clamp_(min=1)
    features = lm_head_features(logits, hidden, tokens, mask, method, 16)
    assert torch.isfinite(features).all()
    assert (features[3] == 0).all()
    if method == "exact":  # every entry of e_t lies in [-1, 1], so |G_i| <= max|h| entrywise (τ = 1)
        assert features.abs().max() <= hidden.abs().max() * (1 + 1e-6)


@settings(max_examples=30)
@given(seed=st.integers(0, 10_000), order=st.permutations(range(3)))
def test_last_token_hidden_picks_each_responses_last_masked_position(seed, order):
    batch = random_batch(seed, B=3, S=6, d=4, p_mask=0.5)
    hidden, mask = batch[1], batch[3]
    mask[2] = False
    expected = torch.zeros(3, 4)
    for b in range(2):
        expected[b] = hidden[b, mask[b].nonzero().max()]
    assert torch.equal(last_token_hidden(hidden, mask), expected)
    _, packed_hidden, _, packed_mask, seg = packed_from_padded(*batch, order)
    assert torch.equal(last_token_hidden(packed_hidden, packed_mask, seg), expected)


# ---------------------------------------------------------------- degenerate inputs and validation


def test_nan_or_inf_at_unmasked_positions_is_ignored():
    logits, hidden, tokens, mask = random_batch(9, B=2, S=5)
    mask[:, 4] = False
    expected = lm_head_features(logits, hidden, tokens, mask, "exact")
    logits[:, 4], hidden[:, 4] = float("nan"), float("inf")
    assert torch.equal(lm_head_features(logits, hidden, tokens, mask, "exact"), expected)


@pytest.mark.parametrize(
    ("corrupt", "name"),
    [
        (lambda z, h: z.__setitem__((0, 0, 3), float("nan")), "logits"),
        (lambda z, h: z.__setitem__((0, 0, 3), float("inf")), "logits"),
        (lambda z, h: z.__setitem__((0, 0), float("-inf")), "logits"),
        (lambda z, h: h.__setitem__((0, 0, 1), float("nan")), "hidden"),
        (lambda z, h: h.__setitem__((0, 0, 1), float("-inf")), "hidden"),
    ],
)
@pytest.mark.parametrize("method", ["exact", "sketch", "kronecker"])
def test_non_finite_values_at_masked_positions_raise_naming_the_argument(corrupt, name, method):
    logits, hidden, tokens, mask = random_batch(10)
    corrupt(logits, hidden)
    with pytest.raises(ValueError, match=rf"^{name} "):
        lm_head_features(logits, hidden, tokens, mask, method, 16)


def test_last_token_hidden_rejects_non_finite_selected_states_only():
    _, hidden, _, mask = random_batch(3, B=2, S=5)
    mask[:, 3:] = False
    mask[:, 2] = True
    hidden[:, 4] = float("nan")  # after every response's last token: never selected
    assert torch.equal(last_token_hidden(hidden, mask), hidden[:, 2])
    hidden[1, 2, 0] = float("inf")
    with pytest.raises(ValueError, match="^hidden "):
        last_token_hidden(hidden, mask)


def test_empty_inputs_give_zero_rows():
    logits, hidden, tokens, mask = random_batch(1)
    mask[:] = False
    assert torch.equal(lm_head_features(logits, hidden, tokens, mask, "sketch", 16), torch.zeros(3, 16))
    seg = torch.full(mask.shape, -1)
    assert lm_head_features(logits, hidden, tokens, mask, "sketch", 16, segment_ids=seg).shape == (0, 16)
    assert last_token_hidden(hidden, mask, seg).shape == (0, 5)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"method": "ghost"}, r"method must be one of \('sketch', 'kronecker', 'exact'\)"),
        ({"dim": 1000}, "dim must be a perfect square >= 16"),
        ({"dim": 9}, "dim must be a perfect square >= 16"),
        ({"temperature": 0.0}, "temperature must be"),
        ({"temperature": float("nan")}, "temperature must be"),
        ({"chunk_size": 0}, "chunk_size must be"),
        ({"segment_ids": torch.zeros(3, 6)}, "segment_ids must be an integer tensor"),
        ({"segment_ids": torch.full((3, 6), -2)}, "segment_ids must be >= -1"),
        ({"segment_ids": torch.zeros(1, 6, dtype=torch.long)}, "segment_ids must have the shape of mask"),
    ],
)
def test_invalid_arguments_raise_a_clear_value_error(kwargs, message):
    with pytest.raises(ValueError, match=message):
        lm_head_features(*random_batch(0), **kwargs)


def test_invalid_shapes_tokens_and_mask_raise_naming_the_argument():
    logits, hidden, tokens, mask = random_batch(0)
    cases = [
        ((logits[0], hidden, tokens, mask), "logits"),
        ((logits, hidden[:, :-1], tokens, mask), "hidden"),
        ((logits, hidden, tokens.float(), mask), "tokens"),
        ((logits, hidden, tokens + 13, mask), "tokens"),
        ((logits, hidden, tokens, mask[:, :-1]), "mask"),
        ((logits, hidden, tokens, mask.long() * 2), "mask"),
    ]
    for args, name in cases:
        with pytest.raises(ValueError, match=name):
            lm_head_features(*args)


def test_exact_method_refuses_huge_vocab_times_hidden_and_points_at_sketch():
    V, d = 2**14, 2**13
    assert V * d > EXACT_MAX_NUMEL
    with pytest.raises(ValueError, match='use method="sketch"'):
        lm_head_features(
            torch.zeros(1, 1, V),
            torch.zeros(1, 1, d),
            torch.zeros(1, 1, dtype=torch.long),
            torch.ones(1, 1, dtype=torch.bool),
            "exact",
        )
