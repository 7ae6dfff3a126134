"""Sweep files: YAML -> a validated ``SweepConfig`` (pydantic), or one clear error naming the field.

Relative paths (prompts, SQLite stores, local model folders) resolve against the directory the
command runs in and are made absolute here, before anything else sees them. Unknown keys are refused.
Nothing in this module creates files, studies or runs.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal, get_args

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from workers.decoding.methods import METHODS, Method, MethodEntry
from workers.decoding.params import MethodParams
from workers.errors import BadInputError
from workers.prompts import BENCHMARKS, PromptSource

# Metrics a sweep can optimise or constrain (names as in DESIGN.md and the worker's results).
METRICS = ("tokens_per_s", "tau", "speedup", "ttft_s", "tpot_s", "peak_memory_gib", "lossless_match")
_MEMORY = re.compile(r"^\d+(\.\d+)?\s*(GiB|GB|MiB|MB)$")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


_LOCAL_ONLY = ("load from this machine only: a folder or the local Hugging Face cache, never the network "
               "(HF_HUB_OFFLINE=1 does the same for every model); a model not here is refused at once")


class TargetSection(_Strict):
    model: str = Field(description="hub id or local folder of the target causal LM")
    dtype: Literal["float32", "bfloat16", "float16"] = "bfloat16"
    attn_implementation: Literal["sdpa", "eager"] = "sdpa"
    local_files_only: bool = Field(False, description=_LOCAL_ONLY)


class DrafterSection(_Strict):
    model: str = Field(description="hub id or local folder of the DFlash drafter (z-lab layout)")
    local_files_only: bool = Field(False, description=_LOCAL_ONLY)


class WorkersSection(_Strict):
    count: int = Field(1, ge=1, description="Ray actors, each with its own copy of the models")
    gpus_per_worker: int = Field(1, ge=0, description="GPUs per actor; the target is split over them; 0 = CPU")
    max_memory_per_gpu: str | None = Field(None, description="cap per GPU for the target's weights, e.g. 44GiB")
    cuda_graphs: bool = Field(True, description="replay verify passes as CUDA graphs (one-GPU targets); false to debug")
    compile_layers: bool = Field(False, description="torch.compile the target's layers (faster, ~1 min per pass width)")
    resources: dict[str, float] = Field(default_factory=dict, description="Ray custom resources per actor")
    max_restarts: int = Field(1, ge=0, description="times a dead actor is restarted (models reloaded)")
    device: Literal["auto", "cuda", "cpu"] = Field(
        "auto", description="where an actor runs its models; auto = cuda when gpus_per_worker > 0"
    )
    parallel: Literal["layers", "tensor"] = Field(
        "layers", description="how a worker uses several GPUs: layers = one actor, the target's layers split over "
        "its GPUs (accelerate device_map); tensor = one actor per GPU on one node (a Ray placement group) joined in "
        "one torch.distributed group, each layer sharded over them (not yet measured on GPUs)"
    )
    ranks: int | None = Field(
        None, ge=2, description="parallel: tensor only: processes in a worker's group; default gpus_per_worker (one "
        "rank per GPU); with gpus_per_worker: 0 give it (the ranks run on CPU, joined with gloo)"
    )
    join_timeout_s: float = Field(
        300.0, gt=0, description="parallel: tensor only: seconds the ranks wait to join their group, and any "
        "collective waits for the other ranks, before the group is reported stuck"
    )

    @field_validator("max_memory_per_gpu")
    @classmethod
    def _memory(cls, value: str | None) -> str | None:
        if value is not None and not _MEMORY.match(value):
            raise ValueError(f"must look like '44GiB' or '40000MiB', got {value!r}")
        return value

    @property
    def world_size(self) -> int:
        """Processes per worker: 1 for a layer split, else the tensor-parallel group's size."""
        if self.parallel == "layers":
            return 1
        return self.ranks or self.gpus_per_worker


