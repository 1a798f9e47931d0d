"""The one training loop: forward under the precision policy, accumulate, guarded step, log, eval, save.

It takes built components and never reads raw config. Each step's micro batches come from the
step-input source (launcher.rank.sources), whose position every checkpoint keeps; the runner (the
whole model, or a pipeline's schedule) runs each micro batch's forward and backward and asks the
objective for its loss; the strategy adapts the other verbs (no_sync, step, save, load) to its
backend; the loop itself is the same for every spec.
"""

from __future__ import annotations

import contextlib
import re
import signal
import statistics
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from rich.console import Console

from launcher.components import checkpoint, metrics, profiling
from launcher.components.checkpoint_async import AsyncSaver, StagedFiles, background_saves
from launcher.components.checkpoint_files import CheckpointFiles
from launcher.components.loggers import observers
from launcher.components.schedule_free import averaged_weights, ready_to_load, train_mode
from launcher.config.reward import checkpoint_record
from launcher.parallel.state_bytes import is_dtensor
from launcher.rank import collection, evaluation, host_memory
from launcher.rank.loop_parts import Components
from launcher.rank.nonfinite import ADVICE, NonFiniteGuard, NonFiniteStop
from launcher.rank.preemption import StopSignal
from launcher.rank.rng import restore_rng, rng_state
from launcher.rank.sources import SourceContext
from launcher.rank.step_inputs import StepInputs, draw
from launcher.rank.watchers import build_observers


