"""What a training run saves and restores: strategy state, every rank's RNG, data position,
fp16 loss scale, config.

Each rank's RNG states travel as a tensor in its own shard (:func:`loom.checkpoint.rng.rng_name`):
a resuming rank reads its own R ≈ 20 KB, not the world · R of a list in ``train_state.json``
(checkpoints written before keep that list, and are still read).

The data position is the sampler's (:meth:`loom.data.BatchSampler.position`): the global sequences
consumed, each source's count and epoch, the seed and the sources' identity. The sampler is a pure
function of (seed, position, step), so a resume continues with exactly the samples the uninterrupted
run would have drawn next, on any data-parallel size, micro-batch and accumulation; with another
``train.global_batch`` it continues at the first unseen sequence. Resuming requires the same
``train.seed`` and ``data.seq_len`` and the same sources (checked by the sampler), the same
``train.optimizer`` (its state is that optimizer's) and the same model: every field the checkpoint
recorded that changes what its weights compute (:mod:`loom.checkpoint.recorded`: not dropout,
init_std, from_hf, hf_architecture or pad_vocab_to; ``model.max_seq_len`` may grow or shrink with
RoPE, whose angles do not depend on it (context extension), not with learned positions, whose table
it sizes). Everything else (layout, world size, global batch, ``train.steps``, learning rate,
dropout) may change.

Which checkpoint a run starts from (decided by rank 0, broadcast to all):

1. after an elastic restart (``TORCHELASTIC_RESTART_COUNT > 0``): ``latest`` of ``run.dir``;
2. ``train.resume`` if set (a run dir, a ``checkpoints`` dir or one checkpoint);
3. ``latest`` of ``run.dir`` if it holds one;
4. none: a fresh start.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol, cast

from loom import config as C
from loom.checkpoint.convert import convert
from loom.checkpoint.format import (
    MANIFEST,
    TOKENIZER_SHA256,
    CheckpointError,
    check_trained_tokenizer,
    write_bytes_atomic,
)
from loom.checkpoint.load import CheckpointReader, find
from loom.checkpoint.protocol import Shardable, ShardedTensor
from loom.checkpoint.recorded import free_on_resume, model_changes, recorded_config
from loom.checkpoint.rng import capture_rng, restore_rng, rng_from_tensor, rng_name, rng_tensor
from loom.checkpoint.save import Checkpointer, broadcast_json, list_checkpoints, new_group

log = logging.getLogger("loom")
POSITION_FIELDS = (("train", "seed"), ("data", "seq_len"))


class DataPosition(Protocol):
    """What the checkpoints need of the sampler (:class:`loom.data.BatchSampler`)."""

    def position(self, step: int) -> dict: ...

    def resume(self, saved: dict, step: int, where: str = ...) -> None: ...


def restart_count() -> int:
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


def choose_source(cfg: C.LoomConfig, run_dir: Path) -> list[tuple[str, str | None]]:
    """The checkpoints to try, in order (see module doc), each with the manifest hash ``latest``
    recorded for it (None when not chosen through ``latest``); empty for a fresh start. Chosen in
    ``run.dir``: the older complete checkpoints follow as fallbacks. Named by ``train.resume``:
    that one only (a damaged one is refused, never replaced by another)."""
    own = find(run_dir) if (run_dir / "checkpoints").is_dir() else None
    if own is not None and (restart_count() > 0 or not cfg.train.resume):
        older = [
            (str(p), None)
            for _, p in reversed(list_checkpoints(run_dir / "checkpoints"))
            if p != own[0] and (p / MANIFEST).is_file()
        ]
        return [(str(own[0]), own[1]), *older]
    if cfg.train.resume:
        found = find(cfg.train.resume)
        if found is None:
            raise CheckpointError(f"train.resume: {cfg.train.resume} holds no complete checkpoint")
        return [(str(found[0]), found[1])]
    return []


def truncate_metrics(run_dir: Path, step: int, name: str = "metrics.jsonl") -> None:
    """Drop the rows of ``run_dir/name`` past ``step`` (written by an attempt that died before its
    next checkpoint) and a torn last line (killed mid-write: no newline ends it). Any other line that
    is no row (not UTF-8, not a JSON object with an integer ``step``) is the user's: kept as it is."""
    path = run_dir / name
    if not path.is_file():
        return
    data = path.read_bytes()
    *lines, last = data.split(b"\n")  # last: b"" after a final newline, else a torn row
    keep = [ln for ln in lines if (_row_step(ln) or 0) <= step]  # None: no row, kept
    if (at := _row_step(last)) is not None and at <= step:  # a whole row, lacking only its newline
        keep.append(last)
    out = b"".join(ln + b"\n" for ln in keep)
    if out != data:
        write_bytes_atomic(path, out)


