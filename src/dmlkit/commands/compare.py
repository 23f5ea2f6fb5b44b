"""``dmlkit compare RESULTS...``: differences tested over seeds and queries, and "papers versus reality"."""

from __future__ import annotations

from pathlib import Path

import typer


def register(app: typer.Typer) -> None:
    @app.command("compare")
    def compare_command(
        results: list[Path] = typer.Argument(..., help="results.json files or bench directories."),
        method: list[str] = typer.Option(None, "--method", "-m", help="Methods to compare (default: all); repeatable."),
        baseline: str | None = typer.Option(None, "--baseline", help="Compare every method against this one only."),
        metric: list[str] = typer.Option(None, "--metric", help="precision_at_1 | r_precision | map_at_r (default: all three)."),
        mode: list[str] = typer.Option(None, "--mode", help="concatenated | separated (default: both)."),
        confidence: float = typer.Option(0.95, "--confidence", help="Confidence level of the CIs and the significance test, a fraction (0.95: 95 % CIs; significant = Holm-adjusted p < 1 - confidence)."),
        out: Path | None = typer.Option(None, "--out", "-o", help="Also write the report (.json or .md)."),
    ) -> None:
        """Differences between methods per metric, with CIs (95 % by default) over seeds and test queries.

        A t-test over training seeds and test queries (per-query scores recomputed from the
        saved embeddings; Welch-Satterthwaite degrees of freedom) gives each pair's CI and p;
        "significant" = p < 1 - confidence (0.05 by default) after Holm's correction over
        the pairs, with >= 3 seeds per method. Also relative improvements over contrastive/triplet."""
        import warnings

        from rich.markup import escape
        from rich.table import Table

        from dmlkit.commands._console import output_console
        from dmlkit.exceptions import ConfigError
        from dmlkit.protocol.compare import (
            compare_results,
            format_p,
            render_compare_markdown,
            significance_label,
            variance_marks,
        )
        from dmlkit.protocol.results import MODES, metric_label
        from dmlkit.protocol.stats import PER_QUERY_METRICS
        from dmlkit.utils import atomic_write_json, atomic_write_text, refuse_overwriting_inputs

        if out is not None and out.suffix not in (".json", ".md"):  # before the embeddings are read
            raise ConfigError(f"--out {out}: name a .json or .md file (the report's format follows the suffix)")
        if out is not None:  # never over a results file it reads
            refuse_overwriting_inputs(out, *(p / "results.json" if p.is_dir() else p for p in results))
        report = compare_results(
            results, methods=method or None, baseline=baseline,
            metrics=metric or list(PER_QUERY_METRICS), modes=mode or list(MODES),
            confidence=confidence,
        )
        for message in report["warnings"]:
            warnings.warn(message, stacklevel=1)
        if out is not None:  # before the tables: a file that cannot be written prints no table
            if out.suffix == ".md":
                atomic_write_text(out, render_compare_markdown(report))
            else:
                atomic_write_json(out, report)
        console = output_console()
        # names are text, not rich markup: "ms@cub[v2]" (a bench name) printed as "ms@cub"
        seeds = escape(", ".join(f"{n}: {k}" for n, k in report["seeds"].items()))
        # the threshold stated, as the markdown states it ("significant = Holm-adjusted p" named none)
        table = Table(title=f"t-test over seeds ({seeds}) and {report['queries']} test queries, points; "
                            f"CI of each pair, significant = Holm-adjusted p < {1 - report['confidence']:.2g}")
        for col in ("A", "B", "mode", "metric"):
            table.add_column(col)
        table.add_column("A - B", justify="right")  # ASCII: any stdout encoding
        table.add_column(f"{100 * report['confidence']:g} % CI", justify="right")
        table.add_column("p", justify="right")
        table.add_column("p (Holm)", justify="right")
        table.add_column("significant", justify="center")
        marks = variance_marks(report["comparisons"], other="(see below)")
        for c in report["comparisons"]:
            mark = " " + marks[c["variance"]] if c.get("variance") in marks else ""
            table.add_row(escape(c["a"]), escape(c["b"]), c["mode"], metric_label(c["metric"]), f"{100 * c['diff']:+.2f}",
                          f"[{100 * c['ci_low']:+.2f}, {100 * c['ci_high']:+.2f}]{mark}", format_p(c["p"]),
                          format_p(c["p_holm"]),
                          {"yes": "[green]yes[/]"}.get(significance_label(c), significance_label(c)))
        if marks:  # a CI without the seed-to-seed variance is narrower than one over retrained models
            table.caption = " ".join(f"{m}: the CI holds the variance of {escape(v)}, not of seeds and "
                                     "queries; it does not show how much the methods move when trained "
                                     "again." for v, m in marks.items())
        console.print(table)
        for base, info in report["relative_improvement"].items():
            rel = Table(title=f"relative improvement over {base} ({escape(info['method'])}), %")
            rel.add_column("method")
            rows = info["relative_percent"]
            if not rows:
                continue
            metrics = list(next(iter(rows.values()))["concatenated"])
            for m_ in MODES:
                for met in metrics:
                    rel.add_column(f"{m_[:6]}. {metric_label(met)}", justify="right")
            for name, modes in rows.items():
                rel.add_row(escape(name), *[("n/a" if modes[m_].get(met) is None else f"{modes[m_][met]:+.1f}")
                                    for m_ in MODES for met in metrics])
            console.print(rel)
        if out is not None:
            console.print(f"written: {out}")

