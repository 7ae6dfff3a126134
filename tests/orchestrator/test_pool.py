"""orchestrator.pool on a real Ray: GPU isolation, trials on actors, actor death, host pinning.

Everything here is real: Ray with logical GPUs (``ray.init(num_gpus=2)`` works without GPUs),
actors that load the tiny target + drafter through ``workers.worker.Worker``, and a two-node
``ray.cluster_utils.Cluster`` (Ray 2.60 has no ``ray.util.cluster_utils``) for the pinning tests.
``workers.device: cpu`` makes an actor run its models on the CPU even when Ray hands it logical
GPUs, so the GPU bookkeeping is still Ray's own.

Two sections, each with its own Ray: a local Ray with 2 logical GPUs (module-scoped fixture,
shut down at the end of the module or when the cluster section takes over), then a two-node
cluster. Actors are killed after every test so their resources return to the pool.
"""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
import time
from pathlib import Path

import pytest
import ray
from ray.exceptions import ActorDiedError, ActorUnavailableError

from orchestrator.config import SweepConfig
from orchestrator.pool import (
    ACTOR_DEATH,
    GenerationActor,
    Slot,
    actor_options,
    replace_actor,
    start_actor,
    start_pool,
    worker_config,
)
from tests.orchestrator.conftest import sweep_dict
from workers.decoding.methods import Method
from workers.decoding.params import TreeParams
from workers.errors import BadInputError
from workers.prompts import load_prompts
from workers.wire import TrialResult, TrialSpec, TrialStatus

pytestmark = pytest.mark.slow  # real Ray actors loading models

BLOCK_SIZE = 8  # the tiny drafter's block (TinyShape.block_size)
GET_TIMEOUT = 180.0  # seconds for any single ray.get: actors load models on 2 shared cores


# -- helpers -----------------------------------------------------------------------------------------


def make_config(tiny_dir: Path, runs: Path, **workers) -> SweepConfig:
    section = {"count": 1, "gpus_per_worker": 0, "device": "cpu", "resources": {}} | workers
    return SweepConfig.model_validate(sweep_dict(tiny_dir, runs, workers=section))


def ddtree_spec(tiny_dir: Path) -> TrialSpec:
    prompts = load_prompts(tiny_dir / "prompts.jsonl", limit=2)
    assert all(p.input_ids for p in prompts)
    return TrialSpec(TreeParams(8, max_depth=4, branching=2), prompts=tuple(prompts), max_new_tokens=8)


def assert_ok_result(result: TrialResult, spec: TrialSpec) -> None:
    assert isinstance(result, TrialResult)  # typed across the actor boundary
    assert result.status is TrialStatus.OK, result.error
    assert result.error is None
    assert result.method is Method.DDTREE
    assert result.params == {"tree_budget": 8, "max_depth": 4, "branching": 2, "depth_discount": None}
    metrics = result.metrics
    for name in ("tokens_per_s", "tau", "tpot_s", "ttft_s", "speedup", "lossless_match", "peak_memory_gib"):
        assert name in metrics, name
    assert metrics["tokens_per_s"] > 0
    assert metrics["tau"] >= 1.0  # the bonus token counts, so every round commits at least one
    assert metrics["lossless_match"] == 1.0  # greedy DDTree equals the AR baseline
    assert 0 < metrics["generated_tokens"] <= spec.max_new_tokens * len(spec.prompts)
    assert len(result.outputs) == len(spec.prompts)
    assert all(len(o.token_ids) <= spec.max_new_tokens for o in result.outputs)
    assert result.wall_s > 0


def get(ref, timeout: float = GET_TIMEOUT):
    return ray.get(ref, timeout=timeout)


def kill_slots(slots: list[Slot]) -> None:
    for slot in slots:
        try:
            ray.kill(slot.handle, no_restart=True)
        except Exception:  # already gone
            pass


def wait_for_resources(expected: dict[str, float], timeout: float = 60.0) -> None:
    """Killed actors give their resources back asynchronously; wait until the pool is whole."""
    deadline = time.monotonic() + timeout
    while True:
        available = ray.available_resources()
        if all(available.get(key, 0.0) >= value - 1e-6 for key, value in expected.items()):
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"resources not returned: available {available}, expected {expected}")
        time.sleep(0.2)