def _row_step(line: bytes) -> int | None:
    """The step of a metrics row; None for a line that is no row (not UTF-8, not a JSON object
    with an integer ``step``)."""
    import json

    try:
        row = json.loads(line.decode("utf-8"))
    except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError
        return None
    value = row.get("step") if isinstance(row, dict) else None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def check_base(
    was: dict | None,
    now: dict | None,
    ckpt: Path | str,
    method: str,
    todo: str = "resume on the same base, or start a new run.dir",
) -> None:
    """The one rule binding a LoRA checkpoint to its base, for resuming, generating and exporting:
    ``was`` (the checkpoint's ``finetune_base``) and ``now`` (the base at hand, by
    :func:`loom.finetune.base.base_identity`) have the same SHA-256, and a full fine-tune's
    checkpoint (no base) never meets adapters. ``method``: the finetune.method at hand; ``todo``:
    what to do instead. Raises one :class:`~loom.config.ConfigError` line naming both bases."""
    if was is None and now is None:
        return
    if was is None or now is None:
        kind = "holds every weight (a full fine-tune)" if was is None else "holds LoRA adapters only"
        raise C.ConfigError(
            f"finetune.method: {ckpt} {kind}; this run has finetune.method = {method}; "
            "resume with the method it was saved with"
        )
    if was.get("sha256") != now.get("sha256"):
        raise C.ConfigError(
            f"finetune: {ckpt} holds LoRA adapters trained on the base {was.get('path')} (sha256 "
            f"{was.get('sha256')}), but the base here is {now.get('path')} (sha256 {now.get('sha256')}); {todo}"
        )


def check_position(ts: dict, cfg: C.LoomConfig, ckpt: Path) -> None:
    """The fields that place a resumed run in its data (:data:`POSITION_FIELDS`) are the checkpoint's
    (``ts``: its ``train_state.json``)."""
    saved = ts.get("config", {})
    for section, key in POSITION_FIELDS:
        old = saved.get(section, {}).get(key)
        new = getattr(getattr(cfg, section), key)
        if old is not None and old != new:
            raise CheckpointError(
                f"{section}.{key}: {ckpt} was saved with {old}, this run has {new}; the samples it "
                "continues with would differ from the uninterrupted run's. Use the same value to resume."
            )


def check_optimizer(ts: dict, cfg: C.LoomConfig, ckpt: Path) -> None:
    """The optimizer that wrote the checkpoint's state is this run's (its state is of no other)."""
    old = (ts.get("config", {}).get("train") or {}).get("optimizer")
    new = cfg.train.optimizer
    if old is not None and old != new:
        raise CheckpointError(
            f"train.optimizer: {ckpt} was saved with {old}, this run has {new}; its optimizer state is "
            f"{old}'s. Use train.optimizer = {old} to resume, or start a new run.dir (train.init_from = "
            f"{ckpt} keeps the weights, with a fresh {new} state)"
        )


def check_model(ts: dict, cfg: C.LoomConfig, ckpt: Path) -> None:
    """The model is the one the checkpoint recorded (:mod:`loom.checkpoint.recorded`); RoPE's
    ``max_seq_len`` may change (context extension). A checkpoint without a config is not checked."""
    saved = recorded_config(ts)
    if saved is None:
        return
    changes = model_changes(saved, cfg, free_on_resume(saved))
    if changes:
        (name, old, new), *rest = changes
        said = [f"{name}: {ckpt} was saved with {old}, this run has {new}"]
        said += [f"{n}: saved with {o}, this run has {v}" for n, o, v in rest]
        raise CheckpointError(
            f"{'; '.join(said)}; its weights would compute another model than the one trained. "
            "Use the saved values to resume, or start a new run.dir"
        )


