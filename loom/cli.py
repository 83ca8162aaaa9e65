"""``loom`` command line: train, prepare, generate.

Every command validates its configuration before importing torch or starting a process, and
reports a bad field as one line: ``loom: error: <section.key>: <what is allowed>``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import os
import re
import sys
from pathlib import Path

from loom import config as C

USAGE = """loom <command> [CONFIG.toml | PRESET | --config CONFIG] [--section.key value ...]

commands:
  train      train a model (local ranks: --nproc N, same as --run.nproc N)
  prepare    tokenize a corpus into memory-mapped token files
  generate   sample text with a KV cache from a trained run (--run.dir DIR) or a Hugging Face model
             directory (--model.from_hf DIR): --prompt TEXT | --prompts FILE (lines, or .jsonl with
             prompt or messages) [--chat] [--max-new-tokens N] [--temperature T (0 = greedy)]
             [--top-k K] [--top-p P] [--repetition-penalty R] [--seed S] [--stop STR ...]
             [--batch-size N] [--no-cache]
  schedule   draw a simulated pipeline schedule, no training: --pp 4 --microbatches 8
             --schedule 1f1b [--v 2] [--out file.png]; prints its bubble beside the formula
  config     print the resolved config as TOML (--reference: every field with its doc)
  plan       predict memory and speed of layouts and pick the best; plan calibrate | validate |
             verify measure this machine, check predictions, build one rank (see loom plan --help)
  cluster    simulate scheduling policies for many jobs on a shared cluster: simulate --trace
             FILE|synthetic [--cluster FILE] [--policy NAME ...] [--json] [--plot OUT.png]; run real
             jobs on this machine's ranks: run --jobs FILE --devices N --policy NAME [--round-s S]
             [--out DIR]; write sbatch scripts / Kubernetes Jobs: slurm --allocation FILE | --jobs FILE
             --policy NAME --out DIR [--kubernetes] (docs/cluster.md)
  compare    RUN_A RUN_B [--tol T] [--plot OUT.png]: two runs' loss and grad_norm step by step, the
             first step they differ by more than T (default 0); exit 1 if they differ
  checkpoint convert RUN_DIR_OR_CHECKPOINT OUT.safetensors
             export a consolidated single-file model from a checkpoint of any layout
  export hf  RUN_DIR_OR_CHECKPOINT OUT_DIR [--max-shard-size 5GB] [--merge-lora] [--dtype bf16|fp16|fp32]
             a Hugging Face model directory (config, sharded safetensors, tokenizer) from any layout
             (a LoRA run: --merge-lora writes the base with W + (alpha/r)·B A on every target)
  export peft RUN_DIR_OR_CHECKPOINT OUT_DIR
             a LoRA run's adapters for peft.PeftModel.from_pretrained (adapter_config.json + safetensors)

