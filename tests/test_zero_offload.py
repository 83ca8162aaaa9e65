"""ZeRO-Infinity parameter offload (``parallel.offload_params``): equal to ZeRO-3 without offload
(losses and weights), no persistent state left on the device (measured: bytes outside the store),
16Φ'/N bytes in the store, every unit's shard read ahead of its all-gather after the first ones,
one-line refusal without ZeRO-3. Each configuration runs once (module-scoped fixture)."""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from loom import config as C
from tests.helpers import train_layout

STEPS, BATCH, MICRO = 4, 8, 2  # two micro-batches per rank: accumulation across offloaded gradient shards
ELEM = 4
LAYOUTS = {
    "z3": {"dp_shard": 2, "zero": 3},
    "cpu": {"dp_shard": 2, "zero": 3, "offload_params": "cpu"},
    "disk": {"dp_shard": 2, "zero": 3, "offload_params": "disk"},
    "cpu_bf16": {"dp_shard": 2, "zero": 3, "offload_params": "cpu", "precision": "bf16"},
    "z3_bf16": {"dp_shard": 2, "zero": 3, "precision": "bf16"},
    "pp_z3": {"pp": 2, "zero": 3},  # a pipeline rank's chunks, each unit resharded after forward
    "pp_cpu": {"pp": 2, "zero": 3, "offload_params": "cpu"},
    "ep_z3": {"dp_shard": 2, "ep": 2, "zero": 3},  # MoE: expert units sharded over their edp group
    "ep_cpu": {"dp_shard": 2, "ep": 2, "zero": 3, "offload_params": "cpu"},
    # Adafactor's statistics cross ranks on the strategy's device, not from the host shards
    "z3_adafactor": {"dp_shard": 2, "zero": 3, "optimizer": "adafactor"},
    "cpu_adafactor": {"dp_shard": 2, "zero": 3, "offload_params": "cpu", "optimizer": "adafactor"},
}
MOE = {"n_experts": 4, "top_k": 2}


def _run_all(tmp: str) -> dict:
    import os

    out = {}
    for name, layout in LAYOUTS.items():
        model_kw = MOE if "ep" in layout else None
        out[name] = train_layout({**layout, "offload_dir": f"{tmp}/{name}"}, STEPS, BATCH, MICRO, model_kw)
        out[name]["files"] = os.listdir(f"{tmp}/{name}") if os.path.isdir(f"{tmp}/{name}") else None
    return out


@pytest.fixture(scope="module")
def runs(pools, tmp_path_factory):
    return pools(2).run(_run_all, str(tmp_path_factory.mktemp("offload")))


@pytest.mark.parametrize(
    "name,ref",
    [
        ("cpu", "z3"),
        ("disk", "z3"),
        ("cpu_bf16", "z3_bf16"),
        ("pp_cpu", "pp_z3"),
        ("ep_cpu", "ep_z3"),
        ("cpu_adafactor", "z3_adafactor"),
    ],
)
def test_equals_zero3_without_offload(runs, name, ref):
    """Same shards, same update, on the host: losses and weights equal ZeRO-3's (bit for bit here)."""
    for r in runs:
        assert_close(torch.tensor(r[name]["losses"]), torch.tensor(r[ref]["losses"]), rtol=0, atol=0)
        assert (r[name]["state"] is None) == (r[ref]["state"] is None)  # a pipeline: the state on one rank
        for k, v in (r[ref]["state"] or {}).items():
            assert_close(r[name]["state"][k], v, rtol=0, atol=0, msg=lambda m, k=k: f"{name} {k}: {m}")


@pytest.mark.parametrize(
    "name,ref", [("cpu", "z3"), ("disk", "z3"), ("cpu_bf16", "z3_bf16"), ("ep_cpu", "ep_z3")]
)
def test_device_bytes_equal_formula(runs, name, ref):
    """Between steps the device holds nothing (ZeRO-3 alone: 16Φ'/N fp32, (2+2+12)Φ'/N bf16); the store
    holds ZeRO-3's parameter and gradient shards (b·Φ'/N each) and the optimizer state (8Φ'/N, plus
    a 4Φ'/N fp32 master in bf16)."""
    for r in runs:
        got, z3 = r[name]["state_bytes"], r[ref]["state_bytes"]
        assert got["device_bytes"] == got["param_bytes"] == got["grad_bytes"] == 0
        assert got["param_offload_bytes"] == z3["param_bytes"] > 0
        assert got["grad_offload_bytes"] == z3["grad_bytes"]
        assert got["optim_offload_bytes"] == got["optim_bytes"] == z3["optim_bytes"]
        phi_n = z3["param_bytes"] // (2 if "bf16" in name else ELEM)  # Φ'/N
        assert z3["param_bytes"] + z3["grad_bytes"] + z3["optim_bytes"] == 16 * phi_n
        assert (
            got["device_bytes"]
            + got["param_offload_bytes"]
            + got["grad_offload_bytes"]
            + got["optim_offload_bytes"]
            == 16 * phi_n
        )