def check_trained_vocab(ts: dict, cfg: C.LoomConfig, ckpt: Path) -> None:
    """A run whose tokenizer was trained on its corpus (no ``data.tokenizer``) resumes with the same
    ``data.vocab_size``: another would train another tokenizer (refused by its hash only once the
    corpus is tokenized again)."""
    data = ts.get("config", {}).get("data") or {}
    old, new = data.get("vocab_size"), cfg.data.vocab_size
    trained = not data.get("tokenizer") and not cfg.data.tokenizer and not cfg.data.prepared_dir
    if trained and old is not None and old != new:
        raise CheckpointError(
            f"data.vocab_size: {ckpt} was trained with a {old}-token tokenizer trained on its corpus, this "
            f"run asks for {new} (another tokenizer); use data.vocab_size = {old} to resume, or start a new "
            f"run.dir with --train.init_from {ckpt}"
        )


def check_resumable(ts: dict, cfg: C.LoomConfig, ckpt: Path) -> None:
    """What a run's config alone decides of a resume from ``ckpt``: its optimizer, model, data
    position and trained vocabulary (the launcher's check before any rank starts and the corpus is
    tokenized; the ranks check again, with the base and tokenizer they load)."""
    check_optimizer(ts, cfg, ckpt)
    check_model(ts, cfg, ckpt)
    check_position(ts, cfg, ckpt)
    check_trained_vocab(ts, cfg, ckpt)