train options: --max-restarts K restarts all ranks after a failure, resuming from the last
checkpoint; --nnodes N --node-rank R --rdzv-endpoint HOST:PORT runs this node's --nproc ranks of a
multi-node job (node 0 hosts the rendezvous); --train.resume PATH starts from any checkpoint
(default: latest in --run.dir). --profile FILE (short for --parallel.profile) names the calibration
profile the planner uses for parallel.auto and the plan_* metrics (loom plan calibrate; default:
./profile.json if present, else the datasheet).
"""


def _split(argv: list[str]) -> tuple[str | None, list[str], dict[str, str]]:
    """Config (first bare arg: a path ending in .toml or a preset name), section overrides, and plain options."""
    path: str | None = None
    overrides: list[str] = []
    plain: dict[str, str] = {}
    i = 0
    while i < len(argv):
        a = argv[i]
        if not a.startswith("--"):
            if path is None and (a.endswith(".toml") or a in C.presets()):
                path = a
                i += 1
                continue
            raise C.ConfigError(
                f"unexpected argument {a!r}; give a config file ending in .toml, a preset "
                f"({', '.join(C.presets())}) or --section.key value"
            )
        key = a[2:].split("=", 1)[0]
        has_eq = "=" in a
        value = a.split("=", 1)[1] if has_eq else (argv[i + 1] if i + 1 < len(argv) else None)
        if value is None:
            raise C.ConfigError(f"{a}: missing value")
        if not has_eq and re.fullmatch(r"--[A-Za-z_][\w-]*(\.[A-Za-z_]\w*)?(=.*)?", value, re.S):
            raise C.ConfigError(
                f"{a}: missing value (the next argument, {value.split('=', 1)[0]}, is an option)"
            )
        step = 1 if has_eq else 2
        if "." in key:
            overrides += [f"--{key}", value]
        else:
            name = key.replace("-", "_")
            if plain.get(name, value) != value:
                print(
                    f"loom: warning: --{key} given twice ({plain[name]!r}, then {value!r}): the later is used",
                    file=sys.stderr,
                )
            plain[name] = value
        i += step
    return path, overrides, plain


def _load(argv: list[str], allowed_plain: tuple[str, ...]) -> tuple[C.LoomConfig, dict[str, str]]:
    path, overrides, plain = _split(argv)
    if "config" in plain:  # `--config FILE`, as loom plan spells it, is the positional config
        given = plain.pop("config")
        if path is not None and path != given:
            raise C.ConfigError(f"--config: {given!r} beside the config {path!r}; give one config")
        path = given
    for k in plain:
        if k not in allowed_plain:
            opts = ", ".join("--" + p.replace("_", "-") for p in allowed_plain) or "none"
            raise C.ConfigError(
                f"--{k.replace('_', '-')}: unknown option; allowed: {opts} and --section.key value"
            )
    cfg = C.load(path, overrides)
    if "nproc" in plain and "run.nproc" in C.overridden(cfg) and plain["nproc"] != str(cfg.run.nproc):
        raise C.ConfigError(f"--nproc {plain['nproc']} and --run.nproc {cfg.run.nproc}: both given; give one")
    if "nproc" in plain:
        _apply_nproc(cfg, plain["nproc"])
    return cfg, plain


def _apply_nproc(cfg: C.LoomConfig, value: str) -> None:
    """``--nproc N`` as ``--run.nproc N``, its errors naming the option that was typed."""
    try:
        C.apply_overrides(cfg, ["--run.nproc", value])
    except C.ConfigError as e:
        raise C.ConfigError(str(e).replace("run.nproc:", "--nproc:", 1)) from None
    if cfg.run.nproc < 1:
        raise C.ConfigError(f"--nproc: must be >= 1, got {cfg.run.nproc}")


def cmd_train(argv: list[str]) -> int:
    from loom.launch import (
        TRAIN_OPTIONS,
        apply_slurm_env,
        check_launcher_env,
        launch_options,
        quiet_launcher_store_logs,
        under_external_launcher,
    )

    cfg, plain = _load(argv, (*TRAIN_OPTIONS, "profile"))
    profile = plain.pop("profile", None)  # short for --parallel.profile
    if profile is not None:
        if cfg.parallel.profile and cfg.parallel.profile != profile:
            raise C.ConfigError(
                f"--profile {profile!r} and parallel.profile = {cfg.parallel.profile!r} disagree; give one"
            )
        cfg.parallel.profile = profile
    opts = launch_options(plain)  # --max-restarts, --nnodes, --node-rank, --rdzv-endpoint (one-line errors)
    quiet_launcher_store_logs(opts.nodes)  # before torch is imported

    apply_slurm_env()  # srun without torchrun: one rank per task
    check_launcher_env()  # RANK/WORLD_SIZE left over without a launcher would hang
    if cfg.model.from_hf:  # shape and tokenizer from the directory, fine-tuning defaults, data required
        from loom.model.hf import resolve_from_hf

        note = resolve_from_hf(cfg)
        if note:
            print(note, flush=True)
    if cfg.parallel.auto:  # the planner picks the layout for the world size (every rank alike under torchrun)
        from loom.plan.auto import apply_auto, describe

        world = int(os.environ["WORLD_SIZE"]) if under_external_launcher() else opts.world(cfg)
        try:
            print(describe(apply_auto(cfg, world), cfg), flush=True)
        except ValueError as e:  # PlanError / HardwareError: say it like any bad field
            raise C.ConfigError(
                str(e) if str(e).startswith(("parallel.auto", "parallel.profile")) else f"parallel.auto: {e}"
            ) from None
    if under_external_launcher():  # every rank checks before any process group exists
        world = int(os.environ["WORLD_SIZE"])
        local = int(os.environ.get("LOCAL_WORLD_SIZE") or world)
        if "run.nproc" in C.overridden(cfg) and cfg.run.nproc != local:  # typed now: never silently dropped
            raise C.ConfigError(
                f"--nproc: {cfg.run.nproc} given, but a launcher started this process as rank "
                f"{os.environ['RANK']} of WORLD_SIZE={world} ({local} on this node; RANK, WORLD_SIZE and "
                "MASTER_ADDR are set); drop --nproc, or unset those variables for a local run"
            )
        C.validate(cfg, world)
    else:
        world = opts.world(cfg)  # run.nproc per node times --nnodes, or the explicit degrees
        nodes = opts.nodes.nnodes if opts.nodes else 1
        if cfg.parallel.dp > 0 and world != cfg.run.nproc * nodes:
            p = cfg.parallel
            raise C.ConfigError(
                f"run.nproc: {cfg.run.nproc} ranks{f' per node on {nodes} nodes' if nodes > 1 else ''}, but "
                f"parallel.dp*tp*pp*cp = {p.dp}*{p.tp}*{p.pp}*{p.cp} = {world}; "
                + (
                    f"give --nproc {world // nodes}"
                    if world % nodes == 0
                    else f"{world} ranks do not split over {nodes} nodes"
                )
                + ", or leave parallel.dp unset so it follows run.nproc"
            )
        C.validate(cfg, world)
    _check_hpz_nodes(cfg, int(os.environ.get("LOCAL_WORLD_SIZE", 0)) if under_external_launcher() else 0)
    from loom.plan.auto import check_fits

    C.check_intent(cfg)  # explicit settings the run would silently not honour
    from loom.train.trackers import tracker_names

    tracker_names(cfg.run.trackers)  # each one named is installed, before any process starts
    measured = None
    if cfg.parallel.profile:  # read as the trainer's plan_* metrics will read it, before any rank starts
        from loom.plan.auto import _device_of, load_profile

        try:
            measured = load_profile(world, cfg.parallel.profile, device=_device_of(cfg))
        except (ValueError, KeyError, TypeError) as e:  # HardwareError, a field missing or mistyped
            text = (
                str(e)
                if str(e).startswith("parallel.profile")
                else f"parallel.profile: {cfg.parallel.profile}: {e}"
            )
            raise C.ConfigError(text) from None
    check_fits(cfg, world, measured)  # what cannot fit this machine's memory, before anything is allocated
    _check_run_dir(cfg)
    if not under_external_launcher():  # under torchrun/srun every rank checks its data itself
        _check_data(cfg)
    from loom.checkpoint.format import naming_writes
    from loom.launch import main_train

    with naming_writes(f"run.dir {cfg.run.dir}"):  # a failed write (disk full) in this process names where
        return main_train(cfg, opts.max_restarts, opts.nodes)


def _check_hpz_nodes(cfg: C.LoomConfig, local_world: int) -> None:
    """hpZ and qgZ without ``parallel.hpz_group`` take one node's ranks as their group (hpZ's partition,
    qgZ's first hop): they must divide the sharding group (``local_world``: torchrun's
    ``LOCAL_WORLD_SIZE``; 0: ``run.nproc`` per node)."""
    p = cfg.parallel
    if not (p.zero == 3 and (p.zeropp_hpz or p.zeropp_qgz)) or p.hpz_group:
        return
    from loom.rules import hpz_partition

    problem = hpz_partition(p.hpz_group, p.dp_shard, p.cp, p.tp, local_world or cfg.run.nproc)[1]
    if problem:
        raise C.ConfigError(problem)


# what a run writes in run.dir, and whether each is a directory
RUN_ENTRIES = {
    "metrics.jsonl": False,
    "tokenizer.json": False,
    "data.json": False,
    "trackers.json": False,
    "tokenizer_config.json": False,  # the tokenizer's side files the run keeps (loom.checkpoint.hf_export)
    "special_tokens_map.json": False,
    "chat_template.jinja": False,
    "chat_templates": True,
    "checkpoints": True,
    "checkpoints/latest": False,  # the pointer to the newest checkpoint, rewritten by every save
    "heartbeat": True,
    "logs": True,
    "tensorboard": True,
    "profile": True,
}


# files a run writes into run.dir, and those of a Hugging Face model directory
_RUN_WRITES = (
    "config.toml",
    "metrics.jsonl",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
)
_MODEL_FILES = ("config.json", "model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")


def foreign_run_files(d: Path) -> list[str]:
    """Files in an existing ``run.dir`` that a run would overwrite or append to but did not write: a
    run writes its config together with its data identity (``data.json``), so a directory without that
    or a checkpoint is not a run's (a project folder, a Hugging Face model directory)."""
    from loom.checkpoint.format import DATA_IDENTITY

    if not d.is_dir() or (d / DATA_IDENTITY).is_file() or (d / "checkpoints").is_dir():
        return []
    return [n for n in _RUN_WRITES + _MODEL_FILES if (d / n).is_file()]