class PromptsSection(_Strict):
    path: Path | None = Field(None, description="our JSONL prompt file, or a local copy of a named dataset")
    dataset: Literal[tuple(BENCHMARKS)] | None = Field(  # type: ignore[valid-type]
        None, description="a named benchmark loaded with `datasets` (or from `path` offline)"
    )
    split: str | None = None
    limit: int | None = Field(None, ge=1)
    seed: int | None = Field(None, description="sample `limit` prompts with this seed (default: the first ones)")
    max_new_tokens: int = Field(256, ge=1)
    chat_template: bool = Field(True, description="format text prompts with the target's chat template")
    enable_thinking: bool = Field(False, description="thinking mode of templates that have it (off: DFlash drafters)")

    @model_validator(mode="after")
    def _source(self) -> PromptsSection:
        if self.path is None and self.dataset is None:
            raise ValueError("give a path, a dataset name, or both")
        return self

    def source(self) -> PromptSource:
        return PromptSource(str(self.path) if self.path else None, self.dataset, self.split, self.limit, self.seed)


class GenerationSection(_Strict):
    temperature: float = Field(0.0, ge=0.0)
    seed: int = 0
    stop_token_ids: list[int] | None = None


class IntParam(_Strict):
    type: Literal["int"]
    low: int
    high: int
    log: bool = False
    step: int = Field(1, ge=1)

    @model_validator(mode="after")
    def _range(self) -> IntParam:
        if self.low > self.high:
            raise ValueError(f"low ({self.low}) is greater than high ({self.high})")
        if self.log and self.low < 1:
            raise ValueError("log=true needs low >= 1")
        if self.log and self.step != 1:
            raise ValueError("log=true cannot be combined with step > 1 (Optuna refuses it)")
        return self

    def values(self) -> list[int]:
        return list(range(self.low, self.high + 1, self.step))


class FloatParam(_Strict):
    """A real-valued knob (``depth_discount``) on a grid of ``step``, so grid and predicted samplers can
    enumerate it as they do integers."""

    type: Literal["float"]
    low: float
    high: float
    step: float = Field(gt=0)

    @model_validator(mode="after")
    def _range(self) -> FloatParam:
        if self.low > self.high:
            raise ValueError(f"low ({self.low}) is greater than high ({self.high})")
        return self

    def values(self) -> list[float]:
        count = int(round((self.high - self.low) / self.step))
        return [round(self.low + i * self.step, 10) for i in range(count + 1)]


class CategoricalParam(_Strict):
    type: Literal["categorical"]
    choices: list[int | float | None] = Field(min_length=1)

    def values(self) -> list[int | float | None]:
        return list(self.choices)


Param = Annotated[IntParam | FloatParam | CategoricalParam, Field(discriminator="type")]


class Objective(_Strict):
    metric: Literal[METRICS]  # type: ignore[valid-type]
    direction: Literal["maximize", "minimize"]


class Bound(_Strict):
    max: float | None = None
    min: float | None = None

    @model_validator(mode="after")
    def _one(self) -> Bound:
        if self.max is None and self.min is None:
            raise ValueError("give max, min or both")
        return self


class SamplerSection(_Strict):
    type: Literal["tpe", "random", "grid", "nsga2", "predicted"] = "tpe"
    seed: int | None = 0
    explore: int = Field(2, ge=0, description="predicted: of the n_trials real trials, how many check random "
                                              "other settings (the rest run the predicted best)")
    max_points: int = Field(2000, ge=1, description="predicted: settings predicted (a random sample when the "
                                                      "space is larger)")
    predict: bool = Field(False, description="other samplers: also log predicted_tokens_per_s on every trial")

    @property
    def predicts(self) -> bool:
        return self.type == "predicted" or self.predict


class PrunerSection(_Strict):
    """Early stopping of bad trials from per-prompt reports (single-objective sweeps only)."""

    type: Literal["none", "median", "percentile", "successive_halving"] = "none"
    n_startup_trials: int = Field(2, ge=0, description="median/percentile: trials completed before any pruning")
    n_warmup_steps: int = Field(1, ge=0, description="median/percentile: prompts a trial runs before it can be pruned")
    percentile: float = Field(25.0, gt=0, lt=100, description="percentile: prune below this percentile")


