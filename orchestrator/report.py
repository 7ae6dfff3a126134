"""Report on a sweep: ``python -m orchestrator.report SWEEP.yaml [--out DIR]``.

Reads the study's trial runs back from MLflow (metrics, params, status) and Optuna (state,
feasibility), prints a table of trials, what the baseline is, and the best settings (the final
re-measurement's winner when the sweep re-measured its top settings), and writes trials.csv,
remeasured.csv and plots to reports/<study>/: tokens/s and tau against the tree budget (points
coloured by depth or branching, the AR baseline as a line), peak memory against budget, the Pareto
front of the objectives (or tokens/s against peak memory for one objective), and Optuna's own
parameter importances and parallel coordinates. It only reads the stores. The notebook
notebooks/sweep_analysis.ipynb calls the same functions (and writes its figures elsewhere).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pandas as pd

from workers.decoding.methods import all_knobs, entry
from workers.errors import BadInputError

KNOBS = {knob.name: knob for knob in all_knobs()}  # every method's knobs, from the registry
PARAM_COLUMNS = tuple(KNOBS)
METRIC_COLUMNS = ("tokens_per_s", "tokens_per_s_median", "tokens_per_s_iqr", "tokens_per_s_ci_low",
                  "tokens_per_s_ci_high", "tau", "speedup",
                  "peak_memory_gib", "ttft_s", "tpot_s", "lossless_match", "divergences_near_tie",
                  "divergences_unexplained", "baseline_tokens_per_s")
REMEASURED_COLUMNS = ("tokens_per_s", "tokens_per_s_min", "tokens_per_s_max", "tau", "speedup", "tpot_s",
                      "peak_memory_gib", "baseline_tokens_per_s", "passes")
UNITS = {
    "tokens_per_s": "tokens/s (decode, prefill excluded)",
    "tau": "tau (tokens committed per round)",
    "speedup": "speedup over AR (x)",
    "peak_memory_gib": "peak memory (GiB)",
    "ttft_s": "time to first token (s)",
    "tpot_s": "time per output token (s)",
    "tree_budget": "tree budget (nodes per round)",
    "num_draft_tokens": "draft tokens per round",
    "max_depth": "max depth",
    "branching": "branching (children per node)",
}
MEMORY_KINDS = {"cuda": "GPU, CUDA reserved", "process_rss": "process RSS, CPU"}
BASELINE_TEXT = (
    "baseline: AR = plain autoregressive decoding with the same target, on the same actor, prompts and "
    "max_new_tokens; speedup = AR time per output token / the method's (1.0 = as fast as AR)."
)
CPU_TEXT = (
    "on CPU, speedups below 1 are expected with a tiny pair: speculative decoding wins when one target "
    "pass is expensive and costs about the same for 1 or 64 tokens (a large model on a GPU at batch 1 is "
    "bound by reading its weights) and the drafter is cheap beside it. A tiny pair on CPU has neither: "
    "each pass costs mostly fixed per-layer overhead, the drafter's pass about as much as a target step, "
    "and a round's drafting, tree build and verify cost more than its extra accepted tokens save. The "
    "demo shows the tool working, not a GPU's speedup."
)
PREDICTED_COLUMNS = ("predicted_tokens_per_s", "predicted_tau")  # sweeps that predict (orchestrator.predictor)


def trials_from_mlflow(tracking_uri: str, experiment: str, study: str, study_uid: str | None = None) -> pd.DataFrame:
    """One row per FINISHED trial run of ``study``: trial number, status, params and metrics.

    Only reads: a missing store or experiment gives an empty frame (nothing is created). With
    ``study_uid`` only the runs of that very study count (the same name may exist in other storages).
    """
    from orchestrator.tracking import read_only_client

    client = read_only_client(tracking_uri)
    found = client.get_experiment_by_name(experiment) if client is not None else None
    if found is None:
        return pd.DataFrame()
    which = f"tags.sweep_study_uid = '{study_uid}'" if study_uid else f"tags.sweep_study = '{study}'"
    runs = client.search_runs(
        [found.experiment_id],
        f"{which} and tags.sweep_role = 'trial' and attributes.status = 'FINISHED'",
        max_results=50_000,
    )
    rows = []
    for run in runs:
        row = {"trial": int(run.data.tags["optuna_trial"]), "status": run.data.tags.get("trial_status", "ok"),
               "method": run.data.params.get("method")}
        for name in PARAM_COLUMNS:
            if name in run.data.params:
                row[name] = KNOBS[name].read(run.data.params[name])
        row.update({name: run.data.metrics.get(name) for name in METRIC_COLUMNS})
        row["memory_kind"] = run.data.tags.get("memory_kind", "cuda")
        row.update({name: run.data.metrics[name] for name in PREDICTED_COLUMNS if name in run.data.metrics})
        row["run_id"] = run.info.run_id
        rows.append(row)
    frame = pd.DataFrame(rows)
    return frame.sort_values("trial").reset_index(drop=True) if rows else frame


def remeasured_from_mlflow(tracking_uri: str, experiment: str, study: str,
                           study_uid: str | None = None) -> pd.DataFrame:
    """One row per setting of the study's latest final re-measurement (empty when there was none).

    Only reads, as ``trials_from_mlflow``; with ``study_uid`` only that very study's runs count."""
    from orchestrator.tracking import read_only_client

    client = read_only_client(tracking_uri)
    found = client.get_experiment_by_name(experiment) if client is not None else None
    if found is None:
        return pd.DataFrame()
    which = f"tags.sweep_study_uid = '{study_uid}'" if study_uid else f"tags.sweep_study = '{study}'"
    runs = client.search_runs([found.experiment_id], f"{which} and tags.sweep_role = 'remeasure'", max_results=50_000)
    if not runs:
        return pd.DataFrame()
    latest = max(int(run.data.tags.get("final_round", "0")) for run in runs)
    rows = []
    for run in runs:
        if int(run.data.tags.get("final_round", "0")) != latest:
            continue
        row = {"trial": int(run.data.tags["optuna_trial"]), "status": "ok", "method": run.data.params.get("method")}
        for name in PARAM_COLUMNS:
            if name in run.data.params:
                row[name] = KNOBS[name].read(run.data.params[name])
        row.update({name: run.data.metrics.get(name) for name in REMEASURED_COLUMNS})
        rows.append(row)
    return pd.DataFrame(rows).sort_values("trial").reset_index(drop=True)


