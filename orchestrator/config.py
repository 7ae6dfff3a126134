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
    def tp_ranks(self) -> int:
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


class CategoricalParam(_Strict):
    type: Literal["categorical"]
    choices: list[int | None] = Field(min_length=1)

    def values(self) -> list[int | None]:
        return list(self.choices)


Param = Annotated[IntParam | CategoricalParam, Field(discriminator="type")]


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


class SweepConfig(_Strict):
    name: str = Field(min_length=1, description="Optuna study name; the same file resumes the same study")
    method: Literal[tuple(m.value for m in METHODS)]  # type: ignore[valid-type]
    target: TargetSection
    drafter: DrafterSection | None = None
    workers: WorkersSection = WorkersSection()
    prompts: PromptsSection
    generation: GenerationSection = GenerationSection()
    search_space: dict[str, Param] = Field(default_factory=dict)
    fixed_params: dict[str, int | None] = Field(default_factory=dict, description="method params not swept")
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

    @property
    def entry(self) -> MethodEntry:
        """This sweep's method: its engine, parameter type and rules (``workers.decoding.methods``)."""
        return METHODS[Method(self.method)]

    @property
    def method_params(self) -> type[MethodParams]:
        """The parameter type of this sweep's method (its knobs: ``KNOBS``)."""
        return self.entry.params

    def setting(self, sampled: Mapping[str, Any]) -> dict[str, Any]:
        """A trial's flat setting: the parameters its sampler chose and the fixed ones (the one place
        the two are merged)."""
        return dict(sampled) | dict(self.fixed_params)

    def params_of(self, sampled: Mapping[str, Any], block_size: int | None = None) -> MethodParams:
        """The method's parameter object of a trial's sampled parameters, checked (``MethodEntry.params_from``)."""
        return self.entry.params_from(self.setting(sampled), block_size)

    def widest_setting(self) -> dict[str, Any]:
        """Every knob at its widest value in the space: the largest number, or None where None is among
        the values (None means block_size-1 or unlimited). Verify widths, tree sizes and replay needs
        only grow with each knob, so this setting bounds every trial's."""
        widest: dict[str, Any] = {}
        for name, (_, values) in self.knob_values().items():
            widest[name] = None if None in values else max(values)
        return widest

    def knob_values(self) -> dict[str, tuple[str, list[int | None]]]:
        """Knob name -> (where it is set in the file, every value a trial can get), for set knobs."""
        found: dict[str, tuple[str, list[int | None]]] = {}
        for name in self.method_params.knob_names():
            if name in self.search_space:
                found[name] = (f"search_space.{name}", self.search_space[name].values())
            elif name in self.fixed_params:
                found[name] = (f"fixed_params.{name}", [self.fixed_params[name]])
        return found

    @model_validator(mode="after")
    def _cross_field(self) -> SweepConfig:
        _check_parallel(self.workers)
        allowed = self.method_params.knob_names()
        for section in ("search_space", "fixed_params"):
            for name in getattr(self, section):
                if name not in allowed:
                    raise ValueError(
                        f"{section}.{name}: not a parameter of method '{self.method}' "
                        f"(its parameters: {', '.join(allowed) or 'none'})"
                    )
        both = set(self.search_space) & set(self.fixed_params)
        if both:
            raise ValueError(f"fixed_params and search_space both set {sorted(both)}")
        check_knobs(self, None)  # every setting a trial can get must be a valid engine parameter
        if self.entry.needs_drafter and self.drafter is None:
            raise ValueError(f"drafter: method '{self.method}' needs a drafter")
        for knob in self.method_params.KNOBS:
            if knob.required and knob.name not in self.knob_values():
                noun = knob.name.replace("_", " ")
                raise ValueError(f"search_space.{knob.name}: method '{self.method}' needs a {noun} (swept or fixed)")
        metrics = [objective.metric for objective in self.objectives]
        if len(set(metrics)) != len(metrics):
            raise ValueError(f"objectives: the same metric twice ({metrics})")
        if self.pruner.type != "none" and len(self.objectives) > 1:
            raise ValueError("pruner.type: pruning needs a single objective "
                             "(Optuna cannot prune multi-objective trials)")
        if self.sampler.predicts:
            where = "sampler.type" if self.sampler.type == "predicted" else "sampler.predict"
            if not self.entry.needs_drafter:
                raise ValueError(f"{where}: predictions are for speculative methods (ddtree, dflash), not "
                                 f"'{self.method}'")
            if self.sampler.type == "predicted" and ("tokens_per_s", "maximize") not in [
                (o.metric, o.direction) for o in self.objectives
            ]:
                raise ValueError("sampler.type: 'predicted' ranks settings by predicted tokens_per_s; "
                                 "add the objective {metric: tokens_per_s, direction: maximize}")
        if self.sampler.type == "grid":
            bad = [n for n, p in self.search_space.items() if isinstance(p, IntParam) and p.log]
            if bad:
                raise ValueError(f"search_space.{bad[0]}: a grid sampler takes every step; drop log=true")
        return self

    def fingerprint(self) -> str:
        """Hash of the fields that define what a study measures; a changed one means a new study."""
        defining = {
            "method": self.method,
            "target": self.target.model,
            "dtype": self.target.dtype,
            "drafter": self.drafter.model if self.drafter else None,
            "search_space": {k: v.model_dump() for k, v in sorted(self.search_space.items())},
            "fixed_params": dict(sorted(self.fixed_params.items())),
            "objectives": [o.model_dump() for o in self.objectives],
        }
        return hashlib.sha256(json.dumps(defining, sort_keys=True, default=str).encode()).hexdigest()[:16]

    def defining_summary(self) -> dict[str, Any]:
        return {
            "method": self.method,
            "target": self.target.model,
            "drafter": self.drafter.model if self.drafter else None,
            "search_space": {k: v.model_dump() for k, v in self.search_space.items()},
            "fixed_params": self.fixed_params,
            "objectives": [f"{o.direction} {o.metric}" for o in self.objectives],
        }


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
    return sorted({name for model in models for name in model.model_fields})


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
    # Drop pydantic's own location parts: the union tag after a search-space entry, and '[key]' markers.
    if len(parts) >= 3 and parts[0] == "search_space" and parts[2] in ("int", "categorical"):
        del parts[2]
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
    by_name = {knob.name: knob for knob in config.method_params.KNOBS}
    for name, (where, values) in config.knob_values().items():
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
    from workers.models.loading import thinking_warning as warning_for

    return warning_for(config.drafter.model if config.drafter else None, config.prompts.enable_thinking)


# The block of the published DFlash drafters, assumed for a hub drafter not downloaded yet (only the
# prompt-length check reads it; the worker checks again with the drafter's own block)
ASSUMED_BLOCK = 16


def widest_verify(config: SweepConfig, block_size: int | None) -> int:
    """Positions one verify pass can add beyond the committed tokens, for the widest setting swept."""
    block = block_size or ASSUMED_BLOCK
    return config.entry.verify_width(config.entry.params_from(config.widest_setting(), block), block)


def check_models(config: SweepConfig, spec, source: str):
    """The target's facts (None for a hub id not downloaded yet), checked to be a model we run, and the
    drafter's spec against it (hidden size, taps, layers, mask token), before anything is created."""
    from workers.models.loading import target_facts

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