def _check_run_dir(cfg: C.LoomConfig) -> None:
    """``run.dir`` is (or can become) a writable directory, and a checkpoint to resume exists."""
    d = cfg.run.dir
    _check_path_length(d)
    if Path(d).expanduser().exists() and not Path(d).expanduser().is_dir():
        raise C.ConfigError(f"run.dir: {d!r} is a file, not a directory")
    for name, is_dir in RUN_ENTRIES.items():  # found by the ranks, after they started, before
        entry = Path(d).expanduser() / name
        if entry.is_symlink() and not entry.exists():  # exists() follows the link: a loop or a missing target
            raise C.ConfigError(
                f"run.dir: {str(entry)!r} is a symbolic link that leads nowhere (a loop, or to the missing "
                f"{os.readlink(entry)!r}); remove it, or choose another run.dir"
            )
        if entry.is_file() and (why := _unappendable(entry)) is not None:
            raise C.ConfigError(
                f"run.dir: {str(entry)!r} cannot be written ({why}; a run appends to it or rewrites it); "
                "fix its permissions, or choose another run.dir"
            )
        if entry.exists() and entry.is_dir() != is_dir:
            kind, want = ("a directory", "a file") if entry.is_dir() else ("a file", "a directory")
            raise C.ConfigError(
                f"run.dir: {str(entry)!r} is {kind}, where a run keeps {want}; move it, or choose another run.dir"
            )
    problem = C._unwritable(d)
    if problem is not None:
        raise C.ConfigError(f"run.dir: {problem}")
    foreign = foreign_run_files(Path(d).expanduser())
    if foreign:
        raise C.ConfigError(
            f"run.dir: {d!r} holds {', '.join(foreign)}, which no Loom run wrote (a run writes its own "
            "config, metrics and tokenizer there); choose a new or empty run.dir, or move them"
        )
    from loom.checkpoint.format import enclosing_checkpoint

    inside = enclosing_checkpoint(d)
    if inside is not None:
        raise C.ConfigError(
            f"run.dir: {d!r} lies inside the checkpoint directory {str(inside)!r}; a run there would write "
            "into a checkpoint; choose a run.dir outside it"
        )
    if cfg.train.resume:
        from loom.checkpoint.integrity import read_manifest
        from loom.checkpoint.load import find

        found = find(cfg.train.resume)
        if found is None:
            raise C.ConfigError(f"train.resume: {cfg.train.resume} holds no complete checkpoint")
        read_manifest(*found)  # the manifest has the hash latest recorded, before run.dir is touched
    _check_resume_step(cfg)


