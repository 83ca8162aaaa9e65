"""Parameter server (parallel.dp_mode = "ps"): BSP equal to all-reduce data parallelism and one process
(co-located and dedicated servers), ASP/SSP staleness within the bound and loss near BSP, bytes
through each server equal to the formula, a dead server named, bad fields refused."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from torch.testing import assert_close

from loom import config as C
from tests.dist import ROOT, RankFailure, get_mesh, rank_device
from tests.helpers import (
    ADAM_FP32_TOL,
    global_batch,
    one_thread,  # noqa: F401 (fixture)
    rank_micro_batches,
    tiny_model,
    tiny_train,
    train_dp,
    train_layout,
)

pytestmark = pytest.mark.usefixtures("one_thread")
BATCH = 8
TOL = ADAM_FP32_TOL
# ASP/SSP: loss after 20 worker steps within 0.6 nats of BSP's. Measured (BSP 4.85 -> 3.81, worker 0
# +100 ms per step): ssp:0 3.33, ssp:1 3.36, asp 3.59 (staleness 18): each push is an update, so they
# take W times more (smaller) steps and end lower here; staleness costs them progress.
ASYNC_MARGIN = 0.6


@pytest.fixture(scope="module")
def reference():
    return train_dp(None, tiny_model(), tiny_train(steps=8), BATCH, micro=BATCH)


def _phi_k(shards: int) -> int:
    from loom.model.llama import build_model, count_params
    from loom.parallel.layout import padded_numel

    return padded_numel(count_params(build_model(tiny_model(), 0)), shards, 4) // shards


# ------------------------------------------------------------------ co-located servers (through build_run)
def _colocated(world: int, shards: int, steps: int):
    out = train_layout(
        {"dp_replicate": world, "dp_mode": "ps", "ps_shards": shards}, steps, BATCH, BATCH // world // 2
    )
    sync = train_dp(
        get_mesh(dp_replicate=world), tiny_model(), tiny_train(steps=steps), BATCH, BATCH // world
    )
    out["dp_state"], out["dp_losses"] = sync["state"], sync["losses"]
    return out


@pytest.mark.parametrize("world,shards", [(2, 1), (2, 2), (4, 2), (4, 4)])
def test_colocated_bsp_equals_allreduce_and_one_process(pools, reference, world, shards):
    results = pools(world).run(_colocated, world, shards, 8)
    phi_k = _phi_k(shards)
    for rank, r in enumerate(results):
        for ref_losses, ref_state in (
            (reference["losses"], reference["state"]),
            (r["dp_losses"], r["dp_state"]),
        ):
            assert_close(torch.tensor(r["losses"]), torch.tensor(ref_losses), **TOL)
            for k, v in ref_state.items():
                assert_close(r["state"][k], v, **TOL, msg=lambda m, k=k: f"{k}: {m}")
        # bytes sent by this rank per step: its pushes to the other servers, and as server k its pulls
        server = rank < shards
        sent = (shards - server) * phi_k * 4 + server * (world - 1) * phi_k * 4
        assert [m.get("send", 0) for m in r["moved"]] == [sent] * 8
        assert r["state_bytes"]["optim_bytes"] == (8 * phi_k if server else 0)


def _server_bytes(world: int, shards: int):
    from loom.model.llama import build_model, loss_fn
    from loom.parallel.ps.strategy import ColocatedParamServer
    from loom.train.schedule import lr_at
    from loom.train.step import plain_run, train_step

    mesh, cfg = get_mesh(dp_replicate=world), tiny_train(steps=3)
    model = build_model(tiny_model(), cfg.seed)
    ps = ColocatedParamServer(model, mesh.group("dp"), shards, cfg)
    counted = []
    for step in range(cfg.steps):
        micro = rank_micro_batches(step, BATCH, BATCH // world, mesh.local_rank("dp"), world)
        train_step(plain_run(model, ps, loss_fn), micro, cfg.grad_clip, lr_at(step, cfg), mesh.group("dp"))
        counted.append(ps.server_bytes)
    return counted


def test_colocated_bytes_per_server_equal_formula(pools):
    """Server k: W-1 pushes in, W-1 pulls out of Φ_k fp32 each (its own worker's share stays in process)."""
    world, shards = 4, 2
    phi_k = _phi_k(shards)
    for rank, counted in enumerate(pools(world).run(_server_bytes, world, shards)):
        assert counted == [2 * (world - 1) * phi_k * 4 if rank < shards else 0] * 3


def _load_into_ps(path: str, shards: int):
    """A fresh co-located parameter server reads the checkpoint at ``path``: its parameters and moments."""
    from loom.checkpoint import CheckpointReader
    from loom.model.llama import build_model
    from loom.parallel.ps.strategy import ColocatedParamServer

    mesh = get_mesh(dp_replicate=2)
    model = build_model(tiny_model(), 0)  # another seed: every value must come from the checkpoint
    ps = ColocatedParamServer(model, mesh.group("dp"), shards, tiny_train())
    with CheckpointReader(path) as reader:
        ps.load_sharded(reader)
    opt = ps.optimizer
    return {
        "state": ps.full_state_dict(),
        "moments": None if opt is None else (opt.exp_avgs[0].clone(), opt.step_count),
        "range": (ps.model.layout.start, ps.model.layout.end),
    }


def test_checkpoint_is_layout_independent(pools, tmp_path):
    """Saved under ps (W=2, K=2) it reads back as the all-reduce run's checkpoint, name for name; an
    all-reduce checkpoint resumes under ps (parameters on every worker, moments on each server)."""
    from loom.checkpoint import CheckpointReader
    from loom.model.llama import build_model
    from loom.parallel.ps.strategy import FlatModel

    ps_dir, dp_dir = tmp_path / "ps", tmp_path / "dp"
    pools(2).run(
        train_layout,
        {"dp_replicate": 2, "dp_mode": "ps", "ps_shards": 2},
        3,
        BATCH,
        2,
        checkpoint_dir=str(ps_dir),
    )
    pools(2).run(train_layout, {"dp_replicate": 2}, 3, BATCH, 2, checkpoint_dir=str(dp_dir))
    with CheckpointReader(ps_dir) as ps, CheckpointReader(dp_dir) as dp:
        assert ps.names() == dp.names() and any(n.endswith(".exp_avg_sq") for n in ps.names())
        for name in dp.names():
            assert_close(ps.read(name), dp.read(name), **TOL, msg=lambda m, n=name: f"{n}: {m}")
        expected = {n.removeprefix("model."): dp.read(n) for n in dp.names() if n.startswith("model.")}
        flat = FlatModel(build_model(tiny_model(), 0), 2)  # the flat exp_avg the servers should hold
        moments = {
            n.removeprefix("optim.").removesuffix(".exp_avg"): dp.read(n)
            for n in dp.names()
            if n.endswith(".exp_avg")
        }
        names = {id(p): n for n, p in flat.module.named_parameters()}
        want = torch.cat([moments[names[id(p)]].flatten() for p in flat.params])
    for r in pools(2).run(_load_into_ps, str(dp_dir), 2):
        for k, v in expected.items():
            assert torch.equal(r["state"][k], v), k
        m, step = r["moments"]
        lo, hi = r["range"]
        assert step == 3 and torch.equal(m[: min(hi, want.numel()) - lo], want[lo:hi])


# ------------------------------------------------------------------ dedicated servers
_LINKS: dict = {}


def _links(workers: int, shards: int):
    from loom.parallel.ps.links import make_links

    if (workers, shards) not in _LINKS:
        _LINKS[(workers, shards)] = make_links(workers, shards)
    return _LINKS[(workers, shards)]


def _dedicated(
    workers: int,
    shards: int,
    sync: str,
    steps: int,
    slow_s: float = 0.0,
    timeout_s: float = 60.0,
    die: int = -1,
    fixed: bool = False,
):
    """Ranks < W train (worker w: rows w of W of each global batch); ranks >= W serve. ``slow_s``: worker 0
    sleeps so long per step (the others run ahead). ``die``: that server exits at once (a dead server).
    ``fixed``: every step trains on the global batch of step 0 (a task the model can learn)."""
    import os
    import time

    from loom.comm import CommMeter
    from loom.model.llama import build_model, loss_fn
    from loom.parallel.ps.server import ParameterServer
    from loom.parallel.ps.strategy import PSWorker
    from loom.rules import parse_ps_sync
    from loom.train.schedule import lr_at
    from loom.train.step import plain_run, train_step

    links = _links(workers, shards)
    cfg = tiny_train(steps=steps)
    dev = rank_device()  # the CPU in gloo pools, this rank's GPU in tests/test_gpu.py's NCCL pools
    model = build_model(tiny_model(), cfg.seed, dev)
    bound = "bsp" if sync == "bsp" else parse_ps_sync(sync)
    meter = CommMeter()
    if links.is_server:
        if links.server_index == die:
            os._exit(3)
        report = ParameterServer(model, links, bound, cfg, meter, timeout_s).serve()
        return {
            "server": report.index,
            "staleness": report.staleness,
            "missed": report.missed,
            "bytes_in": report.bytes_in,
            "bytes_out": report.bytes_out,
            "rounds": report.rounds,
            "waits": report.waits,
            "shard": report.state["shard"].cpu(),
            "meter": dict(meter.moved),
        }
    w = links.rank
    worker = PSWorker(model, links, bound, meter, timeout_s)
    losses, sent = [], []
    for step in range(steps):
        if w == 0 and slow_s:
            time.sleep(slow_s)
        meter.reset()
        micro = rank_micro_batches(0 if fixed else step, BATCH, BATCH // workers, w, workers)
        micro = [tuple(t.to(dev) for t in b) for b in micro]
        group = links.worker_group if sync == "bsp" else None
        losses.append(
            train_step(plain_run(model, worker, loss_fn), micro, cfg.grad_clip, lr_at(step, cfg), group).loss
        )
        sent.append(meter.moved.get("send", 0))
    worker.close()
    return {
        "worker": w,
        "losses": losses,
        "state": {k: v.cpu() for k, v in worker.full_state_dict().items()},
        "sent": sent,
        "versions": worker.versions,
    }


def _assemble(results: list, workers: int) -> dict[str, torch.Tensor]:
    """The model of the servers' final shards (the truth under asp/ssp, where workers pulled at different times)."""
    from loom.model.llama import build_model
    from loom.parallel.ps.strategy import FlatModel

    model = build_model(tiny_model(), 0)
    flat = FlatModel(model, len(results) - workers)
    flat.flat.copy_(torch.cat([r["shard"] for r in results[workers:]]))
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _batch_loss(state: dict[str, torch.Tensor]) -> float:
    """The loss of ``state`` on the global batch of step 0 (the one ``fixed`` runs learn)."""
    from loom.model.llama import build_model, loss_fn

    model = build_model(tiny_model(), 0)
    model.load_state_dict(state)
    x, y = global_batch(0, BATCH)
    with torch.no_grad():
        return float(loss_fn(model(x), y))


def test_dedicated_bsp_equals_one_process_and_bytes(pools, reference):
    workers, shards = 2, 2
    results = pools(4).run(_dedicated, workers, shards, "bsp", 8)
    phi_k = _phi_k(shards)
    for r in results[:workers]:
        assert_close(torch.tensor(r["losses"]), torch.tensor(reference["losses"]), **TOL)
        for k, v in reference["state"].items():
            assert_close(r["state"][k], v, **TOL, msg=lambda m, k=k: f"{k}: {m}")
        assert r["sent"] == [shards * phi_k * 4] * 8  # a worker pushes Φ' = K·Φ_k fp32 per step
    for k, v in _assemble(results, workers).items():
        assert_close(v, reference["state"][k], **TOL)
    for r in results[workers:]:  # through each server per step: W pushes in, W pulls out: 2·W·Φ_k·b
        assert r["rounds"] == 8
        assert r["bytes_in"] + r["bytes_out"] == 8 * 2 * workers * phi_k * 4
        assert r["meter"]["send"] == 8 * workers * phi_k * 4
        assert max(r["staleness"]) == 0


@pytest.fixture(scope="module")
def bsp_fixed(pools):
    """BSP on dedicated servers, 20 steps of the step-0 batch: its loss there, and the loss at the start."""
    results = pools(4).run(_dedicated, 2, 2, "bsp", 20, 0.0, 60.0, -1, True)
    return _batch_loss(_assemble(results, 2)), results[0]["losses"][0]


@pytest.mark.parametrize("sync,bound", [("ssp:1", 1), ("ssp:0", 0), ("asp", None)])
def test_async_staleness_bound_and_loss_near_bsp(pools, bsp_fixed, sync, bound):
    """Worker 0 sleeps 100 ms per step (longer than a step on a loaded machine), so worker 1 runs ahead:
    ssp:S holds it at S clocks, asp never. Loss after 20 worker steps on a learnable batch: within
    ASYNC_MARGIN of BSP's, and learning."""
    workers, steps = 2, 20
    results = pools(4).run(_dedicated, workers, 2, sync, steps, 0.1, 60.0, -1, True)
    seen = [s for r in results[workers:] for s in r["staleness"]]
    assert len(seen) == 2 * workers * steps and min(seen) >= 0  # every push applied once, per server
    missed = [m for r in results[workers:] for m in r["missed"]]
    if bound is not None:
        assert max(seen) <= bound, f"{sync}: staleness {max(seen)} above the bound"
        assert max(missed) <= (workers - 1) * (2 * bound + 1)
        assert sum(r["waits"] for r in results[workers:]) > 0  # the fast worker was held
    else:
        assert max(seen) > 1, "asp: the fast worker should have run ahead of the slow one"
    for r in results[workers:]:
        assert r["rounds"] == steps
        assert r["bytes_in"] + r["bytes_out"] == steps * 2 * workers * _phi_k(2) * 4
    bsp, start = bsp_fixed
    got = _batch_loss(_assemble(results, workers))
    assert abs(got - bsp) <= ASYNC_MARGIN, f"{sync}: loss {got:.4f} vs bsp {bsp:.4f}"
    assert got < start - 0.5, f"{sync}: loss {got:.4f} from {start:.4f}: not learning"


def test_dead_server_is_named(pools):
    with pytest.raises(RankFailure, match=r"parameter server 1 \(rank 3\) did not answer"):
        pools(4).run(_dedicated, 2, 2, "bsp", 2, 0.0, 5.0, 1, timeout=60)


# ------------------------------------------------------------------ bad input
@pytest.mark.parametrize(
    "overrides,field",
    [
        (["--parallel.ps_sync", "ssp:-1"], "parallel.ps_sync: the staleness bound"),
        (["--parallel.ps_sync", "ssp"], "parallel.ps_sync: must be"),
        (["--parallel.ps_shards", "3"], "parallel.ps_shards: 3 co-located servers"),
        (["--parallel.ps_shards", "10000000"], "parallel.ps_shards: 10000000 servers need 4 parameters"),
        (["--parallel.zero", "1"], "parallel.zero: the parameter server"),
        (["--parallel.tp", "2"], "parallel.tp: the parameter server"),
        (["--train.precision", "bf16"], "train.precision: the parameter server"),
        (["--parallel.ps_sync", "asp"], "parallel.ps_sync: 'asp' needs dedicated server ranks"),
        (["--parallel.reduce_dtype", "bf16"], "parallel.reduce_dtype: 'bf16' is an option of the gradient"),
        (["--parallel.allreduce", "ring"], "parallel.allreduce: 'ring' is an option of the gradient"),
    ],
)
def test_bad_fields_refused_in_one_line(overrides, field):
    cfg = C.load(None, ["--parallel.dp_mode", "ps", *overrides])
    with pytest.raises(C.ConfigError) as e:
        C.validate(cfg, 2)
    assert str(e.value).startswith(field) and "\n" not in str(e.value)


DEBUG_CONFIG = str(Path(__file__).resolve().parent.parent / "configs" / "debug.toml")
DEDICATED = ["--parallel.dp_mode", "ps", "--parallel.ps_colocate", "false"]


@pytest.mark.parametrize(
    "nproc,overrides,field",
    [
        (
            2,
            ["--parallel.ps_shards", "2"],
            "run.nproc: 2 ranks cannot hold parallel.ps_shards = 2 dedicated servers",
        ),
        (
            4,
            ["--parallel.dp", "2"],
            "run.nproc: 4 ranks, but parallel.dp + parallel.ps_shards = 2 workers + 1",
        ),
        (
            3,
            ["--parallel.dp", "3", "--parallel.ps_shards", "2"],
            "run.nproc: 3 ranks, but parallel.dp + parallel.ps_shards",
        ),
        (3, ["--train.time_limit_s", "60"], "train.time_limit_s: dedicated parameter servers"),
        (3, ["--finetune.method", "lora"], "finetune.method: lora with dedicated parameter servers"),
        (3, ["--parallel.tp", "2"], "parallel.tp: the parameter server"),
    ],
)
def test_dedicated_rank_count_refused_in_one_line(nproc, overrides, field):
    """run.nproc = parallel.dp workers + parallel.ps_shards servers, checked before any process starts."""
    from loom.launch import LaunchOptions

    cfg = C.load(DEBUG_CONFIG, [*DEDICATED, "--run.nproc", str(nproc), *overrides])
    assert LaunchOptions().world(cfg) == nproc  # the CLI validates the world run.nproc asks for
    with pytest.raises(C.ConfigError) as e:
        C.validate(cfg, nproc)
    assert str(e.value).startswith(field) and "\n" not in str(e.value)


def test_dedicated_rank_count_rule():
    """3 ranks, 1 server: dp follows as 2 workers (data sharded over them), and the world is 3."""
    cfg = C.validate(C.load(DEBUG_CONFIG, [*DEDICATED, "--run.nproc", "3"]), 3)
    assert (cfg.parallel.dp, C.ps_servers(cfg), C.world_size_of(cfg)) == (2, 1, 3)


# ------------------------------------------------------------------ dedicated servers under loom train
CLI_STEPS = [
    "--train.steps",
    "4",
    "--train.log_every",
    "1",
    "--train.eval_every",
    "2",
    "--data.max_corpus_mb",
    "0.3",
]


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> str:
    """The debug corpus, prepared once (in a private cache) for every run of this section."""
    import os

    from loom.data import prepare_data

    os.environ.setdefault("LOOM_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
    return str(prepare_data(C.load(DEBUG_CONFIG, CLI_STEPS).data, progress=False).dir)


def _train_rank(overrides: list[str], slow_s: float = 0.0) -> list[dict]:
    """``loom train``'s rank in a pool: a dedicated server rank serves, the others run the Trainer; rank 0's
    metrics rows. ``slow_s``: rank 0 sleeps so long before each update (a straggler)."""
    import json
    import time

    import torch.distributed as dist

    from loom import comm
    from loom.train.ps_run import serve
    from loom.train.trainer import RankEnv, Trainer

    world, rank = dist.get_world_size(), dist.get_rank()
    cfg, env = C.load(DEBUG_CONFIG, overrides), RankEnv(rank, world, rank, world)
    try:
        if rank >= world - C.ps_servers(cfg):
            serve(cfg, env)
        else:
            trainer = Trainer(cfg, env)
            if rank == 0 and slow_s:
                update = trainer.run.strategy.step
                trainer.run.strategy.step = lambda lr, scale=1.0: (time.sleep(slow_s), update(lr, scale))[1]  # type: ignore[method-assign]
            try:
                trainer.fit()
            finally:
                trainer.heartbeat.close()
    finally:
        comm.take_order_log()  # strict mode: servers and workers do not compare orders at step ends
    return (
        [json.loads(x) for x in (Path(cfg.run.dir) / "metrics.jsonl").read_text().splitlines()]
        if rank == 0
        else []
    )


def _checkpoint(run_dir: Path) -> dict[str, torch.Tensor]:
    from loom.checkpoint import CheckpointReader

    with CheckpointReader(run_dir / "checkpoints" / "step-00000004") as r:  # the training state, name
        # for name; each rank's RNG (train.rng.rank-<r>) is per rank: a dedicated server is a rank more
        return {n: r.read(n) for n in r.names() if not n.startswith("train.rng.")}


def test_train_cli_dedicated_bsp_equals_allreduce(pools, prepared, tmp_path):
    """``loom train`` with 2 workers + 1 dedicated server (bsp) logs the losses of all-reduce dp=2, and
    its final checkpoint is dp's, name for name (parameters and AdamW moments): it resumes under any layout."""
    import json
    import subprocess
    import sys

    common = [*CLI_STEPS, "--data.prepared_dir", prepared]
    run = tmp_path / "ps"
    cmd = [
        sys.executable,
        "-m",
        "loom",
        "train",
        DEBUG_CONFIG,
        "--nproc",
        "3",
        *DEDICATED,
        "--run.dir",
        str(run),
        *common,
    ]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    dp = pools(2).run(_train_rank, [*common, "--run.dir", str(tmp_path / "dp")])[0]
    for key in ("loss", "grad_norm", "eval_loss"):
        assert_close(
            torch.tensor([r.get(key, 0.0) for r in rows]), torch.tensor([r.get(key, 0.0) for r in dp]), **TOL
        )
    assert [r["ps_staleness_max"] for r in rows] == [0] * 4
    ps, ref = _checkpoint(run), _checkpoint(tmp_path / "dp")
    assert sorted(ps) == sorted(ref) and any(n.endswith(".exp_avg_sq") for n in ps)
    for name, v in ref.items():
        assert_close(ps[name], v, **TOL, msg=lambda m, n=name: f"{n}: {m}")
    report = json.loads((run / "ps_server0.json").read_text())
    assert (report["rounds"], report["pushes"], report["max_staleness"]) == (4, 8, 0)


def test_train_dedicated_ssp_reports_staleness_within_bound(pools, prepared, tmp_path):
    """2 workers + 2 servers under ssp:1 train through the Trainer (a periodic checkpoint pauses the servers),
    rank 0 a straggler (+0.3 s per step), so rank 1 runs ahead until held: every server's recorded staleness
    reaches the bound and stays within it, and rank 0's metrics rows say so."""
    import json

    run = tmp_path / "ssp"
    rows = pools(4).run(
        _train_rank,
        [
            *CLI_STEPS,
            *DEDICATED,
            "--parallel.ps_shards",
            "2",
            "--parallel.ps_sync",
            "ssp:1",
            "--train.checkpoint_every",
            "2",
            "--data.prepared_dir",
            prepared,
            "--run.dir",
            str(run),
        ],
        0.3,
    )[0]
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and all(math.isfinite(r["loss"]) for r in rows)
    assert all(0 <= r["ps_staleness_max"] <= 1 for r in rows) and rows[-1]["ps_staleness_max"] == 1
    for k in range(2):
        report = json.loads((run / f"ps_server{k}.json").read_text())
        assert (report["sync"], report["rounds"], report["pushes"]) == ("ssp:1", 4, 8)  # 2 workers x 4 steps
        assert report["max_staleness"] == 1 and report["pulls_held"] > 0
    assert json.loads((run / "checkpoints" / "latest").read_text())["step"] == 4
    # the ssp checkpoint resumes under another mode: plain all-reduce dp=2 continues from step 4
    resumed = pools(2).run(
        _train_rank,
        [*CLI_STEPS, "--train.steps", "6", "--data.prepared_dir", prepared, "--run.dir", str(run)],
    )[0]
    assert [r["step"] for r in resumed][-2:] == [5, 6] and all(math.isfinite(r["loss"]) for r in resumed)


def test_allreduce_checkpoint_resumes_under_dedicated_servers(pools, prepared, tmp_path):
    """A dp=2 run's step-4 checkpoint, resumed for 2 more steps by 2 workers + 1 dedicated server (bsp),
    gives the losses the same checkpoint gives resumed under dp=2: the servers read their shards
    (parameters and moments) from the all-reduce layout."""
    import shutil

    first = [*CLI_STEPS, "--data.prepared_dir", prepared]
    more = [*first, "--train.steps", "6"]
    pools(2).run(_train_rank, [*first, "--run.dir", str(tmp_path / "dp")])
    shutil.copytree(tmp_path / "dp", tmp_path / "ps")
    dp = pools(2).run(_train_rank, [*more, "--run.dir", str(tmp_path / "dp")])[0]
    ps = pools(3).run(_train_rank, [*more, *DEDICATED, "--run.dir", str(tmp_path / "ps")])[0]
    assert [r["step"] for r in ps][-2:] == [r["step"] for r in dp][-2:] == [5, 6]
    for key in ("loss", "grad_norm"):
        assert_close(torch.tensor([r[key] for r in ps][-2:]), torch.tensor([r[key] for r in dp][-2:]), **TOL)