class MlflowSection(_Strict):
    tracking_uri: str = "sqlite:///runs/mlflow.db"
    experiment: str = "specdec"


class RaySection(_Strict):
    address: str | None = None  # None: a local Ray; "auto" or host:port: join a cluster
    num_cpus: int | None = Field(None, ge=1, description="local Ray only: logical CPUs (default: all)")
    num_gpus: int | None = Field(None, ge=0, description="local Ray only: logical GPUs (default: detected)")


class MemoryTraceSection(_Strict):
    interval_ms: float = Field(50.0, gt=0)


class MeasurementSection(_Strict):
    stage_timing: bool = Field(
        False, description="per-stage shares (share_*): synchronises the device around every stage, so tokens/s drops; "
        "the AR baseline is then timed the same way"
    )
    repeats: int = Field(1, ge=1, description="times each prompt is generated per trial; its median-time run counts")
    final_top_k: int = Field(
        3, ge=0, description="best settings re-measured after the search, interleaved with AR, before naming the winner"
    )
    final_repeats: int = Field(3, ge=1, description="passes of the final re-measurement (each pass: AR, A, AR, B, ...)")




class ExternalBaseline(_Strict):
    """A speed the user already has (another engine, another setup), shown beside the study's best."""

    name: str = Field(min_length=1)
    tokens_per_s: float = Field(gt=0)


