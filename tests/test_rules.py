"""One rules module for layout validity: the planner ranks only layouts ``loom train`` accepts, the
pipeline schedules are the names config validates, and every ``Literal`` field is checked and documented
from its type."""

from __future__ import annotations

import ast
import sys
import typing
from pathlib import Path

import pytest

from loom import config as C
from loom import rules
from loom.plan.auto import local_cluster, refusal
from loom.plan.cost import Layout
from loom.plan.hardware import ClusterSpec
from loom.plan.report import model_of, workload_of
from loom.plan.search import search

MOE = ["--model.n_experts", "4", "--model.top_k", "2"]

# (preset, overrides, cluster, world): tp > 1 (debug: 4 heads, 2 kv heads), MoE, dropout (no cp),
# and a memory-tight 8B where only offloaded optimizer state fits.
CASES = [
    ("debug", [], None, 8),
    ("debug", MOE, None, 4),
    ("debug", ["--model.dropout", "0.1"], None, 4),
    ("debug", ["--finetune.method", "qlora", "--finetune.lora_rank", "4"], None, 4),  # QLoRA: tp = 1 only
    ("debug", ["--parallel.dp_mode", "ps", "--parallel.ps_shards", "2"], None, 4),  # whole-model dp only
    ("llama3-8b", ["--model.n_experts", "8", "--model.n_layers", "8"], ("h100-sxm", 8), 8),
    ("llama3-8b", [], ("a100-80g", 4), 4),
    (
        "gpt-125m",
        ["--parallel.allreduce", "butterfly", "--train.global_batch", "12"],
        ("a100-80g", 6),
        6,
    ),  # no 3- or 6-rank all-reduce group
]


def _search(preset: str, overrides: list[str], cluster, world: int):
    cfg = C.load(preset, [*overrides, "--run.nproc", str(world)])
    cl = local_cluster(world) if cluster is None else ClusterSpec.single_node(*cluster)
    return cfg, search(model_of(cfg), workload_of(cfg), cl, world)


@pytest.mark.parametrize("preset,overrides,cluster,world", CASES)
def test_every_ranked_layout_passes_config_validate(preset, overrides, cluster, world):
    cfg, result = _search(preset, overrides, cluster, world)
    assert result.ranked  # not vacuous
    refused = {e.layout.short(): why for e in result.ranked if (why := refusal(cfg, e.layout))}
    assert not refused


def test_refused_layouts_are_not_ranked_and_say_why():
    cfg, moe = _search("debug", MOE, None, 4)
    assert any(e.layout.ep > 1 and e.layout.zero == 3 for e in moe.ranked)  # expert parallelism with ZeRO 0-3
    assert any(e.layout.tp > 1 for e in moe.ranked)  # experts whole on every tp rank
    capped = C.load("debug", [*MOE, "--moe.capacity_factor", "1.0", "--run.nproc", "2"])
    assert refusal(capped, Layout(dp=1, tp=2, sp=True)).startswith("moe.capacity_factor: capacity is counted")

    _, butterfly = _search(
        "gpt-125m", ["--parallel.allreduce", "butterfly", "--train.global_batch", "12"], ("a100-80g", 6), 6
    )
    assert butterfly.ranked and not any(
        e.layout.dp * e.layout.cp in (3, 6) and e.layout.zero == 0 for e in butterfly.ranked
    )
    assert any(r.startswith("parallel.allreduce: butterfly") for r in butterfly.rejected)

    _, dense = _search("llama3-8b", ["--train.precision", "fp32"], ("a100-80g", 4), 4)  # auto: bf16 fits
    assert not any(e.layout.offload and e.layout.zero == 0 for e in dense.ranked)
    assert any(e.layout.offload for e in dense.ranked)
    assert any(r.startswith("parallel.offload: 'cpu' offloads ZeRO optimizer state") for r in dense.rejected)


