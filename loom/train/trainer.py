"""The training loop run by every rank: set up, train, evaluate, log, save.

Every rank's setup before training (process group, data, initial model): :mod:`loom.train.setup`.
Entry point :func:`run` is called once per rank, by ``loom train`` through the elastic
launcher, or directly under ``torchrun``/``srun`` (``python -m loom train ...``).
"""

from __future__ import annotations

import logging
import math
import shutil
import signal
import threading
import time
from datetime import timedelta
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist

from loom import comm
from loom import config as C
from loom.checkpoint.format import naming_writes, write_bytes_atomic
from loom.checkpoint.hf_export import keep_tokenizer_files
from loom.checkpoint.load import find
from loom.checkpoint.protocol import CombinedState
from loom.checkpoint.save import broadcast_json
from loom.checkpoint.training import TrainCheckpoints, truncate_metrics
from loom.comm import CommMeter
from loom.data import BatchSampler, TokenDataset, eval_batches, mixture_sampler
from loom.data.sample_ids import SAMPLE_IDS, SampleIdLog, gather_ids
from loom.device import (
    peak_memory_bytes,
    peak_reserved_bytes,
    reset_peak_memory,
    synchronize,
)
from loom.model.llama import build_model, count_params, expert_params, flops_per_token
from loom.parallel.base import held_state_bytes
from loom.train import timings
from loom.train.build import build_mesh, build_run, saved_activations
from loom.train.export import write_json_atomic
from loom.train.gns import gns_estimate, small_batch
from loom.train.health import (
    CollectiveFailure,
    Heartbeat,
    NonFiniteError,
    diagnose,
    failed_peers,
    heartbeat_interval,
    is_comm_failure,
    reported_peers,
)
from loom.train.metrics import MetricsWriter, max_over_ranks, setup_logging, step_line
from loom.train.mfu import mfu_peak
from loom.train.moe_report import MoEReport
from loom.train.profiling import StepProfiler
from loom.train.schedule import lr_at
from loom.train.setup import (
    DATA_IDENTITY,
    RankEnv,
    check_same_data,
    control_group,
    data_identity,
    ensure_data,
    init_process_group,
    initial_model,
)
from loom.train.step import scaler_stats, train_step
from loom.train.timings import PhaseClock, Stragglers, rank_times, timing_fields
from loom.train.trackers import open_trackers, tracker_names, wants_tensorboard

log = logging.getLogger("loom")

STOPPED = "stopped.json"  # run.dir: the step a SIGTERM/SIGINT stopped the run at (read by loom.launch)


class StopRequest:
    """SIGTERM and SIGINT (preemption, Ctrl-C) on this rank. During training (:attr:`deferred`) the
    handler only notes the signal; the loop asks :meth:`agreed` at each step boundary, one all-reduce
    (MAX) of a one-number CPU tensor on the gloo control group, so every rank stops after the same
    step, however far apart the signal reached them, and none waits on the device for it. Before
    training (setup) a signal interrupts at once (``KeyboardInterrupt``): there is no new step to save."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self) -> None:
        self.signum = 0
        self.deferred = False
        self._previous: dict[int, object] = {}

    def install(self) -> None:
        if threading.current_thread() is threading.main_thread():  # Python handles signals there only
            for sig in self.SIGNALS:
                previous = signal.signal(sig, self._handle)
                self._previous.setdefault(sig, previous)  # hold_off's record is the one to restore

    def hold_off(self) -> None:
        """Until :meth:`install`: the signals' default action, so a rank stopped while it starts ends
        at once. Python runs a handler only between bytecodes, and a rank still connecting to the
        rendezvous store sits in one C++ call that retries on EINTR for a minute, printing c10d's
        stacks, before a ``KeyboardInterrupt`` could end it."""
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                self._previous[sig] = signal.signal(sig, signal.SIG_DFL)

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]
        self._previous.clear()

    def _handle(self, signum: int, frame) -> None:
        first = not self.signum
        self.signum = self.signum or signum
        if first and not self.deferred:
            raise KeyboardInterrupt

    def agreed(self, group, world: int, timeout_s: float) -> int:
        """The signal any rank has received (the largest number), 0 if none; every rank calls it at the
        same step boundary and gets the same answer. The wait is bounded by ``run.timeout_s``, not by
        the control group's day: a rank stopped just before this call is a hang like any other."""
        flag = torch.tensor([float(self.signum)])
        if world > 1:
            work = dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group, async_op=True)
            work.wait(timedelta(seconds=timeout_s))  # gloo, CPU: raises "Operation timed out!"
        return int(flag.item())


