"""Pipeline runtime: equality with one process, torch.distributed.pipelining parity, weight
stashing, convergence of PipeDream, measured timelines, failures, bad configurations."""

from __future__ import annotations

import contextlib
import os
import time

import pytest
import torch
from torch.testing import assert_close

from tests.dist import get_mesh
from tests.helpers import SEQ, VOCAB, rank_micro_batches, tiny_model, tiny_train, train_dp

BATCH, MICRO = 8, 2  # m = 4 micro-batches per step (2 per rank when dp = 2)
TOL = dict(rtol=1e-4, atol=1e-5)
SYNC = [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb-h1", 1)]


def _uniform(n_layers: int, n: int) -> list[int]:
    return [round(i * n_layers / n) for i in range(n + 1)]


def _strategy(
    mesh,
    mcfg,
    tcfg,
    name: str,
    v: int = 1,
    vertical_sync: bool = False,
    timeout_s: float | None = None,
    group=None,
):
    from loom.model.llama import build_model
    from loom.optim.groups import build_optimizer
    from loom.parallel.data.strategy import DataParallel
    from loom.parallel.pipeline.stage import split_model
    from loom.parallel.pipeline.strategy import PipelineStrategy

    pp = mesh.size("pp")
    model = build_model(mcfg, tcfg.seed)
    links = mesh.pp_links()
    if group is not None:  # a private pp group (2 ranks) gets private links too
        import torch.distributed as dist

        links = {(0, 1): dist.new_group([0, 1]), (1, 0): dist.new_group([0, 1])}
    pipe = split_model(
        model, mesh.local_rank("pp"), pp, _uniform(mcfg.n_layers, pp * v), group or mesh.group("pp"), links
    )
    inner = DataParallel(pipe, mesh.group("dp")).attach_optimizer(build_optimizer(pipe, tcfg))
    return pipe, PipelineStrategy(
        inner, pipe, name, v, vertical_sync=vertical_sync, record_step=tcfg.steps - 1, timeout_s=timeout_s
    )


def _train(mesh, mcfg, tcfg, name: str, v: int, batches) -> dict:
    from loom.model.llama import loss_fn
    from loom.parallel.pipeline.stage import gather_full_state
    from loom.train.build import pipeline_run
    from loom.train.schedule import lr_at
    from loom.train.step import train_step

    pipe, strategy = _strategy(mesh, mcfg, tcfg, name, v)
    losses, per_mb = [], []
    for step in range(tcfg.steps):
        res = train_step(
            pipeline_run(pipe, strategy, loss_fn),
            batches(step),
            tcfg.grad_clip,
            lr_at(step, tcfg),
            mesh.group("dp"),
        )
        losses.append(res.loss)
        per_mb.append({k: float(t) for k, t in strategy.last_stats.losses.items()})
    strategy.remove()
    return {
        "losses": losses,
        "per_mb": per_mb,
        "state": gather_full_state(pipe),
        "timeline": strategy.timeline,
        "peak_versions": strategy.last_stats.peak_versions,
        "versions": strategy.last_stats.version_log,
    }


# ----------------------------------------------------------------------------- synchronous equality


def _sync_runs(pp: int, dp: int, schedules: list[tuple[str, int]], steps: int) -> dict:
    mesh = get_mesh(pp=pp, dp_replicate=dp)
    dp_rank = mesh.local_rank("dp")
    out = {}
    for name, v in schedules:
        out[name] = _train(
            mesh,
            tiny_model(n_layers=LAYERS[pp]),
            tiny_train(steps=steps),
            name,
            v,
            lambda s: rank_micro_batches(s, BATCH, MICRO, dp_rank, dp),
        )
    return out


LAYERS = {2: 4, 4: 8}  # blocks per pipeline size: pp * v stages need at least one block each


@pytest.fixture(scope="module")
def reference():
    """Single-process runs on the same global batches (one micro-batch: accumulation is exact to float)."""
    cache: dict[int, dict] = {}

    def get(n_layers: int) -> dict:
        if n_layers not in cache:
            threads = torch.get_num_threads()
            torch.set_num_threads(1)  # this machine's 2 cores are shared with the rank processes
            try:
                cache[n_layers] = train_dp(None, tiny_model(n_layers=n_layers), tiny_train(), BATCH, BATCH)
            finally:
                torch.set_num_threads(threads)
        return cache[n_layers]

    return get


def _assert_equal_to_reference(result: dict, reference: dict, what: str) -> None:
    assert_close(
        torch.tensor(result["losses"]), torch.tensor(reference["losses"]), **TOL, msg=lambda m: f"{what}: {m}"
    )
    for k, v in reference["state"].items():
        assert_close(result["state"][k], v, **TOL, msg=lambda m, k=k, w=what: f"{w} {k}: {m}")
    assert torch.equal(
        result["state"]["output.weight"], result["state"]["tok_embeddings.weight"]
    )  # tied copies


@pytest.mark.parametrize("pp", [2, 4])
def test_sync_schedules_equal_single_process(pools, reference, pp, tmp_path):
    """GPipe, 1F1B, interleaved (v=2), ZB-H1: 20 steps, tied embeddings, grad clipping; and the
    measured timeline of the last step (every action, in list order, bubble beside the formula)."""
    from loom.parallel.pipeline.report import timeline_report
    from loom.parallel.pipeline.runtime import bubble_formula, step_schedule
    from loom.parallel.pipeline.simulate import peak_in_flight

    results = pools(pp).run(_sync_runs, pp, 1, SYNC, 20)
    m = BATCH // MICRO
    for name, v in SYNC:
        _assert_equal_to_reference(results[0][name], reference(LAYERS[pp]), f"{name} pp={pp}")
        timeline = results[0][name]["timeline"]
        schedule = step_schedule(name, pp, m, v)
        assert timeline.n_ranks == pp
        for r in range(pp):
            measured = [e.action for e in sorted(timeline.events, key=lambda e: e.start) if e.rank == r]
            assert [a for a in measured if a.kind.value not in ("SEND_F", "SEND_B")] == [
                a for a in schedule[r] if a.kind.value not in ("SEND_F", "SEND_B")
            ]
        assert timeline.peak_in_flight == peak_in_flight(schedule)
        assert 0.0 < timeline.bubble < 1.0
        text = timeline_report(timeline, name, m, v, tmp_path / f"{name}.png")
        assert (tmp_path / f"{name}.png").stat().st_size > 0
        assert f"formula {bubble_formula(name, pp, m, v):.1%}" in text
        print(text)


def test_pp2_dp2_equals_single_process(pools, reference):
    results = pools(4).run(_sync_runs, 2, 2, [("interleaved", 2)], 20)
    for r in results:  # pipeline rank 0 of each replica gathers the full state: global ranks 0 and 1
        assert_close(
            torch.tensor(r["interleaved"]["losses"]), torch.tensor(reference(LAYERS[2])["losses"]), **TOL
        )
    for r in results[:2]:
        _assert_equal_to_reference(r["interleaved"], reference(LAYERS[2]), "interleaved pp2 x dp2")


def _three_d(steps: int) -> dict:
    """pp2 x tp2 x dp2: tensor parallel blocks inside interleaved pipeline stages, replicated over dp."""
    from loom.config import LoomConfig
    from loom.model.llama import build_model
    from loom.optim.groups import build_optimizer
    from loom.parallel.data.strategy import DataParallel
    from loom.parallel.pipeline.stage import gather_full_state, split_model
    from loom.parallel.pipeline.strategy import PipelineStrategy
    from loom.parallel.tensor.parallelize import apply_tensor_parallel
    from loom.train.build import pipeline_run
    from loom.train.schedule import lr_at
    from loom.train.step import train_step

    mesh = get_mesh(pp=2, dp_replicate=2, tp=2)
    mcfg, tcfg = tiny_model(n_layers=4), tiny_train(steps=steps)
    cfg = LoomConfig(model=mcfg, train=tcfg)
    cfg.parallel.tp, cfg.data.seq_len = 2, SEQ
    model = build_model(mcfg, tcfg.seed)
    loss = apply_tensor_parallel(model, mesh)
    pipe = split_model(model, mesh.local_rank("pp"), 2, _uniform(4, 4), mesh.group("pp"), mesh.pp_links())
    pipe.tp_group = mesh.group("tp")
    inner = DataParallel(pipe, mesh.group("dp"), tp_group=mesh.group("tp"))
    strategy = PipelineStrategy(
        inner.attach_optimizer(build_optimizer(pipe, tcfg)), pipe, "interleaved", 2, tp_group=mesh.group("tp")
    )
    losses = []
    for step in range(steps):
        batches = rank_micro_batches(step, BATCH, MICRO, mesh.local_rank("dp"), 2)
        losses.append(
            train_step(
                pipeline_run(pipe, strategy, loss),
                batches,
                tcfg.grad_clip,
                lr_at(step, tcfg),
                mesh.group("dp"),
            ).loss
        )
    inner.remove()
    return {"losses": losses, "state": gather_full_state(pipe)}


def test_3d_pp2_tp2_dp2_equals_single_process(pools):
    """8 ranks (one short run): interleaved pipeline x tensor parallel x data parallel, tied embeddings."""
    steps = 6
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        ref = train_dp(None, tiny_model(n_layers=4), tiny_train(steps=steps), BATCH, BATCH)
    finally:
        torch.set_num_threads(threads)
    results = pools(8).run(_three_d, steps)
    for r in results:
        assert_close(torch.tensor(r["losses"]), torch.tensor(ref["losses"]), **TOL)
    for r in results:
        if r["state"] is not None:  # pipeline rank 0 of each (dp, tp) coordinate
            _assert_equal_to_reference(r, ref, "pp2 x tp2 x dp2")


PP_ZERO = [(1, True), (2, True), (3, True), (2, False), (3, False)]  # (stage, tied embeddings)


def _pp_zero_runs(steps: int) -> dict:
    """pp2 x dp2 (sharded) under ZeRO 1-3 (ZeRO-3 with full recomputation), tied embeddings or not,
    every synchronous schedule."""
    from loom.comm import CommMeter
    from loom.config import LoomConfig
    from loom.memory.recompute import apply_recompute
    from loom.model.llama import build_model, loss_fn
    from loom.parallel.pipeline.stage import gather_full_state, split_model
    from loom.parallel.pipeline.strategy import PipelineStrategy
    from loom.train.build import data_parallel, pipeline_run
    from loom.train.schedule import lr_at
    from loom.train.step import train_step

    mesh = get_mesh(pp=2, dp_shard=2)
    out = {}
    for zero, tied in PP_ZERO:
        mcfg, tcfg = tiny_model(n_layers=4, tie_embeddings=tied), tiny_train(steps=steps)
        for name, v in SYNC:
            cfg = LoomConfig(model=mcfg, train=tcfg)
            cfg.parallel.zero, cfg.parallel.dp, cfg.parallel.dp_shard, cfg.parallel.pp = zero, 2, 2, 2
            pipe = split_model(
                build_model(mcfg, tcfg.seed),
                mesh.local_rank("pp"),
                2,
                _uniform(4, 2 * v),
                mesh.group("pp"),
                mesh.pp_links(),
            )
            if zero == 3:
                apply_recompute(pipe, "full")
            meter = CommMeter()
            inner = data_parallel(pipe, mesh, cfg, meter)
            strategy = PipelineStrategy(inner, pipe, name, v)
            losses, calls = [], []
            for step in range(steps):
                meter.reset()
                batches = rank_micro_batches(step, BATCH, MICRO, mesh.local_rank("dp"), 2)
                losses.append(
                    train_step(
                        pipeline_run(pipe, strategy, loss_fn),
                        batches,
                        tcfg.grad_clip,
                        lr_at(step, tcfg),
                        mesh.group("dp"),
                    ).loss
                )
                calls.append(dict(meter.calls))
            with inner.gathered() if zero == 3 else contextlib.nullcontext():
                state = gather_full_state(pipe)
            units = [u.layout for u in getattr(inner, "units", [])]
            out[zero, tied, name] = {
                "losses": losses,
                "state": state,
                "calls": calls,
                "bytes": inner.state_bytes(),
                "units": [(lay.numel, lay.padded) for lay in units],
            }
            inner.remove()
    return out


def test_pp2_zero_1_2_3_equal_single_process(pools):
    """ZeRO 1-3 (ZeRO-3 with full recomputation) inside pipeline stages, tied embeddings or not:
    GPipe, 1F1B, interleaved and ZB-H1 at pp2 x dp2 equal one process, the two tied copies stay
    bitwise equal (their reduced gradient shards are summed element for element); ZeRO-3 keeps
    1/N of each stage's state, and its gathers per step are the planner's 2u per micro-batch
    (ZB-H1 may skip some: a forward between a micro-batch's BI and BW finds the unit gathered)."""
    from loom.plan.cost import CostModel, Layout, Workload
    from loom.plan.hardware import ClusterSpec

    steps = 6
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        refs = {
            tied: train_dp(
                None, tiny_model(n_layers=4, tie_embeddings=tied), tiny_train(steps=steps), BATCH, BATCH
            )
            for tied in (True, False)
        }
    finally:
        torch.set_num_threads(threads)
    results = pools(4).run(_pp_zero_runs, steps)
    for zero, tied, name in results[0]:
        what, key, ref = f"ZeRO-{zero} tied={tied} {name} pp2 x dp2", (zero, tied, name), refs[tied]
        for r in results:
            assert_close(
                torch.tensor(r[key]["losses"]),
                torch.tensor(ref["losses"]),
                **TOL,
                msg=lambda m, w=what: f"{w}: {m}",
            )
            if r[key]["state"] is not None:  # pipeline rank 0 of each data-parallel rank
                for k, t in ref["state"].items():
                    assert_close(r[key]["state"][k], t, **TOL, msg=lambda m, k=k, w=what: f"{w} {k}: {m}")
                if tied:
                    assert torch.equal(
                        r[key]["state"]["output.weight"], r[key]["state"]["tok_embeddings.weight"]
                    )
        if zero < 3:
            continue
        mcfg = tiny_model(n_layers=4, tie_embeddings=tied)
        planner = CostModel(mcfg, Workload(BATCH, SEQ, precision="fp32"), ClusterSpec.single_node("cpu", 4))
        expected = planner.collective_calls(
            Layout(dp=2, dp_shard=2, pp=2, zero=3, micro_batch=MICRO, schedule=name, v=dict(SYNC)[name])
        )
        first = results[0][key]  # global rank 0: pipeline rank 0, the planner's first stage
        assert len(first["units"]) == mcfg.n_layers // 2 + 1  # embedding + its blocks
        for step_calls in first["calls"]:
            assert step_calls["reduce_scatter"] == expected["reduce_scatter"] == len(first["units"])
            if name == "zb-h1":
                assert (
                    len(first["units"]) * BATCH // MICRO // 2
                    <= step_calls["all_gather"]
                    <= expected["all_gather"]
                )
            else:
                assert step_calls["all_gather"] == expected["all_gather"], what
        for r in results:  # 16 bytes per parameter of the stage, each rank 1/N of every padded unit
            padded = sum(p for _, p in r[key]["units"])
            assert r[key]["bytes"]["param_bytes"] * 2 == 4 * padded
            assert r[key]["bytes"]["optim_bytes"] * 2 == 8 * padded
        held = sum(
            n for r in (results[0], results[2]) for n, _ in r[key]["units"]
        )  # pp ranks 0, 1 of dp rank 0
        assert held == sum(t.numel() for t in ref["state"].values())  # (a state dict names both tied copies)


# ----------------------------------------------------------------------------- torch.distributed.pipelining


def _loom_vs_torch(steps: int) -> dict:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    from loom.model.llama import build_model, loss_fn
    from loom.optim.groups import build_optimizer, set_lr
    from loom.parallel.pipeline.stage import split_model
    from loom.train.schedule import lr_at

    mesh = get_mesh(pp=2)
    mcfg, tcfg = tiny_model(n_layers=4, tie_embeddings=False), tiny_train(steps=steps, grad_clip=0.0)
    m, out = BATCH // MICRO, {}
    for name, cls in (("gpipe", ScheduleGPipe), ("1f1b", Schedule1F1B)):
        ours = _train(mesh, mcfg, tcfg, name, 1, lambda s: rank_micro_batches(s, BATCH, MICRO, 0, 1))
        pipe = split_model(
            build_model(mcfg, tcfg.seed),
            mesh.local_rank("pp"),
            2,
            _uniform(4, 2),
            mesh.group("pp"),
            mesh.pp_links(),
        )
        stage = pipe.stages[0]
        opt = build_optimizer(stage, tcfg)
        torch_stage = PipelineStage(stage, stage.index, 2, torch.device("cpu"), group=mesh.group("pp"))
        schedule = cls(torch_stage, n_microbatches=m, loss_fn=loss_fn)
        theirs = []
        for step in range(steps):
            x, y = rank_micro_batches(step, BATCH, BATCH, 0, 1)[0]
            set_lr(opt, lr_at(step, tcfg))
            opt.zero_grad()
            losses: list[torch.Tensor] = []
            if stage.is_first:
                schedule.step(x)
            else:
                schedule.step(target=y, losses=losses)
                theirs.append([float(t.detach()) for t in losses])
            opt.step()
        out[name] = {
            "ours": ours["per_mb"],
            "theirs": theirs,
            "is_last": stage.is_last,
            "ours_state": {k: v for k, v in (ours["state"] or {}).items()},
            "theirs_state": {k: v.detach().clone() for k, v in stage.state_dict().items()},
        }
    return out


def test_same_losses_as_torch_pipelining(pools):
    """Same stage modules under torch's ScheduleGPipe / Schedule1F1B and under ours: same losses and weights."""
    results = pools(2).run(_loom_vs_torch, 5)
    for name in ("gpipe", "1f1b"):
        last = next(r[name] for r in results if r[name]["is_last"])
        ours = [[d[k] for k in sorted(d)] for d in last["ours"]]
        assert_close(torch.tensor(ours), torch.tensor(last["theirs"]), **TOL)
        full = results[0][name]["ours_state"]
        for r in results:
            for k, v in r[name]["theirs_state"].items():  # stage modules keep the full model's names
                assert_close(full[k], v, **TOL, msg=lambda msg, k=k, n=name: f"{n} {k}: {msg}")


# ----------------------------------------------------------------------------- asynchronous PipeDream


def _chain_batch(i: int, rows: int = MICRO) -> tuple[torch.Tensor, torch.Tensor]:
    """Learnable data: t_{k+1} = (5 t_k + 3) mod V from a random start."""
    g = torch.Generator().manual_seed(1000 + i)
    tokens = [torch.randint(0, VOCAB, (rows, 1), generator=g)]
    for _ in range(SEQ):
        tokens.append((tokens[-1] * 5 + 3) % VOCAB)
    t = torch.cat(tokens, 1)
    return t[:, :-1], t[:, 1:]


ASYNC_M = 8
ASYNC_CASES = [("pipedream", False), ("pipedream", True), ("2bw", False)]
CONVERGE_M = 64


def _async_runs() -> dict:
    """One step of each asynchronous list over ASYNC_M micro-batches (traced), and a long PipeDream run."""
    from loom.model.llama import loss_fn
    from loom.parallel.pipeline.stage import gather_full_state
    from loom.train.build import pipeline_run
    from loom.train.step import train_step

    mesh = get_mesh(pp=4)
    mcfg = tiny_model(n_layers=4, tie_embeddings=False)
    out = {}
    for name, vsync in ASYNC_CASES:
        tcfg = tiny_train(steps=1, lr=1e-2)
        pipe, strategy = _strategy(mesh, mcfg, tcfg, name, vertical_sync=vsync)
        strategy.runtime.trace_versions = True
        train_step(
            pipeline_run(pipe, strategy, loss_fn), [_chain_batch(i) for i in range(ASYNC_M)], 1.0, 1e-2, None
        )
        stats = strategy.last_stats
        out[(name, vsync)] = {
            "losses": {k: float(v) for k, v in stats.losses.items()},
            "log": stats.version_log,
            "peak": stats.peak_versions,
            "state": gather_full_state(pipe),
        }
        strategy.remove()
    tcfg = tiny_train(steps=1)
    pipe, strategy = _strategy(mesh, mcfg, tcfg, "pipedream")
    train_step(
        pipeline_run(pipe, strategy, loss_fn), [_chain_batch(i) for i in range(CONVERGE_M)], 1.0, 3e-3, None
    )
    out["converge"] = [float(strategy.last_stats.losses[i]) for i in sorted(strategy.last_stats.losses)]
    strategy.remove()
    return out


def _async_reference(name: str, vsync: bool, p: int, m: int, stash: bool = True):
    """Single process PipeDream semantics: micro-batch j runs forward and backward with stage r's
    weights of version v(r, j) (or, without stashing, the backward with the newest ones); rank r
    steps when its list says so, applying the gradients accumulated since its last step."""
    from loom.model.llama import build_model, loss_fn
    from loom.optim.groups import build_optimizer, set_lr
    from loom.parallel.base import grad_norm_sq
    from loom.parallel.pipeline.runtime import loss_scale, step_schedule
    from loom.parallel.pipeline.schedules import Kind, weight_versions
    from loom.parallel.pipeline.stage import split_model

    mcfg = tiny_model(n_layers=4, tie_embeddings=False)
    model = build_model(mcfg, 7)
    schedule = step_schedule(name, p, m, 1, vsync)
    versions = weight_versions(schedule)
    stages = [split_model(model, r, p, _uniform(4, p)).stages[0] for r in range(p)]
    params = [list(s.parameters()) for s in stages]
    opts = [build_optimizer(s, tiny_train(lr=1e-2)) for s in stages]
    for o in opts:
        set_lr(o, 1e-2)
    history = [[[t.detach().clone() for t in ps]] for ps in params]  # history[r][k] = version k of stage r
    steps_after = [{a.microbatch for a in actions if a.kind is Kind.STEP} for actions in schedule]
    acc = [[torch.zeros_like(t) for t in ps] for ps in params]
    losses = {}
    for j in range(max(mb for v in versions for (_, mb, _) in v) + 1):
        for r in range(p):
            src = history[r][versions[r][(Kind.F, j, r)]]
            for t, w in zip(params[r], src):
                t.data.copy_(w)
        loss = loss_fn(model(_chain_batch(j)[0]), _chain_batch(j)[1])
        losses[j] = float(loss.detach())
        if not stash:  # no stashing: the gradient is taken at each stage's newest weights
            for r in range(p):
                for t, w in zip(params[r], history[r][-1]):
                    t.data.copy_(w)
            loss = loss_fn(model(_chain_batch(j)[0]), _chain_batch(j)[1])
        grads = torch.autograd.grad(loss * loss_scale(name, m), [t for ps in params for t in ps])
        k = 0
        for r in range(p):
            for a, g in zip(acc[r], grads[k : k + len(params[r])]):
                a.add_(g)
            k += len(params[r])
            if j in steps_after[r]:
                for t, w, a in zip(params[r], history[r][-1], acc[r]):
                    t.data.copy_(w)
                    t.grad = a.clone()
                    a.zero_()
                norm = grad_norm_sq(params[r]).sqrt()  # the stage's own norm, clipped to 1
                torch._foreach_mul_([t.grad for t in params[r]], torch.clamp(1.0 / (norm + 1e-6), max=1.0))
                opts[r].step()
                history[r].append([t.detach().clone() for t in params[r]])
    final = {}
    for r, stage in enumerate(stages):
        for (n, _), w in zip(stage.named_parameters(), history[r][-1]):
            final[n] = w
    return losses, final


def test_pipedream_weight_stashing_and_convergence(pools):
    """PipeDream (with and without vertical sync) and 2BW at pp=4 equal the single-process model of
    their semantics; a backward sees exactly its forward's weights while newer versions exist;
    versions kept = the schedule's stated count; PipeDream converges close to synchronous SGD."""
    from loom.model.llama import build_model, loss_fn
    from loom.optim.groups import build_optimizer, set_lr
    from loom.parallel.pipeline.runtime import step_schedule
    from loom.parallel.pipeline.schedules import stashed_versions

    results = pools(4).run(_async_runs)
    for name, vsync in ASYNC_CASES:
        what = f"{name}{' vertical sync' if vsync else ''}"
        losses, final = _async_reference(name, vsync, 4, ASYNC_M)
        last = results[3][(name, vsync)]
        assert_close(
            torch.tensor([last["losses"][j] for j in sorted(losses)]),
            torch.tensor([losses[j] for j in sorted(losses)]),
            **TOL,
            msg=lambda m, w=what: f"{w}: {m}",
        )
        for k, v in final.items():
            assert_close(
                results[0][(name, vsync)]["state"][k], v, **TOL, msg=lambda m, k=k, w=what: f"{w} {k}: {m}"
            )
        peaks = stashed_versions(step_schedule(name, 4, ASYNC_M, 1, vsync))
        if vsync:  # stashed_versions counts in-flight versions + the newest (p - r + 1); a rank must also
            peaks = [4] * 4  # keep the versions between stage 0's and its own that later forwards use: p
        assert [r[(name, vsync)]["peak"] for r in results] == peaks
        stale = [e for r in results for e in r[(name, vsync)]["log"] if e["newest"] > e["version"]]
        assert stale, f"{what}: no backward ran while a newer weight version existed"
        for e in stale:
            assert e["used"] != e["live"]  # the live weights moved on; the backward used the stash
    # without stashing the same run gives other weights: the test above can tell the difference
    _, unstashed = _async_reference("pipedream", False, 4, ASYNC_M, stash=False)
    assert any(
        not torch.allclose(unstashed[k], v, **TOL)
        for k, v in results[0][("pipedream", False)]["state"].items()
        if k in unstashed
    )
    # convergence: PipeDream (staleness up to 3 updates) vs synchronous per-micro-batch training
    model = build_model(tiny_model(n_layers=4, tie_embeddings=False), 7)
    opt = build_optimizer(model, tiny_train())
    set_lr(opt, 3e-3)
    sync = []
    for i in range(CONVERGE_M):
        x, y = _chain_batch(i)
        opt.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sync.append(float(loss.detach()))
    ours = results[3]["converge"]
    tail_sync, tail_async = sum(sync[-8:]) / 8, sum(ours[-8:]) / 8
    print(f"PipeDream pp=4 after {CONVERGE_M} updates: loss {tail_async:.3f} vs synchronous {tail_sync:.3f}")
    assert ours[0] - tail_async > 1.5  # it learns
    assert abs(tail_async - tail_sync) <= 0.25  # stated margin: within 0.25 nats of synchronous


# ----------------------------------------------------------------------------- failures


def _dead_peer(timeout_s: float) -> str:
    """Pipeline rank 1 crashes on its second micro-batch; rank 0 must fail naming it within the timeout."""
    import torch.distributed as dist

    from loom.model.llama import loss_fn
    from loom.train.build import pipeline_run
    from loom.train.step import train_step

    mesh = get_mesh(pp=2)
    group = dist.new_group([0, 1])  # its own group: the dead run's unmatched messages stay out of other tests
    pipe, strategy = _strategy(
        mesh, tiny_model(n_layers=2), tiny_train(steps=1), "1f1b", timeout_s=timeout_s, group=group
    )
    batches = rank_micro_batches(0, BATCH, MICRO, 0, 1)

    class Crashing(list):
        def __getitem__(self, i):
            if i == 1 and pipe.rank == 1:
                raise SystemError("simulated crash")
            return list.__getitem__(self, i)

    t0 = time.perf_counter()
    try:
        train_step(pipeline_run(pipe, strategy, loss_fn), Crashing(batches), 1.0, 1e-3, None)
    except Exception as e:  # noqa: BLE001 - reported to the test
        return f"{type(e).__name__} after {time.perf_counter() - t0:.1f}s: {e}"
    finally:
        strategy.remove()
    return "no error"


def test_dead_rank_surfaces_as_error_naming_it(pools):
    """Bound: the runtime's receive timeout (here 3 s; run.timeout_s in training) plus one action."""
    out = pools(2).run(_dead_peer, 3.0)
    assert out[1].startswith("SystemError")
    assert out[0].startswith("PipelineError"), out[0]
    assert "rank 1" in out[0] and "died or hung" in out[0]
    assert 2.5 <= float(out[0].split(" after ")[1].split("s:")[0]) <= 8.0


# ----------------------------------------------------------------------------- setup, config, CLI


def test_timeline_report_of_a_simulated_run_matches_the_formula():
    from loom.parallel.pipeline.report import timeline_report
    from loom.parallel.pipeline.runtime import step_schedule
    from loom.parallel.pipeline.simulate import simulate

    for name, v in [*SYNC, ("pipedream", 1)]:
        text = timeline_report(simulate(step_schedule(name, 4, 8, v), 1, 2), name, 8, v)
        measured, formula, simulated = (
            float(t.split("%")[0])
            for t in text.split("bubble ")[1:2]
            + text.split("formula ")[1:2]
            + text.split("stage times ")[1:2]
        )
        assert measured == formula == simulated, text
        assert "runtime overhead between actions 0.0%" in text, text


class _Sleep(torch.autograd.Function):
    """Identity that sleeps ``fwd_s`` in forward and ``bwd_s`` in backward: compute of a known length."""

    @staticmethod
    def forward(ctx, x, fwd_s: float, bwd_s: float):
        time.sleep(fwd_s)
        ctx.bwd_s = bwd_s
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        time.sleep(ctx.bwd_s)
        return g, None, None


class _TimedBlock(torch.nn.Module):
    """A block taking t in forward, t for the input gradient (BI) and t for the weight gradient (BW)."""

    def __init__(self, dim: int, t: float) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(dim))
        self.t = t

    def forward(self, h, cos, sin):
        return _Sleep.apply(h, self.t, self.t) * _Sleep.apply(self.weight, 0.0, self.t)