def parent_tags(tracking_uri: str, experiment: str, study_uid: str | None) -> dict[str, str]:
    """The study's parent run's tags ({} when there is none); only reads."""
    from orchestrator.tracking import read_only_client

    client = read_only_client(tracking_uri)
    found = client.get_experiment_by_name(experiment) if client is not None and study_uid else None
    if found is None:
        return {}
    runs = client.search_runs([found.experiment_id],
                              f"tags.sweep_study_uid = '{study_uid}' and tags.sweep_role = 'parent'", max_results=1)
    return dict(runs[0].data.tags) if runs else {}


def pareto_mask(frame: pd.DataFrame, objectives: list[tuple[str, str]]) -> pd.Series:
    """True for rows no other row beats on every objective (ties kept)."""
    signs = {name: (1 if direction == "maximize" else -1) for name, direction in objectives}
    values = frame[[name for name, _ in objectives]].astype(float).mul(pd.Series(signs))
    mask = []
    for _, row in values.iterrows():
        dominated = ((values >= row).all(axis=1) & (values > row).any(axis=1)).any()
        mask.append(not dominated)
    return pd.Series(mask, index=frame.index)


def _colour_column(frame: pd.DataFrame) -> str | None:
    """max_depth when it varies, else branching when it varies (the knobs beside the budget)."""
    for name in ("max_depth", "branching"):
        if name in frame and frame[name].dropna().nunique() > 1:
            return name
    return None


