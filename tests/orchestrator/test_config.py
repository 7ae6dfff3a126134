"""Sweep-file validation: ``orchestrator.config`` and the ``orchestrator.sweep`` CLI's bad-input path.

What is checked here (issue 4, DESIGN.md "config"):
- a valid file loads; relative paths resolve against the cwd (or ``base``) and become absolute; hub
  ids stay as they are; the issue's sample YAML validates;
- every bad file gives ONE clear ``BadInputError`` naming the file and the field (in process, for all
  cases), and through the real CLI exit status 2 with one ``orchestrator.sweep: error: ...`` line and
  nothing created (a representative subset: the subprocess runs are slow);
- ``--dry-run`` prints the plan and creates nothing; ``--help`` exits 0;
- ``fingerprint()`` follows exactly the study-defining fields.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from orchestrator.config import SweepConfig, load_sweep
from orchestrator.sweep import main, plan_text, validate
from tests.orchestrator.conftest import run_sweep, sweep_dict, write_sweep
from workers.errors import BadInputError

# The sample sweep file of issue 4, verbatim (prompts.path is written by the test that uses it).
ISSUE_SAMPLE = """\
name: ddtree-tree-budget            # study name; running the same file again resumes this study
method: ddtree                      # ddtree | dflash | ar
target: {model: Qwen/Qwen3.6-27B, dtype: bfloat16}
drafter: {model: z-lab/Qwen3.6-27B-DFlash}
workers:
  count: 1                          # Ray actors
  gpus_per_worker: 2                # an actor's target is split over its GPUs; 0 = CPU
  max_memory_per_gpu: 44GiB
  resources: {"host:lxc-129": 0.01} # optional Ray custom resource pinning actors to a host
prompts: {path: data/prompts/mixed.jsonl, limit: 16, max_new_tokens: 256}
generation: {temperature: 0.0, seed: 0}
search_space:
  tree_budget: {type: int, low: 16, high: 512, log: true}
  max_depth: {type: int, low: 4, high: 15}
  branching: {type: categorical, choices: [1, 2, 4, 8, 16]}
objectives:
  - {metric: tokens_per_s, direction: maximize}
