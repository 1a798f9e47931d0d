"""Every scripts/bench_* still runs: what it imports from the package exists, --help answers, and the
cheap ones measure something tiny for real (the docs quote their numbers; a moved module must not
leave them broken until someone reruns them)."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import json
import subprocess
import sys
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = sorted((ROOT / "scripts").glob("bench_*"))
TINY_RUN = [
    "model.n_layer=1",
    "model.d_model=32",
    "model.n_head=2",
    "data.seq_len=16",
    "data.max_bytes=100000",
    "train.micro_batch_size=2",
]


def _package_references(script: Path) -> list[tuple[int, str, str]]:
    """(line, module, name) for each name a script takes from the package, and each attribute it reads
    off a package module it imported (`from launcher.parallel import dims` ... `dims.init`)."""
    tree = ast.parse(script.read_text())
    found: list[tuple[int, str, str]] = []
    modules: dict[str, str] = {}  # local name -> package module it stands for
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("launcher"):
            for alias in node.names:
                found.append((node.lineno, node.module, alias.name))
                modules[alias.asname or alias.name] = f"{node.module}.{alias.name}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("launcher") and alias.asname:
                    modules[alias.asname] = alias.name
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in modules:
            module = modules[node.value.id]
            found.append((node.lineno, module, node.attr))
    return found


def _missing(module_name: str, name: str) -> str | None:
    """Why `module_name` has no `name` (neither an attribute nor a submodule), or None."""
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError:
        parent, _, attr = module_name.rpartition(".")
        try:  # `from launcher.x import function` then `function.attr`: not a module, not checked
            if not isinstance(getattr(importlib.import_module(parent), attr), types.ModuleType):
                return None
        except (ImportError, AttributeError) as err:
            return str(err)
        raise
    if hasattr(module, name):
        return None
    try:
        importlib.import_module(f"{module_name}.{name}")
    except ImportError as err:
        return str(err)
    return None


def test_there_are_bench_scripts() -> None:
    assert len(SCRIPTS) >= 12, SCRIPTS


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_what_a_bench_script_takes_from_the_package_exists(script: Path) -> None:
    problems = [
        f"{script.name}:{line}: {module}.{name}: {why}"
        for line, module, name in _package_references(script)
        if (why := _missing(module, name)) is not None
    ]
    assert not problems, "\n".join(problems)


def test_every_bench_script_answers_help() -> None:
    started = {
        script.name: subprocess.Popen(
            [sys.executable, str(script), "--help"],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        for script in SCRIPTS
    }
    failed = []
    for name, proc in started.items():
        out, err = proc.communicate(timeout=120)
        if proc.returncode != 0 or "usage:" not in out:
            failed.append(f"{name} (exit {proc.returncode}): {err[-1500:]}")
    assert not failed, "\n".join(failed)


def _run(script: str, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / script), *args], cwd=cwd, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def test_bench_checkpoint_compares_a_sealed_save_and_a_verified_load_with_torch(tmp_path) -> None:
    out = tmp_path / "numbers.json"
    args = [
        "--gib",
        "0.004",
        "--rounds",
        "1",
        "--keep-page-cache",
        "--dir",
        str(tmp_path),
        "--json",
        str(out),
    ]
    result = _run("bench_checkpoint", *args, cwd=tmp_path)
    assert "sealed save / plain save" in result.stdout and "verify + load / plain load" in result.stdout
    numbers = json.loads(out.read_text())
    assert set(numbers["median_s"]["wall"]) == {"plain save", "sealed save", "plain load", "verify + load"}
    assert all(value > 0 for value in numbers["ratios"]["wall"].values())
    assert list(tmp_path.iterdir()) == [out]  # its files are gone


@pytest.mark.extended  # a bench's own run; the default tier holds every script's --help and the bench table
def test_bench_overhead_times_the_engine_against_a_plain_loop(tmp_path, monkeypatch) -> None:
    """Each loop in its own process, an engine variant beside the engine, and the rows scripts/bench makes."""
    from importlib.machinery import SourceFileLoader

    out = tmp_path / "overhead.json"
    _run("bench_overhead", "--rounds", "1", "--steps", "1", "--warmup", "0", "--json", str(out),
         "--also-engine", "memory.cpu_malloc_reuse=false", *TINY_RUN, cwd=tmp_path)  # fmt: skip
    numbers = json.loads(out.read_text())
    variant = "engine memory.cpu_malloc_reuse=false"
    assert set(numbers["median_s"]) == {"plain", "engine", variant}
    assert numbers["ratio_to_plain"]["engine"] > 0 and numbers["ratio_to_plain"][variant] > 0
    loader = SourceFileLoader("bench", str(ROOT / "scripts" / "bench"))
    bench = importlib.util.module_from_spec(importlib.util.spec_from_loader("bench", loader))
    monkeypatch.setitem(sys.modules, "bench", bench)  # its dataclasses look their module up there
    loader.exec_module(bench)
    rows = bench._overhead_rows("gpt_tiny")(numbers)
    assert [(r.comparison, r.aim) for r in rows] == [
        ("engine / plain loop, gpt_tiny, step time", "<= 1.02"),
        ("engine with memory.cpu_malloc_reuse=false / plain loop, gpt_tiny, step time", ""),
    ]


def test_bench_gpu_skips_cleanly_without_a_gpu(tmp_path) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: the script would measure (tests/gpu runs it)")
    result = _run("bench_gpu", cwd=tmp_path)
    assert "skipped, no CUDA GPU is visible" in result.stdout


def test_bench_tokenize_times_the_launcher_against_datasets_on_the_same_tokens(tmp_path) -> None:
    out = tmp_path / "tokenize.json"
    args = ["--mb", "0.05", "--vocab", "300", "--rounds", "1", "--json", str(out)]
    result = _run("bench_tokenize", *args, cwd=tmp_path)  # it exits non-zero when the token counts differ
    assert "launcher / datasets" in result.stdout
    numbers = json.loads(out.read_text())
    assert numbers["tokens"] > 0 and numbers["ratio"] > 0 and numbers["cpu_ratio"] > 0


def test_bench_generate_times_the_cache_against_recomputing_on_the_same_tokens(tmp_path) -> None:
    out = tmp_path / "generate.json"
    args = ["--batch", "2", "--prompt-len", "4", "--new-tokens", "8", "--repeats", "1", "--out", str(out)]
    result = _run("bench_generate", *args, cwd=tmp_path)  # it exits non-zero when the tokens differ
    assert "speed-up" in result.stdout
    numbers = json.loads(out.read_text())
    assert numbers["same_tokens"] and numbers["cache_tokens_per_s"] > 0 and numbers["recompute_cpu_s"] > 0


def test_bench_long_context_measures_each_path_and_writes_its_table(tmp_path) -> None:
    out, numbers = tmp_path / "table.md", tmp_path / "numbers.json"
    tiny = ["model.n_layer=1", "model.d_model=32", "model.n_head=2"]
    args = ["--models", "gpt", "--seqs", "64", "--variants", "dense", "chunked", "--steps", "1"]
    result = _run("bench_long_context", *tiny, *args, "--out", str(out), "--json", str(numbers), cwd=tmp_path)
    rows = json.loads(numbers.read_text())
    assert set(rows) == {"gpt 64 dense", "gpt 64 chunked"}, rows
    assert all(r["peak_gib"] > 0.05 and r["tokens_per_s"] > 0 for r in rows.values()), rows
    table = out.read_text()
    assert table.strip() in result.stdout
    assert "| gpt | 64 | dense mask (sdpa), whole logits |" in table and "| 1.00 |" in table


@pytest.mark.extended  # two 2-rank runs; DDP's parity with torch's own DDP is test_local_ddp.py's
def test_bench_ddp_compares_train_with_a_plain_torchrun_script(tmp_path) -> None:
    """One round without background load (a busy process would take one of two cores from the suite)."""
    out = tmp_path / "ddp.json"
    _run("bench_ddp", "--rounds", "1", "--steps", "16", "--load", "0", "--strategies", "ddp", "--cpu",
         "--json", str(out), *TINY_RUN, cwd=tmp_path)  # fmt: skip
    numbers = json.loads(out.read_text())
    row = numbers["summary"]["ddp load 0"]
    assert row["plain_tokens_per_s"] > 0 and row["train_tokens_per_s"] > 0 and row["ratio"] > 0
    # each rank's CPU seconds per step between log steps 10 and 15, read from /proc
    assert (
        0 < row["plain_cpu_s_per_step"] < 1 and 0 < row["train_cpu_s_per_step"] < 1 and row["cpu_ratio"] > 0
    )
    assert list(numbers["summary"]) == ["ddp load 0"] and numbers["machine"]["background_processes"] == 0


def test_bench_runs_the_comparisons_and_writes_the_table_the_docs_show(tmp_path, monkeypatch) -> None:
    """`scripts/bench`, the one command behind README's and docs/performance.md's table."""
    from importlib.machinery import SourceFileLoader

    table = tmp_path / "table.md"
    result = _run("bench", "--quick", "--only", "checkpoint", "--table", str(table), cwd=tmp_path)
    text = table.read_text()
    assert "| checkpoint save / torch.save + fsync" in text and "| verified load / torch.load" in text
    assert "load average" in result.stdout and "scripts/bench --update-docs" in text
    loader = SourceFileLoader("bench", str(ROOT / "scripts" / "bench"))
    bench = importlib.util.module_from_spec(importlib.util.spec_from_loader("bench", loader))
    monkeypatch.setitem(sys.modules, "bench", bench)  # its dataclasses look their module up there
    loader.exec_module(bench)
    page = tmp_path / "page.md"
    page.write_text(f"before\n{bench.START}\nold table\n{bench.END}\nafter\n")
    plain = tmp_path / "no_markers.md"
    plain.write_text("no table here\n")
    assert bench.update_docs(text, (page, plain)) == [page]
    assert plain.read_text() == "no table here\n"
    assert page.read_text() == f"before\n{bench.START}\n{text}{bench.END}\nafter\n"
    shown = bench.published_rows((plain, page))  # what the page shows reads back as rows
    assert [r.comparison for r in shown][:1] == ["checkpoint save / torch.save + fsync, 0.00 GiB, wall"]
    assert shown[0].when and shown[0].load and shown[0].aim == "<= 1.0"
    again = bench.Row(shown[1].comparison, 9.0, 8.0, 10.0, "", "0.1-0.2", "2000-01-01")
    extra = bench.Row("a new comparison", 1.0, 1.0, 1.0, "", "", "2000-01-01")
    # `--only X --update-docs`: X's rows replaced in place, the other rows kept, new ones last
    assert bench.merged(shown, [extra, again]) == [shown[0], again, extra]
    for path in bench.DOCS:  # both pages carry the markers the command fills
        assert bench.START in path.read_text() and bench.END in path.read_text(), path