TIMED_M, TIMED_T = (
    8,
    0.05,
)  # long enough that p2p latency and late wake-ups on a loaded machine stay below a point


def _timed_bubbles() -> dict:
    """The real runtime on blocks of known duration (sleeps: no contention for the 2 cores), pp2."""
    from loom.model.llama import build_model, loss_fn
    from loom.optim.groups import build_optimizer
    from loom.parallel.data.strategy import DataParallel
    from loom.parallel.pipeline.stage import split_model
    from loom.parallel.pipeline.strategy import PipelineStrategy
    from loom.train.build import pipeline_run
    from loom.train.step import train_step

    mesh = get_mesh(pp=2)
    mcfg = tiny_model(dim=8, n_layers=4, n_heads=2, n_kv_heads=2, tie_embeddings=False)
    g = torch.Generator().manual_seed(0)
    batches = [
        tuple(torch.randint(0, VOCAB, (1, SEQ), generator=g) for _ in range(2)) for _ in range(TIMED_M)
    ]
    out = {}
    for name, v in SYNC:
        model = build_model(mcfg, 0)
        for i in range(
            4
        ):  # t per stage per micro-batch: 2 blocks of t/2, or v = 2 chunks of one block of t/2
            model.layers[i] = _TimedBlock(mcfg.dim, TIMED_T / 2)
        pipe = split_model(
            model, mesh.local_rank("pp"), 2, _uniform(4, 2 * v), mesh.group("pp"), mesh.pp_links()
        )
        strategy = PipelineStrategy(
            DataParallel(pipe, None).attach_optimizer(build_optimizer(pipe, tiny_train())),
            pipe,
            name,
            v,
            record_step=1,
        )
        for _ in range(2):  # the first step warms up; the second is recorded
            train_step(pipeline_run(pipe, strategy, loss_fn), batches, 1.0, 1e-4, None)
        out[name] = strategy.timeline
    return out