class Trainer:
    """Holds the pieces of one run; :meth:`fit` is the loop."""

    def __init__(self, cfg: C.LoomConfig, env: RankEnv, stop: StopRequest | None = None) -> None:
        self.cfg, self.env = cfg, env
        self.stop = stop  # None: signals keep their default action (dedicated parameter servers)
        self.stopped: tuple[int, int] | None = None  # (step, signal) once a signal stopped the loop
        self.device = init_process_group(cfg, env)
        if stop is not None:  # the process group exists: a signal now interrupts, or stops after a step
            stop.install()
        C.validate(cfg, env.world)
        # The default generators (dropout's stream; every device's) start from train.seed on every
        # rank, as Megatron's do over data parallelism: torch starts them from a random seed, so two
        # runs of one config drew different dropout masks. Split regions fork rank-private streams
        # from it (loom.parallel.rng); a resume restores the saved states (loom.checkpoint.rng).
        torch.manual_seed(cfg.train.seed)
        self.mesh = build_mesh(
            cfg, self.device.type
        )  # dedicated parameter servers: the workers' (loom.train.ps_run)
        self.run_dir = Path(cfg.run.dir)
        self.is_main = env.rank == 0
        if self.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
        self.heartbeat = Heartbeat(self.run_dir, env.rank, heartbeat_interval(cfg.run.timeout_s))
        self.control = control_group(env)
        self.data = ensure_data(cfg, env, self.control)
        C.check_vocab(cfg, self.data.vocab_size)
        cfg.model.vocab_size = C.effective_vocab(cfg, self.data.vocab_size)
        self.meter = CommMeter()
        self.model, source = initial_model(cfg, self.device)
        self.run = build_run(cfg, self.mesh, self.model, self.meter, source)
        dp_rank, dp = self.mesh.local_rank("dp"), self.mesh.size("dp")
        pack_eot = self.data.eot_id if cfg.data.pack else None  # packed: batches carry document positions
        train_set = TokenDataset(self.data.train_path, cfg.data.seq_len, pack_eot=pack_eot)
        self.sampler = BatchSampler(
            train_set, cfg.train.global_batch, cfg.train.micro_batch, dp_rank, dp, cfg.train.seed
        )
        if cfg.data.sources:  # a weighted mixture (all sources prepared by rank 0 already: this only loads)
            self.sampler = mixture_sampler(cfg, dp_rank, dp, pack_eot)
        self.eval_set: list = []  # train.eval_every = 0: no held-out loss, and no held-out window needed
        if cfg.train.eval_every:
            val_set = TokenDataset(self.data.val_path, cfg.data.seq_len, pack_eot=pack_eot)
            self.eval_set = self._my_tokens(
                eval_batches(val_set, cfg.train.eval_batches, cfg.train.micro_batch, dp_rank, dp)
            )
        self.loss_group = self.mesh.group(
            "dp_cp"
        )  # losses averaged over every rank of a different batch share
        # the whole model's parameters (a meta build: no memory), not this rank's slices of them
        whole = build_model(cfg.model, cfg.train.seed, meta=True, moe=cfg.moe)
        self.n_params = count_params(whole)
        matmul_params = count_params(whole, exclude_embedding=not cfg.model.tie_embeddings)
        self.flops_per_token = flops_per_token(
            cfg.model, cfg.data.seq_len, matmul_params, expert_params(whole)
        )
        self.peak_flops, self.peak_source = mfu_peak(self.device, cfg.train.precision)
        self.model = self.run.model  # pp > 1: this rank's stages; the rest of the full model is freed
        m = cfg.model  # MoE: per-layer expert load in the metrics rows, a heatmap at the end
        self.moe_report = MoEReport(self.model, m.n_layers, m.n_experts, self.device) if m.moe else None
        self.clock, self.stragglers = PhaseClock(self.device), Stragglers(cfg.run.straggler_pct)
        self.profiler = StepProfiler(cfg.run, self.run_dir, env.rank, env.world, self.device, self.control)
        # Saved-tensor hooks around each step: activation accounting, compression, offload (loom.memory).
        self.saved_acts = saved_activations(cfg, self.model, self.device)
        self.heartbeat.set(0, "checkpoint load")
        scaler = self.run.scaler
        state = self.run.strategy if scaler is None else CombinedState(self.run.strategy, scaler)
        base = None
        if cfg.finetune.method != "full":  # a LoRA run's checkpoints are bound to the base (path, sha256)
            from loom.finetune.base import base_identity

            base = partial(base_identity, cfg)
        self.data_identity = data_identity(self.data)
        self.ckpts = TrainCheckpoints(
            cfg,
            self.run_dir,
            env.rank,
            env.world,
            state,
            scaler,
            base,
            data=self.sampler,
            tokenizer_sha256=self.data_identity["tokenizer"],
        )  # the data position and the tokenizer travel in every checkpoint, checked when restored
        if cfg.train.resume or find(self.run_dir) is not None:  # a resume: first the data the run recorded
            check_same_data(self.run_dir, self.data_identity)  # every rank: the same files, the same verdict
        self.start_step = self.ckpts.restore()
        if self.is_main:  # rows an earlier attempt wrote past the checkpoint it resumes from
            truncate_metrics(self.run_dir, self.start_step)
            truncate_metrics(self.run_dir, self.start_step, SAMPLE_IDS)
            (self.run_dir / STOPPED).unlink(missing_ok=True)
        trackers = self._open_trackers()
        self.metrics = MetricsWriter(
            self.run_dir, self.is_main, wants_tensorboard(cfg.run), trackers, self.start_step
        )
        self.sample_ids = SampleIdLog(self.run_dir, self.is_main) if cfg.data.record_ids else None
        if self.is_main:
            self._write_run_files()

    def _open_trackers(self) -> list:
        """Rank 0 opens the external trackers; its refusal (W&B without an API key) reaches every rank
        as the same one line, instead of the others failing later in a collective with rank 0 gone."""
        cfg, env = self.cfg, self.env
        if not tracker_names(cfg.run.trackers):
            return []
        trackers, error = [], ""
        if self.is_main:
            try:
                trackers = open_trackers(cfg.run.trackers, self.run_dir, C.to_dict(cfg))
            except C.ConfigError as e:
                if env.world == 1:
                    raise
                error = str(e)
        verdict = broadcast_json({"error": error}, env.rank, env.world, self.control)
        assert isinstance(verdict, dict)
        if verdict["error"]:
            raise C.ConfigError(verdict["error"])
        return trackers

    def _write_run_files(self) -> None:
        # the data identity first: it marks the directory as a run's (loom.cli.foreign_run_files), so a
        # start that dies while writing the others is resumed, not taken for someone else's files
        if not (self.run_dir / DATA_IDENTITY).is_file():  # a run is bound to the data it started on
            kept = keep_tokenizer_files(self.cfg, self.run_dir)  # and to its chat template, end token
            write_json_atomic(self.run_dir / DATA_IDENTITY, self.data_identity | kept)
        write_bytes_atomic(self.run_dir / "config.toml", C.dump_toml(self.cfg).encode())
        with naming_writes(self.run_dir / "tokenizer.json"):
            shutil.copyfile(self.data.tokenizer_path, self.run_dir / "tokenizer.json")
        c = self.cfg
        log.info(
            "model %.2fM params | world %d: %s | global batch %d x %d tokens, micro %d, accum %d",
            self.n_params / 1e6,
            self.env.world,
            self.mesh,
            c.train.global_batch,
            c.data.seq_len,
            c.train.micro_batch,
            C.grad_accum_steps(c),
        )
        log.info("MFU peak: %.1f GFLOP/s per rank (%s)", self.peak_flops / 1e9, self.peak_source)

    def _my_tokens(self, batches):
        """Context parallelism: this cp rank's tokens of each sequence (all of them when cp = 1)."""
        from loom.parallel.context.parallelize import shard_sequence

        return shard_sequence(batches, self.mesh.size("cp"), self.mesh.local_rank("cp"))

    def _to_device(self, batches):
        return [tuple(t.to(self.device, non_blocking=True) for t in batch) for batch in batches]

    def _record_ids(self, step: int) -> None:
        """``data.record_ids``: the step's global batch as every dp rank's sampler gave it, one line."""
        assert self.sample_ids is not None
        dp_rank, dp = self.mesh.local_rank("dp"), self.mesh.size("dp")
        ids = gather_ids(
            self.sampler.sample_ids(step), dp_rank, dp, self.env.world, self.control, self.cfg.run.timeout_s
        )
        self.sample_ids.write(step + 1, ids)

    def _time_up(self, start: float) -> bool:
        limit = self.cfg.train.time_limit_s
        if limit <= 0:
            return False
        flag = torch.tensor([1.0 if time.perf_counter() - start > limit else 0.0], device=self.device)
        if self.env.world > 1:
            dist.broadcast(flag, src=0)
        return bool(flag.item())

    def _nonfinite_cause(self, e: NonFiniteError, step: int) -> str:
        """What a non-finite gradient norm points at. Weights that hold NaN/inf are damaged where they
        came from; on the first step of a process no update has run yet, so the learning rate is not
        the cause either (the weights' scale, the adapter scale or the data are); only later is
        "lower train.lr" the advice."""
        model = self.run.model
        bad = next(
            (
                n
                for n, p in model.named_parameters()
                if p.numel() and not bool(torch.isfinite(p.detach()).all())
            ),
            None,
        )
        m, f = self.cfg.model, self.cfg.finetune
        source = (
            f"resumed from step {self.start_step}"
            if self.start_step
            else f"loaded from {m.from_hf}"
            if m.from_hf
            else f"loaded from {self.cfg.train.init_from}"
            if self.cfg.train.init_from
            else f"initialized with seed {self.cfg.train.seed}"
        )
        if bad is not None:
            return (
                f"parameter {bad} holds NaN/inf before this step's update: the weights {source} are damaged "
                "(the non-finite gradient follows from them); the learning rate is not the cause"
            )
        if step == self.start_step:
            adapter = (
                f" (finetune.lora_alpha / lora_rank = {f.lora_alpha / f.lora_rank:g} scales every adapter's output)"
                if f.method in ("lora", "qlora")
                else ""
            )
            return (
                f"non-finite gradient norm on the first step, before any update (weights {source}): the "
                f"learning rate has not acted yet; the forward overflows with these settings{adapter} or this "
                "batch holds bad data"
            )
        return str(e)

    def _memory_peaks(self) -> dict[str, int]:
        """This rank's peak allocated and reserved bytes of the log window; with several ranks also
        the largest of each over them and whose (dedicated parameter servers run no such step)."""
        mine = {
            "peak_mem_bytes": peak_memory_bytes(self.device),
            "peak_reserved_bytes": peak_reserved_bytes(self.device),
        }
        if self.env.world == 1 or C.ps_servers(self.cfg):
            return mine
        return mine | max_over_ranks(
            mine, self.env.rank, self.env.world, self.control, self.cfg.run.timeout_s
        )

    def _timings(self, step: int, steps: int, step_s: float) -> dict[str, object]:
        """Every rank's phase times of the log window (:mod:`loom.train.timings`); rank 0 names a
        straggler. Dedicated parameter servers run no such step: this rank's own times only."""
        mine = self.clock.read(steps)
        alone = self.env.world == 1 or C.ps_servers(self.cfg)
        times = rank_times(mine, step_s, 1 if alone else self.env.world, self.control, self.cfg.run.timeout_s)
        if self.is_main and (line := self.stragglers.check(step, times)) is not None:
            log.warning("%s", line)
        return timing_fields(times)

    def fit(self) -> dict[str, float]:
        c = self.cfg.train
        tokens_per_step = c.global_batch * self.cfg.data.seq_len
        bar = _progress(c.steps, self.is_main and self.cfg.run.progress)
        bar.update(self.start_step)
        start = time.perf_counter()
        last: dict[str, float] = {}
        done = self.start_step
        synchronize(self.device)
        reset_peak_memory(self.device)
        window_t, window_steps = time.perf_counter(), 0
        if self.stop is not None:
            self.stop.deferred = True  # from here a signal stops the loop at the next step boundary
        for step in range(self.start_step, c.steps):
            self.heartbeat.set(step + 1, "train step")
            lr = lr_at(step, c)
            self.meter.reset()
            self.profiler.before(step + 1)
            with timings.active(self.clock):
                with timings.phase("data"):
                    batches = self._to_device(self._my_tokens(self.sampler.micro_batches(step)))
                    if self.sample_ids is not None:
                        self._record_ids(step)
                evaluated = bool(c.eval_every) and (step + 1) % c.eval_every == 0  # its row carries the eval
                logged = (step + 1) % c.log_every == 0 or step + 1 == c.steps or evaluated
                try:
                    small = (  # train.log_gns: one more micro-batch's gradient, before the step
                        small_batch(
                            self.run.model,
                            self.run.strategy,
                            self.run.loss_fn,
                            batches,
                            c.global_batch,
                            self.loss_group,
                        )
                        if c.log_gns and logged
                        else None
                    )
                    with self.saved_acts.around(logged):  # accounting alone: on logged steps only
                        res = train_step(self.run, batches, c.grad_clip, lr, self.loss_group)
                except NonFiniteError as e:
                    raise NonFiniteError(f"step {step + 1}: {self._nonfinite_cause(e, step)}") from None
            self.profiler.after(step + 1)
            if not C.ps_servers(
                self.cfg
            ):  # (dedicated parameter servers do not reach the workers' step ends)
                comm.verify_order()  # strict mode: every group's members issued the same collectives
            window_steps += 1
            bar.update(1)
            bar.set_postfix(loss=f"{res.loss:.3f}")
            if logged:
                synchronize(self.device)  # the window's device work is done before the clock is read
                dt = time.perf_counter() - window_t
                tps = tokens_per_step * window_steps / dt
                row = {
                    "step": step + 1,
                    "loss": res.loss,
                    "lr": lr,
                    "grad_norm": res.grad_norm,
                    "tokens_per_s": tps,
                    "step_time_s": dt / window_steps,
                    "mfu": tps / self.env.world * self.flops_per_token / self.peak_flops,
                    **self._memory_peaks(),
                    **self.run.strategy.state_bytes(),
                    **self.meter.snapshot(),
                    **self.saved_acts.stats(),
                    **scaler_stats(self.run.scaler),
                    **(self.moe_report.row() if self.moe_report is not None else {}),
                    **self.run.strategy.row(),  # a strategy's own figures (parameter servers: staleness)
                    **self._timings(step + 1, window_steps, dt / window_steps),
                }
                if small is not None and math.isfinite(res.grad_norm):
                    row.update(gns_estimate(small[0], res.grad_norm**2, small[1], c.global_batch))
                self.saved_acts.reset_peak()
                reset_peak_memory(self.device)  # peak_mem_bytes is per log window
                if c.eval_every and ((step + 1) % c.eval_every == 0 or step + 1 == c.steps):
                    row["eval_loss"] = self.run.evaluate(
                        self._to_device(self.eval_set), self.run.loss_fn, self.loss_group
                    )
                if self.is_main and step + 1 == c.steps:  # the planner's prediction beside the measurement
                    _add_plan(self.cfg, self.env.world, row)
                self.metrics.write(row)
                if self.is_main:
                    bar.write(
                        step_line(row) + (f" | eval {row['eval_loss']:.4f}" if "eval_loss" in row else "")
                    )
                last = row
                window_t, window_steps = time.perf_counter(), 0
            done = step + 1
            if c.checkpoint_every and done % c.checkpoint_every == 0 and done < c.steps:
                self.heartbeat.set(done, "checkpoint save")
                self.ckpts.save(done, blocking=not c.checkpoint_async)
            if (
                self.stop is not None
                and done < c.steps
                and (sig := self.stop.agreed(self.control, self.env.world, self.cfg.run.timeout_s))
            ):
                self.stopped = (done, sig)  # every rank: the same step and signal
                break
            if self._time_up(start):
                if self.is_main:
                    bar.write(f"train.time_limit_s reached after step {step + 1}; stopping")
                break
        bar.close()
        if self.stopped is not None:
            return self._save_stopped(*self.stopped, last)
        if self.moe_report is not None and self.is_main:
            self.moe_report.heatmap(self.run_dir / "moe_load.png")
        if not math.isfinite(last.get("eval_loss", 0.0)):  # the last update left weights no step checked
            self.ckpts.checkpointer.wait()  # the earlier steps' saves in flight complete; this step's is not made
            raise NonFiniteError(
                f"step {done}: the final evaluation loss is {last['eval_loss']}: the last update made the "
                f"weights non-finite (train.lr = {c.lr:g}); the final checkpoint is not written"
            )
        self.heartbeat.set(done, "final save")
        self.ckpts.finish(done)
        self.save_final(done, last)
        self.metrics.close()
        if self.sample_ids is not None:
            self.sample_ids.close()
        self._stop_after_final(done)
        return last

    def _stop_after_final(self, step: int) -> None:
        """A signal that came during the final save (noted, as the loop had no step left to stop at):
        the ranks agree on it once more and, if any rank got one, record it (``final``) and leave as a
        stopped run does. The launcher that sent it is shutting down and waits for no result (a rank
        that returned one would wait for the agent until ``run.preempt_grace_s`` ran out). From here
        a signal interrupts at once: the run's files are written."""
        if self.stop is None:
            return
        sig = self.stop.agreed(self.control, self.env.world, self.cfg.run.timeout_s)
        self.stop.deferred = False
        if sig:
            self.stopped = (step, sig)
            self._record_stop(step, sig, self.run_dir / "checkpoints" / "final", final=True)

    def _record_stop(self, step: int, signum: int, checkpoint: Path | None, final: bool = False) -> None:
        """Rank 0 writes ``run.dir/stopped.json`` (the launcher's one line reads it); every rank waits
        for it before returning."""
        if self.is_main:
            record = {"step": step, "signal": signal.Signals(signum).name, "checkpoint": str(checkpoint)}
            write_json_atomic(self.run_dir / STOPPED, record | ({"final": True} if final else {}))
        if self.env.world > 1:
            dist.barrier(group=self.control)  # the record exists before any rank returns

    def _save_stopped(self, step: int, signum: int, last: dict[str, float]) -> dict[str, float]:
        """Save ``step`` (no export: the run is not finished), record it for the launcher's one line
        (``run.dir/stopped.json``), and return; the launcher's line is the only output."""
        self.heartbeat.set(step, "stop save")
        quiet, level = logging.getLogger("loom"), logging.getLogger("loom").level
        quiet.setLevel(logging.WARNING)
        try:
            path = self.ckpts.finish(step)
        finally:
            quiet.setLevel(level)
        self.metrics.close()
        if self.sample_ids is not None:
            self.sample_ids.close()
        self._record_stop(step, signum, path)
        return last

    def save_final(self, step: int, last: dict[str, float]) -> None:
        """Rank 0 exports the consolidated model from the final checkpoint: one path for every
        layout (ZeRO-3, tensor and pipeline shards are assembled by the checkpoint reader).

        A resume at the step the run had already finished runs no step: the final model and
        ``meta.json`` it wrote then are kept as they are; without them the model is exported and
        ``meta.json`` takes that step's loss from ``metrics.jsonl`` (if it was logged)."""
        if self.is_main:
            out = self.run_dir / "checkpoints" / "final"
            if step == self.start_step and _final_of(out) == step:  # nothing new: never degrade what is there
                log.info("no step to run: kept %s of step %d", out / "model.safetensors", step)
            else:
                if self.cfg.finetune.method != "full" and self.ckpts.last_saved is not None:  # LoRA: merged
                    from loom.finetune.export import save_merged

                    save_merged(self.ckpts.last_saved[1], out / "model.safetensors")
                else:
                    self.ckpts.export(out / "model.safetensors")
                loss = last["loss"] if "loss" in last else _logged_loss(self.run_dir, step)
                write_json_atomic(out / "meta.json", {"step": step, "loss": loss})
                log.info("saved %s", out / "model.safetensors")
        if self.env.world > 1:
            dist.barrier(group=self.control)  # gloo, long timeout: the export may take long