def _unappendable(path: Path) -> str | None:
    """Why ``path`` cannot be opened for appending (nothing is written), or None: the permission
    bits, a read-only mount or an immutable file, as the run's first write would find them."""
    try:
        with open(path, "ab"):
            return None
    except OSError as e:
        return e.strerror or str(e)


# the longest path a run writes under run.dir (a checkpoint's shard while it is being written)
LONGEST_RUN_PATH = "checkpoints/.tmp-step-00000000/shard-00000-of-00000.safetensors"


def _check_path_length(d: str) -> None:
    """``run.dir`` leaves room for every path a run writes: each component within the file system's
    NAME_MAX, run.dir plus :data:`LONGEST_RUN_PATH` within its PATH_MAX (found before any step is
    trained, not at the first checkpoint)."""
    path = Path(d).expanduser().absolute()
    probe = path
    while probe.parent != probe and not os.path.exists(probe):  # os.path: False for a name too long
        probe = probe.parent
    try:
        name_max, path_max = os.pathconf(probe, "PC_NAME_MAX"), os.pathconf(probe, "PC_PATH_MAX")
    except (OSError, ValueError):
        return
    longest = max(path.parts, key=len)
    if len(os.fsencode(longest)) > name_max:
        raise C.ConfigError(
            f"run.dir: a component of {d!r} has {len(os.fsencode(longest))} bytes, more than the file "
            f"system's {name_max}; choose a shorter run.dir"
        )
    need = len(os.fsencode(str(path / LONGEST_RUN_PATH)))
    if need >= path_max:
        raise C.ConfigError(
            f"run.dir: {len(os.fsencode(str(path)))} bytes long: the checkpoints a run writes under it "
            f"would need paths of {need} bytes, beyond the file system's {path_max}; choose a shorter run.dir"
        )