def _scatter(ax, data: pd.DataFrame, x: str, y: str, colour: str | None) -> None:
    """Points coloured by ``colour`` (a colour bar); those where it is unset (engine default) in grey."""
    if colour is None:
        ax.scatter(data[x], data[y], s=22)
        return
    known = data[data[colour].notna()]
    points = ax.scatter(known[x], known[y], c=known[colour].astype(float), cmap="viridis", s=26)
    ax.figure.colorbar(points, ax=ax, label=UNITS.get(colour, colour))
    unset = data[data[colour].isna()]
    if not unset.empty:
        ax.scatter(unset[x], unset[y], s=26, color="grey", marker="s", label=f"{colour} unset (engine default)")


def _memory_label(frame: pd.DataFrame) -> str:
    kinds = sorted(set(frame["memory_kind"].dropna())) if "memory_kind" in frame else ["cuda"]
    return f"peak memory (GiB, {', '.join(MEMORY_KINDS.get(k, k) for k in kinds)})"


def write_plots(frame: pd.DataFrame, out: Path, objectives: list[tuple[str, str]],
                baselines: list[tuple[str, float]] = ()) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    written = []
    ok = frame[frame["status"] == "ok"] if "status" in frame else frame
    x = "tree_budget" if "tree_budget" in frame and frame["tree_budget"].notna().any() else None
    if x is None and "num_draft_tokens" in frame and frame["num_draft_tokens"].notna().any():
        x = "num_draft_tokens"
    colour = _colour_column(frame)
    baseline = ok["baseline_tokens_per_s"].dropna() if "baseline_tokens_per_s" in ok else pd.Series(dtype=float)
    if x is not None:
        for metric, name in (("tokens_per_s", "tokens_per_s_vs_budget.png"), ("tau", "tau_vs_budget.png"),
                             ("peak_memory_gib", "peak_memory_vs_budget.png")):
            fig, ax = plt.subplots(figsize=(6.5, 4))
            data = ok if metric != "peak_memory_gib" else frame
            _scatter(ax, data, x, metric, colour)
            if metric == "tokens_per_s":  # the numbers every setting has to beat
                _baseline_lines(ax, baseline, baselines)
            if metric == "tau":
                ax.axhline(1.0, color="C3", linestyle="--", label="AR (tau = 1)")
            if x == "tree_budget":
                ax.set_xscale("log", base=2)
            ax.set_xlabel(UNITS.get(x, x))
            ax.set_ylabel(_memory_label(frame) if metric == "peak_memory_gib" else UNITS.get(metric, metric))
            ax.set_title(f"{metric} against {x}")
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize=7)
            fig.tight_layout()
            fig.savefig(out / name, dpi=90)
            plt.close(fig)
            written.append(out / name)
    if "method" in ok and ok["method"].nunique() > 1:
        written.append(_methods_plot(ok, baseline, baselines, out / "tokens_per_s_by_method.png"))
    pair = [name for name, _ in objectives] if len(objectives) == 2 else ["peak_memory_gib", objectives[0][0]]
    if not ok.empty and all(c in ok for c in pair):
        axes = [(n, d) for n, d in objectives] if len(objectives) == 2 else [
            ("peak_memory_gib", "minimize"), objectives[0]]
        front = ok[pareto_mask(ok, axes)].sort_values(pair[0])
        fig, ax = plt.subplots(figsize=(6, 4))
        ax.scatter(ok[pair[0]], ok[pair[1]], s=14, alpha=0.5, label="trials")
        ax.plot(front[pair[0]], front[pair[1]], "o-", color="C3", label="Pareto front")
        label = {"peak_memory_gib": _memory_label(frame)}
        ax.set_xlabel(label.get(pair[0], UNITS.get(pair[0], pair[0])))
        ax.set_ylabel(label.get(pair[1], UNITS.get(pair[1], pair[1])))
        ax.legend()
        ax.set_title("Pareto front")
        fig.tight_layout()
        fig.savefig(out / "pareto_front.png", dpi=90)
        plt.close(fig)
        written.append(out / "pareto_front.png")
    return written