def _final_of(out: Path) -> int | None:
    """The step of the final model in ``out`` (``meta.json`` beside ``model.safetensors``), else None."""
    import json

    try:
        meta = json.loads((out / "meta.json").read_text())
    except (OSError, ValueError):
        return None
    step = meta.get("step") if isinstance(meta, dict) else None
    return step if isinstance(step, int) and (out / "model.safetensors").is_file() else None


def _logged_loss(run_dir: Path, step: int) -> float | None:
    """The loss ``metrics.jsonl`` logged for ``step`` (its last such row), else None."""
    import json

    loss = None
    try:
        lines = (run_dir / "metrics.jsonl").read_bytes().decode("utf-8", "replace").splitlines()
    except OSError:
        return None
    for line in lines:
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict) and row.get("step") == step and isinstance(row.get("loss"), (int, float)):
            loss = float(row["loss"])
    return loss


def _add_plan(cfg: C.LoomConfig, world: int, row: dict) -> None:
    """Add ``plan_*`` fields (loom.plan.auto.predicted_fields) to ``row`` and log them; never raises."""
    try:
        from loom.plan.auto import predicted_fields, prediction_line

        row.update(predicted_fields(cfg, world))
        log.info("%s", prediction_line(cfg, world, row, held_state_bytes(row)))
    except Exception as e:  # a planner problem must never break training
        log.warning("planner prediction unavailable: %s", e)


