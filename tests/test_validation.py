"""dmlkit.validation: one check for embeddings and labels; scale-safe distances (issue 11, 2-4)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from dmlkit import validation
from dmlkit.distances import CosineSimilarity, DotProductSimilarity, LpDistance, SNRDistance
from dmlkit.exceptions import NonFiniteError, ShapeError
from dmlkit.metrics import evaluate, knn, per_class, pos_neg_histograms
from dmlkit.validation import check_embeddings, check_labels, check_product_range, safe_normalize

RETRIEVAL = ["precision_at_1", "recall_at_k", "r_precision", "map_at_r", "map"]


def clustered(n_classes: int = 10, per: int = 6, d: int = 8, seed: int = 0):
    rng = np.random.default_rng(seed)
    centres = rng.normal(size=(n_classes, d))
    labels = np.repeat(np.arange(n_classes), per)
    x = (centres[labels] + 0.9 * rng.normal(size=(labels.size, d))).astype(np.float32)
    return x, labels


# -- labels ---------------------------------------------------------------------------------------
def test_integer_labels_pass_through_as_int64():
    for labels in ([3, 1, 2], np.array([3, 1, 2], np.uint8), torch.tensor([3, 1, 2], dtype=torch.int32),
                   np.array([3.0, 1.0, 2.0]), (3, 1, 2)):
        out, names = check_labels(labels, 3)
        assert out.dtype == np.int64 and out.tolist() == [3, 1, 2] and names is None


def test_string_labels_are_class_names():
    codes, names = check_labels(["dog", "cat", "dog", "emu"], 4)
    assert names == ["cat", "dog", "emu"]
    assert [names[c] for c in codes] == ["dog", "cat", "dog", "emu"]
    mixed_str_types = np.array([np.str_("dog"), "cat"], dtype=object)  # e.g. from pandas
    codes, names = check_labels(mixed_str_types, 2)
    assert codes.tolist() == [1, 0] and names == ["cat", "dog"]
    codes, names = check_labels(np.array([b"b", b"a"]), 2)
    assert names == ["a", "b"] and codes.tolist() == [1, 0]
    # a second set shares the first set's codes; new names are appended
    ref, names2 = check_labels(["emu", "yak"], 2, class_names=names + ["emu"])
    assert names2 == ["a", "b", "emu", "yak"] and ref.tolist() == [2, 3]


def test_integer_queries_never_meet_string_references():
    """Query ids 0/1 against reference names: the names' codes (cat 0, dog 1) would pass for the
    ids and give a confident P@1 of 0.0; either order is refused the same way."""
    from dmlkit.metrics import evaluate, per_class

    q = np.array([[1, 0], [0, 1]], np.float32)
    r = np.array([[1, 0.1], [0.1, 1]], np.float32)
    for ql, rl in (([0, 1], ["dog", "cat"]), (["dog", "cat"], [0, 1])):
        with pytest.raises(ShapeError, match="same kind of labels for both"):
            evaluate(q, ql, r, rl, metrics=["precision_at_1"])
        with pytest.raises(ShapeError, match="same kind of labels for both"):
            per_class(q, ql, r, rl)
    assert evaluate(q, ["cat", "dog"], r, ["cat", "dog"], metrics=["precision_at_1"])["precision_at_1"] == 1.0


@pytest.mark.parametrize(
    "labels, match",
    [
        (np.arange(10) / 10, "fractional"),  # 0.0 ... 0.9 must not collapse into class 0
        ([0.5, 1.0], "fractional"),
        ([np.nan, 1.0], "NaN"),
        (np.array([1.0, np.inf]), "NaN or infinite"),
        (["a", 1], "all integer class ids or all class-name strings"),
        ([True, False], "bool"),
        (np.array([True, False]), "dtype bool"),
        (torch.tensor([True, False]), "dtype torch.bool"),
        ([1 + 2j, 3j], "complex"),
        ([None, None], "NoneType"),
        (np.zeros((2, 1), np.int64), r"shape \(2,\)"),
        ([1, 2, 3], r"shape \(2,\)"),
        (np.array([2.0**60, 1.0]), "too large"),
    ],
)
def test_bad_labels_are_refused_with_one_line(labels, match):
    with pytest.raises(ShapeError, match=match) as info:
        check_labels(labels, 2 if not isinstance(labels, np.ndarray) or labels.size == 2 else None)
    assert "\n" not in str(info.value)


def test_numeric_and_string_label_sets_cannot_be_mixed():
    with pytest.raises(ShapeError, match="same kind"):
        check_labels([1, 2], 2, class_names=["a"])


def test_evaluate_refuses_fractional_labels_instead_of_scoring_one():
    x, _ = clustered()
    with pytest.raises(ShapeError, match="fractional"):
        evaluate(x, (np.arange(x.shape[0]) % 10) / 10)
    with pytest.raises(ShapeError, match="NaN"):
        evaluate(x, np.where(np.arange(x.shape[0]) == 3, np.nan, 1.0))


def test_evaluate_with_string_labels_equals_integer_labels():
    x, y = clustered()
    names = np.array([f"class-{c:02d}" for c in y])
    want = evaluate(x, y, metrics=RETRIEVAL)
    assert evaluate(x, names, metrics=RETRIEVAL) == want
    q, r = x[::2], x[1::2]
    # the reference names are encoded with the query's codes, whatever their order
    shuffled = np.random.default_rng(0).permutation(r.shape[0])
    a = evaluate(q, y[::2], r[shuffled], y[1::2][shuffled], metrics=RETRIEVAL)
    b = evaluate(q, names[::2], r[shuffled], names[1::2][shuffled], metrics=RETRIEVAL)
    assert a == b
    table = per_class(x, names)
    assert sorted(table) == sorted(set(names.tolist()))
    assert table["class-03"] == per_class(x, y)[3]
    h_int = pos_neg_histograms(q, y[::2], r, y[1::2], bins=10)
    h_str = pos_neg_histograms(q, names[::2], r, names[1::2], bins=10)
    np.testing.assert_array_equal(h_int.pos_counts, h_str.pos_counts)


# -- embeddings -----------------------------------------------------------------------------------
def test_check_embeddings_accepts_numbers_and_keeps_float32_without_copy():
    x = np.ones((3, 2), np.float32)
    t = check_embeddings(x)
    assert t.dtype == torch.float32 and np.shares_memory(t.numpy(), x)
    assert check_embeddings([[1, 2], [3, 4]]).dtype == torch.float32
    assert check_embeddings(np.ones((2, 2), np.float16)).dtype == torch.float32


@pytest.mark.parametrize(
    "x, error, match",
    [
        (np.ones(3), ShapeError, "2-D"),
        (np.zeros((0, 3)), ShapeError, "empty"),
        ([["a", "b"]], ShapeError, "real numbers"),
        (np.array([[True]]), ShapeError, "real numbers"),
        (torch.ones(2, 2, dtype=torch.complex64), ShapeError, "real numbers"),
        (np.array([[1.0, np.nan], [1.0, 2.0], [np.inf, 0.0]]), NonFiniteError, "2 row"),
        (np.array([[1e39, 0.0], [1.0, 1.0]]), NonFiniteError, "float32's range"),
        (np.full((2, 4), 3e38, np.float32), NonFiniteError, "L2 norm"),
    ],
)
def test_check_embeddings_refuses(x, error, match):
    with pytest.raises(error, match=match) as info:
        check_embeddings(x, "query embeddings")
    assert "\n" not in str(info.value)


# -- scale ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("scale", [1e19, 1e-20, 1e-41, 2.0**-100, 3e30])
def test_safe_normalize_is_scale_invariant(scale):
    x = torch.randn(200, 32, generator=torch.Generator().manual_seed(0))
    want = F.normalize(x.double(), dim=1)
    got = safe_normalize(x * scale).double()
    # subnormal inputs (1e-41) keep fewer bits: allow their rounding, normal ones ~1 ulp
    tol = 1e-3 if scale < 1e-38 else 1e-6
    torch.testing.assert_close(got, want, rtol=0, atol=tol)


def test_safe_normalize_equals_f_normalize_bitwise_at_ordinary_scale_and_its_gradient():
    x = torch.randn(64, 16, generator=torch.Generator().manual_seed(1), requires_grad=True)
    assert torch.equal(safe_normalize(x), F.normalize(x, dim=-1))
    w = torch.randn(64, 16, generator=torch.Generator().manual_seed(2))
    (g1,) = torch.autograd.grad((safe_normalize(x) * w).sum(), x)
    (g2,) = torch.autograd.grad((F.normalize(x, dim=-1) * w).sum(), x)
    torch.testing.assert_close(g1, g2)
    assert torch.equal(safe_normalize(torch.zeros(2, 3)), torch.zeros(2, 3))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_safe_normalize_plain_path_equals_the_rescaled_one_bitwise(monkeypatch, dtype):
    """On the CPU, rows whose peaks lie in PLAIN_NORMALIZE_RANGE skip the power-of-two
    rescaling: the values and gradients must be the rescaled path's bit for bit, at every scale
    of the range (and rows outside it must take the rescaled path)."""
    gen = torch.Generator().manual_seed(5)
    low, high = validation.PLAIN_NORMALIZE_RANGE
    # randn rows peak in [0.5, 4]: exponents 2 inside the range's ends keep every peak within it
    exponents = torch.randint(int(math.log2(low)) + 2, int(math.log2(high)) - 2, (300, 1),
                              generator=gen)
    x = (torch.randn(300, 24, generator=gen, dtype=torch.float64) * 2.0 ** exponents).to(dtype)
    w = torch.randn(300, 24, generator=gen, dtype=torch.float64).to(dtype)

    def value_and_gradient():
        leaf = x.clone().requires_grad_(True)
        out = safe_normalize(leaf)
        (out * w).sum().backward()
        return out.detach(), leaf.grad

    calls = []
    real = validation._plain_normalize_is_safe
    monkeypatch.setattr(validation, "_plain_normalize_is_safe",
                        lambda *a: calls.append(real(*a)) or calls[-1])
    plain = value_and_gradient()
    assert calls == [True]
    monkeypatch.setattr(validation, "_plain_normalize_is_safe", lambda *a: False)
    rescaled = value_and_gradient()
    assert torch.equal(plain[0], rescaled[0]) and torch.equal(plain[1], rescaled[1])
    for outside in (high * 4, low / 4, 0.0):
        assert not real(x, torch.tensor([[1.0], [outside]], dtype=dtype))


@pytest.mark.parametrize("backend", ["torch", "numba"])
def test_cosine_metrics_are_scale_invariant(backend):
    x, y = clustered(seed=3)
    want = evaluate(x, y, metrics=RETRIEVAL, backend=backend)
    for scale in (1e19, 1e-20, 1e-30):
        assert evaluate(x * np.float32(scale), y, metrics=RETRIEVAL, backend=backend) == want, scale


def test_cosine_knn_at_huge_scale_matches_unit_scale():
    x, _ = clustered(seed=4)
    a = knn(x, None, 5)
    b = knn(x * np.float32(1e19), None, 5)
    assert torch.equal(a.indices, b.indices)
    torch.testing.assert_close(a.values, b.values)


@pytest.mark.parametrize(
    "dist", [DotProductSimilarity(normalize_embeddings=False), LpDistance(normalize_embeddings=False),
             LpDistance(power=2, normalize_embeddings=False), SNRDistance()]
)
@pytest.mark.parametrize("scale", [1e19, 1e-25])
def test_unnormalised_distances_refuse_overflow_and_underflow(dist, scale):
    x = torch.randn(20, 8, generator=torch.Generator().manual_seed(0))
    with pytest.raises(NonFiniteError, match="too large" if scale > 1 else "too small"):
        dist(x * scale)
    with pytest.raises(NonFiniteError):
        dist.paired(x * scale, x)
    out = dist(x)  # ordinary scale: fine
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("distance", ["dot", "euclidean"])
@pytest.mark.parametrize("backend", ["torch", "numba"])
def test_evaluate_refuses_overflowing_unnormalised_distances(distance, backend):
    x, y = clustered()
    with pytest.raises(NonFiniteError, match="too large"):
        evaluate(x * np.float32(1e19), y, distance=DotProductSimilarity(False) if distance == "dot"
                 else LpDistance(normalize_embeddings=False), backend=backend)


def test_cosine_similarity_at_huge_scale_is_exact():
    x = torch.randn(10, 6, generator=torch.Generator().manual_seed(5))
    want = CosineSimilarity()(x)
    torch.testing.assert_close(CosineSimilarity()(x * 1e19), want)
    torch.testing.assert_close(CosineSimilarity()(x * 1e-20), want)
    torch.testing.assert_close(LpDistance(power=2)(x * 1e19), LpDistance(power=2)(x))


def test_lp_overflow_and_snr_constant_anchor_raise():
    x = torch.full((2, 4), 1e10)
    x[1] = -1e10
    with pytest.raises(NonFiniteError, match="beyond the floating range"):
        LpDistance(p=5, normalize_embeddings=False)(x / 1e0, None)
    flat = torch.randn(3, 5, generator=torch.Generator().manual_seed(0))
    flat[1] = 2.0
    with pytest.raises(NonFiniteError, match="zero variance"):
        SNRDistance()(flat)


def test_check_product_range_accepts_zero_and_ordinary_values():
    check_product_range(torch.zeros(3, 2))
    check_product_range(torch.randn(3, 2))
    check_product_range(torch.full((2, 2), 1e18))


def test_a_read_only_memory_map_is_checked_without_a_warning(tmp_path):
    """A flat index directory and shards are read-only memory maps: torch's "not writable"
    warning reached users of `dmlkit query` on every call. A fresh process: torch gives that
    warning once a process, so an earlier test could have used it up."""
    import subprocess
    import sys

    np.save(tmp_path / "v.npy", np.arange(12, dtype=np.float32).reshape(3, 4))
    code = ("import numpy as np, torch; from dmlkit.validation import check_embeddings; "
            f"t = check_embeddings(np.load({str(tmp_path / 'v.npy')!r}, mmap_mode='r')); "
            "assert torch.equal(t, torch.arange(12.0).reshape(3, 4))")
    proc = subprocess.run([sys.executable, "-W", "error::UserWarning", "-c", code],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