class TrainCheckpoints:
    """The trainer's checkpoint duties on one rank: resume, periodic saves, the final save."""

    def __init__(
        self,
        cfg: C.LoomConfig,
        run_dir: Path,
        rank: int,
        world: int,
        state: Shardable,
        loss_scaler=None,
        base: Callable[[], dict | None] | None = None,
        data: DataPosition | None = None,
        tokenizer_sha256: str = "",
    ) -> None:
        """``base``: the identity (path, SHA-256) of the frozen base a LoRA run fine-tunes, computed by
        rank 0 (:func:`loom.finetune.base.base_identity`); its checkpoints are bound to it. ``data``:
        the sampler whose position is saved and restored (None: the step and global sequences only).
        ``tokenizer_sha256``: the run's tokenizer, recorded in every checkpoint; a checkpoint recording
        another is not resumed ("": neither recorded nor checked)."""
        self.data, self.tokenizer_sha256 = data, tokenizer_sha256
        self.cfg, self.run_dir, self.rank, self.world = cfg, run_dir, rank, world
        self.group = new_group(world, cfg.run.timeout_s)
        self.checkpointer = Checkpointer(
            run_dir / "checkpoints", rank, world, self.group, cfg.train.checkpoint_keep
        )
        self.state = state  # what this rank holds: the strategy's state (and the loss scaler's)
        self.loss_scaler = loss_scaler  # fp16 dynamic loss scaling, if any
        self.last_saved: tuple[int, Path] | None = None
        self.base: dict | None = None
        if base is not None:
            self.base = cast(
                dict | None, broadcast_json(base() if rank == 0 else None, rank, world, self.group)
            )

    def restore(self) -> int:
        """Load the chosen checkpoint into the strategy and this rank's RNG; return its step (0 if none)."""
        chosen: dict[str, object] | None = None  # rank 0's choice; the other ranks receive it
        if self.rank == 0:
            try:
                chosen = {"candidates": choose_source(self.cfg, self.run_dir)}
            except CheckpointError as e:
                chosen = {"error": str(e)}
        source = cast(dict[str, Any], broadcast_json(chosen, self.rank, self.world, self.group))
        if "error" in source:
            raise CheckpointError(source["error"])
        if not source["candidates"]:
            return 0
        t0 = time.perf_counter()
        with self._open(source["candidates"]) as reader:
            ts = reader.train_state
            check_optimizer(ts, self.cfg, reader.dir)
            self._check_base(ts, reader.dir)
            check_trained_tokenizer(ts, self.tokenizer_sha256, reader.dir, "this run's tokenizer")
            check_model(ts, self.cfg, reader.dir)
            check_position(ts, self.cfg, reader.dir)
            if self.data is not None:  # every rank: the same record, the same verdict
                saved = dict(ts.get("data") or {})
                saved.setdefault("global_batch", ts.get("config", {}).get("train", {}).get("global_batch"))
                self.data.resume(saved, reader.step, str(reader.dir))
            self.state.load_sharded(reader)
            if self.loss_scaler is not None and ts.get("loss_scale"):
                for key, value in ts["loss_scale"].items():
                    setattr(self.loss_scaler, key, value)
            if ts.get("world_size") == self.world and (rng := self._saved_rng(reader, ts)) is not None:
                restore_rng(rng)
            elif self.rank == 0:
                log.info(
                    "world size changed (%s -> %d): RNG streams start fresh", ts.get("world_size"), self.world
                )
            step = reader.step
            ckpt = reader.dir
        log.info("resumed from %s at step %d (%.2f s)", ckpt, step, time.perf_counter() - t0)
        self.last_saved = (step, ckpt)
        return step

    def _saved_rng(self, reader: CheckpointReader, ts: dict) -> dict | None:
        """This rank's saved generator states: its own tensor, or (a checkpoint from before them) its
        entry of the list in ``train_state.json``; None if neither holds one."""
        name = rng_name(self.rank)
        if name in reader.names():
            return rng_from_tensor(reader.read(name))
        ranks = ts.get("ranks", [])
        return ranks[self.rank].get("rng") if self.rank < len(ranks) else None

    def _open(self, candidates: list) -> CheckpointReader:
        """The first candidate that verifies (every rank sees the same verdict: verification ends in
        one all-reduce), saying loudly which damaged ones were skipped."""
        for i, (path, sha) in enumerate(candidates):
            try:
                return CheckpointReader(path, self.rank, self.world, self.group, manifest_sha=sha)
            except CheckpointError as e:
                if i + 1 == len(candidates):
                    raise
                if self.rank == 0:
                    log.warning(
                        "SKIPPING checkpoint %s: %s; resuming from the older %s instead",
                        path,
                        e,
                        candidates[i + 1][0],
                    )
        raise CheckpointError("no checkpoint to resume from")  # pragma: no cover - candidates is never empty

    def _check_base(self, ts: dict, ckpt: Path) -> None:
        """A LoRA checkpoint resumes only on the base it was trained on (:func:`check_base`)."""
        check_base(ts.get("finetune_base"), self.base, ckpt, self.cfg.finetune.method)

    def _scaler_state(self) -> dict | None:
        """The loss scaler's numbers (scale, counters), restored as they were for an exact resume."""
        if self.loss_scaler is None:
            return None
        return {k: v for k, v in vars(self.loss_scaler).items() if isinstance(v, (bool, int, float))}

    def save(self, step: int, blocking: bool) -> None:
        """Save step ``step`` (all ranks); asynchronous unless ``blocking``."""
        meta = {
            "data": self.data.position(step)
            if self.data is not None
            else {"step": step, "global_sequences": step * self.cfg.train.global_batch},
            "config": C.to_dict(self.cfg),
            "loss_scale": self._scaler_state(),
            "finetune_base": self.base,  # a LoRA run: the base its adapters apply to (path, sha256)
            **({TOKENIZER_SHA256: self.tokenizer_sha256} if self.tokenizer_sha256 else {}),
            "saved_unix_s": time.time(),
        }
        state = dict(self.state.sharded_state())
        state[rng_name(self.rank)] = ShardedTensor.full(
            rng_tensor(capture_rng()), (0, 1)
        )  # this rank writes it
        path = self.checkpointer.save(step, state, {}, meta, blocking=blocking)
        if path is not None:
            self.last_saved = (step, path)
        if self.rank == 0:
            how = "saved" if blocking else "saving (async)"
            log.info("%s checkpoint step %d (stalled %.3f s)", how, step, self.checkpointer.last_stall_s)

    def finish(self, step: int) -> Path | None:
        """Wait for saves in flight and save ``step`` unless it is saved already; the final checkpoint."""
        done = self.checkpointer.wait()
        if done is not None:
            self.last_saved = (int(done.name.split("-")[1]), done)
        if step > 0 and (self.last_saved is None or self.last_saved[0] != step):
            self.save(step, blocking=True)
        return self.last_saved[1] if self.last_saved else None

    def export(self, path: Path) -> None:
        """Consolidated single-file model of the last checkpoint (for ``loom generate``)."""
        if self.last_saved is None:
            raise CheckpointError("no checkpoint to export the final model from")
        convert(self.last_saved[1], path, check=False, replace=True)  # a resumed run's final model