def _baseline_lines(ax, ar: pd.Series, baselines) -> None:
    """The AR baseline measured beside the trials (median), and the speeds the user already has."""
    if not ar.empty:
        ax.axhline(ar.median(), color="C3", linestyle="--", label=f"AR baseline ({ar.median():.4g} tokens/s)")
    for index, (name, tokens_per_s) in enumerate(baselines):
        ax.axhline(tokens_per_s, color=f"C{4 + index}", linestyle=":", label=f"{name} ({tokens_per_s:.4g} tokens/s)")


def _methods_plot(ok: pd.DataFrame, ar: pd.Series, baselines, path: Path) -> Path:
    """tokens/s of every finished trial, one column of points per method, beside the baselines."""
    import matplotlib.pyplot as plt

    methods = sorted(ok["method"].dropna().unique())
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for position, method in enumerate(methods):
        speeds = ok.loc[ok["method"] == method, "tokens_per_s"].dropna()
        spread = [position + 0.15 * ((i % 5) - 2) / 2 for i in range(len(speeds))]  # side by side, not on top
        ax.scatter(spread, speeds, s=22, label=f"{method} ({len(speeds)} trials, best {speeds.max():.4g})")
    _baseline_lines(ax, ar, baselines)
    ax.set_xticks(range(len(methods)), methods)
    ax.set_ylabel(UNITS["tokens_per_s"])
    ax.set_title("tokens/s by method")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def method_lines(frame: pd.DataFrame, remeasured: pd.DataFrame, objectives: list[tuple[str, str]],
                 baselines: list[tuple[str, float]]) -> list[str]:
    """Each method's best (re-measured when it was) against the AR baseline and the user's baselines:
    the answer to "tree or chain, which setting, against what I have"."""
    ok = frame[frame["status"] == "ok"] if "status" in frame else frame
    if "method" not in ok or ok.empty:
        return []
    name, direction = objectives[0]
    lines = []
    ar = ok["baseline_tokens_per_s"].dropna() if "baseline_tokens_per_s" in ok else pd.Series(dtype=float)
    for method in sorted(ok["method"].dropna().unique()):
        pool, source = ok[ok["method"] == method], "search"
        if not remeasured.empty and "method" in remeasured and (remeasured["method"] == method).any():
            pool, source = remeasured[remeasured["method"] == method], "re-measured"
        if name not in pool or pool[name].dropna().empty:
            continue
        row = pool.sort_values(name, ascending=direction == "minimize").iloc[0]
        params = {c: KNOBS[c].read(row[c]) for c in entry(method).params.knob_names() if c in row}
        speed = row.get("tokens_per_s")
        against = [f"{speed / value:.2f}x {label}" for label, value in baselines if speed and not pd.isna(speed)]
        lines.append(f"best {method} ({source}): trial {int(row['trial'])} {params} -> {name} {_cell(row[name])}, "
                     f"speedup {_cell(row.get('speedup'))}" + (f"; {', '.join(against)}" if against else ""))
    if not ar.empty:
        lines.append(f"AR baseline: {ar.median():.4g} tokens/s (median of the trials' own)")
    lines += [f"your baseline {label}: {value:.4g} tokens/s" for label, value in baselines]
    return lines