class SweepConfig(_Strict):
    name: str = Field(min_length=1, description="Optuna study name; the same file resumes the same study")
    method: str | list[str] = Field(
        description="one method, or several compared in one study (then search_space and fixed_params hold one "
        "mapping per method)")
    target: TargetSection
    drafter: DrafterSection | None = None
    workers: WorkersSection = WorkersSection()
    prompts: PromptsSection
    generation: GenerationSection = GenerationSection()
    search_space: dict[str, Param] = Field(default_factory=dict)
    fixed_params: dict[str, int | None] = Field(default_factory=dict, description="method params not swept")
    # several methods: search_space and fixed_params per method, moved here by _per_method (never written)
    method_spaces: dict[str, dict[str, Param]] = Field(default_factory=dict)
    method_fixed: dict[str, dict[str, int | None]] = Field(default_factory=dict)
    trial_timeout_s: float | None = Field(
        None, gt=0, description="a trial running longer is stopped: its actor restarted and the trial run once more, "
        "then failed (default: from the AR baseline's time, see orchestrator.trials)")
    baselines: list[ExternalBaseline] = Field(
        default_factory=list, description="speeds you already have, shown beside the study's best in the report")
    objectives: list[Objective] = Field(min_length=1, max_length=2)
    constraints: dict[Literal[METRICS], Bound] = Field(default_factory=dict)  # type: ignore[valid-type]
    sampler: SamplerSection = SamplerSection()
    pruner: PrunerSection = PrunerSection()
    n_trials: int = Field(ge=1, description="COMPLETE trials wanted")
    storage: str = "sqlite:///runs/optuna.db"
    mlflow: MlflowSection = MlflowSection()
    ray: RaySection = RaySection()
    memory_trace: MemoryTraceSection = MemoryTraceSection()
    measurement: MeasurementSection = MeasurementSection()

    @field_validator("method", mode="before")
    @classmethod
    def _method_names(cls, value: Any) -> Any:
        known = ", ".join(m.value for m in METHODS)
        names = value if isinstance(value, list) else [value]
        if not names:
            raise ValueError(f"give one method or a list of them ({known})")
        for name in names:
            if not isinstance(name, str) or name not in {m.value for m in METHODS}:
                raise ValueError(f"{name!r} is not a method (known: {known})")
        return value

    @model_validator(mode="before")
    @classmethod
    def _per_method(cls, raw: Any) -> Any:
        """With several methods, search_space and fixed_params map each method to its own mapping:
        moved to method_spaces / method_fixed, so pydantic checks them with their place named."""
        if not isinstance(raw, dict):
            return raw
        for internal in INTERNAL_FIELDS:
            if internal in raw:
                raise ValueError(f"{internal}: unknown field (write search_space / fixed_params per method)")
        if not isinstance(raw.get("method"), list):
            return raw
        moved = dict(raw)
        moved["method_spaces"] = moved.pop("search_space", {})
        moved["method_fixed"] = moved.pop("fixed_params", {})
        return moved

    # -- the methods of the study and each one's space -------------------------------------------------
    @property
    def methods(self) -> tuple[str, ...]:
        return tuple(self.method) if isinstance(self.method, list) else (self.method,)

    @property
    def several(self) -> bool:
        """Several methods compared in one study: each trial's sampled parameters name its ``method``."""
        return isinstance(self.method, list)

    def space(self, method: str) -> dict[str, Param]:
        return self.method_spaces.get(method, {}) if self.several else self.search_space

    def fixed(self, method: str) -> dict[str, int | None]:
        return self.method_fixed.get(method, {}) if self.several else self.fixed_params

    def where(self, method: str, section: str) -> str:
        """How the file names a method's ``search_space`` or ``fixed_params``."""
        return f"{section}.{method}" if self.several else section

    def entry_for(self, method: str) -> MethodEntry:
        """A method's engine, parameter type and rules (``workers.decoding.methods``)."""
        return METHODS[Method(method)]

    @property
    def needs_drafter(self) -> bool:
        return any(self.entry_for(m).needs_drafter for m in self.methods)

    @property
    def has_knobs(self) -> bool:
        """More than one setting to rank (several methods, or a method with knobs)."""
        return self.several or any(self.entry_for(m).params.KNOBS for m in self.methods)

    # -- a trial's setting ----------------------------------------------------------------------------------
    def method_of(self, sampled: Mapping[str, Any]) -> str:
        """The method of a trial from its sampled parameters (with several methods, its ``method``)."""
        return sampled["method"] if self.several else self.method

    def setting(self, sampled: Mapping[str, Any]) -> dict[str, Any]:
        """A trial's flat setting: the parameters its sampler chose and its method's fixed ones (the one
        place the two are merged); with several methods it keeps its ``method``."""
        return dict(sampled) | dict(self.fixed(self.method_of(sampled)))

    def params_of(self, sampled: Mapping[str, Any], block_size: int | None = None) -> MethodParams:
        """The method's parameter object of a trial's sampled parameters, checked (``MethodEntry.params_from``)."""
        knobs = {k: v for k, v in self.setting(sampled).items() if k != "method"}
        return self.entry_for(self.method_of(sampled)).params_from(knobs, block_size)

    def widest_setting(self, method: str) -> dict[str, Any]:
        """Every knob of ``method`` at its widest value in the space: the largest number, or None where
        None is among the values (None means block_size-1 or unlimited). Verify widths, tree sizes and
        replay needs only grow with each knob, so this setting bounds every trial's of that method."""
        return {name: None if None in values else max(values)
                for name, (_, values) in self.knob_values(method).items()}

    def knob_values(self, method: str) -> dict[str, tuple[str, list[int | None]]]:
        """Knob name -> (where it is set in the file, every value a trial can get), for ``method``'s set knobs."""
        found: dict[str, tuple[str, list[int | None]]] = {}
        space, fixed = self.space(method), self.fixed(method)
        for name in self.entry_for(method).params.knob_names():
            if name in space:
                found[name] = (f"{self.where(method, 'search_space')}.{name}", space[name].values())
            elif name in fixed:
                found[name] = (f"{self.where(method, 'fixed_params')}.{name}", [fixed[name]])
        return found

    @model_validator(mode="after")
    def _cross_field(self) -> SweepConfig:
        _check_parallel(self.workers)
        if len(set(self.methods)) != len(self.methods) or not self.methods:
            raise ValueError(f"method: each method once, at least one (got {list(self.methods)})")
        for section, per_method in (("search_space", self.method_spaces), ("fixed_params", self.method_fixed)):
            stray = sorted(set(per_method) - set(self.methods))
            if stray:
                raise ValueError(f"{section}.{stray[0]}: not one of this study's methods ({', '.join(self.methods)})")
        for method in self.methods:
            allowed = self.entry_for(method).params.knob_names()
            space, fixed = self.space(method), self.fixed(method)
            for section, values in (("search_space", space), ("fixed_params", fixed)):
                for name in values:
                    if name not in allowed:
                        raise ValueError(
                            f"{self.where(method, section)}.{name}: not a parameter of method '{method}' "
                            f"(its parameters: {', '.join(allowed) or 'none'})"
                        )
            both = set(space) & set(fixed)
            if both:
                raise ValueError(f"{self.where(method, 'fixed_params')} and {self.where(method, 'search_space')} "
                                 f"both set {sorted(both)}")
            for knob in self.entry_for(method).params.KNOBS:
                if knob.required and knob.name not in self.knob_values(method):
                    noun = knob.name.replace("_", " ")
                    raise ValueError(f"{self.where(method, 'search_space')}.{knob.name}: method '{method}' needs a "
                                     f"{noun} (swept or fixed)")
        check_knobs(self, None)  # every setting a trial can get must be a valid engine parameter
        if self.needs_drafter and self.drafter is None:
            needing = [m for m in self.methods if self.entry_for(m).needs_drafter]
            raise ValueError(f"drafter: method '{needing[0]}' needs a drafter")
        metrics = [objective.metric for objective in self.objectives]
        if len(set(metrics)) != len(metrics):
            raise ValueError(f"objectives: the same metric twice ({metrics})")
        if self.pruner.type != "none" and len(self.objectives) > 1:
            raise ValueError("pruner.type: pruning needs a single objective "
                             "(Optuna cannot prune multi-objective trials)")
        if self.sampler.predicts:
            where = "sampler.type" if self.sampler.type == "predicted" else "sampler.predict"
            if not self.needs_drafter:
                raise ValueError(f"{where}: predictions are for speculative methods (ddtree, dflash), not "
                                 f"'{self.methods[0]}'")
            if self.sampler.type == "predicted" and ("tokens_per_s", "maximize") not in [
                (o.metric, o.direction) for o in self.objectives
            ]:
                raise ValueError("sampler.type: 'predicted' ranks settings by predicted tokens_per_s; "
                                 "add the objective {metric: tokens_per_s, direction: maximize}")
        if self.sampler.type == "grid":
            for method in self.methods:
                bad = [n for n, p in self.space(method).items() if isinstance(p, IntParam) and p.log]
                if bad:
                    raise ValueError(f"{self.where(method, 'search_space')}.{bad[0]}: a grid sampler takes every "
                                     "step; drop log=true")
        return self

    def fingerprint(self) -> str:
        """Hash of the fields that define what a study measures; a changed one means a new study (a
        one-method file hashes as it always did, so its studies resume)."""
        return hashlib.sha256(json.dumps(self._defining(), sort_keys=True, default=str).encode()).hexdigest()[:16]

    def _defining(self) -> dict[str, Any]:
        def dump(space: dict[str, Param]) -> dict[str, Any]:
            return {k: v.model_dump() for k, v in sorted(space.items())}

        if self.several:
            spaces = {m: dump(self.space(m)) for m in self.methods}
            fixed = {m: dict(sorted(self.fixed(m).items())) for m in self.methods}
        else:
            spaces, fixed = dump(self.search_space), dict(sorted(self.fixed_params.items()))
        return {
            "method": self.method,
            "target": self.target.model,
            "dtype": self.target.dtype,
            "drafter": self.drafter.model if self.drafter else None,
            "search_space": spaces,
            "fixed_params": fixed,
            "objectives": [o.model_dump() for o in self.objectives],
        }

    def defining_summary(self) -> dict[str, Any]:
        defining = self._defining()
        return {key: defining[key] for key in ("method", "target", "drafter", "search_space", "fixed_params")} | {
            "objectives": [f"{o.direction} {o.metric}" for o in self.objectives]}


