"""Report on a sweep: ``python -m orchestrator.report SWEEP.yaml [--out DIR]``.

Reads the study's trial runs back from MLflow (metrics, params, status) and Optuna (state,
feasibility), prints a table of trials and the best settings, and writes trials.csv and plots:
tokens/s and tau against tree budget, peak memory against budget, and the Pareto front of the
objectives (or tokens/s against peak memory for one objective). The notebook
notebooks/sweep_analysis.ipynb calls the same functions.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pandas as pd

from workers.errors import BadInputError

PARAM_COLUMNS = ("tree_budget", "max_depth", "branching", "num_draft_tokens")
METRIC_COLUMNS = ("tokens_per_s", "tau", "speedup", "peak_memory_gib", "ttft_s", "tpot_s", "lossless_match")
PREDICTED_COLUMNS = ("predicted_tokens_per_s", "predicted_tau")  # sweeps that predict (orchestrator.predictor)


def trials_from_mlflow(tracking_uri: str, experiment: str, study: str) -> pd.DataFrame:
    """One row per FINISHED trial run of ``study``: trial number, status, params and metrics."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=tracking_uri)
    found = client.get_experiment_by_name(experiment)
    if found is None:
        return pd.DataFrame()
    runs = client.search_runs(
        [found.experiment_id],
        f"tags.sweep_study = '{study}' and tags.sweep_role = 'trial' and attributes.status = 'FINISHED'",
        max_results=50_000,
    )
    rows = []
    for run in runs:
        row = {"trial": int(run.data.tags["optuna_trial"]), "status": run.data.tags.get("trial_status", "ok")}
        for name in PARAM_COLUMNS:
            if name in run.data.params:
                value = run.data.params[name]
                row[name] = None if value == "None" else int(value)
        row.update({name: run.data.metrics.get(name) for name in METRIC_COLUMNS})
        row.update({name: run.data.metrics[name] for name in PREDICTED_COLUMNS if name in run.data.metrics})
        row["run_id"] = run.info.run_id
        rows.append(row)
    frame = pd.DataFrame(rows)
    return frame.sort_values("trial").reset_index(drop=True) if rows else frame


def pareto_mask(frame: pd.DataFrame, objectives: list[tuple[str, str]]) -> pd.Series:
    """True for rows no other row beats on every objective (ties kept)."""
    signs = {name: (1 if direction == "maximize" else -1) for name, direction in objectives}
    values = frame[[name for name, _ in objectives]].astype(float).mul(pd.Series(signs))
    mask = []
    for _, row in values.iterrows():
        dominated = ((values >= row).all(axis=1) & (values > row).any(axis=1)).any()
        mask.append(not dominated)
    return pd.Series(mask, index=frame.index)


def write_plots(frame: pd.DataFrame, out: Path, objectives: list[tuple[str, str]]) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    written = []
    ok = frame[frame["status"] == "ok"] if "status" in frame else frame
    x = "tree_budget" if "tree_budget" in frame and frame["tree_budget"].notna().any() else None
    if x is None and "num_draft_tokens" in frame and frame["num_draft_tokens"].notna().any():
        x = "num_draft_tokens"
    if x is not None:
        for metric, name in (("tokens_per_s", "tokens_per_s_vs_budget.png"), ("tau", "tau_vs_budget.png"),
                             ("peak_memory_gib", "peak_memory_vs_budget.png")):
            fig, ax = plt.subplots(figsize=(6, 4))
            data = ok if metric != "peak_memory_gib" else frame
            ax.scatter(data[x], data[metric], s=18)
            if x == "tree_budget":
                ax.set_xscale("log", base=2)
            ax.set_xlabel(x)
            ax.set_ylabel(metric)
            ax.set_title(f"{metric} against {x}")
            fig.tight_layout()
            fig.savefig(out / name, dpi=90)
            plt.close(fig)
            written.append(out / name)
    pair = [name for name, _ in objectives] if len(objectives) == 2 else ["peak_memory_gib", objectives[0][0]]
    if not ok.empty and all(c in ok for c in pair):
        axes = [(n, d) for n, d in objectives] if len(objectives) == 2 else [
            ("peak_memory_gib", "minimize"), objectives[0]]
        front = ok[pareto_mask(ok, axes)].sort_values(pair[0])
        fig, ax = plt.subplots(figsize=(6, 4))
        ax.scatter(ok[pair[0]], ok[pair[1]], s=14, alpha=0.5, label="trials")
        ax.plot(front[pair[0]], front[pair[1]], "o-", color="C3", label="Pareto front")
        ax.set_xlabel(pair[0])
        ax.set_ylabel(pair[1])
        ax.legend()
        ax.set_title("Pareto front")
        fig.tight_layout()
        fig.savefig(out / "pareto_front.png", dpi=90)
        plt.close(fig)
        written.append(out / "pareto_front.png")
    return written