class Engine:
    """Runs the loop for one rank; rank 0 also writes metrics, summaries and checkpoint markers."""

    def __init__(
        self, parts: Components, run_dir: Path, console: Console | None = None, stop: StopSignal | None = None
    ) -> None:
        self.parts, self.spec, self.run_dir = parts, parts.spec, Path(run_dir)
        self.console = console or Console()
        self.stop = stop or StopSignal()
        self.device = parts.dist.device
        # a context-parallel group reads each sequence once between its ranks: its first rank counts it
        self._counts_samples = parts.dist.dims.cp_rank(parts.dist.rank) == 0
        self.step = 0
        self.session = 0
        """Sessions before this one in the run directory (resumes and restarts), recorded in every metrics record."""
        self.guard = NonFiniteGuard(self.spec.train, self.device, self.console, is_main=parts.dist.is_main)
        self.resumed_from: str | None = None
        self.timer = metrics.PhaseTimer(self.device.type)
        self._interval = self._new_interval()
        self._last_result = None
        self._next: StepInputs | None = None  # the next step's inputs, drawn and agreed on after a step
        self._source_context = SourceContext(
            dist=parts.dist, batch=parts.batch, strategy=parts.strategy, objective=parts.objective
        )
        self._schedule_started = False  # torch checks the schedule's order at its first step only
        self._history: dict[str, list] = {"tokens_per_s": [], "loss": []}
        self._eval: dict[str, float] = {}
        self.observers = observers.Observers()
        """Rank 0's watchers of this session's records (log lines, trackers, advisor); the worker finishes them."""
        dist = parts.dist
        self.saver = (
            AsyncSaver(self.run_dir, rank=dist.rank, world_size=dist.world_size, keep=self.spec.checkpoint.keep,
                       agree=dist.all_true, timeout_s=self.spec.launcher.timeout_s)
            if background_saves(self.spec.checkpoint.async_save) else None
        )  # fmt: skip
        """Writes checkpoints in the background (checkpoint.async_save), None where saves block the loop."""

    # ----- state -----------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Loop state shared by all ranks (the source's position is rank-independent)."""
        return {
            "step": self.step,
            "session": self.session,
            "scheduler": self.parts.scheduler.state_dict(),
            # the source's position before the next step's batches, which the loop has drawn already
            "data": self._next.data_state if self._next is not None else self.parts.source.state_dict(),
            **self.guard.state_dict(),
        }

    def _write_checkpoint(self, out: CheckpointFiles | StagedFiles) -> None:
        self.parts.strategy.save(out)
        if self.parts.dist.is_main:
            out.save(self.state_dict(), "trainer.pt")
        out.save(rng_state(), f"rng_rank{self.parts.dist.rank}.pt")

    def weights_finite(self) -> bool:
        """Whether every rank's trained parameters (its local shards) hold finite values (collective).

        Frozen parameters (a quantized base under adapters) never change, so they are not read.
        """
        params = [p for p in self.parts.strategy.model.parameters() if p.requires_grad]
        local = [getattr(p, "ds_tensor", p) for p in params]
        local = [t.to_local() if is_dtensor(t) else t for t in local]
        ok = all(bool(torch.isfinite(t).all()) for t in local if t.is_floating_point() and t.numel())
        return self.parts.dist.all_true(ok)

    def restore(self, directory: Path) -> None:
        """Continue exactly where the checkpoint in `directory` left off."""
        ready_to_load(self.parts.strategy.optimizer)  # schedule-free: DCP steps it once at lr 0
        self.parts.strategy.load(directory)
        state = checkpoint.load_tensor_file(directory / "trainer.pt")
        self.parts.scheduler.load_state_dict(state["scheduler"])
        self.parts.source.load_state_dict(state["data"])
        self._next = None
        self.step = state["step"]
        self.session = int(state.get("session", 0)) + 1
        self.guard.load_state_dict(state)
        self.guard.start_session(self.step)
        restore_rng(directory, rank=self.parts.dist.rank, seed=self.spec.train.seed, step=self.step)
        self.resumed_from = str(directory)

    def save(self, *, wait: bool = False) -> float:
        """Checkpoint the current step (every rank takes part); the seconds the loop was held.

        With checkpoint.async_save the state is copied to host memory and written in the background
        (launcher.components.checkpoint_async); `wait` waits for that write and its commit too.
        Weights that are no longer finite are never saved: the run stops (exit status 3) and the
        newest checkpoint stays the last good one. A schedule-free optimizer's checkpoint holds the averaged
        weights and the optimizer in eval mode (launcher.components.schedule_free).
        """
        started = time.perf_counter()
        with averaged_weights(self.parts.strategy.optimizer):  # schedule-free: the checkpoint holds x
            self._save()
        if wait:
            self.finish_saves()
        return time.perf_counter() - started

    def finish_saves(self) -> None:
        """Wait for a background save and commit it (every rank calls it); raise CheckpointSaveError if it failed."""
        if self.saver is not None:
            self.saver.wait()

    def _save(self) -> Path:
        dist = self.parts.dist
        self.finish_saves()  # at most one save in flight; a failed one stops the run here
        self.guard.settle(self.step)  # the saved skip counters must include steps not yet logged
        if not self.weights_finite():
            raise NonFiniteStop(
                f"the weights hold NaN or inf at step {self.step} (an update too large for its values?), so no "
                f"checkpoint was written for it; the newest checkpoint holds the last good weights. {ADVICE}"
            )
        if dist.is_main and (warning := checkpoint.space_warning(self.run_dir)):
            self.console.print(f"[yellow]warning:[/] {warning}")
        info = {"nonfinite_skips": self.guard.nonfinite_skips, **checkpoint_record(self.spec.reward)}
        if self.saver is not None:
            return self.saver.start(self.step, self._write_checkpoint, info=info)
        return checkpoint.save(
            self.run_dir, self.step, self._write_checkpoint, keep=self.spec.checkpoint.keep, rank=dist.rank,
            agree=dist.all_true, info=info,
        )  # fmt: skip

    # ----- the loop --------------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        """Train from the current step to train.max_steps; returns the run summary."""
        t, dist = self.spec.train, self.parts.dist
        started = time.perf_counter()
        train_mode(self.parts.strategy.optimizer)  # schedule-free: a checkpoint's x (or a fresh start) to y
        writer = metrics.MetricsFile(self.run_dir / "metrics.jsonl") if dist.is_main else None
        if dist.is_main:
            self.observers = build_observers(self.spec, self._run_context())
        show = dist.is_main and self.spec.log.progress and self.console.is_terminal  # else: log lines
        progress, task = metrics.make_progress(self.console, t.max_steps, self.step)
        lines = self._progress_lines() if dist.is_main and not show else None
        self._mark = (time.perf_counter(), self.step)
        signum: int | None = None
        profiler = profiling.profile(
            self.spec.profile, self.spec.profiler, self.run_dir, rank=dist.rank, device_type=self.device.type,
            console=self.console,
        )  # fmt: skip
        with progress if show else contextlib.nullcontext(), profiler as prof, self.loop_policies():
            while self.step < t.max_steps:
                self._train_step()
                self.step += 1
                prof.step()
                for hook in self.parts.after_step:
                    hook(self.step)
                records: list[dict[str, Any]] = []  # written after the save, which adds its time
                try:
                    stopping, signum = self._after_step(records, lambda **kw: progress.update(task, **kw))
                finally:
                    for record in records if writer else ():
                        writer.write(record)
                        self.observers.record(record)
                if show:
                    progress.update(task, completed=self.step)
                elif lines is not None:
                    lines.after_step(self.step, records)
                if stopping or signum:
                    break
        self.finish_saves()  # a session that ends without a final save still commits the one in flight
        if writer:
            writer.close()
        self.guard.settle(self.step)  # a session may end (stop_after, a signal) between log steps
        self.guard.check_final_loss(self._history["loss"][-1] if self._history["loss"] else None, self.step)
        if self.step >= t.max_steps:
            reason = "completed"
        else:
            reason = self.stop.reason(signum) if signum else "stopped_after"
        summary = self.summary(reason, time.perf_counter() - started)
        if signum:
            summary["signal"] = signal.Signals(signum).name
        return summary

    @contextlib.contextmanager
    def loop_policies(self) -> Iterator[bool]:
        """What the loop changes in the process while it runs: garbage collection only at its pauses
        (launcher.rank.collection) and, on the CPU, freed memory kept for the next step (host_memory);
        yields whether it keeps freed memory."""
        reuse = self.device.type == "cpu" and self.spec.memory.cpu_malloc_reuse
        with collection.collect_at_pauses(), host_memory.reuse_freed_memory(reuse) as kept:
            yield kept

    def _after_step(
        self, records: list[dict[str, Any]], show: Callable[..., None]
    ) -> tuple[bool, int | None]:
        """Log, evaluate, agree on a stop and checkpoint after a step; whether the session stops, and on
        which signal. The step's record gets the seconds a save held the loop (`time_checkpoint_s`)."""
        t, last = self.spec.train, self.step == self.spec.train.max_steps
        if self.step % t.log_every == 0 or last:
            records.append(record := self._log_record())
            collection.collect()
            self.guard.check_loss_scale(record["loss_scale"], self.step)
            show(loss=f"{record['loss']:.4f}", tps=f"{record['tokens_per_s']:,.0f}")
        evaluates = (t.eval_every and self.step % t.eval_every == 0) or (last and t.evaluates_at_end())
        if evaluates and (scores := self.evaluate()):  # a source without held-out sequences makes none
            records.append({"step": self.step, "session": self.session, **scores})
            collection.collect(full=True)
        stopping = self.step == t.stop_after
        # A stop signal on any rank stops every rank after this same step: agreed on with the next step's
        # count of terms (one collective, launcher.rank.step_inputs).
        signum = None if last else self._prepare_next_step()
        every, final = self.spec.checkpoint.every, last or stopping or bool(signum)
        if (every and self.step % every == 0) or signum or (final and self.spec.checkpoint.save_final):
            held = {"time_checkpoint_s": round(self.save(wait=final), 6)}  # the session's last: written
            if records and "loss" in records[0]:
                records[0].update(held)
            else:  # a step that is not logged gets a record of its own
                records.append({"step": self.step, "session": self.session, **held})
        return stopping, signum

    def _progress_lines(self) -> metrics.ProgressLines | None:
        """Plain progress lines where no bar draws (log.progress_every_s; null: none)."""
        every_s, total = self.spec.log.progress_every_s, self.spec.train.max_steps
        if not self.spec.log.progress or every_s is None:
            return None
        return metrics.ProgressLines(self.console, total=total, start_step=self.step, every_s=every_s)

    def _run_context(self) -> observers.RunContext:
        return observers.RunContext(
            run_dir=self.run_dir, console=self.console, device_type=self.device.type, start_step=self.step,
            session=self.session, world_size=self.parts.dist.world_size, max_steps=self.spec.train.max_steps,
        )  # fmt: skip

    def _draw(self, stop: StopSignal | None) -> tuple[StepInputs, int | None]:
        """Step self.step's inputs from the source and, with `stop`, the signal every rank stops on (one collective)."""
        return draw(
            self.parts.source, self.step, self._source_context, stop=stop, timer=self.timer,
            counts_samples=self._counts_samples, local_batch=self.parts.local_batch,
        )  # fmt: skip

    def _prepare_next_step(self) -> int | None:
        """Draw the next step's inputs after this step and agree on the stop signal with their count."""
        self._next, signum = self._draw(self.stop)
        self.timer.stop()
        return signum

    def _train_step(self) -> None:
        """One optimizer step over grad_accum_steps micro batches, normalized by the step's terms (the objective's
        count: trained tokens, or pairs) on all ranks."""
        strategy, runner = self.parts.strategy, self.parts.runner
        dtype = self.parts.dtype
        for hook in self.parts.before_step:
            hook(self.step)
        self.guard.check_learning_rate(self.parts.scheduler.get_last_lr()[0], self.step)
        if self._next is None:  # a session's first step
            inputs = self._draw(None)[0]
        else:
            inputs, self._next = self._next, None
            self.timer.start("forward")
        batches, terms_per_rank = inputs.batches, inputs.terms_per_rank
        loss_sum = torch.zeros((), device=self.device)
        for i, batch in enumerate(batches):
            sync = i == len(batches) - 1
            with contextlib.nullcontext() if sync else strategy.no_sync():
                loss_sum += runner.forward_backward(batch, terms_per_rank, dtype, self.timer)
        self.timer.start("optimizer")
        result = strategy.step(loss_ok=torch.isfinite(loss_sum))
        if self._schedule_started:
            self.parts.scheduler.step()
        else:  # a skipped step still advances the schedule, on purpose; torch warns at its first step only
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=re.escape("Detected call of `lr_scheduler.step()`"))
                self.parts.scheduler.step()
            self._schedule_started = True
        self.timer.stop()
        self._interval["loss"] += loss_sum
        self._interval["tokens"] += inputs.num_tokens
        self._interval["processed"] += inputs.num_processed
        self._interval["terms"] += inputs.num_terms
        self._interval["samples"] += inputs.samples
        self._last_result = result
        self.guard.record(result, self.step + 1)

    def _log_record(self) -> dict[str, Any]:
        """Read the interval's numbers back from the device (the one sync of a log step)."""
        dist, strategy = self.parts.dist, self.parts.strategy
        self.guard.settle(self.step)
        now = time.perf_counter()
        elapsed = now - self._mark[0]
        interval = self._interval
        sums = [float(interval["loss"]), *(interval[k] for k in ("tokens", "samples", "terms", "processed"))]
        loss_sum, tokens, samples, terms, processed = dist.data_sum(sums)
        counted = processed if self.parts.objective.counts_processed_tokens else tokens  # its choice
        tokens_per_s = counted / elapsed if elapsed > 0 else 0.0
        peak = self.parts.peak_flops
        phases = self.timer.read()
        record = {
            "step": self.step,
            "loss": loss_sum / max(terms, 1),
            "lr": self.parts.scheduler.get_last_lr()[0],
            "grad_norm": float(self._last_result.grad_norm),
            "tokens_per_s": tokens_per_s,
            "trained_tokens_per_s": tokens / elapsed if elapsed > 0 else 0.0,
            "trained_tokens_per_step": tokens / max(self.step - self._mark[1], 1),
            **self.parts.source.record(),  # its epoch
            "samples_per_s": samples / elapsed if elapsed > 0 else 0.0,
            "mfu": (self.parts.flops_per_token * tokens_per_s / dist.world_size / peak) if peak else None,
            "mem_peak_bytes": metrics.peak_memory_bytes(self.device.type),
            # what the caching allocator holds: far above the peak is fragmentation (the advisor says so)
            **(
                {"mem_reserved_bytes": int(torch.cuda.max_memory_reserved())}
                if self.device.type == "cuda"
                else {}
            ),
            **strategy.state_bytes(),  # this rank's share: local shards only
            "loss_scale": strategy.loss_scale(),
            "nonfinite_skips": self.guard.nonfinite_skips,
            "overflow_skips": self.guard.overflow_skips,
            "session": self.session,
            **{key: value for extra in self.parts.record_extras for key, value in extra().items()},
            **{f"time_{name}_s": round(seconds, 6) for name, seconds in phases.items()},
        }
        self._history["tokens_per_s"].append(tokens_per_s)
        self._history["loss"].append(record["loss"])
        self._interval = self._new_interval()
        self._mark = (time.perf_counter(), self.step)
        return record

    def _new_interval(self) -> dict[str, Any]:
        """The sums of a log interval: loss (on the device), trained and processed tokens, samples, terms."""
        sums = dict.fromkeys(("tokens", "processed", "samples", "terms"), 0)
        return {"loss": torch.zeros((), device=self.device), **sums}

    def evaluate(self) -> dict[str, float]:
        """Held-out loss and perplexity at this step (launcher.rank.evaluation; every rank calls it), {} without held-out sequences."""
        scores = evaluation.evaluate(self.parts, self.step)
        if scores:
            self._eval = scores
        return scores

    def summary(self, exit_reason: str, wall_time_s: float) -> dict[str, Any]:
        """The end-of-run record written to summary.json."""
        rates = self._history["tokens_per_s"][1:] or self._history["tokens_per_s"]
        return {
            "steps": self.step,
            "final_loss": self._history["loss"][-1] if self._history["loss"] else None,
            "eval_loss": self._eval.get("eval_loss"),
            "eval_ppl": self._eval.get("eval_ppl"),
            "median_tokens_per_s": statistics.median(rates) if rates else None,
            "peak_mem_bytes": metrics.peak_memory_bytes(self.device.type),
            "wall_time_s": wall_time_s,
            "exit_reason": exit_reason,
            "nonfinite_skips": self.guard.nonfinite_skips,
            "overflow_skips": self.guard.overflow_skips,
            "resumed_from": self.resumed_from,
            "sessions": self.session + 1,
            "world_size": self.parts.dist.world_size,
        }