def write_optuna_plots(study, out: Path, objectives: list[tuple[str, str]]) -> tuple[list[Path], list[str]]:
    """Optuna's own parameter importances and parallel coordinates (matplotlib, headless), per the
    first objective. Returns (files written, one-line reasons for plots that could not be drawn)."""
    import warnings

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from optuna.visualization import matplotlib as optuna_plots

    out.mkdir(parents=True, exist_ok=True)
    name = objectives[0][0]
    kwargs = {"target": lambda t: t.values[0], "target_name": name} if len(objectives) > 1 else {"target_name": name}
    written, skipped = [], []
    for kind, draw in (("param_importances", optuna_plots.plot_param_importances),
                       ("parallel_coordinate", optuna_plots.plot_parallel_coordinate)):
        path = out / f"optuna_{kind}.png"
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # Optuna marks its matplotlib plots experimental
                ax = draw(study, **kwargs)
            figure = (ax.flat[0] if hasattr(ax, "flat") else ax).figure
            figure.set_size_inches(9, 5)
            figure.tight_layout(rect=(0, 0, 1, 0.92))  # room for the title above Optuna's legend
            figure.savefig(path, dpi=90)
            plt.close(figure)
            written.append(path)
        except Exception as exc:  # too few trials, a single value per parameter: say so and go on
            skipped.append(f"optuna {kind}: not drawn ({type(exc).__name__}: {str(exc).splitlines()[0]})")
    return written, skipped


def best_rows(frame: pd.DataFrame, objectives: list[tuple[str, str]],
              remeasured: pd.DataFrame | None = None) -> pd.DataFrame:
    """The best trial (one objective) or the Pareto front (two). With a final re-measurement, one
    objective's best is the re-measured winner (its re-measured values), not the luckiest sample."""
    if remeasured is not None and not remeasured.empty and len(objectives) == 1:
        name, direction = objectives[0]
        if name in remeasured and remeasured[name].notna().any():
            return remeasured.sort_values(name, ascending=direction == "minimize").head(1)
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
        study_name, study_uid = resolve_study(config)
    except BadInputError as exc:
        print(f"orchestrator.report: error: {exc}", file=sys.stderr)
        return 2
    frame = trials_from_mlflow(config.mlflow.tracking_uri, config.mlflow.experiment, study_name, study_uid)
    if frame.empty:
        print(f"orchestrator.report: nothing to report: no finished trials of study '{study_name}' in "
              f"{config.mlflow.tracking_uri} (experiment '{config.mlflow.experiment}') yet", file=sys.stderr)
        return 1
    objectives = [(o.metric, o.direction) for o in config.objectives]
    out = args.out or report_dir(study_name)
    out.mkdir(parents=True, exist_ok=True)
    frame.to_csv(out / "trials.csv", index=False)
    remeasured = remeasured_from_mlflow(config.mlflow.tracking_uri, config.mlflow.experiment, study_name, study_uid)
    if not remeasured.empty:
        remeasured.to_csv(out / "remeasured.csv", index=False)
    baselines = [(b.name, b.tokens_per_s) for b in config.baselines]
    written = write_plots(frame, out, objectives, baselines)
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    more, skipped = write_optuna_plots(optuna.load_study(study_name=study_name, storage=config.storage), out,
                                       objectives)
    written += more

    console = Console()
    if not console.is_terminal:
        console = Console(width=180)
    method_column = ["method"] if config.several else []
    columns = ["trial", "status", *method_column, *[c for c in PARAM_COLUMNS if c in frame], *METRIC_COLUMNS,
               *[c for c in PREDICTED_COLUMNS if c in frame]]
    table = Table(title=f"study {study_name}: {len(frame)} finished trials")
    for column in columns:
        table.add_column(column, justify="right")
    for _, row in frame.iterrows():
        table.add_row(*[_cell(row.get(c)) for c in columns])
    console.print(table)
    if not remeasured.empty:
        again = Table(title=f"final re-measurement: {int(remeasured['passes'].max())} passes, each AR then the setting")
        columns = ["trial", *method_column, *[c for c in PARAM_COLUMNS if c in remeasured], *REMEASURED_COLUMNS]
        for column in columns:
            again.add_column(column, justify="right")
        for _, row in remeasured.iterrows():
            again.add_row(*[_cell(row.get(c)) for c in columns])
        console.print(again)
        separated = parent_tags(config.mlflow.tracking_uri, config.mlflow.experiment, study_uid).get(
            "winner_separated")
        if separated:
            console.print(f"winner: {separated}", highlight=False)
    console.print(BASELINE_TEXT, highlight=False)
    device = config.workers.device if config.workers.device != "auto" else (
        "cuda" if config.workers.gpus_per_worker > 0 else "cpu")
    if device == "cpu":
        console.print(CPU_TEXT, highlight=False)
    best = best_rows(frame, objectives, remeasured)
    used_final = not remeasured.empty and len(objectives) == 1 and not best.empty and "passes" in best
    label = "best" if len(objectives) == 1 else "Pareto front"
    if used_final:
        label = f"best (re-measured, {int(best.iloc[0]['passes'])} passes interleaved with AR)"
    for _, row in best.iterrows():
        params = {c: KNOBS[c].read(row[c]) for c in PARAM_COLUMNS if c in best}
        values = {name: _cell(row[name]) for name, _ in objectives}
        console.print(f"{label}: trial {int(row['trial'])} {params} -> {values}", highlight=False)
        if used_final:
            searched = frame[frame["trial"] == row["trial"]]
            if not searched.empty:
                name = objectives[0][0]
                console.print(f"  in the search it measured {name} {_cell(searched.iloc[0][name])}; "
                              f"re-measured range {_cell(row['tokens_per_s_min'])}..{_cell(row['tokens_per_s_max'])} "
                              f"tokens/s, tau {_cell(row.get('tau'))}, speedup {_cell(row['speedup'])} against AR at "
                              f"{_cell(row['baseline_tokens_per_s'])} tokens/s", highlight=False)
        elif pd.notna(row.get("baseline_tokens_per_s")):  # the number the setting has to beat, beside it
            console.print(f"  tau {_cell(row.get('tau'))}, speedup {_cell(row.get('speedup'))} against AR at "
                          f"{_cell(row['baseline_tokens_per_s'])} tokens/s", highlight=False)
    if config.several or baselines:
        for line in method_lines(frame, remeasured, objectives, baselines):
            console.print(line, highlight=False)
    for line in skipped:
        console.print(line, highlight=False)
    for line in prediction_lines(frame):
        console.print(line, highlight=False)
    console.print(f"wrote {out / 'trials.csv'} and {len(written)} plots to {out}")
    return 0