def info_after_restart(handle, old_pid: int, timeout: float = GET_TIMEOUT) -> dict:
    """Call info() until the restarted actor answers; calls made while Ray notices the death or
    while it restarts the actor may fail with an actor error, which is allowed."""
    deadline = time.monotonic() + timeout
    errors = []
    while time.monotonic() < deadline:
        try:
            info = get(handle.info.remote(), timeout=max(1.0, deadline - time.monotonic()))
        except ActorDiedError as exc:  # final: the restart never came
            raise AssertionError(f"actor died for good instead of restarting (after {errors})") from exc
        except ACTOR_DEATH as exc:  # unavailable / not yet noticed: try again
            errors.append(type(exc).__name__)
            time.sleep(0.2)
            continue
        if info["pid"] != old_pid:
            return info
        time.sleep(0.2)  # the old process has not been noticed dead yet
    raise AssertionError(f"actor did not come back within {timeout}s (errors: {errors})")


def wait_until_dead(handle, timeout: float = 60.0) -> None:
    """With restarts spent, calls must end in the final ActorDiedError."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            info = get(handle.info.remote(), timeout=max(1.0, deadline - time.monotonic()))
        except ActorDiedError:
            return
        except ActorUnavailableError:
            time.sleep(0.2)
            continue
        raise AssertionError(f"a killed actor with no restarts left still answers: {info}")
    raise AssertionError("no ActorDiedError within the timeout")


# -- pure functions (no Ray needed) ------------------------------------------------------------------


def test_actor_options_and_worker_config(tiny_dir, tmp_path):
    cpu = make_config(tiny_dir, tmp_path, gpus_per_worker=0, max_restarts=3, resources={"host_b": 0.01})
    options = actor_options(cpu)
    assert options["num_gpus"] == 0 and options["num_cpus"] == 1
    assert options["resources"] == {"host_b": 0.01}
    assert options["max_restarts"] == 3 and options["max_task_retries"] == 0
    env = options["runtime_env"]["env_vars"]
    assert env["CUDA_VISIBLE_DEVICES"] == "" and env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"

    two = make_config(tiny_dir, tmp_path, gpus_per_worker=2, max_memory_per_gpu="44GiB", device="auto")
    options = actor_options(two)
    assert options["num_gpus"] == 2 and options["resources"] == {}
    assert "CUDA_VISIBLE_DEVICES" not in options["runtime_env"]["env_vars"]  # Ray sets it per actor
    wc = worker_config(two)
    assert wc["gpus"] == 2 and wc["device"] == "cuda" and wc["max_memory_per_gpu"] == "44GiB"
    assert wc["target"] == str(tiny_dir / "target") and wc["drafter"] == str(tiny_dir / "drafter")
    assert wc["dtype"] == "float32" and wc["memory_interval_ms"] == 20

    wc = worker_config(make_config(tiny_dir, tmp_path, gpus_per_worker=0, device="auto"))
    assert wc["device"] == "cpu" and wc["gpus"] == 1
    wc = worker_config(make_config(tiny_dir, tmp_path, gpus_per_worker=1, device="cpu"))
    assert wc["device"] == "cpu"  # an explicit device wins over the GPU count


# -- section 1: one local Ray with 2 logical GPUs ----------------------------------------------------

LOCAL_RESOURCES = {"CPU": 4.0, "GPU": 2.0}


@pytest.fixture(scope="module")
def local_ray():
    if ray.is_initialized():
        ray.shutdown()
    saved = os.environ.pop("RAY_ADDRESS", None)
    # address="local": always a fresh Ray of our own, never someone else's running cluster
    ray.init(address="local", num_cpus=4, num_gpus=2, include_dashboard=False, log_to_driver=False)
    try:
        yield
    finally:
        ray.shutdown()
        if saved is not None:
            os.environ["RAY_ADDRESS"] = saved


@pytest.fixture
def slots(local_ray):
    """Every Slot a test starts goes in here; all are killed afterwards and their resources freed."""
    started: list[Slot] = []
    yield started
    kill_slots(started)
    wait_for_resources(LOCAL_RESOURCES)


@pytest.fixture(scope="module")
def runs_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("pool_runs")


def test_two_one_gpu_actors_get_disjoint_gpus(tiny_dir, runs_dir, slots):
    config = make_config(tiny_dir, runs_dir, count=2, gpus_per_worker=1)
    slots += start_pool(config)
    assert [s.index for s in slots] == [0, 1]
    assert all(s.state == "idle" for s in slots)
    devices = sorted(s.info["cuda_visible_devices"] for s in slots)
    assert devices == ["0", "1"]
    for slot in slots:
        assert slot.info["gpu_ids"] == [slot.info["cuda_visible_devices"]]
        assert slot.info["block_size"] == BLOCK_SIZE
        assert slot.info["load_error"] is None
    assert slots[0].info["pid"] != slots[1].info["pid"]
    assert ray.available_resources().get("GPU", 0.0) == 0.0  # both GPUs are held


def test_two_gpu_actor_gets_both(tiny_dir, runs_dir, slots):
    slots += start_pool(make_config(tiny_dir, runs_dir, count=1, gpus_per_worker=2))
    info = slots[0].info
    assert sorted(info["cuda_visible_devices"].split(",")) == ["0", "1"]
    assert sorted(info["gpu_ids"]) == ["0", "1"]
    assert info["block_size"] == BLOCK_SIZE


def test_zero_gpu_actor_sees_no_gpu(tiny_dir, runs_dir, slots):
    slots += start_pool(make_config(tiny_dir, runs_dir, count=1, gpus_per_worker=0))
    info = slots[0].info
    assert info["cuda_visible_devices"] == ""  # set explicitly: Ray 2.60 leaves it alone
    assert info["gpu_ids"] == []
    assert info["block_size"] == BLOCK_SIZE
    assert info["node_id"] == ray.get_runtime_context().get_node_id()  # one node here
    # it holds no GPU, so both are still free for GPU actors
    assert ray.available_resources().get("GPU", 0.0) == 2.0


def test_trial_runs_on_an_actor(tiny_dir, runs_dir, slots):
    config = make_config(tiny_dir, runs_dir, count=1, gpus_per_worker=1)
    slots += start_pool(config)
    spec = ddtree_spec(tiny_dir)
    remote = get(slots[0].handle.run_trial.remote(spec))
    assert_ok_result(remote, spec)
    # the same models run in this process give the same tokens: the actor ran the real worker
    local = GenerationActor(worker_config(config))
    assert local.info()["pid"] == os.getpid() and local.info()["block_size"] == BLOCK_SIZE
    here = local.run_trial(spec)
    assert_ok_result(here, spec)
    assert [o.token_ids for o in remote.outputs] == [o.token_ids for o in here.outputs]
    # a second trial on the same actor reuses the loaded models (same process)
    again = get(slots[0].handle.run_trial.remote(spec))
    assert again.status is TrialStatus.OK
    assert get(slots[0].handle.info.remote())["pid"] == slots[0].info["pid"]


def test_killed_actor_restarts_then_is_replaced(tiny_dir, runs_dir, slots):
    config = make_config(tiny_dir, runs_dir, count=2, gpus_per_worker=1, max_restarts=1)
    slots += start_pool(config)
    slot, other = slots
    spec = ddtree_spec(tiny_dir)
    first_pid, gpu = slot.info["pid"], slot.info["cuda_visible_devices"]

    # 1st death: Ray restarts the actor, which re-runs __init__ (models reloaded, new process)
    os.kill(first_pid, signal.SIGKILL)
    info = info_after_restart(slot.handle, first_pid)
    assert info["pid"] != first_pid
    assert info["block_size"] == BLOCK_SIZE
    assert info["cuda_visible_devices"] == gpu  # the other actor still holds the other GPU
    assert_ok_result(get(slot.handle.run_trial.remote(spec)), spec)

    # 2nd death: restarts spent, the handle is dead for good
    os.kill(info["pid"], signal.SIGKILL)
    wait_until_dead(slot.handle)
    dead_handle = slot.handle

    replace_actor(config, slot)
    assert slot.handle is not dead_handle
    assert slot.state == "idle"
    assert slot.info["pid"] not in (first_pid, info["pid"])
    assert slot.info["cuda_visible_devices"] == gpu  # the dead actor's GPU was given back
    assert slot.info["block_size"] == BLOCK_SIZE
    assert_ok_result(get(slot.handle.run_trial.remote(spec)), spec)

    # replacing a live actor (e.g. a hung one) kills it first, so its GPU can be reused
    old_handle, old_pid = other.handle, other.info["pid"]
    replace_actor(config, other)
    assert other.info["pid"] != old_pid
    with pytest.raises(ActorDiedError):
        get(old_handle.info.remote())
    assert sorted(s.info["cuda_visible_devices"] for s in slots) == ["0", "1"]


def test_a_model_that_cannot_load_is_one_clear_error(tiny_dir, runs_dir, slots, tmp_path):
    empty = tmp_path / "no_model_here"
    empty.mkdir()
    data = sweep_dict(tiny_dir, runs_dir, workers={"count": 2, "gpus_per_worker": 1, "device": "cpu"})
    data["target"] = {"model": str(empty), "dtype": "float32"}
    with pytest.raises(BadInputError) as caught:
        start_pool(SweepConfig.model_validate(data))
    message = str(caught.value)
    assert message.startswith(f"{empty}: cannot load the target config from this folder")
    assert message.count("cannot load the target config") == 1  # both failed alike: one message
    # both actors were killed, so their GPUs come back (the ``slots`` teardown waits for that too)
    wait_for_resources(LOCAL_RESOURCES)


# -- section 2: a two-node cluster, host pinning by custom resource ----------------------------------


@pytest.fixture(scope="module")
def two_nodes():
    """Head (2 CPUs) + a node with the custom resource ``host_b``; yields (that node's id, all ids).

    The class is ``ray.cluster_utils.Cluster``: Ray 2.60 has no ``ray.util.cluster_utils``.
    Like ``ray start``, the Cluster writes its address to ``<ray temp dir>/ray_current_cluster``,
    where any ``ray.init()`` without an address on this machine would find it and join it; a private
    RAY_TMPDIR (short: socket paths are limited to 107 bytes) keeps other test runs out of it.
    """
    from ray.cluster_utils import Cluster

    if ray.is_initialized():  # the local Ray of section 1: one Ray per driver at a time
        ray.shutdown()
    saved = {key: os.environ.pop(key, None) for key in ("RAY_ADDRESS", "RAY_TMPDIR")}
    temp = tempfile.mkdtemp(prefix="rp", dir="/tmp")
    os.environ["RAY_TMPDIR"] = temp
    cluster = None
    try:
        cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "num_gpus": 0})
        cluster.add_node(num_cpus=2, num_gpus=0, resources={"host_b": 1})
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, log_to_driver=False)
        nodes = [n for n in ray.nodes() if n["Alive"]]
        assert len(nodes) == 2, nodes
        host_b = [n["NodeID"] for n in nodes if n["Resources"].get("host_b", 0) > 0]
        assert len(host_b) == 1, nodes
        yield host_b[0], {n["NodeID"] for n in nodes}
    finally:
        ray.shutdown()
        if cluster is not None:
            cluster.shutdown()
        for key, value in saved.items():
            os.environ.pop(key, None)
            if value is not None:
                os.environ[key] = value
        shutil.rmtree(temp, ignore_errors=True)


def test_resource_pinned_actors_land_on_their_host(tiny_dir, runs_dir, two_nodes):
    host_b, node_ids = two_nodes
    pinned = make_config(tiny_dir, runs_dir, count=2, gpus_per_worker=0, resources={"host_b": 0.01})
    free = make_config(tiny_dir, runs_dir, count=1, gpus_per_worker=0)
    started: list[Slot] = []
    try:
        started += start_pool(pinned)
        for slot in started:
            assert slot.info["node_id"] == host_b
            assert slot.info["cuda_visible_devices"] == ""
            assert slot.info["block_size"] == BLOCK_SIZE
        # the unpinned one may land anywhere (here: the head, since host_b's 2 CPUs are taken)
        [anywhere] = start_pool(free)
        started.append(anywhere)
        assert anywhere.info["node_id"] in node_ids
        assert anywhere.info["node_id"] != host_b
        # a third pinned actor waits for host_b although the head has a free CPU: pinning, not luck
        assert ray.available_resources().get("CPU", 0.0) >= 1.0
        extra = start_actor(pinned)
        started.append(Slot(2, extra))
        ready, _ = ray.wait([extra.info.remote()], timeout=5.0)
        assert not ready
        spec = ddtree_spec(tiny_dir)
        assert_ok_result(get(started[0].handle.run_trial.remote(spec)), spec)
    finally:
        kill_slots(started)