INTERNAL_FIELDS = ("method_spaces", "method_fixed")


def _check_parallel(workers: WorkersSection) -> None:
    """The combinations of parallel, gpus_per_worker and ranks that make a worker (ValueError naming the field)."""
    if workers.parallel == "layers":
        if workers.ranks is not None:
            raise ValueError("workers.ranks: only for parallel: tensor (parallel is 'layers': one actor per worker)")
        return
    gpus, ranks = workers.gpus_per_worker, workers.ranks
    if gpus == 1:
        raise ValueError("workers.gpus_per_worker: parallel: tensor needs 2 or more GPUs per worker (one rank each), "
                         "got 1")
    if gpus == 0 and ranks is None:
        raise ValueError("workers.ranks: parallel: tensor with gpus_per_worker: 0 runs its ranks on CPU; give their "
                         "number, e.g. ranks: 2")
    if gpus > 1 and ranks not in (None, gpus):
        raise ValueError(f"workers.ranks: parallel: tensor runs one rank per GPU, so ranks ({ranks}) must equal "
                         f"gpus_per_worker ({gpus}) or be left out")


def _absolute_sqlite(url: str, base: Path) -> str:
    """sqlite:///relative.db -> sqlite:////abs/relative.db (other URLs unchanged)."""
    prefix = "sqlite:///"
    if url.startswith(prefix) and not url.startswith(prefix + "/") and url != "sqlite:///:memory:":
        return prefix + str((base / url[len(prefix):]).resolve())
    return url