def _check_resume_step(cfg: C.LoomConfig) -> None:
    """A resumed run continues the model, optimizer and data position its checkpoint was saved with
    (:func:`~loom.checkpoint.training.check_resumable`) and has steps left: ``train.steps`` below the
    checkpoint's step would train nothing and rewrite the final model's record (refused before
    anything is written)."""
    from loom.checkpoint import format as F
    from loom.checkpoint.load import find

    where = cfg.train.resume or (Path(cfg.run.dir) / "checkpoints")
    if not cfg.train.resume and not Path(where).is_dir():
        return
    try:
        found = find(where)
        ts = F.read_json(found[0] / F.TRAIN_STATE) if found else {}
        step = int(ts.get("step", 0))
    except (F.CheckpointError, OSError, ValueError, TypeError, AttributeError):
        return  # unreadable: the trainer's own checks name it
    if found:  # the model, optimizer and data position it was saved with, before any rank starts
        from loom.checkpoint.training import check_resumable

        try:
            check_resumable(ts, cfg, found[0])
        except F.CheckpointError as e:
            raise C.ConfigError(str(e)) from None
    if cfg.train.steps < step:
        raise C.ConfigError(
            f"train.steps: {cfg.train.steps} is below step {step} of the checkpoint {found[0] if found else where} "
            f"this run resumes; give train.steps > {step} to train on (or a new run.dir)"
        )


def _check_data(cfg: C.LoomConfig) -> None:
    """Prepare (or load and verify) the data before any rank starts or anything is written to
    ``run.dir``; a resumed run must continue on the data it started with."""
    from loom.data import prepare_data, prepare_sources
    from loom.data.dataset import check_one_window

    if cfg.data.tokenizer:  # the tokenizer given (or model.from_hf's) before the corpus is read: its
        # end-of-document token, and ids the model's vocabulary holds
        from loom.data.tokenizer import eot_id, load_tokenizer

        path = cfg.data.tokenizer
        from_hf = bool(cfg.model.from_hf) and Path(path).is_relative_to(cfg.model.from_hf)
        try:
            tok = load_tokenizer(path)
            eot_id(tok, path)
            C.check_vocab(cfg, tok.get_vocab_size())
        except C.ConfigError as e:
            said = str(e) if path in str(e) else f"{e} ({path})"
            raise C.ConfigError(f"{said}{' (the tokenizer of model.from_hf)' if from_hf else ''}") from None
    every = (
        prepare_sources(cfg.data, cfg.run.progress)
        if cfg.data.sources
        else [prepare_data(cfg.data, progress=cfg.run.progress, explicit=C.overridden(cfg))]
    )
    prepared = every[0]  # the validation tokens of the first source; training windows of each
    for p in every:
        check_one_window(p.train_path, p.n_train_tokens, cfg.data.seq_len)
    if cfg.train.eval_every:  # the held-out loss needs one window
        check_one_window(prepared.val_path, prepared.n_val_tokens, cfg.data.seq_len)
    cfg.data.prepared_dir = str(prepared.dir)
    C.check_vocab(cfg, prepared.vocab_size)
    if cfg.train.init_from:  # each rank would find a tensor missing or of another shape only once started
        from loom.train.init_from import check_init_from

        check_init_from(cfg, prepared.vocab_size)
    run_dir = Path(cfg.run.dir)
    if not (run_dir / "data.json").is_file() and not (run_dir / "tokenizer.json").is_file():
        return
    from loom.checkpoint.load import find
    from loom.train.setup import check_data_record, check_same_data, data_identity

    check_data_record(run_dir)
    resumes = cfg.train.resume or ((run_dir / "checkpoints").is_dir() and find(run_dir) is not None)
    if resumes:
        check_same_data(run_dir, data_identity(prepared))


def cmd_prepare(argv: list[str]) -> int:
    verify = "--verify" in argv
    cfg, _ = _load([a for a in argv if a != "--verify"], ())
    C.validate(cfg, 1)
    C.check_intent(cfg)  # data.prepared_dir beside [[data.sources]], ...: as loom train refuses them
    from loom.data import prepare_data
    from loom.data.prepare import META, default_dir, verify_full

    if verify:  # every byte against the SHA-256 recorded at prepare time (loading checks samples)
        d = Path(cfg.data.prepared_dir).expanduser() if cfg.data.prepared_dir else default_dir(cfg.data)
        if not (d / META).is_file():
            raise C.ConfigError(
                f"data.prepared_dir: {d} is not prepared yet; run loom prepare without --verify"
            )
        prepared = verify_full(d)
        print(
            f"verified {prepared.dir}: train.bin, val.bin and tokenizer.json match the SHA-256 recorded in {META}; "
            f"every token id is below the vocabulary of {prepared.vocab_size}"
        )
        return 0
    from loom.data import prepare_sources

    every = (
        prepare_sources(cfg.data, cfg.run.progress)
        if cfg.data.sources
        else [prepare_data(cfg.data, cfg.run.progress, explicit=C.overridden(cfg))]
    )
    for prepared in every:  # one line per [[data.sources]] table
        print(
            f"prepared {prepared.n_train_tokens:,} train + {prepared.n_val_tokens:,} val tokens "
            f"(vocab {prepared.vocab_size}) in {prepared.dir}"
        )
    return 0