def best_rows(frame: pd.DataFrame, objectives: list[tuple[str, str]]) -> pd.DataFrame:
    ok = frame[frame["status"] == "ok"] if "status" in frame else frame
    if ok.empty:
        return ok
    if len(objectives) == 1:
        name, direction = objectives[0]
        return ok.sort_values(name, ascending=direction == "minimize").head(1)
    return ok[pareto_mask(ok, objectives)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m orchestrator.report", description=__doc__.splitlines()[0])
    parser.add_argument("sweep", type=Path)
    parser.add_argument("--out", type=Path, help="folder for trials.csv and plots (default: reports/<study>)")
    args = parser.parse_args(argv)
    from rich.console import Console
    from rich.table import Table

    from orchestrator.config import load_sweep

    try:
        config = load_sweep(args.sweep)
        study_name = resolve_study_name(config)
    except BadInputError as exc:
        print(f"orchestrator.report: error: {exc}", file=sys.stderr)
        return 2
    frame = trials_from_mlflow(config.mlflow.tracking_uri, config.mlflow.experiment, study_name)
    if frame.empty:
        print(f"orchestrator.report: no finished trials of study '{study_name}' yet", file=sys.stderr)
        return 1
    objectives = [(o.metric, o.direction) for o in config.objectives]
    out = args.out or Path("reports") / study_name
    out.mkdir(parents=True, exist_ok=True)
    frame.to_csv(out / "trials.csv", index=False)
    written = write_plots(frame, out, objectives)

    console = Console()
    if not console.is_terminal:
        console = Console(width=180)
    columns = ["trial", "status", *[c for c in PARAM_COLUMNS if c in frame], *METRIC_COLUMNS,
               *[c for c in PREDICTED_COLUMNS if c in frame]]
    table = Table(title=f"study {study_name}: {len(frame)} finished trials")
    for column in columns:
        table.add_column(column, justify="right")
    for _, row in frame.iterrows():
        table.add_row(*[_cell(row.get(c)) for c in columns])
    console.print(table)
    best = best_rows(frame, objectives)
    label = "best" if len(objectives) == 1 else "Pareto front"
    for _, row in best.iterrows():
        params = {c: (None if pd.isna(row[c]) else int(row[c])) for c in PARAM_COLUMNS if c in frame}
        values = {name: row[name] for name, _ in objectives}
        console.print(f"{label}: trial {int(row['trial'])} {params} -> {values}")
    for line in prediction_lines(frame):
        console.print(line)
    console.print(f"wrote {out / 'trials.csv'} and {len(written)} plots to {out}")
    return 0


def prediction_lines(frame: pd.DataFrame) -> list[str]:
    """Predicted against measured over the trials that ran to the end: mean and worst relative
    error of tokens/s and tau, and whether the predicted best was the measured best."""
    if "predicted_tokens_per_s" not in frame:
        return []
    ok = frame[(frame["status"] == "ok") & frame["predicted_tokens_per_s"].notna()]
    if ok.empty:
        return []
    error = (ok["predicted_tokens_per_s"] - ok["tokens_per_s"]) / ok["tokens_per_s"]
    lines = [f"predicted vs measured tokens/s over {len(ok)} trials: mean error {error.abs().mean():.1%}, "
             f"worst {error.abs().max():.1%} (trial {int(ok.loc[error.abs().idxmax(), 'trial'])})"]
    if "predicted_tau" in ok:
        tau_error = (ok["predicted_tau"] - ok["tau"]).abs() / ok["tau"]
        lines.append(f"predicted vs measured tau: mean error {tau_error.mean():.2%}, worst {tau_error.max():.2%}")
    best_predicted = int(ok.loc[ok["predicted_tokens_per_s"].idxmax(), "trial"])
    best_measured = int(ok.loc[ok["tokens_per_s"].idxmax(), "trial"])
    lines.append(f"predicted best: trial {best_predicted}; measured best: trial {best_measured}")
    return lines


def resolve_study_name(config) -> str:
    """The study this file's runs belong to (a --new-study sweep lives under <name>@k)."""
    import optuna

    from orchestrator.study import FINGERPRINT_ATTR

    if config.storage.startswith("sqlite:///") and not Path(config.storage.removeprefix("sqlite:///")).exists():
        raise BadInputError(f"storage: {config.storage} does not exist yet (run the sweep first)")
    try:
        summaries = optuna.get_all_study_summaries(config.storage, include_best_trial=False)
    except Exception as exc:  # missing database, unreachable server
        raise BadInputError(f"storage: cannot read studies from {config.storage} ({exc})") from exc
    for summary in summaries:
        base = summary.study_name.split("@")[0]
        if base == config.name and summary.user_attrs.get(FINGERPRINT_ATTR) == config.fingerprint():
            return summary.study_name
    raise BadInputError(f"no study for sweep '{config.name}' with this definition in {config.storage}")


def _cell(value) -> str:
    if value is None or (isinstance(value, float) and pd.isna(value)):
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


if __name__ == "__main__":
    sys.exit(main())