def database_url(url: str) -> str:
    """A plain ``postgresql://`` URL gets the PostgreSQL driver that is installed.

    SQLAlchemy 2.1 reads a bare ``postgresql://`` as psycopg 3, while the ``postgres`` extra (and
    many machines) have psycopg2; ``postgres://`` (Heroku style) is not accepted by SQLAlchemy at all.
    An explicit ``postgresql+driver://`` is left alone.
    """
    import importlib.util

    for prefix in ("postgresql://", "postgres://"):
        if url.startswith(prefix):
            for driver in ("psycopg", "psycopg2"):
                if importlib.util.find_spec(driver) is not None:
                    return f"postgresql+{driver}://" + url.removeprefix(prefix)
            return "postgresql://" + url.removeprefix(prefix)
    return url


def _absolute_model(name: str, base: Path) -> str:
    """Local folders become absolute; hub ids (org/name that is not a local path) stay as they are."""
    candidate = base / name
    if name.startswith((".", "/", "~")) or candidate.exists():
        return str(Path(name).expanduser() if name.startswith("~") else candidate.resolve())
    return name


def load_sweep(path: str | Path, base: Path | None = None) -> SweepConfig:
    """Read and validate a sweep file; relative paths resolve against ``base`` (default: the cwd)."""
    path = Path(path)
    base = (base or Path.cwd()).resolve()
    try:
        raw = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise BadInputError(f"{path}: cannot read the sweep file ({exc.strerror})") from exc
    except yaml.YAMLError as exc:
        raise BadInputError(f"{path}: {_yaml_error(exc)}") from exc
    if not isinstance(raw, dict):
        raise BadInputError(f"{path}: the sweep file must be a YAML mapping at the top level")
    try:
        config = SweepConfig.model_validate(raw)
    except ValidationError as exc:
        raise BadInputError(f"{path}: {_first_error(exc)}") from exc
    updates: dict[str, Any] = {
        "prompts": config.prompts.model_copy(
            update={"path": (base / config.prompts.path).resolve() if config.prompts.path else None}
        ),
        "target": config.target.model_copy(update={"model": _absolute_model(config.target.model, base)}),
        "storage": database_url(_absolute_sqlite(config.storage, base)),
        "mlflow": config.mlflow.model_copy(
            update={"tracking_uri": database_url(_absolute_sqlite(config.mlflow.tracking_uri, base))}),
    }
    if config.drafter is not None:
        updates["drafter"] = config.drafter.model_copy(update={"model": _absolute_model(config.drafter.model, base)})
    config = config.model_copy(update=updates)
    if config.prompts.path is not None and not config.prompts.path.is_file():
        raise BadInputError(f"{path}: prompts.path: no such file {config.prompts.path}")
    return config