def test_measured_bubble_equals_the_formula_on_timed_stages(pools):
    """With equal stages of known length (t_f = t_bi = t_w = t per stage, so t_b = 2 t_f), the time
    real ranks wait on each other in a step equals the schedule's formula: (p-1)/(m+p-1) for GPipe
    and 1F1B, (p-1)/(v m+p-1) interleaved, (p-1)/(3m+p-1) ZB-H1: within 1.5 points of the simulation
    of the same lists with the measured stage times (what is left: p2p latency), and within 2.5
    points of the formula plus however far the measured stage times drifted from equal (sleeps
    overshoot; the embedding and head lengthen the end stages; a loaded machine wakes ranks
    late). The runtime's own time between actions is reported apart and stays small."""
    from loom.parallel.pipeline.report import timeline_report
    from loom.parallel.pipeline.runtime import bubble_formula
    from loom.parallel.pipeline.schedules import Kind
    from loom.parallel.pipeline.simulate import Timeline

    def misses(timelines, names, slack: float = 0.0) -> dict[str, str]:
        out = {}
        for name, v in SYNC:
            if name not in names:
                continue
            compute = Timeline(2, [e for e in timelines[name].events if e.action.kind is not Kind.STEP])
            formula = bubble_formula(name, 2, TIMED_M, v)
            text = timeline_report(timelines[name], name, TIMED_M, v)
            print(text)
            simulated = float(text.split("stage times ")[1].split("%")[0]) / 100
            skew = abs(
                simulated - formula
            )  # stage times that drifted from equal (a loaded machine delays wake-ups)
            if (
                abs(compute.waiting_bubble - simulated) > 0.015 + slack
                or abs(compute.waiting_bubble - formula) > 0.025 + skew + slack
                or compute.bubble - compute.waiting_bubble >= 0.05
            ):
                out[name] = text
        return out

    # Sleeps on 2 shared cores: a burst of load from another process (the rest of the suite runs
    # beside this test) can delay wake-ups by several ms. A runtime that adds waiting misses in
    # every measurement; a burst of load misses in one. So a schedule passes when one of three
    # measurements holds.
    # Under sustained load (a full suite keeps both cores busy: 1-minute load 8-11 on 2 cores, for
    # minutes) all three can miss by up to 2.5 points: then the last two allow 3 points more of late
    # wake-ups, far below what a runtime that serialized the stages would add (the whole bubble
    # again: 11 points and more at p = 2, m = 8).
    missed = misses(pools(2).run(_timed_bubbles)[0], {name for name, _ in SYNC})
    slack = 0.0
    for attempt in range(4):
        if not missed:
            break
        if attempt == 2 and os.getloadavg()[0] > (os.cpu_count() or 1) + 1:
            slack = 0.03
        missed = misses(pools(2).run(_timed_bubbles)[0], set(missed), slack)
    assert not missed, "\n".join(missed.values())


