"""Seed 003's loss forms that dmlkit offers as options, against float64 numpy oracles written
from the seed's text (audit s40_formulas, findings F1-F6).

* the online contrastive loss, one mean over all pairs: ``contrastive(reduction="pooled")``;
* NCA's objective ``argmax sum_i p_i``: ``nca(objective="sum")``;
* the ratio triplet loss ``max{0, 1 - d(a, n) / (m + d(a, p))}``: ``triplet(form="ratio")``;
* the plain-hinge lifted loss ``L_L``: ``lifted_structure(hinge_power=1)``.

Each oracle is a loop in numpy float64 over the pairs/triplets the seed names; values are
compared to 1e-10 and gradients to a central finite difference of the same oracle. The docs
that name these options (docs/seeds.md, docs/losses.md) are checked to name calls that
reproduce the oracles.
"""

from __future__ import annotations

import itertools
import math
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from dmlkit.distances import LpDistance
from dmlkit.exceptions import ConfigError
from dmlkit.losses import LOSSES, get_loss
from dmlkit.miners import get_miner

DOCS = Path(__file__).resolve().parents[1] / "docs"


# ------------------------------------------------------------------ helpers
def _batch(classes: int, per_class: int | list[int], dim: int = 4, seed: int = 0):
    """Standard-normal float64 rows and their labels (``per_class`` rows of each class)."""
    counts = [per_class] * classes if isinstance(per_class, int) else per_class
    x = np.random.default_rng(seed).normal(size=(sum(counts), dim))
    return x, np.repeat(np.arange(len(counts)), counts)


def _euclid(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.sqrt(((a - b) ** 2).sum()))