def _progress(total: int, enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, disable=not enabled, desc="train", unit="step", dynamic_ncols=True)


def run(
    cfg: C.LoomConfig, exit_on_signal: bool = False, report_comm_failure: bool = False
) -> dict[str, float]:
    """Train on this rank; tears the process group down on the way out. ``exit_on_signal`` (a rank
    under a launcher): once a signal's step is saved every rank ends with ``SystemExit(128 + signal)``,
    quietly, instead of returning (a launcher that got the signal is shutting down and reads no
    result, and the elastic agent's worker would wait for it to; one that did not sees the exit
    code and names the saved step). A failed collective raises :class:`CollectiveFailure` (its
    message :func:`diagnose`'s line, which the launcher or the CLI prints); ``report_comm_failure``
    also logs that line here (under restarts, where the launcher restarts instead of reporting)."""
    env = RankEnv.from_environ()
    setup_logging(env.rank)
    trainer = None
    Heartbeat.current = None  # this run's, once the Trainer starts it
    # dedicated parameter servers do not take part in the trainer's steps: no agreed stop (yet)
    stop = StopRequest() if not C.ps_servers(cfg) else None
    if stop is not None and exit_on_signal and env.world > 1 and not dist.is_initialized():
        stop.hold_off()  # a rank of a launcher: ended at once until its process group exists (Trainer)
    elif stop is not None:
        stop.install()
    try:
        if env.rank >= env.world - C.ps_servers(cfg):  # a dedicated parameter-server rank: the last ps_shards
            from loom.train.ps_run import serve

            return serve(cfg, env)
        trainer = Trainer(cfg, env, stop)
        last = trainer.fit()
        if exit_on_signal and trainer.stopped is not None:
            raise SystemExit(128 + trainer.stopped[1])
        return last
    except KeyboardInterrupt:  # a signal before training: nothing to save; the launcher says so
        raise SystemExit(128 + (stop.signum if stop is not None and stop.signum else signal.SIGINT)) from None
    except Exception as e:
        if stop is not None and stop.signum:  # a peer interrupted before this rank: not a failure to report
            raise SystemExit(128 + stop.signum) from None
        if env.world > 1 and is_comm_failure(e):
            msg = diagnose(e, Path(cfg.run.dir), env.rank, env.world, cfg.run.timeout_s)
            after_peer = bool(reported_peers(Path(cfg.run.dir), env.world, env.rank))
            if report_comm_failure and not failed_peers(Path(cfg.run.dir), env.world, env.rank):
                log.error("%s", msg)  # else theirs, or this raise through the launcher, is the one line
            raise CollectiveFailure(msg, after_peer) from e
        if Heartbeat.current is not None:  # before the process group goes: peers read it first
            Heartbeat.current.close(failed=f"{type(e).__name__}: {str(e).strip()[:300]}")
        raise
    finally:
        if Heartbeat.current is not None:  # the Trainer's, even when its constructor failed
            Heartbeat.current.close()
            Heartbeat.current = None
        if dist.is_initialized():
            dist.destroy_process_group()
        if stop is not None:
            stop.restore()