@pytest.mark.parametrize(
    "kw,field",
    [
        (dict(tp=2, sp=True, facts=dict(moe_capacity=True)), "moe.capacity_factor"),  # tokens split over tp
        (dict(ep=3), "parallel.ep"),
        (dict(offload="cpu"), "parallel.offload"),
        (dict(cp=16, cp_mode="alltoall"), "parallel.cp_mode"),  # 8 heads over 16 ranks
        (dict(cp=3), "data.seq_len"),
        (dict(pp=2, schedule="pipedream"), "model.tie_embeddings"),
        (dict(pp=2, schedule="interleaved", virtual_stages=2, microbatches=3), "train.global_batch"),
        (dict(pp=2, schedule="2bw", precision="fp16", facts=dict(tie_embeddings=False)), "train.precision"),
        (dict(pp=2, pp_layout="0-3,4-6"), "parallel.pp_layout"),
        (dict(cp=2, recompute="selective"), "train.recompute"),  # the cp kernel replaces CoreAttention
        (dict(dp=2, dp_shard=2), "parallel.dp_shard"),  # ZeRO-0's master path crashed on a sharding group
    ],
)
def test_layout_problems_name_the_field(kw, field):
    kw = dict(kw)
    facts = rules.ModelFacts(
        n_layers=8, n_heads=8, n_kv_heads=4, ffn_dim=512, vocab_size=512, n_experts=4, **kw.pop("facts", {})
    )
    base = dict(seq_len=64, precision="bf16", optimizer="adamw", microbatches=8)
    problems = rules.layout_problems(facts, **(base | kw))
    assert problems and problems[0].split(":")[0].split(" ")[0] == field and "\n" not in problems[0]
    dense = rules.ModelFacts(n_layers=8, n_heads=8, n_kv_heads=4, ffn_dim=512, vocab_size=512)
    assert rules.layout_problems(dense, **base, tp=2, sp=True, pp=2, cp=2, ep=1, zero=3, offload="cpu") == []


def test_schedule_names_live_in_the_ground_layer():
    from loom.parallel.pipeline.schedules import SCHEDULES
    from loom.plan.cost import RECOMPUTE
    from loom.plan.cost import SCHEDULES as MODELLED

    assert tuple(SCHEDULES) == rules.SCHEDULES == C.choices(C._field_types(C.ParallelConfig)["schedule"])
    assert set(rules.ASYNC_SCHEDULES) < set(rules.SCHEDULES) and set(MODELLED) <= set(rules.SCHEDULES)
    assert set(RECOMPUTE) == set(typing.get_args(C.RecomputePolicy))
    tree = ast.parse(Path(rules.__file__).read_text())
    imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert imported <= set(sys.stdlib_module_names) | {"__future__"}  # standard library only


def test_literal_fields_are_checked_and_documented():
    ref = C.reference()
    literal = [
        (s, name, C.choices(t))
        for s, cls in C.SECTIONS.items()
        for name, t in C._field_types(cls).items()
        if C.choices(t)
    ]
    assert {f"{s}.{n}" for s, n, _ in literal} >= {
        "train.precision",
        "train.optimizer",
        "parallel.schedule",
        "parallel.offload",
        "parallel.reduce_dtype",
        "run.device",
    }
    for section, name, allowed in literal:
        line = next(ln for ln in ref.splitlines() if ln.strip().startswith(f"{section}.{name} "))
        assert line.endswith("one of: " + " | ".join(map(str, allowed)))
        cfg = C.LoomConfig()
        setattr(getattr(cfg, section), name, "bogus")
        with pytest.raises(C.ConfigError) as e:
            C.validate(cfg, 2)
        assert (
            str(e.value) == f"{section}.{name}: must be one of {' | '.join(map(str, allowed))}, got 'bogus'"
        )


