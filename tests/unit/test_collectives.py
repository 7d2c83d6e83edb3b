"""trinity.distributed.collectives: the only place trinity calls torch.distributed's collectives.

NCCL refuses host tensors and gloo accepts them, so a metric all-reduced straight over the data-parallel
group passed every CPU test and crashed every RL recipe at DP=2 on GPUs. These tests keep that class of
bug out: a scan of the package for direct calls, the strict guard that the suite runs under (a direct
call raises on gloo too), and the helpers' results on a gloo group of two ranks.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from pathlib import Path

import pytest
import torch

from tests.conftest import REPO, run_two_ranks
from trinity.distributed import collectives

PACKAGE = REPO / "trinity"
HELPERS = PACKAGE / "distributed" / "collectives.py"
DIST_MODULES = {"torch.distributed", "torch.distributed.distributed_c10d"}


def _direct_calls(path: Path) -> list[str]:
    """`file:line name` of every torch.distributed collective that `path` calls or imports by name."""
    tree = ast.parse(path.read_text(), filename=str(path))
    aliases = set(DIST_MODULES)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            aliases |= {a.asname for a in node.names if a.name in DIST_MODULES and a.asname}
        elif isinstance(node, ast.ImportFrom) and node.module:
            for a in node.names:
                full = f"{node.module}.{a.name}"
                if full in DIST_MODULES:
                    aliases.add(a.asname or a.name)
                elif node.module in DIST_MODULES and a.name in collectives.COLLECTIVES:
                    found.append(f"{path}:{node.lineno} imports {a.name}")
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in collectives.COLLECTIVES:
            if ast.unparse(node.func.value) in aliases:
                found.append(f"{path}:{node.lineno} {ast.unparse(node.func)}")
    return found


def test_no_collective_outside_the_helpers():
    found = [hit for path in sorted(PACKAGE.rglob("*.py")) if path != HELPERS for hit in _direct_calls(path)]
    assert not found, "call trinity.distributed.collectives instead:\n" + "\n".join(found)


def test_the_scan_finds_each_spelling(tmp_path):
    """The scan is not vacuous: each way of reaching a collective is found, a helper call is not."""
    src = tmp_path / "mod.py"
    src.write_text(textwrap.dedent("""
        import torch
        import torch.distributed as dist
        import torch.distributed as tdist
        from torch import distributed as d2
        from torch.distributed import broadcast
        from trinity.distributed import collectives
        torch.distributed.all_reduce(x)
        dist.all_gather_object(a, b)
        tdist.barrier()
        d2.send(t, 1)
        torch.distributed.distributed_c10d.recv(t, 0)
        collectives.all_reduce(x)
        dist.get_rank()
    """))
    hits = [h.split(" ", 1)[1] for h in _direct_calls(src)]
    assert hits == ["imports broadcast", "torch.distributed.all_reduce", "dist.all_gather_object", "tdist.barrier",
                    "d2.send", "torch.distributed.distributed_c10d.recv"]


# --- today's bug, put back: the update's metric reduce of rl_update before it used the helpers ---------

_OLD_REDUCE = '''
def _reduce(records, grad_norms, prefix):
    dp, group = _dp()
    keys = sorted({k for r in records for k in r})
    sums = torch.tensor([sum(float(r[k]) for r in records if k in r) for k in keys], dtype=torch.float64)
    counts = torch.tensor([sum(1 for r in records if k in r) for k in keys], dtype=torch.float64)
    if dp > 1:
        torch.distributed.all_reduce(sums, group=group)
        torch.distributed.all_reduce(counts, group=group)
    return {k: float(s) for k, s in zip(keys, sums.tolist())}
'''


def _dp2_worker(rank: int, port: int, out: str) -> None:
    import json
    import os

    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    from trinity.distributed.layout import ParallelLayout
    from trinity.distributed.parallel import destroy, init_parallel
    from trinity.trainer.recipes import rl_update

    init_parallel(device="cpu", layout=ParallelLayout(), seed=1)  # DP=2; installs the strict guard
    try:
        res: dict = {}
        records = [{"actor/pg_loss": 1.0 + rank, "actor/clipfrac": 0.1 * (rank + 1)}]
        res["new"] = rl_update._reduce(records, [0.5], "actor")
        namespace = dict(vars(rl_update))  # the old code, compiled as rl_update's own
        exec(compile(_OLD_REDUCE, inspect.getfile(rl_update), "exec"), namespace)
        try:
            namespace["_reduce"](records, [0.5], "actor")
            res["old"] = "passed"
        except collectives.StrictCollectiveError as exc:
            res["old"] = str(exc)
        x = torch.tensor([float(rank + 1)])
        res["all_reduce"] = [collectives.all_reduce(x).item(), x.item()]
        res["max"] = collectives.all_reduce_floats([rank, -rank], "max")
        res["objects"] = collectives.all_gather_object({"r": rank})
        res["bcast"] = collectives.broadcast_object(f"from {rank}", src=1)
        res["gather"] = collectives.gather_object(rank * 10, dst=0)
        res["bcast_t"] = collectives.broadcast(torch.full((2,), float(rank)), src=1).tolist()
        res["parts"] = [p.tolist() for p in collectives.all_gather(torch.tensor([rank, rank + 1]))]
        Path(out, f"rank{rank}.json").write_text(json.dumps(res))
    finally:
        destroy()


@pytest.mark.multiproc
def test_strict_mode_catches_the_direct_reduce_and_the_helpers_reduce(tmp_path, monkeypatch):
    import json

    monkeypatch.setenv(collectives.STRICT_ENV, "1")
    run_two_ranks(_dp2_worker, str(tmp_path))
    for rank in range(2):
        res = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert "calls torch.distributed.all_reduce directly" in res["old"], res["old"]
        assert "trinity.trainer.recipes.rl_update" in res["old"]
        # losses: summed over DP ranks then divided by DP; other metrics: the mean over micro batches
        assert res["new"] == pytest.approx({"actor/pg_loss": 1.5, "actor/clipfrac": 0.15, "actor/grad_norm": 0.5})
        assert res["all_reduce"] == [3.0, rank + 1.0]  # the sum, and the input untouched
        assert res["max"] == [1.0, 0.0]
        assert res["objects"] == [{"r": 0}, {"r": 1}]
        assert res["bcast"] == "from 1"
        assert res["gather"] == ([0, 10] if rank == 0 else None)
        assert res["bcast_t"] == [1.0, 1.0]
        assert res["parts"] == [[0, 1], [1, 2]]


@pytest.fixture(scope="module")
def gloo_world():
    """A gloo process group of one rank (megatron's parallel state up, TP=PP=DP=1)."""
    from trinity.distributed.layout import ParallelLayout
    from trinity.distributed.parallel import destroy, init_parallel

    init_parallel(device="cpu", layout=ParallelLayout(), seed=1)
    yield
    destroy()


def test_helpers_in_a_world_of_one_are_the_identity_and_never_write_the_input():
    x = torch.tensor([2.0, 3.0])
    y = collectives.all_reduce(x)
    assert torch.equal(y, x) and y.data_ptr() != x.data_ptr()
    assert collectives.all_reduce_floats([1, 2.5]) == [1.0, 2.5]
    assert collectives.all_gather_object("a") == ["a"]
    assert collectives.broadcast_object({"k": 1}, src=0) == {"k": 1}
    assert collectives.group_device() == torch.device("cpu")


def test_the_guard_lets_non_trinity_callers_through_and_stops_trinity_ones(gloo_world):
    """In one process with a gloo world of one: torch's own call passes, the same call compiled as a trinity
    module's raises; the helper's call passes."""
    collectives.install_strict_guard()
    torch.distributed.all_reduce(torch.ones(1))  # this test module is not trinity
    code = compile("torch.distributed.all_reduce(torch.ones(1))", "<trinity>", "exec")
    with pytest.raises(collectives.StrictCollectiveError, match="trinity.somewhere calls torch.distributed.all_reduce"):
        exec(code, {"__name__": "trinity.somewhere", "torch": torch})
    assert collectives.all_reduce(torch.ones(1)).item() == 1.0


def test_in_place_helpers_refuse_a_host_tensor_for_a_gpu_backend(monkeypatch, gloo_world):
    """The hot-path helpers do not move tensors: a host tensor for a backend that needs a GPU one is a
    clear error, not NCCL's "No backend type associated with device type cpu"."""
    monkeypatch.setattr(collectives, "group_device", lambda group=None: torch.device("cuda", 0))
    monkeypatch.setattr(collectives, "size", lambda group=None: 2)
    with pytest.raises(ValueError, match="a cpu tensor sent over a gloo group, which needs cuda tensors"):
        collectives.all_reduce_(torch.ones(1))