@pytest.mark.parametrize("name", ["cpu", "disk"])
def test_transient_bytes_add_only_staging(runs, name):
    """During a step the device holds ZeRO-3's transients plus staging copies of shards: at most
    three units' shards (one feeding an all-gather on demand, one prefetched, one read ahead)."""
    from loom.model.llama import build_model, count_params
    from tests.helpers import tiny_model

    model = build_model(tiny_model(), 0)
    widest = max(
        [count_params(b) for b in model.layers]
        + [count_params(model) - sum(count_params(b) for b in model.layers)]
    )
    shard = ELEM * -(-widest // 8) * 8 // 2  # the largest unit's shard (16-byte aligned, N = 2)
    for r in runs:
        extra = (
            r[name]["state_bytes"]["transient_peak_bytes"] - r["z3"]["state_bytes"]["transient_peak_bytes"]
        )
        assert 0 < extra <= 3 * shard


@pytest.mark.parametrize("name", ["cpu", "disk"])
def test_shards_read_ahead_of_their_gather(runs, name):
    """Every all-gather is fed by a copy from the store. The copy of the unit after the one being
    prefetched is read ahead (on a reader thread, during the current unit's compute), so per
    micro-batch only 3 reads are on demand whatever the depth: the forward's first two units and
    the backward's first gathered one; the tiny model's other 2 of 5 are read ahead."""
    for r in runs:
        events = r[name]["events"]
        fetches = [how for what, _, how in events if what == "fetch"]
        gathers = [what for what, _, _ in events if what == "gather"]
        assert len(fetches) == len(gathers) > 0
        k = BATCH // 2 // MICRO
        assert fetches.count("demand") == 3 * k
        assert fetches.count("prefetch") == len(fetches) - 3 * k == 2 * k


def test_disk_files_reserved_and_unlinked(runs):
    """On disk every shard is a map of a file whose blocks were reserved at start (loom.optim.store's
    guarantee: a full disk is an error then, never a SIGBUS later), unlinked at once: nothing is left."""
    for r in runs:
        assert r["disk"]["files"] == []  # the directory was made, its files unlinked while mapped
        assert r["cpu"]["files"] is None  # host memory: no directory


def test_refused_without_zero3():
    cfg = C.apply_overrides(C.LoomConfig(), ["--parallel.zero", "2", "--parallel.offload_params", "cpu"])
    with pytest.raises(C.ConfigError, match=r"^parallel\.offload_params: .*needs parallel\.zero = 3$") as e:
        C.validate(cfg, 2)
    assert "\n" not in str(e.value)
    ok = C.apply_overrides(C.LoomConfig(), ["--parallel.zero", "3", "--parallel.offload_params", "disk"])
    C.validate(ok, 2)


def _save_and_resume(root: str, save: dict, load: dict):
    """ZeRO-3 with ``save``'s options trains 2 steps and saves; ZeRO-3 with ``load``'s options loads
    it into a differently initialised model and goes on; the first run goes on too, for reference."""
    from dataclasses import replace

    from loom.checkpoint import Checkpointer, CheckpointReader
    from loom.checkpoint.save import new_group
    from loom.model.llama import build_model
    from loom.train.build import data_parallel
    from tests.dist import get_mesh
    from tests.helpers import tiny_model, tiny_train

    mesh = get_mesh(dp_shard=2)

    def strategy(seed: int, opts: dict, tag: str):
        cfg = C.LoomConfig(model=tiny_model(), train=tiny_train(steps=4))
        cfg.parallel = replace(cfg.parallel, zero=3, dp=2, dp_shard=2, **opts)
        cfg.run.dir = f"{root}/{tag}"
        model = build_model(cfg.model, seed)
        return model, data_parallel(model, mesh, cfg), cfg

    model, s, cfg = strategy(7, save, "save")
    _steps(model, s, mesh, cfg, (0, 1))
    ck = Checkpointer(f"{root}/ck", torch.distributed.get_rank(), 2, new_group(2, 60))
    ck.save(2, s.sharded_state(), {}, {})
    saved = s.full_state_dict()
    ref = _steps(model, s, mesh, cfg, (2, 3))
    model2, s2, cfg2 = strategy(99, load, "load")
    with CheckpointReader(f"{root}/ck", torch.distributed.get_rank(), 2, ck.group) as reader:
        s2.load_sharded(reader)
    got = s2.full_state_dict()
    same = all(torch.equal(got[k], v) for k, v in saved.items())
    return same, ref, _steps(model2, s2, mesh, cfg2, (2, 3))


def _steps(model, strategy, mesh, cfg, steps: tuple[int, ...]) -> list[float]:
    """These steps of the global batches (this dp rank's rows)."""
    from loom.model.llama import loss_fn
    from loom.train.schedule import lr_at
    from loom.train.step import plain_run, train_step
    from tests.helpers import rank_micro_batches

    return [
        train_step(
            plain_run(model, strategy, loss_fn),
            rank_micro_batches(t, BATCH, MICRO, mesh.local_rank("dp"), 2),
            cfg.train.grad_clip,
            lr_at(t, cfg.train),
            mesh.group("dp"),
        ).loss
        for t in steps
    ]


@pytest.mark.parametrize(
    "save,load,tol",
    [
        ({"offload_params": "disk"}, {}, 0.0),  # offloaded to plain ZeRO-3
        ({}, {"offload_params": "cpu"}, 0.0),  # and back
        (
            {"zeropp_qwz": True, "zeropp_hpz": True, "hpz_group": 2, "zeropp_qgz": True},
            {"offload_params": "cpu"},
            2e-3,
        ),
    ],
)
def test_checkpoint_saved_in_one_mode_resumes_in_another(pools, tmp_path, save, load, tol):
    """The exact parameter shards and optimizer state come back (ZeRO++ saves its exact shards too);
    the resumed run equals the first run going on (ZeRO++ to offload: within the ZeRO++ tolerance)."""
    for same, ref, resumed in pools(2).run(_save_and_resume, str(tmp_path), save, load):
        assert same
        assert_close(torch.tensor(resumed), torch.tensor(ref), rtol=0, atol=tol)
