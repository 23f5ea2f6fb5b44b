import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from dmlkit import ConfigError, ShapeError
from dmlkit.cli import app, main
from dmlkit.distances import (
    CosineSimilarity,
    DotProductSimilarity,
    LpDistance,
    SNRDistance,
    get_distance,
)


def _reference(name, x, y):
    """Obviously-correct loops over pairs."""
    out = np.zeros((len(x), len(y)))
    for i, a in enumerate(x):
        for j, b in enumerate(y):
            if name == "cos":
                out[i, j] = a @ b / np.linalg.norm(a) / np.linalg.norm(b)
            elif name == "dot":
                out[i, j] = a @ b
            elif name == "l2":
                out[i, j] = np.linalg.norm(a - b)
            elif name == "l2sq":
                out[i, j] = np.sum((a - b) ** 2)
            elif name == "l1":
                out[i, j] = np.abs(a - b).sum()
            elif name == "snr":
                out[i, j] = np.var(b - a, ddof=1) / np.var(a, ddof=1)
    return out


@pytest.mark.parametrize(
    "name,dist",
    [
        ("cos", CosineSimilarity()),
        ("dot", DotProductSimilarity(normalize_embeddings=False)),
        ("l2", LpDistance(normalize_embeddings=False)),
        ("l2sq", LpDistance(power=2, normalize_embeddings=False)),
        ("l1", LpDistance(p=1, normalize_embeddings=False)),
        ("snr", SNRDistance()),
    ],
)
def test_distances_match_reference(name, dist):
    x = torch.randn(7, 5, dtype=torch.float64)
    y = torch.randn(4, 5, dtype=torch.float64)
    np.testing.assert_allclose(dist(x, y).numpy(), _reference(name, x.numpy(), y.numpy()), atol=1e-9)
    paired = dist.paired(x[:4], y)
    np.testing.assert_allclose(paired.numpy(), np.diag(_reference(name, x[:4].numpy(), y.numpy())), atol=1e-9)


def test_direction_flags_and_margin():
    assert CosineSimilarity().higher_is_closer and not LpDistance().higher_is_closer
    d = LpDistance()
    assert d.margin(torch.tensor(0.2), torch.tensor(0.5)) == pytest.approx(0.3)
    s = CosineSimilarity()
    assert s.margin(torch.tensor(0.9), torch.tensor(0.5)) == pytest.approx(0.4)


def test_euclidean_self_distance_has_finite_gradient():
    x = torch.randn(6, 4, requires_grad=True)
    d = LpDistance()(x)
    assert torch.all(d.diagonal() <= 1e-6)
    d.sum().backward()
    assert torch.isfinite(x.grad).all()


def test_bfloat16_works():
    x = torch.randn(8, 16).bfloat16()
    assert CosineSimilarity()(x).dtype == torch.bfloat16
    assert LpDistance()(x).dtype == torch.bfloat16


def test_bad_shapes_and_names():
    with pytest.raises(ShapeError):
        CosineSimilarity()(torch.randn(3, 4), torch.randn(3, 5))
    with pytest.raises(ValueError, match="unknown distance"):
        get_distance("manhattan-ish")
    assert isinstance(get_distance("euclidean", power=2), LpDistance)


def test_cli_help_lists_commands():
    result = CliRunner().invoke(app, ["--help"])
    assert result.exit_code == 0
    assert "Usage" in result.output


def test_help_paragraphs_wrap_at_the_terminal_not_at_the_source():
    """typer keeps a docstring's line breaks: a paragraph must reach the terminal as one line
    (``train --help`` printed "...(torchrun --nproc-per-node N -m dmlkit train CONFIG): the" alone
    on a line of a 200-column terminal)."""
    from dmlkit.cli import reflow_help

    assert reflow_help("""First line
        goes on.

        * an item
          continued
        """) == "First line goes on.\n\n* an item\n  continued"
    result = CliRunner().invoke(app, ["train", "--help"], env={"COLUMNS": "300"}, terminal_width=300)
    assert result.exit_code == 0
    assert "(torchrun --nproc-per-node N -m dmlkit train CONFIG): the sampler's C x M batch" in result.output


def test_cli_user_error_exits_2_without_traceback(capsys, monkeypatch):
    import typer

    from dmlkit import cli

    probe = typer.Typer()

    @probe.command()
    def boom() -> None:
        raise ConfigError("bad value for 'margin': use a positive number")

    @probe.command()
    def other() -> None:
        pass

    monkeypatch.setattr(cli, "app", probe)
    with pytest.raises(SystemExit) as exc:
        main(["boom"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "bad value for 'margin'" in err and "Traceback" not in err
    with pytest.raises(SystemExit) as exc:
        main(["boom", "--no-such-option"])
    assert exc.value.code == 2


@pytest.mark.parametrize("offset", [0.0, 10.0, 100.0, 1e4])
def test_euclidean_distances_of_offset_rows_are_accurate(offset):
    """Rows that share an offset (ReLU features, raw pixels): the expanded form rounded with
    ``|x|^2``; at 100 + N(0, 1), 64-d, distances of about 11 were off by up to 0.027 (too far
    from 0 for the near-zero recomputation). The distance cannot depend on the offset."""
    from dmlkit.distances import LpDistance

    rng = np.random.default_rng(0)
    x = (offset + rng.normal(size=(50, 64))).astype(np.float32)
    y = (offset + rng.normal(size=(30, 64))).astype(np.float32)
    x64, y64 = x.astype(np.float64), y.astype(np.float64)
    dist = LpDistance(normalize_embeddings=False)
    for a, b, a64, b64 in ((x, x, x64, x64), (x, y, x64, y64)):
        got = dist(torch.from_numpy(a), None if a is b else torch.from_numpy(b)).double().numpy()
        want = np.sqrt(((a64[:, None] - b64[None]) ** 2).sum(-1))
        assert np.abs(got - want).max() < 1e-5
    squared = LpDistance(power=2, normalize_embeddings=False)(torch.from_numpy(x)).double().numpy()
    assert np.abs(squared - ((x64[:, None] - x64[None]) ** 2).sum(-1)).max() < 1e-3


def test_rows_without_a_dominating_offset_are_taken_as_given():
    """Centring would round small-integer rows (a mean of thirds) and break their exact ties: they
    are not moved, and their squared distances stay exact integers."""
    from dmlkit.distances import LpDistance

    x = torch.from_numpy(np.random.default_rng(1).integers(-3, 4, (40, 9)).astype(np.float32))
    sq = LpDistance(power=2, normalize_embeddings=False)(x).double().numpy()
    x64 = x.double().numpy()
    assert np.array_equal(sq, ((x64[:, None] - x64[None]) ** 2).sum(-1))