@pytest.mark.parametrize(
    "problem,overrides,world",
    [
        (rules.world_problem(4, dp=-1, tp=3, pp=1, cp=1, ep=1), ["--parallel.tp", "3"], 4),
        (rules.world_problem(4, dp=3, tp=1, pp=1, cp=1, ep=1), ["--parallel.dp", "3"], 4),
        (rules.sharding_problem(dp=4, dp_shard=3, cp=1, ep=1), ["--parallel.dp_shard", "3"], 4),
        (rules.sharding_problem(dp=4, dp_shard=4, cp=1, ep=3), ["--parallel.ep", "3"], 4),
        (rules.zero_stage_problem(4), ["--parallel.zero", "4"], 2),
        (rules.zero_sharding_problem(0, 2), ["--parallel.dp_shard", "2", "--train.precision", "fp16"], 2),
        (rules.batch_problem(16, 3, 2), ["--train.global_batch", "16", "--train.micro_batch", "3"], 2),
        (
            rules.server_ranks_problem(2, servers=2, dp=-1),
            ["--parallel.dp_mode", "ps", "--parallel.ps_shards", "2", "--parallel.ps_colocate", "false"],
            2,
        ),
        (
            rules.expert_rebalance_problem(rebalance_every=1, hot_experts=1, n_experts=4, ep=1),
            [*MOE, "--moe.rebalance_every", "1"],
            2,
        ),
        (rules.qlora_layout_problem("qlora", 2), ["--finetune.method", "qlora", "--parallel.tp", "2"], 2),
        (
            rules.zero3_options_problem(zero=2, qwz=True),
            ["--parallel.zeropp_qwz", "true", "--parallel.zero", "2"],
            2,
        ),
        (
            rules.zero3_options_problem(zero=3, hpz=True, hpz_group=3, dp_shard=4),
            ["--parallel.zeropp_hpz", "true", "--parallel.hpz_group", "3", "--parallel.zero", "3"],
            4,
        ),
    ],
)
def test_config_validate_raises_the_rules_own_message(problem, overrides, world):
    """The degree and option rules are plain functions of plain values; validate raises their message."""
    assert problem and "\n" not in problem
    cfg = C.load("debug", overrides)
    with pytest.raises(C.ConfigError) as e:
        C.validate(cfg, world)
    assert str(e.value) == problem


def test_mesh_problem_resolves_automatic_degrees():
    assert rules.resolve_degrees(8, dp=-1, dp_shard=-1, tp=2, pp=1, cp=1, zero=1) == (4, 4)
    assert rules.resolve_degrees(8, dp=-1, dp_shard=-1, tp=2, pp=2, cp=1, zero=0) == (2, 1)
    assert rules.mesh_problem(8, dp=-1, dp_shard=-1, tp=2, pp=2, cp=2, ep=1, zero=3) is None
    assert rules.mesh_problem(8, dp=-1, dp_shard=-1, tp=2, pp=1, cp=1, ep=8, zero=0) == (
        "parallel.ep: must divide dp*cp = 4, got 8"
    )


@pytest.mark.parametrize(
    "hpz_group,dp_shard,cp,tp,local,size,refused",
    [
        (0, 8, 1, 1, 8, 8, False),  # one node: the whole sharding group
        (0, 16, 1, 1, 8, 8, False),  # two nodes of 8
        (0, 8, 2, 2, 8, 4, False),  # 4 sharding ranks per node (tp 2), n = 16
        (0, 6, 1, 1, 4, 4, True),  # 4 per node do not divide 6: a group would straddle two nodes
        (2, 6, 1, 1, 4, 2, False),  # an explicit divisor
        (0, 2, 1, 1, 8, 2, False),  # more ranks per node than the group: the group
    ],
)
def test_the_hpz_partition_is_a_divisor_of_the_sharding_group(
    hpz_group, dp_shard, cp, tp, local, size, refused
):
    g, problem = rules.hpz_partition(hpz_group, dp_shard, cp, tp, local)
    assert (problem is not None) == refused
    if not refused:
        assert g == size and (dp_shard * cp) % g == 0


@pytest.mark.parametrize("option", ["zeropp_hpz", "zeropp_qgz"])
def test_hpz_over_nodes_that_split_its_groups_is_refused_before_any_rank_starts(tmp_path, capsys, option):
    """hpZ (or qgZ's first hop) without hpz_group over 3 nodes of 4 ranks with pp 2: sharding groups of
    6 would straddle nodes; it used to fail inside every rank with a ValueError."""
    from loom.cli import main

    argv = ["train", "debug", "--nproc", "4", "--nnodes", "3", "--node-rank", "0"]
    argv += ["--rdzv-endpoint", "127.0.0.1:29999", "--run.dir", str(tmp_path / "run")]
    argv += ["--parallel.pp", "2", "--parallel.dp_shard", "6", "--parallel.zero", "3"]
    argv += [f"--parallel.{option}", "true", "--train.global_batch", "24"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("loom: error: parallel.hpz_group: 4 (unset: 4 ranks per node") and "\n" not in err
    assert not (tmp_path / "run").exists()
