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

    _, dense = _search("llama3-8b", [], ("a100-80g", 4), 4)
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