def _cos_dist(a: np.ndarray, b: np.ndarray) -> float:
    """Seed 003's ``d(p, q) = 1 - p.q / (|p| |q|)``."""
    return 1.0 - float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def _numeric_grad(f, x: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    g = np.zeros_like(x)
    for idx in np.ndindex(*x.shape):
        hi, lo = x.copy(), x.copy()
        hi[idx] += eps
        lo[idx] -= eps
        g[idx] = (f(hi) - f(lo)) / (2 * eps)
    return g


def _check(loss, oracle, x: np.ndarray, labels: np.ndarray, indices_fn=None) -> None:
    """``loss`` equals ``oracle(x)`` (1e-10) and its gradient the oracle's finite difference."""
    xt = torch.tensor(x, requires_grad=True)
    yt = torch.tensor(labels)
    indices = None if indices_fn is None else indices_fn(xt.detach(), yt)
    out = loss(xt, yt, indices=indices)
    out.backward()
    assert out.dtype == torch.float64
    assert abs(out.item() - oracle(x)) < 1e-10, (out.item(), oracle(x))
    np.testing.assert_allclose(xt.grad.numpy(), _numeric_grad(oracle, x), atol=1e-6, rtol=1e-5)


def _finite_at_zero_distance(loss, labels=(0, 0, 1, 1, 1, 2)) -> None:
    """Duplicated rows (``d = 0`` for a positive and for a negative pair): finite loss and
    gradient, in float64, float32 and under bfloat16 autocast (returned as float32)."""
    x = torch.tensor([[1.0, 0.0, 0.0], [1.0, 0.0, 0.0], [1.0, 0.0, 0.0], [0.0, 1.0, 0.5],
                      [0.0, 1.0, 0.5], [0.3, -1.0, 2.0]], dtype=torch.float64)
    y = torch.tensor(labels)
    for dtype in (torch.float64, torch.float32):
        xi = x.to(dtype).detach().clone().requires_grad_(True)
        out = loss(xi, y)
        out.backward()
        assert torch.isfinite(out) and torch.isfinite(xi.grad).all()
    xb = x.float().requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = loss(xb @ torch.eye(3), y)  # a bfloat16 product under autocast
    out.backward()
    assert out.dtype == torch.float32
    assert torch.isfinite(out) and torch.isfinite(xb.grad).all()


def _one_config_error(match: str, name: str, **params) -> None:
    with pytest.raises(ConfigError) as info:
        get_loss(name, **params)
    message = str(info.value)
    assert "\n" not in message and re.search(match, message), message


# ------------------------------------------------------------------ F1: online contrastive
def _contrastive_terms(x: np.ndarray, labels: np.ndarray, m: float) -> tuple[list[float], list[float]]:
    """Every pair ``i < j``: ``d^2`` for a positive, ``relu(m - d)^2`` for a negative."""
    pos, neg = [], []
    for i, j in itertools.combinations(range(len(x)), 2):
        d = _euclid(x[i], x[j])
        if labels[i] == labels[j]:
            pos.append(d * d)
        else:
            neg.append(max(0.0, m - d) ** 2)
    return pos, neg


def online_contrastive(x: np.ndarray, labels: np.ndarray, m: float) -> float:
    """Seed 003's ``OnlineContrastiveLoss`` with ``AllPairsSelector``: the pair terms of
    :func:`_contrastive_terms`, ``torch.cat([pos, neg]).mean()``."""
    pos, neg = _contrastive_terms(x, labels, m)
    return float(np.mean(pos + neg))


def contrastive_sum_of_means(x: np.ndarray, labels: np.ndarray, m: float) -> float:
    """dmlkit's ``reduction="mean"``: mean of the positive terms plus mean of the negative ones."""
    pos, neg = _contrastive_terms(x, labels, m)
    return float(np.mean(pos) + np.mean(neg))


@pytest.mark.parametrize("with_miner", [False, True])
@pytest.mark.parametrize("m", [1.0, 2.5])
def test_pooled_contrastive_is_seed_003_online_contrastive(with_miner, m):
    x, labels = _batch(4, 3, seed=1)  # raw embeddings, as the seed's code
    loss = get_loss("contrastive", neg_margin=m, hinge_power=2, reduction="pooled",
                    distance=LpDistance(normalize_embeddings=False))
    miner = get_miner("all_pairs") if with_miner else None
    _check(loss, lambda v: online_contrastive(v, labels, m), x, labels, miner)


def test_pooled_contrastive_on_the_audit_batch():
    # the audit's repro: C = 8 x M = 4 unit vectors, m = 1: the seed gives 0.1953, where
    # mean(pos) + mean(neg) (the old closest reduction) gives 2.0180
    g = torch.Generator().manual_seed(0)
    x = torch.nn.functional.normalize(torch.randn(32, 16, generator=g, dtype=torch.float64))
    labels = np.arange(32) // 4
    ours = get_loss("contrastive", hinge_power=2, reduction="pooled")(x, torch.tensor(labels))
    assert abs(ours.item() - online_contrastive(x.numpy(), labels, 1.0)) < 1e-12


def test_contrastive_mean_keeps_its_meaning():
    # old configs: "mean" is still mean(positive terms) + mean(negative terms)
    x, labels = _batch(4, 3, seed=2)
    loss = get_loss("contrastive", hinge_power=2, reduction="mean",
                    distance=LpDistance(normalize_embeddings=False))
    _check(loss, lambda v: contrastive_sum_of_means(v, labels, 1.0), x, labels)


def test_pooled_contrastive_is_safe_at_zero_distance():
    for hinge_power in (1, 2):
        loss = get_loss("contrastive", hinge_power=hinge_power, reduction="pooled")
        _finite_at_zero_distance(loss)


def test_a_bad_contrastive_reduction_is_one_line_listing_the_values():
    _one_config_error(r"reduction must be one of 'mean_nonzero', 'mean', 'pooled'; got 'sum'",
                      "contrastive", reduction="sum")


# ------------------------------------------------------------------ F2: NCA objective
def nca_p(x: np.ndarray, labels: np.ndarray, scale: float = 1.0) -> np.ndarray:
    """Seed 003's ``p_i = sum_{j in C_i} p_ij``, ``p_ij = exp(-|x_i - x_j|^2) / sum_{k != i}
    exp(-|x_i - x_k|^2)``, ``p_ii = 0`` (the seed's denominator ``k != j`` is a typo for
    ``k != i``: the softmax is over ``i``'s neighbours); NaN for an anchor without a positive."""
    n = len(x)
    out = np.full(n, np.nan)
    for i in range(n):
        if not any(labels[j] == labels[i] for j in range(n) if j != i):
            continue
        w = {k: math.exp(-scale * ((x[i] - x[k]) ** 2).sum()) for k in range(n) if k != i}
        total = sum(w.values())
        out[i] = sum(w[j] / total for j in w if labels[j] == labels[i])
    return out


@pytest.mark.parametrize("scale", [1.0, 0.5])
@pytest.mark.parametrize("with_miner", [False, True])
def test_nca_sum_objective_is_seed_003(scale, with_miner):
    # one singleton class: its anchor has no positive and is left out of the mean
    x, labels = _batch(3, 3, seed=3)
    x, labels = np.vstack([x, [[0.5, -0.2, 0.1, 0.3]]]), np.append(labels, 9)
    loss = get_loss("nca", objective="sum", scale=scale,
                    distance=LpDistance(power=2, normalize_embeddings=False))
    miner = get_miner("all_pairs") if with_miner else None
    _check(loss, lambda v: -np.nanmean(nca_p(v, labels, scale)), x, labels, miner)


def test_nca_log_objective_is_the_default_and_unchanged():
    x, labels = _batch(3, 3, seed=4)
    loss = get_loss("nca", distance=LpDistance(power=2, normalize_embeddings=False))
    assert loss.objective == "log"
    _check(loss, lambda v: -np.nanmean(np.log(nca_p(v, labels))), x, labels)


def test_nca_objectives_differ_on_the_audit_batch():
    # the audit's repro: 16 raw 4-d embeddings of 4 classes; -mean p_i = -0.205870 where the
    # log form gives 2.713327
    g = torch.Generator().manual_seed(0)
    x = torch.randn(16, 4, generator=g, dtype=torch.float64)
    labels = torch.arange(16) // 4
    dist = LpDistance(power=2, normalize_embeddings=False)
    p = nca_p(x.numpy(), labels.numpy())
    assert abs(get_loss("nca", objective="sum", distance=dist)(x, labels).item() + p.mean()) < 1e-12
    assert abs(get_loss("nca", distance=dist)(x, labels).item() + np.log(p).mean()) < 1e-12


def test_nca_sum_is_safe_at_zero_distance_and_refuses_unknown_objectives():
    _finite_at_zero_distance(get_loss("nca", objective="sum"))
    _one_config_error(r"objective must be one of 'log', 'sum'; got 'mean'", "nca", objective="mean")


def test_nca_keeps_its_name_and_import_paths():
    from dmlkit.losses import NCALoss, pair_weighting_losses
    from dmlkit.losses import nca as nca_module

    assert LOSSES["nca"] is NCALoss is pair_weighting_losses.NCALoss is nca_module.NCALoss


# ------------------------------------------------------------------ F3: ratio triplet
def triplets(labels: np.ndarray):
    n = len(labels)
    for a, p, q in itertools.product(range(n), repeat=3):
        if a != p and labels[a] == labels[p] and labels[q] != labels[a]:
            yield a, p, q


def ratio_triplet(x, labels, m, dist, reduction, swap=False) -> float:
    """Seed 003's ``L = max{0, 1 - d(a, n) / (m + d(a, p))}`` over every triplet, reduced as
    Hermans et al.'s batch all / batch all non-zero / batch hard."""
    d = [[dist(u, v) for v in x] for u in x]
    terms: dict[int, list[float]] = {}
    for a, p, q in triplets(labels):
        d_an = min(d[a][q], d[p][q]) if swap else d[a][q]
        terms.setdefault(a, []).append(max(0.0, 1.0 - d_an / (m + d[a][p])))
    flat = [t for ts in terms.values() for t in ts]
    if reduction == "batch_all":
        return float(np.mean(flat))
    if reduction == "batch_all_nonzero":
        nonzero = [t for t in flat if t > 0]
        return float(np.mean(nonzero)) if nonzero else 0.0
    return float(np.mean([max(ts) for ts in terms.values()]))


@pytest.mark.parametrize("reduction", ["batch_all", "batch_all_nonzero", "batch_hard"])
@pytest.mark.parametrize("per_class", [[3, 3, 3], [10, 3]])  # 10: > 8 positives, the sorting path
def test_ratio_triplet_is_seed_003_euclidean(reduction, per_class):
    x, labels = _batch(len(per_class), per_class, dim=2, seed=5)
    loss = get_loss("triplet", form="ratio", margin=0.7, reduction=reduction,
                    distance=LpDistance(normalize_embeddings=False))
    _check(loss, lambda v: ratio_triplet(v, labels, 0.7, _euclid, reduction), x, labels)


@pytest.mark.parametrize("reduction", ["batch_all", "batch_all_nonzero", "batch_hard"])
def test_ratio_triplet_is_seed_003_cosine_distance(reduction):
    x, labels = _batch(3, 3, seed=6)
    loss = get_loss("triplet", form="ratio", margin=0.3, reduction=reduction, distance="cosine")
    _check(loss, lambda v: ratio_triplet(v, labels, 0.3, _cos_dist, reduction), x, labels)


def test_ratio_triplet_with_swap_and_with_mined_triplets():
    x, labels = _batch(3, 3, seed=7)
    dist = LpDistance(normalize_embeddings=False)
    swapped = get_loss("triplet", form="ratio", margin=0.5, reduction="batch_all", swap=True,
                       distance=dist)
    _check(swapped, lambda v: ratio_triplet(v, labels, 0.5, _euclid, "batch_all", swap=True),
           x, labels)
    # a miner's triplets: every triplet of the batch (its values are the all-triplet ones)
    mined = get_loss("triplet", form="ratio", margin=0.5, reduction="batch_all_nonzero",
                     distance=dist)
    _check(mined, lambda v: ratio_triplet(v, labels, 0.5, _euclid, "batch_all_nonzero"), x, labels,
           get_miner("all_triplets"))
    # the batch-hard miner + batch-hard reduction: each anchor's hardest term
    hard = get_loss("triplet", form="ratio", margin=0.5, reduction="batch_hard", distance=dist)
    _check(hard, lambda v: ratio_triplet(v, labels, 0.5, _euclid, "batch_hard"), x, labels,
           get_miner("batch_hard", distance=LpDistance(normalize_embeddings=False)))


def test_ratio_triplet_is_safe_at_zero_distance():
    for reduction in ("batch_all", "batch_all_nonzero", "batch_hard"):
        for distance in (None, "cosine"):
            loss = get_loss("triplet", form="ratio", reduction=reduction, distance=distance)
            _finite_at_zero_distance(loss)


def test_ratio_triplet_refuses_what_has_no_meaning():
    _one_config_error(r"form must be one of 'difference', 'ratio'; got 'quotient'", "triplet",
                      form="quotient")
    _one_config_error(r"soft_margin", "triplet", form="ratio", soft_margin=True)
    for margin in (0.0, -0.1, float("nan")):
        _one_config_error(r"margin > 0", "triplet", form="ratio", margin=margin)
    _one_config_error(r"distance", "triplet", form="ratio", distance="dot")


# ------------------------------------------------------------------ F3: plain-hinge lifted
def lifted_l(x: np.ndarray, labels: np.ndarray, m: float) -> float:
    """Seed 003's ``L_L = sum_i [d(a_i, p_i) + log sum_{n != a_i, p_i} (e^{m - d(a_i, n)} +
    e^{m - d(p_i, n)})]_+`` over the batch's ``B`` anchor-positive pairs, in the seed's batch
    layout: two samples per identity, so every other sample is a negative."""
    total, pairs = 0.0, 0
    for a, p in itertools.combinations(range(len(x)), 2):
        if labels[a] != labels[p]:
            continue
        s = sum(math.exp(m - _euclid(x[a], x[q])) + math.exp(m - _euclid(x[p], x[q]))
                for q in range(len(x)) if q not in (a, p))
        total += max(0.0, _euclid(x[a], x[p]) + math.log(s))
        pairs += 1
    return total, pairs


@pytest.mark.parametrize("m", [1.0, -2.0])  # -2: some hinges are 0
def test_plain_hinge_lifted_is_seed_003_l_l(m):
    x, labels = _batch(4, 2, dim=3, seed=8)
    loss = get_loss("lifted_structure", hinge_power=1, neg_margin=m,
                    distance=LpDistance(normalize_embeddings=False))
    # dmlkit averages over the positive pairs: the seed's sum over its B pairs / B
    _check(loss, lambda v: np.divide(*lifted_l(v, labels, m)), x, labels)


def test_lifted_hinge_power_default_and_refusals():
    assert get_loss("lifted_structure").hinge_power == 2
    _finite_at_zero_distance(get_loss("lifted_structure", hinge_power=1))
    for bad in (0, 3, True):
        _one_config_error(r"hinge_power must be 1 or 2", "lifted_structure", hinge_power=bad)
        # contrastive's two powers by the same rule (it took True as 1)
        _one_config_error(r"hinge_power must be 1 or 2", "contrastive", hinge_power=bad)
        _one_config_error(r"distance_power and hinge_power must be 1 or 2", "contrastive", distance_power=bad)


# ------------------------------------------------------------------ the docs name these calls
def _seed_rows() -> dict[str, list[str]]:
    """``{method cell: [backticked dmlkit references]}`` of docs/seeds.md's loss tables."""
    rows = {}
    for line in (DOCS / "seeds.md").read_text(encoding="utf-8").splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 4 and cells[0] == "loss":
            rows[cells[1]] = re.findall(r"`([^`]+)`", cells[2])
    return rows


def _params(ref: str) -> dict[str, object]:
    inner = re.search(r"\((.*)\)$", ref)
    out: dict[str, object] = {}
    for part in filter(None, (p.strip() for p in (inner.group(1) if inner else "").split(","))):
        key, _, value = part.partition("=")
        out[key] = {"True": True, "False": False}.get(value, value)
        if isinstance(out[key], str) and re.fullmatch(r"-?\d+(\.\d*)?", value):
            out[key] = float(value) if "." in value else int(value)
    return out


def _row(start: str) -> list[str]:
    (refs,) = [refs for method, refs in _seed_rows().items() if method.startswith(start)]
    return refs


def _build(refs: list[str]):
    """The loss of a seeds.md row, with the row's ``distance:`` entry as its distance."""
    from dmlkit.distances import get_distance

    (loss_ref,) = [r for r in refs if r.startswith("loss:")]
    params = _params(loss_ref)
    for r in refs:
        if r.startswith("distance:"):
            params["distance"] = get_distance(r.split(":")[1].split("(")[0], **_params(r))
    return get_loss(loss_ref.split(":")[1].split("(")[0], **params)


def test_seeds_md_rows_reproduce_the_seed_formulas():
    x, labels = _batch(4, 2, dim=3, seed=9)
    xt, yt = torch.tensor(x), torch.tensor(labels)
    online = _build(_row("Online contrastive loss"))
    assert abs(online(xt, yt).item() - online_contrastive(x, labels, 1.0)) < 1e-10
    single = _build(_row("Contrastive loss, single margin"))
    assert single.hinge_power == 2  # F4: seed 003's Hadsell form is the squared hinge
    nca = _build(_row("NCA loss"))
    assert abs(nca(xt, yt).item() + np.nanmean(nca_p(x, labels))) < 1e-10
    ratio = _build(_row("Ratio triplet loss")[:1])
    assert ratio.form == "ratio"
    lifted = _build(_row("Lifted structure with the plain hinge"))
    unit = x / np.linalg.norm(x, axis=1, keepdims=True)  # the row keeps the default normalisation
    total, pairs = lifted_l(unit, labels, 1.0)
    assert abs(lifted(xt, yt).item() - total / pairs) < 1e-10
    assert "reduction=batch_all_nonzero" in " ".join(_row("Triplet loss, batch hard non-zero"))


def test_losses_md_states_the_acos_clamp_and_the_label_convention():
    from dmlkit.losses.classification_losses import _ACOS_EPS

    text = (DOCS / "losses.md").read_text(encoding="utf-8")
    numerics = text[text.index("**Numerics.**"):][:600]
    assert _ACOS_EPS == {torch.float64: 1e-12, torch.float32: 1e-6}
    assert "`ε = 1e-6` for float32" in numerics and "`ε = 1e-12`\n  for float64" in numerics
    assert "the seed's 1/0 labels" not in text  # F5: y = 1 for similar is dmlkit's choice
    assert "deliberately inverts" in text
    from dmlkit.losses import CosineSimilarityLoss

    assert "deliberately inverts" in CosineSimilarityLoss.__doc__