def report_dir(study_name: str) -> Path:
    """Where ``python -m orchestrator.report`` writes (relative to the cwd)."""
    return Path("reports") / study_name


def notebook_figures_dir(root: Path, study_name: str) -> Path:
    """Where the analysis notebook writes its figures: beside the notebook, never the report's folder."""
    return root / "notebooks" / "figures" / study_name


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
    return resolve_study(config)[0]


def resolve_study(config) -> tuple[str, str | None]:
    """(name, uid) of the study this file's runs belong to, read without writing to the storage."""
    import optuna

    from orchestrator.study import FINGERPRINT_ATTR, UID_ATTR, read_only_storage

    try:
        storage = read_only_storage(config.storage)
        if storage is None:
            raise BadInputError(f"storage: {config.storage} has no studies yet (run the sweep first)")
        summaries = optuna.get_all_study_summaries(storage, include_best_trial=False)
    except BadInputError:
        raise
    except Exception as exc:  # missing tables, unreachable server
        raise BadInputError(f"storage: cannot read studies from {config.storage} ({exc})") from exc
    for summary in summaries:
        base = summary.study_name.split("@")[0]
        if base == config.name and summary.user_attrs.get(FINGERPRINT_ATTR) == config.fingerprint():
            return summary.study_name, summary.user_attrs.get(UID_ATTR)
    raise BadInputError(f"no study for sweep '{config.name}' with this definition in {config.storage}")


def _cell(value) -> str:
    if value is None or (isinstance(value, float) and pd.isna(value)):
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


if __name__ == "__main__":
    from orchestrator.sweep import exit_now

    exit_now(main())