def test_profiled_partitioner_prints_cut_time_and_memory():
    from loom.config import LoomConfig
    from loom.model.llama import build_model, loss_fn
    from loom.parallel.pipeline.profile import choose_layout, layer_costs, profile_model

    mcfg = tiny_model(n_layers=6)
    model = build_model(mcfg, 0)
    cfg = LoomConfig(model=mcfg)
    cfg.parallel.pp, cfg.train.micro_batch, cfg.data.seq_len = 2, 2, SEQ
    lines: list[str] = []
    bounds = choose_layout(model, cfg, 4, loss_fn, lines.append)
    assert bounds[0] == 0 and bounds[-1] == 6 and len(bounds) == 3
    assert "stage 0 (rank 0)" in lines[0] and "stage 1 (rank 1)" in lines[0] and "MiB" in lines[0]
    prof = profile_model(model, 2, SEQ, loss_fn, repeats=1)
    assert all(t > 0 for t in prof.fwd_s + prof.bwd_s) and all(a > 0 for a in prof.act_bytes)
    t, state, acts = layer_costs(prof)
    assert len(t) == len(state) == len(acts) == 6 and t[0] > sum(prof.fwd_s[1:2])  # embedding folded in
    cfg.parallel.pp_layout = "0-1,2-5"
    assert choose_layout(model, cfg, 4, loss_fn) == [0, 2, 6]
    assert all(p.grad is None for p in model.parameters())  # profiling leaves no gradients behind


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["--parallel.pp", "8"], "parallel.pp: pp*virtual_stages = 8 pipeline stages but model.n_layers = 4"),
        (
            [
                "--parallel.pp",
                "2",
                "--parallel.schedule",
                "interleaved",
                "--parallel.virtual_stages",
                "2",
                "--train.global_batch",
                "6",
                "--train.micro_batch",
                "2",
            ],
            "divisible by parallel.pp = 2",
        ),
        (
            ["--parallel.pp", "4", "--parallel.schedule", "2bw", "--model.tie_embeddings", "false"],
            "2bw splits a step's 4 micro-batches",
        ),
        (
            ["--parallel.pp", "2", "--parallel.pp_layout", "0-1,3-3"],
            "parallel.pp_layout '0-1,3-3': stage 1 starts",
        ),
        (["--parallel.pp", "2", "--parallel.pp_layout", "0-1,2-2"], "covers layers 0-2 but the model has 4"),
        (
            ["--parallel.pp", "2", "--parallel.schedule", "pipedream"],
            "model.tie_embeddings: schedule 'pipedream'",
        ),
        (["--parallel.schedule", "zerobubble"], "parallel.schedule: must be one of"),
        (["--parallel.pp", "2", "--parallel.virtual_stages", "2"], "needs parallel.schedule = 'interleaved'"),
        # the docs' interleaved example gave no virtual_stages: it trained v = 1 (1F1B's order) as
        # "interleaved", a layout the planner refused
        (
            ["--parallel.pp", "2", "--parallel.schedule", "interleaved"],
            "parallel.virtual_stages: the interleaved schedule runs >= 2 chunks per rank, got 1",
        ),
        (
            [
                "--parallel.pp",
                "2",
                "--parallel.zero",
                "2",
                "--parallel.schedule",
                "pipedream",
                "--model.tie_embeddings",
                "false",
            ],
            "parallel.zero: ZeRO-2 with schedule 'pipedream'",
        ),
    ],
)
def test_bad_pipeline_configs_fail_in_one_line(overrides, message):
    from loom import config as C

    cfg = C.apply_overrides(C.LoomConfig(), overrides)
    with pytest.raises(C.ConfigError) as e:
        C.validate(cfg, cfg.parallel.pp * max(1, cfg.parallel.dp))
    assert message in str(e.value) and "\n" not in str(e.value)


def test_loom_schedule_command(tmp_path, capsys):
    from loom.cli import main

    out = tmp_path / "s.svg"
    assert (
        main(["schedule", "--pp", "4", "--microbatches", "8", "--schedule", "1f1b", "--out", str(out)]) == 0
    )
    text = capsys.readouterr().out
    assert "simulated bubble 27.3% vs formula 27.3%" in text and out.read_text().startswith("<?xml")
    assert (
        main(["schedule", "--pp", "4", "--microbatches", "6", "--schedule", "interleaved", "--v", "2"]) == 2
    )
    assert "divisible" in capsys.readouterr().err
    # interleaved without --v simulates 2 chunks per rank; --v 1 is refused, as loom train refuses it
    assert main(["schedule", "--pp", "4", "--microbatches", "8", "--schedule", "interleaved"]) == 0
    assert "interleaved: pp=4 microbatches=8 v=2 | simulated bubble 15.8%" in capsys.readouterr().out
    assert main(["schedule", "--pp", "4", "--schedule", "interleaved", "--v", "1"]) == 2
    assert "--v: the interleaved schedule runs >= 2 chunks per rank, got 1" in capsys.readouterr().err