def check_models_available(config: SweepConfig, path: str) -> None:
    """A model folder that is not there, or a hub id missing from the cache when models must come from
    this machine: refused in seconds, before anything is created (not in ``load_sweep``: a report
    of a finished sweep needs no models)."""
    from workers.models.sources import check_model_available

    sections = {"target.model": config.target, "drafter.model": config.drafter}
    for field, section in sections.items():
        if section is None:
            continue
        try:
            check_model_available(section.model, field, section.local_files_only)
        except BadInputError as exc:
            raise BadInputError(f"{path}: {exc}") from None


def _yaml_error(exc: yaml.YAMLError) -> str:
    """'line L, column C: problem' (1-based, as editors count) for a YAML syntax error."""
    mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
    problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
    context = getattr(exc, "context", None)
    where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
    return f"not valid YAML at {where}{problem}" + (f" ({context})" if context else "")


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    """The pydantic models an annotation can hold (through Optional, unions, dicts, Annotated)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [model for arg in get_args(annotation) for model in _models_in(arg)]


def _known_fields(loc: tuple[Any, ...]) -> list[str]:
    """Field names allowed at the place of ``loc``'s last part (dict keys and union tags passed through)."""
    models: list[type[BaseModel]] = [SweepConfig]
    for part in loc[:-1]:
        inner = [m for model in models if part in model.model_fields
                 for m in _models_in(model.model_fields[part].annotation)]
        if inner:
            models = inner
    return sorted({name for model in models for name in model.model_fields} - set(INTERNAL_FIELDS))


def _did_you_mean(name: str, known: list[str]) -> str:
    close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
    return f" (did you mean '{close[0]}'?)" if close else f" (allowed here: {', '.join(known)})"


def _first_error(exc: ValidationError) -> str:
    """pydantic's first error as 'field.path: message' (one line, the field named as in the YAML).

    An unknown key is reported before anything else: a misspelt required field (``n_trails``) is
    both unknown and missing, and the unknown spelling is the one the user can find in the file.
    """
    errors = exc.errors()
    error = next((e for e in errors if e["type"] == "extra_forbidden"), errors[0])
    parts = list(error["loc"])
    # several methods: the per-method mappings are validated as method_spaces / method_fixed
    renamed = {"method_spaces": "search_space", "method_fixed": "fixed_params"}
    if parts and parts[0] in renamed:
        parts[0] = renamed[parts[0]]
    # Drop pydantic's own location parts: the union tag after a search-space entry, and '[key]' markers.
    tag_at = 3 if error["loc"] and error["loc"][0] == "method_spaces" else 2
    if len(parts) > tag_at and parts[0] == "search_space" and parts[tag_at] in ("int", "categorical"):
        del parts[tag_at]
    where = ".".join(str(part) for part in parts if str(part) != "[key]")
    message = error["msg"].removeprefix("Value error, ")
    if error["type"] == "missing":
        message = "missing required field"
    elif error["type"] == "extra_forbidden":
        message = "unknown field" + _did_you_mean(str(error["loc"][-1]), _known_fields(tuple(error["loc"])))
    elif error["type"] == "literal_error":
        message = f"{message} (got {error.get('input')!r})"
    if error["type"] == "union_tag_invalid" or error["type"] == "union_tag_not_found":
        message = "type must be 'int' or 'categorical'"
    return f"{where}: {message}" if where else message


