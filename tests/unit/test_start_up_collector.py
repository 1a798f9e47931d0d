"""Start-up without automatic garbage collection (launcher/components/collector.py): the console process
pauses the collector until its spec is built, a rank in that process imports and builds with it paused,
and nothing else's collector is changed."""

from __future__ import annotations

import gc
import json
import subprocess
import sys
import textwrap
import weakref
from pathlib import Path

from launcher.components import collector


class Cycle:
    def __init__(self) -> None:
        self.me = self


def test_start_up_garbage_is_collected_once_and_the_collector_resumes() -> None:
    assert gc.isenabled()
    collector.pause()
    try:
        assert not gc.isenabled()
        garbage = weakref.ref(Cycle())
        for _ in range(2000):
            Cycle()  # past the automatic threshold: nothing collects while paused
        assert garbage() is not None
        collector.resume()
        assert garbage() is None  # collected, not frozen with what lives
        assert gc.isenabled() and gc.get_freeze_count() > 0
        collector.resume()  # once only
        assert gc.isenabled()
    finally:
        gc.unfreeze()
        gc.enable()


def test_a_collector_the_start_up_did_not_pause_is_left_as_it_was() -> None:
    gc.disable()  # a caller's own choice (e.g. a process that calls cli.run)
    try:
        collector.pause()
        collector.resume()
        assert not gc.isenabled() and gc.get_freeze_count() == 0
        with collector.paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
    finally:
        gc.enable()
    with collector.paused(), collector.frozen():
        assert not gc.isenabled() and gc.get_freeze_count() > 0
    assert gc.isenabled() and gc.get_freeze_count() == 0


RUN = textwrap.dedent(
    """
    import contextlib, gc, json, sys
    from launcher.rank import collection

    generations, seen = [], {}
    gc.callbacks.append(lambda phase, info: phase == "stop" and generations.append(info["generation"]))
    loop_policy = collection.collect_at_pauses

    @contextlib.contextmanager
    def at_loop_start():
        seen.update(full=generations.count(2), unfrozen=len(gc.get_objects()), frozen=gc.get_freeze_count())
        with loop_policy():
            yield

    collection.collect_at_pauses = at_loop_start
    sys.argv = ["train", *sys.argv[1:]]
    from launcher.front.entry import main
    try:
        main()
    except SystemExit as stop:
        seen["status"] = stop.code
    sys.stderr.write("\\nSEEN " + json.dumps(seen) + "\\n")
    """
)


def test_a_one_step_run_reaches_its_loop_with_one_full_collection_and_the_imports_frozen(
    tmp_path: Path,
) -> None:
    """`train train.max_steps=1` (inline): no automatic pass over the imports before the loop, and the
    loop's own collection walks only what the build made; the final checkpoint is written."""
    from tests.unit.test_bench_scripts import TINY_RUN

    run_dir = tmp_path / "run"
    done = subprocess.run(
        [sys.executable, "-c", RUN, *TINY_RUN, "train.max_steps=1", f"run_dir={run_dir}"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    seen = json.loads(done.stderr.rsplit("SEEN ", 1)[-1]) if "SEEN " in done.stderr else {}
    assert seen.get("status") == 0, done.stderr[-3000:]
    assert seen["full"] == 1, seen  # the one at the end of the front's start-up (collector.resume)
    assert seen["frozen"] > 4 * seen["unfrozen"], seen  # torch, Hydra and the package: out of later passes
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step_1"
    assert (run_dir / "checkpoints" / "step_1" / "COMPLETE").is_file()


RANK = textwrap.dedent(
    """
    import contextlib, gc, json, runpy, sys
    from launcher.rank import collection

    generations, seen = [], {}
    gc.callbacks.append(lambda phase, info: phase == "stop" and generations.append(info["generation"]))
    loop_policy = collection.collect_at_pauses

    @contextlib.contextmanager
    def at_loop_start():
        seen.update(enabled=gc.isenabled(), full=generations.count(2), unfrozen=len(gc.get_objects()),
                    frozen=gc.get_freeze_count())
        with loop_policy():
            yield

    collection.collect_at_pauses = at_loop_start
    try:
        runpy.run_module("launcher.rank", run_name="__main__", alter_sys=True)
    except SystemExit as stop:
        seen.update(status=stop.code, frozen_at_exit=gc.get_freeze_count(), left=len(gc.get_objects()))
    sys.stderr.write("\\nSEEN " + json.dumps(seen) + "\\n")
    """
)


def test_a_rank_process_imports_and_builds_paused_runs_with_its_imports_frozen_and_exits_frozen(
    tmp_path: Path,
) -> None:
    """`python -m launcher.rank SPEC` (a rank under torchrun; local and SLURM ranks run the same run_process):
    no full pass before the loop, whose collection walks only the build's objects, and the interpreter's
    last collections walk nothing (they cost about a second of CPU per rank)."""
    from conftest import write_spec
    from tests.unit.test_bench_scripts import TINY_RUN

    spec = write_spec([*TINY_RUN, "train.max_steps=1", "log.summary_table=false"], tmp_path / "run")
    done = subprocess.run(
        [sys.executable, "-c", RANK, str(spec)], capture_output=True, text=True, timeout=300
    )  # fmt: skip
    seen = json.loads(done.stderr.rsplit("SEEN ", 1)[-1]) if "SEEN " in done.stderr else {}
    assert seen.get("status") == 0, done.stderr[-3000:]
    assert not seen["enabled"] and seen["full"] == 0, seen  # imports and build: automatic collection paused
    assert seen["frozen"] > 4 * seen["unfrozen"], seen  # torch and the package: out of the loop's passes
    # what the interpreter's end collects: the few objects made after the freeze (the SystemExit), not the run's
    assert seen["left"] < 100 and seen["frozen_at_exit"] > 100_000, seen