GENERATE_OPTIONS = {
    "prompt": str,
    "prompts": str,
    "max_new_tokens": int,
    "temperature": float,
    "top_k": int,
    "top_p": float,
    "repetition_penalty": float,
    "seed": int,
    "batch_size": int,
}
GENERATE_FLAGS = ("--chat", "--no-cache")  # options without a value
GENERATE_SOURCES = ("--run.dir", "--model.from_hf")


def cmd_generate(argv: list[str]) -> int:
    flags = {a for a in argv if a in GENERATE_FLAGS}
    rest, stop = [], []
    it = iter(a for a in argv if a not in GENERATE_FLAGS)
    for a in it:
        if a == "--stop" or a.startswith("--stop="):
            value = a.split("=", 1)[1] if "=" in a else next(it, None)
            if value is None:
                raise C.ConfigError("--stop: missing value")
            stop.append(value)
        else:
            rest.append(a)
    path, overrides, plain = _split(rest)
    allowed = ", ".join(
        [
            *GENERATE_SOURCES,
            *("--" + a.replace("_", "-") for a in GENERATE_OPTIONS),
            "--stop",
            *GENERATE_FLAGS,
        ]
    )
    for k in plain:
        if k not in GENERATE_OPTIONS:
            raise C.ConfigError(f"--{k.replace('_', '-')}: unknown option; allowed: {allowed}")
    if path is not None:
        raise C.ConfigError(f"generate: takes no config file ({path!r}); the run's own config.toml is used")
    sources = dict(zip(overrides[::2], overrides[1::2], strict=True))
    for k in sources:
        if k not in GENERATE_SOURCES:
            raise C.ConfigError(
                f"{k[2:]}: generate reads only --run.dir (a Loom run) or --model.from_hf (a Hugging "
                "Face model directory) from the config"
            )
    if len(sources) != 1:
        raise C.ConfigError(
            "generate: give one model: --run.dir DIR (a directory written by loom train) or "
            "--model.from_hf DIR (a Hugging Face model directory)"
        )
    spelled = {
        a[2:].split("=", 1)[0].replace("-", "_"): a.split("=", 1)[0] for a in rest if a.startswith("--")
    }
    opts = {k: C._coerce(v, GENERATE_OPTIONS[k], spelled.get(k, f"--{k}")) for k, v in plain.items()}
    from loom.generate.options import SamplingOptions, read_prompts

    sampling = SamplingOptions(
        **{
            k: opts[k]
            for k in ("max_new_tokens", "temperature", "top_k", "top_p", "repetition_penalty", "seed")
            if k in opts
        },
        stop=tuple(stop),
    ).check()
    if problem := sampling.greedy_problem(set(opts), spelled.get("temperature", "--temperature")):
        raise C.ConfigError(problem)  # an explicit temperature of 0 beside an explicit top-k: which is meant?
    batch_size = opts.get("batch_size", 8)
    if batch_size < 1:
        raise C.ConfigError(f"--batch-size: must be >= 1, got {batch_size}")
    if "prompt" in opts and "prompts" in opts:
        raise C.ConfigError("--prompts: give --prompt TEXT or --prompts FILE, not both")
    chat = "--chat" in flags
    prompts = read_prompts(opts["prompts"], chat) if "prompts" in opts else [opts.get("prompt", "def ")]
    ((key, where),) = sources.items()
    if key == "--model.from_hf" and not Path(where).is_dir():
        raise C.ConfigError(f"model.from_hf: {where!r} is not a directory (a Hugging Face model directory)")
    from loom.generate.run import main as generate_main
    from loom.generate.source import load_hf, load_run

    src = load_run(where) if key == "--run.dir" else load_hf(where)
    if problem := sampling.with_defaults(src.sampling).greedy_problem(
        set(opts), f"the default temperature of {src.what} (generation_config.json)"
    ):  # the model's own default is greedy: the explicit option is kept but does nothing, so say so
        print(f"loom: warning: {problem}", file=sys.stderr)
    window = src.model.cfg.max_seq_len
    if "max_new_tokens" not in opts and sampling.max_new_tokens > window:  # the default: within the window
        sampling = dataclasses.replace(sampling, max_new_tokens=window)
    if opts.get("max_new_tokens", 0) > window:  # the window slides: past it the prompt is out of sight
        raise C.ConfigError(
            f"{spelled.get('max_new_tokens', '--max-new-tokens')}: {opts['max_new_tokens']} new tokens exceed "
            f"model.max_seq_len = {window}, the most the model attends to; give at most {window}"
        )
    return generate_main(
        src, prompts, sampling, chat, batch_size, "--no-cache" not in flags, "prompts" in opts
    )