def drafter_spec(config: SweepConfig, source: str):
    """The drafter's ``DrafterSpec`` when its config is on this machine (a folder, the local hub cache,
    or a random:<shape>), every field checked as the worker will check it (BadInputError naming the
    field and the file); None for a hub id not downloaded yet (the worker checks it after fetching)."""
    from workers.models.drafter_config import DrafterSpec
    from workers.models.shapes import drafter_config
    from workers.models.sources import ModelSource, cached_config_file

    if config.drafter is None:
        return None
    name = config.drafter.model
    shape = ModelSource.parse(name).shape
    try:
        if shape is not None:
            try:
                return DrafterSpec.from_dict(drafter_config(shape), source=name)
            except KeyError as exc:
                raise BadInputError(f"drafter {name}: {exc.args[0]}") from None
        config_file = cached_config_file(name)
        return None if config_file is None else DrafterSpec.from_config_file(config_file)
    except BadInputError as exc:
        raise BadInputError(f"{source}: drafter.model: {exc}") from None


def check_knobs(config: SweepConfig, block_size: int | None) -> None:
    """Every value a trial can get, checked by its knob (and against the drafter's block when known);
    ValueError names the field as written in the sweep file."""
    for method in config.methods:
        by_name = {knob.name: knob for knob in config.entry_for(method).params.KNOBS}
        for name, (where, values) in config.knob_values(method).items():
            try:
                by_name[name].check(values, block_size)
            except ValueError as exc:
                raise ValueError(f"{where}: {str(exc).removeprefix(name + ' ')}") from None


def check_against_block(config: SweepConfig, block_size: int | None, source: str) -> None:
    """Depth and chain-length settings must fit the drafter's block (1..block_size-1)."""
    try:
        check_knobs(config, block_size)
    except ValueError as exc:
        raise BadInputError(f"{source}: {exc}") from None


def thinking_warning(config: SweepConfig) -> str | None:
    """A warning when the sweep turns thinking on with a drafter that does not declare it."""
    from workers.models.facts import thinking_warning as warning_for

    return warning_for(config.drafter.model if config.drafter else None, config.prompts.enable_thinking)


# The block of the published DFlash drafters, assumed for a hub drafter not downloaded yet (only the
# prompt-length check reads it; the worker checks again with the drafter's own block)
ASSUMED_BLOCK = 16


def widest_verify(config: SweepConfig, block_size: int | None) -> int:
    """Positions one verify pass can add beyond the committed tokens, for the widest setting swept."""
    block = block_size or ASSUMED_BLOCK
    return max(config.entry_for(m).verify_width(config.entry_for(m).params_from(config.widest_setting(m), block), block)
               for m in config.methods)


def check_models(config: SweepConfig, spec, source: str):
    """The target's facts (None for a hub id not downloaded yet), checked to be a model we run, and the
    drafter's spec against it (hidden size, taps, layers, mask token), before anything is created."""
    from workers.models.facts import target_facts

    try:
        facts = target_facts(config.target.model)
    except BadInputError as exc:
        raise BadInputError(f"{source}: target.model: {exc}") from exc
    if facts is not None and spec is not None:
        try:
            spec.check_fits(facts.config, facts.vocab_rows, f"{source}: drafter.model: {config.drafter.model}")
        except BadInputError as exc:
            raise BadInputError(f"{exc} (target.model {config.target.model})") from None
    return facts


def check_prompts(config: SweepConfig, block_size: int | None, source: str, facts) -> None:
    """Every prompt encoded once against the target, before anything is created (BadInputError
    naming the prompt's file and line). Skipped for a target not on this machine (the worker checks)."""
    from workers.prompts import ChatFormat, load_source
    from workers.prompts import check_prompts as check

    if facts is None:
        return
    prompts = load_source(config.prompts.source())
    chat = ChatFormat(config.prompts.chat_template, config.prompts.enable_thinking)
    new_positions = config.prompts.max_new_tokens + widest_verify(config, block_size)
    try:
        check(prompts, facts.tokenizer, facts.vocab_rows, facts.max_positions, new_positions, chat)
    except BadInputError as exc:
        raise BadInputError(f"{source}: prompts: {exc}") from exc