constraints: {peak_memory_gib: {max: 46}}
sampler: {type: tpe, seed: 0}       # tpe | random | grid | nsga2
n_trials: 40                        # COMPLETE trials wanted
storage: sqlite:///runs/optuna.db
mlflow: {tracking_uri: sqlite:///runs/mlflow.db, experiment: ddtree}
ray: {address: null}                # null: start a local Ray; "auto" or an address: join a cluster
memory_trace: {interval_ms: 50}
"""



# -- helpers -------------------------------------------------------------------------------------------


@pytest.fixture
def workdir(tmp_path, monkeypatch) -> Path:
    """An empty cwd: anything a check wrongly creates relative to the cwd shows up here."""
    folder = tmp_path / "cwd"
    folder.mkdir()
    monkeypatch.chdir(folder)
    return folder


def fresh_runs(tmp_path: Path) -> Path:
    """Where the stores point: a folder (and its parent) that does not exist yet."""
    return tmp_path / "fresh" / "runs"


def assert_nothing_created(tmp_path: Path, cwd: Path) -> None:
    fresh = tmp_path / "fresh"
    assert not fresh.exists(), f"created {sorted(str(p) for p in fresh.rglob('*'))} or the folder itself"
    assert not list(cwd.iterdir()), f"created in the cwd: {sorted(p.name for p in cwd.iterdir())}"


def only_line(text: str) -> str:
    lines = text.strip().splitlines()
    assert len(lines) == 1, f"expected exactly one line, got {len(lines)}:\n{text}"
    return lines[0]


# -- 1. valid files ------------------------------------------------------------------------------------


def test_valid_sweep_loads(tiny_dir, tmp_path, workdir):
    path = write_sweep(tmp_path / "sweep.yaml", sweep_dict(tiny_dir, fresh_runs(tmp_path)))

    config = validate(path)

    assert isinstance(config, SweepConfig)
    assert config.method == "ddtree"
    assert set(config.search_space) == {"tree_budget", "max_depth", "branching"}
    assert config.target.model == str((tiny_dir / "target").resolve())
    assert config.storage == f"sqlite:///{fresh_runs(tmp_path)}/optuna.db"
    assert_nothing_created(tmp_path, workdir)


def _relative_layout(root: Path) -> None:
    (root / "data").mkdir(parents=True)
    (root / "data" / "prompts.jsonl").write_text(json.dumps({"input_ids": [1, 2, 3]}) + "\n")
    (root / "models" / "target").mkdir(parents=True)
    (root / "models" / "drafter").mkdir(parents=True)


def _relative_sweep(tmp_path: Path, tiny_dir: Path, **overrides) -> dict:
    return sweep_dict(
        tiny_dir,
        fresh_runs(tmp_path),
        prompts={"path": "data/prompts.jsonl", "limit": 2, "max_new_tokens": 8},
        storage="sqlite:///runs/optuna.db",
        mlflow={"tracking_uri": "sqlite:///./runs/mlflow.db", "experiment": "test"},
        **overrides,
    )


def test_relative_paths_resolve_against_the_cwd(tiny_dir, tmp_path, monkeypatch):
    root = (tmp_path / "project").resolve()
    _relative_layout(root)
    config_dict = _relative_sweep(
        tmp_path, tiny_dir, target={"model": "models/target"}, drafter={"model": "./models/drafter"}
    )
    path = write_sweep(tmp_path / "sweep.yaml", config_dict)
    monkeypatch.chdir(root)

    config = load_sweep(path)

    assert config.prompts.path == root / "data" / "prompts.jsonl"
    assert config.prompts.path.is_absolute()
    assert config.storage == f"sqlite:///{root}/runs/optuna.db"
    assert config.mlflow.tracking_uri == f"sqlite:///{root}/runs/mlflow.db"
    assert config.target.model == str(root / "models" / "target")  # existing folder, no ./ prefix
    assert config.drafter.model == str(root / "models" / "drafter")  # ./ prefix
    assert not (root / "runs").exists()


def test_relative_paths_resolve_against_base(tiny_dir, tmp_path, workdir):
    root = (tmp_path / "elsewhere").resolve()
    _relative_layout(root)
    config_dict = _relative_sweep(tmp_path, tiny_dir, target={"model": "models/target"},
                                  drafter={"model": "models/drafter"})
    path = write_sweep(tmp_path / "sweep.yaml", config_dict)

    config = load_sweep(path, base=root)

    assert config.prompts.path == root / "data" / "prompts.jsonl"
    assert config.storage == f"sqlite:///{root}/runs/optuna.db"
    assert config.mlflow.tracking_uri == f"sqlite:///{root}/runs/mlflow.db"
    assert config.target.model == str(root / "models" / "target")
    assert config.drafter.model == str(root / "models" / "drafter")
    assert_nothing_created(tmp_path, workdir)


def test_a_plain_postgresql_url_names_the_installed_driver():
    import importlib.util

    from orchestrator.config import database_url

    assert importlib.util.find_spec("psycopg") is None and importlib.util.find_spec("psycopg2") is not None
    assert database_url("postgresql://u@h/db") == "postgresql+psycopg2://u@h/db"
    assert database_url("postgres://u@h/db") == "postgresql+psycopg2://u@h/db"
    assert database_url("postgresql+psycopg://u@h/db") == "postgresql+psycopg://u@h/db"  # an explicit driver stays
    assert database_url("sqlite:////tmp/x.db") == "sqlite:////tmp/x.db"


def test_hub_ids_and_non_sqlite_urls_are_left_unchanged(tiny_dir, tmp_path, workdir):
    config_dict = sweep_dict(
        tiny_dir,
        fresh_runs(tmp_path),
        target={"model": "Qwen/Qwen3-8B"},
        drafter={"model": "z-lab/Qwen3-8B-DFlash-b16"},
        storage="postgresql://user:pw@db.example:5432/optuna",
        mlflow={"tracking_uri": "http://127.0.0.1:5000", "experiment": "x"},
    )
    path = write_sweep(tmp_path / "sweep.yaml", config_dict)

    config = load_sweep(path)  # no connection checks here: those are validate()'s

    assert config.target.model == "Qwen/Qwen3-8B"
    assert config.drafter.model == "z-lab/Qwen3-8B-DFlash-b16"
    # the one change: a plain postgresql:// gets the installed driver (SQLAlchemy 2.1 would assume psycopg 3)
    assert config.storage == "postgresql+psycopg2://user:pw@db.example:5432/optuna"
    assert config.mlflow.tracking_uri == "http://127.0.0.1:5000"


def test_absolute_sqlite_and_memory_urls_are_left_unchanged(tiny_dir, tmp_path, workdir):
    absolute = f"sqlite:///{tmp_path.resolve()}/abs/optuna.db"
    config_dict = sweep_dict(
        tiny_dir, fresh_runs(tmp_path), storage=absolute, mlflow={"tracking_uri": "sqlite:///:memory:"}
    )
    config = load_sweep(write_sweep(tmp_path / "sweep.yaml", config_dict))

    assert config.storage == absolute
    assert config.mlflow.tracking_uri == "sqlite:///:memory:"


def test_issue_sample_validates(tmp_path, monkeypatch):
    root = tmp_path.resolve()
    (root / "data" / "prompts").mkdir(parents=True)
    (root / "data" / "prompts" / "mixed.jsonl").write_text(json.dumps({"prompt": "Hello"}) + "\n")
    path = root / "tree_budget.yaml"
    path.write_text(ISSUE_SAMPLE)
    monkeypatch.chdir(root)
    # a machine that may download (validation itself never does): hub ids not cached here pass, for the worker
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)

    config = validate(path)

    assert config.name == "ddtree-tree-budget"
    assert config.target.model == "Qwen/Qwen3.6-27B"
    assert config.drafter.model == "z-lab/Qwen3.6-27B-DFlash"
    assert config.workers.gpus_per_worker == 2 and config.workers.resources == {"host:lxc-129": 0.01}
    assert config.prompts.path == root / "data" / "prompts" / "mixed.jsonl"
    assert config.storage == f"sqlite:///{root}/runs/optuna.db"
    assert config.mlflow.tracking_uri == f"sqlite:///{root}/runs/mlflow.db"
    assert config.search_space["branching"].values() == [1, 2, 4, 8, 16]
    assert config.constraints["peak_memory_gib"].max == 46
    assert config.ray.address is None
    assert not (root / "runs").exists()


# -- 2. bad files: one clear error naming the file and the field ---------------------------------------


@dataclass(frozen=True)
class Case:
    """A bad sweep file: ``make(tmp_path, tiny_dir) -> sweep path``; ``expect``: message fragments."""

    id: str
    make: Callable[[Path, Path], Path]
    expect: tuple[str, ...]

    def param(self):
        return pytest.param(self, id=self.id)


def edit(change: Callable[[dict, Path], None]) -> Callable[[Path, Path], Path]:
    """A maker that writes the conftest's valid sweep after ``change(config, tmp_path)``."""

    def make(tmp_path: Path, tiny_dir: Path) -> Path:
        config = sweep_dict(tiny_dir, fresh_runs(tmp_path))
        change(config, tmp_path)
        return write_sweep(tmp_path / "sweep.yaml", config)

    return make


def drop(key: str):
    return edit(lambda c, _: c.pop(key))


def put(*keys: str, value):
    """Set c[k0][k1]...[kn] = value."""

    def change(config: dict, _: Path) -> None:
        node = config
        for key in keys[:-1]:
            node = node[key]
        node[keys[-1]] = value

    return edit(change)


def raw(text: str) -> Callable[[Path, Path], Path]:
    def make(tmp_path: Path, _: Path) -> Path:
        path = tmp_path / "sweep.yaml"
        path.write_text(text)
        return path

    return make


def directory_as_sweep(tmp_path: Path, _: Path) -> Path:
    folder = tmp_path / "a-folder.yaml"
    folder.mkdir()
    return folder


def _dflash(config: dict, _: Path, **changes) -> None:
    config.update(method="dflash", search_space={"num_draft_tokens": {"type": "int", "low": 1, "high": 7}})
    config.update(changes)


def _sqlite_under_a_file(config: dict, tmp_path: Path) -> None:
    blocker = tmp_path / "blocker"  # a regular file where the store's folder should be
    blocker.write_text("not a folder")
    config["storage"] = f"sqlite:///{blocker}/optuna.db"

INT = "int"
OBJ = {"metric": "tokens_per_s", "direction": "maximize"}

CASES = [
    # missing required fields
    Case("missing-name", drop("name"), ("name: missing required field",)),
    Case("missing-method", drop("method"), ("method: missing required field",)),
    Case("missing-prompts", drop("prompts"), ("prompts: missing required field",)),
    Case("missing-objectives", drop("objectives"), ("objectives: missing required field",)),
    Case("missing-n_trials", drop("n_trials"), ("n_trials: missing required field",)),
    # wrong types / values
    Case("n_trials-not-int", put("n_trials", value="ten"), ("n_trials:", "valid integer")),
    Case("workers.count-negative", put("workers", "count", value=-1), ("workers.count:", "greater than or equal to 1")),
    # tensor-parallel workers: the combinations that make no worker, named by field
    Case("parallel-unknown", put("workers", "parallel", value="pipeline"), ("workers.parallel:", "'pipeline'")),
    Case("ranks-with-layers", put("workers", "ranks", value=2), ("workers.ranks:", "only for parallel: tensor")),
    Case("tensor-on-one-gpu", put("workers", value={"gpus_per_worker": 1, "parallel": "tensor"}),
         ("workers.gpus_per_worker:", "2 or more GPUs")),
    Case("tensor-on-cpu-without-ranks", put("workers", value={"gpus_per_worker": 0, "parallel": "tensor"}),
         ("workers.ranks:", "give their number")),
    Case("tensor-ranks-not-gpus", put("workers", value={"gpus_per_worker": 2, "parallel": "tensor", "ranks": 3}),
         ("workers.ranks:", "ranks (3) must equal gpus_per_worker (2)")),
    Case("temperature-negative", put("generation", "temperature", value=-0.5),
         ("generation.temperature:", "greater than or equal to 0")),
    # unknown keys and names
    Case("unknown-top-level-key", put("bogus", value=1), ("bogus: unknown field",)),
    Case("unknown-nested-key", put("workers", "gpus", value=1), ("workers.gpus: unknown field",)),
    # a misspelt required key is named as unknown, with the field it resembles (not "n_trials missing")
    Case("misspelt-required-key", edit(lambda c, _: c.update(n_trails=c.pop("n_trials"))),
         ("n_trails: unknown field (did you mean 'n_trials'?)",)),
    Case("misspelt-nested-key", put("target", "dtyp", value="float32"),
         ("target.dtyp: unknown field (did you mean 'dtype'?)",)),
    Case("misspelt-search-space-key", put("search_space", "max_depth", value={"type": INT, "low": 1, "hihg": 7}),
         ("search_space.max_depth.hihg: unknown field (did you mean 'high'?)",)),
    Case("unknown-key-unlike-any", put("prompts", "zzz", value=1), ("prompts.zzz: unknown field (allowed here:",
                                                                   "max_new_tokens")),
    Case("target-given-as-drafter", edit(lambda c, _: c["drafter"].update(model=c["target"]["model"])),
         ("drafter.model:", "is a target model (Qwen3ForCausalLM), not a DFlash drafter")),
    Case("measurement-repeats-zero", put("measurement", value={"repeats": 0}),
         ("measurement.repeats:", "greater than or equal to 1")),
    Case("unknown-objective-metric", put("objectives", value=[{"metric": "speed", "direction": "maximize"}]),
         ("objectives.0.metric:", "'speed'", "tokens_per_s")),
    Case("unknown-constraint-metric", put("constraints", value={"vram_gib": {"max": 40}}),
         ("constraints.vram_gib", "'vram_gib'", "peak_memory_gib")),
    Case("unknown-sampler", put("sampler", "type", value="bayes"), ("sampler.type:", "'bayes'", "tpe")),
    Case("unknown-method", put("method", value="medusa"), ("method:", "'medusa'", "ddtree")),
    # search space
    Case("low-greater-than-high", put("search_space", "tree_budget", value={"type": INT, "low": 64, "high": 16}),
         ("search_space.tree_budget", "low (64) is greater than high (16)")),
    Case("log-with-low-0", put("search_space", "tree_budget", value={"type": INT, "low": 0, "high": 16, "log": True}),
         ("search_space.tree_budget", "log=true needs low >= 1")),
    Case("param-of-another-method", put("search_space", "num_draft_tokens", value={"type": INT, "low": 1, "high": 4}),
         ("search_space.num_draft_tokens", "not a parameter of method 'ddtree'")),
    Case("ddtree-without-tree_budget", edit(lambda c, _: c["search_space"].pop("tree_budget")),
         ("search_space.tree_budget", "needs a tree budget")),
    Case("dflash-without-drafter", edit(lambda c, t: _dflash(c, t, drafter=None)),
         ("drafter", "method 'dflash' needs a drafter")),
    Case("max_depth-beyond-block", put("search_space", "max_depth", value={"type": INT, "low": 1, "high": 9}),
         ("search_space.max_depth", "9", "block_size-1 = 7")),
    Case("fixed-num_draft_tokens-beyond-block",
         edit(lambda c, t: _dflash(c, t, search_space={}, fixed_params={"num_draft_tokens": 8})),
         ("fixed_params.num_draft_tokens", "8", "block_size-1 = 7")),
    # objectives
    Case("same-objective-twice", put("objectives", value=[OBJ, {"metric": "tokens_per_s", "direction": "minimize"}]),
         ("objectives", "the same metric twice")),
    Case("three-objectives", put("objectives", value=[OBJ, {"metric": "tau", "direction": "maximize"},
                                                      {"metric": "peak_memory_gib", "direction": "minimize"}]),
         ("objectives", "at most 2")),
    # the file itself
    Case("yaml-syntax-error", raw("name: [unclosed\nmethod: ddtree\n"), ("not valid YAML at line 2, column 7:",)),
    Case("yaml-bad-indent", raw("name: x\n  method: ddtree\n"),
         ("not valid YAML at line 2, column 9: mapping values are not allowed here",)),
    Case("top-level-list", raw("- name: x\n- method: ddtree\n"), ("must be a YAML mapping",)),
    Case("missing-prompts-file", put("prompts", "path", value="/nonexistent/prompts.jsonl"),
         ("prompts.path", "no such file", "/nonexistent/prompts.jsonl")),
    Case("sweep-path-missing", lambda tmp_path, _: tmp_path / "no-such-sweep.yaml",
         ("cannot read the sweep file", "No such file")),
    Case("sweep-path-is-a-folder", directory_as_sweep, ("cannot read the sweep file", "Is a directory")),
    # stores: checked before anything is created
    Case("storage-unreachable", put("storage", value="postgresql://user:pw@127.0.0.1:1/db"),
         ("storage: cannot connect", "127.0.0.1:1")),
    Case("storage-sqlite-parent-is-a-file", edit(_sqlite_under_a_file),
         ("storage: cannot create the SQLite file",)),
    Case("tracking-http-closed-port", put("mlflow", "tracking_uri", value="http://127.0.0.1:1"),
         ("mlflow.tracking_uri: cannot reach", "http://127.0.0.1:1")),
    Case("tracking-file-uri", put("mlflow", "tracking_uri", value="file:///tmp/x"),
         ("mlflow.tracking_uri:", "not supported", "file:///tmp/x")),
]
BY_ID = {case.id: case for case in CASES}
STORE_CASES = [BY_ID[i] for i in ("storage-unreachable", "storage-sqlite-parent-is-a-file", "tracking-http-closed-port",
                                  "tracking-file-uri")]


def _check_message(message: str, case: Case) -> None:
    only_line(message)
    for fragment in case.expect:
        assert fragment in message, f"{fragment!r} not in {message!r}"


@pytest.mark.parametrize("case", [case.param() for case in CASES])
def test_bad_sweep_gives_one_clear_error(case, tiny_dir, tmp_path, workdir, capsys):
    path = case.make(tmp_path, tiny_dir)

    with pytest.raises(BadInputError) as caught:
        validate(path)
    message = str(caught.value)

    _check_message(message, case)
    assert_nothing_created(tmp_path, workdir)
    # main() turns it into exit status 2 and exactly this one line on stderr
    assert main([str(path)]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert only_line(err) == f"orchestrator.sweep: error: {message}"
    assert_nothing_created(tmp_path, workdir)
    assert message.startswith(f"{path}: "), f"the sweep file is not named first in {message!r}"


@pytest.mark.parametrize("case", [case.param() for case in STORE_CASES])
def test_bad_store_names_the_field_and_creates_nothing(case, tiny_dir, tmp_path, workdir):
    """Store problems are found before anything exists (no database file, no folder)."""
    path = case.make(tmp_path, tiny_dir)
    with pytest.raises(BadInputError) as caught:
        validate(path)
    _check_message(str(caught.value), case)
    assert_nothing_created(tmp_path, workdir)


def test_unreachable_storage_message_is_one_line_without_driver(tiny_dir, tmp_path, workdir):
    """With or without a PostgreSQL driver installed, the error is one line naming ``storage``."""
    path = BY_ID["storage-unreachable"].make(tmp_path, tiny_dir)
    with pytest.raises(BadInputError) as caught:
        validate(path)
    line = only_line(str(caught.value))
    assert "storage" in line and "Traceback" not in line


# Through the real CLI (slow: one interpreter each): a representative subset, with and without --dry-run.
CLI_CASES = [
    ("missing-name", "--dry-run"),
    ("max_depth-beyond-block", None),
    ("storage-unreachable", None),
    ("storage-sqlite-parent-is-a-file", "--dry-run"),
    ("tracking-http-closed-port", None),  # storage check passes first: still nothing may be created
    ("tracking-file-uri", "--dry-run"),
    ("misspelt-required-key", "--dry-run"),
    ("target-given-as-drafter", None),
]


@pytest.mark.parametrize(
    ("case_id", "flag"), [pytest.param(c, f, id=f"{c}{f or ''}") for c, f in CLI_CASES]
)
@pytest.mark.slow  # the sweep CLI in a subprocess
def test_cli_bad_sweep_exits_2_with_one_line(case_id, flag, tiny_dir, tmp_path):
    case = BY_ID[case_id]
    path = case.make(tmp_path, tiny_dir)
    cwd = tmp_path / "cwd"
    cwd.mkdir()

    result = run_sweep(path, *([flag] if flag else []), cwd=cwd, timeout=120)

    assert result.returncode == 2, result.stderr
    assert result.stdout == ""
    line = only_line(result.stderr)
    assert line.startswith("orchestrator.sweep: error: ")
    for fragment in case.expect:
        assert fragment in line
    assert str(path) in line
    assert_nothing_created(tmp_path, cwd)


# -- 3. --dry-run and --help -----------------------------------------------------------------------------


@pytest.mark.slow  # the sweep CLI in a subprocess
def test_cli_dry_run_prints_the_plan_and_creates_nothing(tmp_path):
    root = tmp_path.resolve()
    (root / "data" / "prompts").mkdir(parents=True)
    (root / "data" / "prompts" / "mixed.jsonl").write_text(json.dumps({"prompt": "Hello"}) + "\n")
    path = root / "tree_budget.yaml"
    path.write_text(ISSUE_SAMPLE)
    before = sorted(root.rglob("*"))

    result = run_sweep(path, "--dry-run", cwd=root, timeout=120, offline=False)  # hub ids: checked by the worker

    assert result.returncode == 0, result.stderr
    plan = result.stdout
    assert "actors     1 x 2 GPU(s), max 44GiB per GPU, resources {'host:lxc-129': 0.01}" in plan
    assert "ray        local cluster" in plan
    for name in ("tree_budget", "max_depth", "branching"):
        assert f"  {name}" in plan
    assert "'low': 16, 'high': 512" in plan
    assert f"prompts    {root}/data/prompts/mixed.jsonl" in plan
    assert f"optuna     sqlite:///{root}/runs/optuna.db" in plan
    assert f"mlflow     sqlite:///{root}/runs/mlflow.db experiment 'ddtree'" in plan
    assert "maximize tokens_per_s; constraints peak_memory_gib {'max': 46.0}" in plan
    assert f"fingerprint {load_sweep(path, base=root).fingerprint()}" in plan
    assert sorted(root.rglob("*")) == before  # no runs/, no sqlite files, no mlruns
    assert not (root / "runs").exists()


def test_dry_run_in_process_on_the_tiny_sweep(tiny_dir, tmp_path, workdir, capsys):
    path = write_sweep(tmp_path / "sweep.yaml", sweep_dict(tiny_dir, fresh_runs(tmp_path)))

    assert main([str(path), "--dry-run"]) == 0

    out, err = capsys.readouterr()
    config = load_sweep(path)
    assert out.strip() == plan_text(config, path)
    assert "actors     1 x 0 GPU(s)" in out
    assert config.fingerprint() in out
    assert_nothing_created(tmp_path, workdir)


@pytest.mark.slow  # the sweep CLI in a subprocess
def test_cli_help_exits_0(tmp_path):
    result = run_sweep(Path("--help"), cwd=tmp_path, timeout=120)  # run_sweep's first argument is argv[1]
    assert result.returncode == 0, result.stderr
    assert "--dry-run" in result.stdout and "--new-study" in result.stdout
    assert not list(tmp_path.iterdir())


# -- 4. fingerprint ---------------------------------------------------------------------------------------


def _config(tiny_dir: Path, change: Callable[[dict], None] | None = None) -> SweepConfig:
    config = sweep_dict(tiny_dir, Path("/unused/runs"))
    if change is not None:
        change(config)
    return SweepConfig.model_validate(config)


def _set(*keys: str, value) -> Callable[[dict], None]:
    def change(config: dict) -> None:
        node = config
        for key in keys[:-1]:
            node = node[key]
        node[keys[-1]] = value

    return change


def _method_only(method: str) -> Callable[[dict], None]:
    """Same everything (drafter, empty search space) but the method: only ar/dflash allow that."""

    def change(config: dict) -> None:
        config.update(method=method, search_space={})

    return change


FINGERPRINT_CHANGES = {
    "target-model": _set("target", "model", value="Qwen/Qwen3-8B"),
    "drafter-model": _set("drafter", "model", value="z-lab/Qwen3-8B-DFlash-b16"),
    "search-space-range": _set("search_space", "tree_budget", "high", value=64),
    "search-space-log": _set("search_space", "tree_budget", "log", value=False),
    "search-space-choices": _set("search_space", "branching", "choices", value=[1, 2]),
    "search-space-param-removed": lambda c: c["search_space"].pop("max_depth"),
    "search-space-to-fixed": lambda c: c.update(fixed_params={"max_depth": c["search_space"].pop("max_depth")["high"]}),
    "objective-direction": _set("objectives", 0, "direction", value="minimize"),
    "objective-metric": _set("objectives", 0, "metric", value="tau"),
    "objective-added": lambda c: c["objectives"].append({"metric": "peak_memory_gib", "direction": "minimize"}),
}
FINGERPRINT_SAME = {
    "prompts-limit": _set("prompts", "limit", value=16),
    "n_trials": _set("n_trials", value=400),
    "sampler-seed": _set("sampler", "seed", value=123),
    "workers-count": _set("workers", "count", value=3),
    "search-space-key-order": lambda c: c.update(search_space=dict(reversed(list(c["search_space"].items())))),
}


@pytest.mark.parametrize("change", FINGERPRINT_CHANGES.values(), ids=FINGERPRINT_CHANGES.keys())
def test_fingerprint_changes_with_defining_fields(tiny_dir, change):
    assert _config(tiny_dir, change).fingerprint() != _config(tiny_dir).fingerprint()


def test_fingerprint_changes_with_method(tiny_dir):
    dflash, ar = _config(tiny_dir, _method_only("dflash")), _config(tiny_dir, _method_only("ar"))
    assert dflash.fingerprint() != ar.fingerprint()


def test_fingerprint_changes_with_fixed_params(tiny_dir):
    def fixed(value: int) -> Callable[[dict], None]:
        return lambda c: c.update(method="dflash", search_space={}, fixed_params={"num_draft_tokens": value})

    assert _config(tiny_dir, fixed(4)).fingerprint() != _config(tiny_dir, fixed(5)).fingerprint()


@pytest.mark.parametrize("change", FINGERPRINT_SAME.values(), ids=FINGERPRINT_SAME.keys())
def test_fingerprint_ignores_non_defining_fields(tiny_dir, change):
    assert _config(tiny_dir, change).fingerprint() == _config(tiny_dir).fingerprint()


def test_fingerprint_is_stable_across_loads(tiny_dir, tmp_path, workdir):
    path = write_sweep(tmp_path / "sweep.yaml", sweep_dict(tiny_dir, fresh_runs(tmp_path)))
    first = load_sweep(path).fingerprint()
    assert load_sweep(path).fingerprint() == first
    assert len(first) == 16 and int(first, 16) >= 0


# -- settings the engine would refuse at trial time are refused up front ------------------------------


def test_search_space_error_path_is_named_as_in_the_yaml(tiny_dir, tmp_path, workdir):
    path = put("search_space", "tree_budget", value={"type": INT, "low": 64, "high": 16})(tmp_path, tiny_dir)
    with pytest.raises(BadInputError) as caught:
        load_sweep(path)
    assert str(caught.value) == f"{path}: search_space.tree_budget: low (64) is greater than high (16)"


def test_log_with_step_is_refused(tiny_dir, tmp_path, workdir):
    path = put("search_space", "tree_budget", value={"type": INT, "low": 2, "high": 32, "log": True, "step": 2})(
        tmp_path, tiny_dir
    )
    with pytest.raises(BadInputError, match=r"search_space\.tree_budget"):
        validate(path)


BELOW_ONE = {
    "tree_budget-low-0": put("search_space", "tree_budget", value={"type": INT, "low": 0, "high": 8}),
    "max_depth-low-0": put("search_space", "max_depth", value={"type": INT, "low": 0, "high": 7}),
    "branching-choice-0": put("search_space", "branching", value={"type": "categorical", "choices": [0, 2]}),
    "fixed-num_draft_tokens-0": edit(lambda c, t: _dflash(c, t, search_space={}, fixed_params={"num_draft_tokens": 0})),
}


@pytest.mark.parametrize("make", BELOW_ONE.values(), ids=BELOW_ONE.keys())
def test_method_params_below_one_are_refused(make, tiny_dir, tmp_path, workdir):
    with pytest.raises(BadInputError):
        validate(make(tmp_path, tiny_dir))