def cmd_checkpoint(argv: list[str]) -> int:
    from loom.checkpoint.convert import main as convert_main

    _no_empty_paths(argv)
    out = argv[-1] if len(argv) == 3 else None
    from loom.checkpoint.format import naming_writes

    with _output_lock(out), naming_writes(out or "the output"):
        return convert_main(argv)


def cmd_export(argv: list[str]) -> int:
    from loom.checkpoint.hf_export import main as export_main

    _no_empty_paths(argv)
    formats = ("hf", "peft")
    if argv and not argv[0].startswith("-") and argv[0] not in formats:
        raise C.ConfigError(f"loom export: unknown format {argv[0]!r}; choose one of: {', '.join(formats)}")
    if argv[:1] == ["peft"] or "--merge-lora" in argv:  # a LoRA run: its adapters (PEFT), or merged weights
        from loom.finetune.export import main as lora_main

        export_main = lora_main
    values = {i + 1 for i, a in enumerate(argv) if a == "--max-shard-size"}
    for i in values:
        if i < len(argv):
            from loom.checkpoint.hf_export import parse_size

            if parse_size(argv[i]) < 1:  # 0 would write one shard per tensor
                raise C.ConfigError(f"--max-shard-size: must be at least 1 byte (e.g. 5GB), got {argv[i]!r}")
    values |= {i + 1 for i, a in enumerate(argv) if a == "--dtype"}
    positional = [a for i, a in enumerate(argv) if not a.startswith("--") and i not in values]
    out = positional[-1] if len(positional) == 3 else None
    from loom.checkpoint.format import naming_writes

    with _output_lock(out), naming_writes(out or "the output"):
        return export_main(argv)


def _no_empty_paths(argv: list[str]) -> None:
    """An empty argument is refused naming it: an option's value by the option, else a path."""
    for i, a in enumerate(argv):
        if not a.strip():
            if i > 0 and argv[i - 1].startswith("--"):
                raise C.ConfigError(f"{argv[i - 1]}: an empty value was given")
            raise C.ConfigError(
                "an empty path was given; name a checkpoint or run directory and an output path"
            )


def _output_lock(out: str | None):
    """Hold the lock of the run directory ``out`` lies in (if any) while writing there, so an export
    into a directory a running job owns is refused naming the job (loom.train.run_lock)."""
    from loom.train.run_lock import LOCK_NAME, RunLock

    if out is None:
        return contextlib.nullcontext()
    p = Path(out).expanduser().absolute()
    for d in (p, *p.parents):
        if (d / LOCK_NAME).is_file():
            return RunLock(d)
    return contextlib.nullcontext()


def cmd_config(argv: list[str]) -> int:
    if "--reference" in argv:
        print(C.reference())
        return 0
    cfg, _ = _load(argv, ("nproc",))
    note = None
    if cfg.model.from_hf:  # what loom train would run: the directory's model, fine-tuning defaults
        from loom.model.hf import resolve_from_hf

        note = resolve_from_hf(cfg)
    C.validate(cfg, C.world_size_of(cfg))
    C.check_intent(cfg)
    print((f"# {note}\n" if note else "") + C.dump_toml(cfg), end="")
    return 0


def cmd_plan(argv: list[str]) -> int:
    from loom.plan.cli import main as plan_main

    if argv[:1] == ["verify"]:  # builds and steps one rank for real: the training side (loom.train.verify)
        from loom.plan.cli import cluster_of
        from loom.train.verify import main as verify_main

        return verify_main(argv[1:], cluster_of)

    return plan_main(argv)


COMMANDS = {
    "train": cmd_train,
    "config": cmd_config,
    "plan": cmd_plan,
    "prepare": cmd_prepare,
    "generate": cmd_generate,
    "checkpoint": cmd_checkpoint,
    "export": cmd_export,
}


SCHEDULE_MAX_ACTIONS = 300_000  # actions of one simulated step (seconds to simulate: 10^6 took 22 s)


def cmd_schedule(argv: list[str]) -> int:
    """Simulate one step's schedule (per stage t_f = 1, t_b = 2, t_w = 1; a chunk 1/v of that), print, draw."""
    path, overrides, plain = _split(argv)
    allowed = ("pp", "microbatches", "schedule", "v", "out")
    for k in [*plain, *overrides[::2]]:
        if k.lstrip("-") not in allowed:
            raise C.ConfigError(
                f"--{k.lstrip('-')}: unknown option; allowed: {', '.join('--' + a for a in allowed)}"
            )
    if path is not None:
        raise C.ConfigError(f"schedule: takes no config file, got {path!r}")
    name = plain.get("schedule", "1f1b")
    chunks = "2" if name == "interleaved" else "1"  # interleaved runs >= 2 chunks per rank: 2 unless given
    pp, m, v = (
        C._coerce(plain.get(k, d), int, f"--{k}")
        for k, d in (("pp", "4"), ("microbatches", "8"), ("v", chunks))
    )
    if "out" in plain:  # before the simulation: the picture is drawn last
        C.check_picture_path("--out", plain["out"], ("png", "svg"))
    for opt, n in (("--pp", pp), ("--microbatches", m), ("--v", v)):
        if n < 1:
            raise C.ConfigError(f"{opt}: must be >= 1, got {n}")
    from loom.rules import interleaved_chunks_problem

    if interleaved_chunks_problem(name, pp, v):
        raise C.ConfigError(
            f"--v: the interleaved schedule runs >= 2 chunks per rank, got {v} (that is 1F1B)"
        )
    actions = 3 * pp * m * v  # forward, backward (input and weight) per stage, micro-batch and chunk
    if actions > SCHEDULE_MAX_ACTIONS:
        raise C.ConfigError(
            f"--microbatches: --pp {pp} x --microbatches {m} x --v {v} is {actions:,} schedule actions, more "
            f"than the {SCHEDULE_MAX_ACTIONS:,} this simulator draws; give fewer stages or micro-batches"
        )
    from loom.parallel.pipeline.runtime import bubble_formula, step_schedule
    from loom.parallel.pipeline.simulate import simulate

    try:
        timeline = simulate(
            step_schedule(name, pp, m, v), t_f=1.0 / v, t_b=2.0 / v
        )  # a chunk is 1/v of a stage
    except ValueError as e:
        raise C.ConfigError(f"schedule: {e}") from None
    print(
        f"{name}: pp={pp} microbatches={m} v={v} | simulated bubble {timeline.bubble:.1%} "
        f"vs formula {bubble_formula(name, pp, m, v):.1%} | makespan {timeline.makespan:g} (per stage t_f=1, t_b=2) | "
        f"peak in-flight per rank {timeline.peak_in_flight}"
    )
    if "out" in plain:
        from loom.parallel.pipeline.picture import draw_timeline

        print(f"wrote {draw_timeline(timeline, plain['out'], title=f'{name} pp={pp} m={m} v={v}')}")
    return 0


COMMANDS["schedule"] = cmd_schedule


def cmd_compare(argv: list[str]) -> int:
    from loom.train.compare import main as compare_main

    return compare_main(argv)


COMMANDS["compare"] = cmd_compare


def cmd_cluster(argv: list[str]) -> int:
    from loom.cluster.cli import main as cluster_main

    return cluster_main(argv)


COMMANDS["cluster"] = cmd_cluster


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(USAGE)
        return 0
    cmd, rest = argv[0], argv[1:]
    if cmd not in COMMANDS:
        print(f"loom: error: unknown command {cmd!r}; commands: {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    if ("-h" in rest or "--help" in rest) and cmd not in ("plan", "cluster"):
        print(USAGE)
        return 0
    from loom.data.report import launcher_lines

    try:  # what preparing data logs reaches stderr (rank 0 repeats a mixture's lines under train)
        with launcher_lines(cmd in ("prepare", "train"), ranks_repeat=cmd == "train"):
            return COMMANDS[cmd](rest)
    except KeyboardInterrupt:  # Ctrl-C outside training (the trainer stops at a step and saves)
        print("loom: interrupted by SIGINT", file=sys.stderr)
        return 128 + 2
    except Exception as e:
        line = error_line(e)
        if line is None:
            raise
        print(f"loom: error: {line}", file=sys.stderr)
        return 2


def run() -> None:
    """The ``loom`` command (and ``python -m loom``): :func:`main`, then exit. The heap is frozen
    first (``gc.freeze``): the interpreter's collections at exit traversed every object a trained
    process holds, about a second per process; finalizers and ``atexit`` still run."""
    code = main()
    gc.freeze()
    sys.exit(code)


def error_line(e: BaseException) -> str | None:
    """The one line for Loom's own errors (their message names the field or file) and for operating
    system errors (named by their path); None for anything else, which keeps its traceback."""
    from loom.launch import OWN_ERRORS

    if isinstance(e, C.ConfigError) or type(e).__name__ in OWN_ERRORS:
        text = str(e)
    elif isinstance(e, OSError):
        what = e.strerror or str(e)
        text = f"{e.filename}: {what}" if e.filename else what
    else:
        return None
    return "; ".join(part.strip() for part in text.strip().splitlines() if part.strip())


if __name__ == "__main__":  # pragma: no cover
    run()
