"""The readers that keep code in files from running: DCP metadata's allowlist, non-tensor DCP values,
torch files, spec.yaml; and a scan of the package that every read goes through them."""

from __future__ import annotations

import ast
import pickle
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from payloads import Payload, poisoned_metadata
from torch.distributed.checkpoint import FileSystemReader

import launcher
from launcher.components.files.dcp_reader import (
    ADMITTED,
    MetadataUnpickler,
    SafeReader,
    load_full_state,
    read_metadata,
)
from launcher.components.files.safe_load import (
    RefusedFile,
    load_tensor_file,
    named_global,
    refused_yaml,
    yaml_tag,
)
from launcher.spec import SpecFileError, load_spec

DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.uint8, torch.bool)


def _save(folder: Path, extra: object = None) -> Path:
    """A DCP folder written in this process: tensors of several dtypes and shapes, and non-tensor values."""
    state = {
        "model": {f"w{i}": torch.ones(3, 2 + i).to(dtype) for i, dtype in enumerate(DTYPES)},
        "optim": {"lr": 0.1, "betas": (0.9, 0.95), "foreach": None, "params": ["w0", "w1"]},
    }
    if extra is not None:
        state["optim"]["extra"] = extra
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to load in a single process"
        dcp.save(state, checkpoint_id=folder, no_dist=True)
    return folder


class _Recorder(pickle.Unpickler):
    def __init__(self, file) -> None:
        super().__init__(file)
        self.asked: set[tuple[str, str]] = set()

    def find_class(self, module: str, name: str):
        self.asked.add((module, name))
        return super().find_class(module, name)


def test_torch_metadata_names_only_admitted_globals_and_loads_the_same(tmp_path) -> None:
    folder = _save(tmp_path / "dcp")
    with open(folder / ".metadata", "rb") as handle:
        recorder = _Recorder(handle)
        recorder.load()
    dtypes = {
        (m, n) for m, n in recorder.asked if m == "torch" and isinstance(getattr(torch, n), torch.dtype)
    }
    assert len(dtypes) == len(DTYPES)
    assert recorder.asked - dtypes <= set(ADMITTED), recorder.asked - dtypes - set(ADMITTED)
    ours, theirs = read_metadata(folder / ".metadata"), FileSystemReader(folder).read_metadata()
    assert ours.state_dict_metadata == theirs.state_dict_metadata and ours.storage_data == theirs.storage_data
    state = load_full_state(folder)
    assert state["optim"] == {"lr": 0.1, "betas": (0.9, 0.95), "foreach": None, "params": ["w0", "w1"]}
    assert all(torch.equal(state["model"][f"w{i}"], torch.ones(3, 2 + i).to(d)) for i, d in enumerate(DTYPES))


def test_a_payload_in_metadata_runs_under_plain_pickle_and_is_refused_here(tmp_path) -> None:
    folder, marker = _save(tmp_path / "dcp"), tmp_path / "ran"
    (folder / ".metadata").write_bytes(poisoned_metadata(folder, marker))
    FileSystemReader(folder).read_metadata()  # torch's own reader runs it: the payload is live
    assert marker.exists()
    marker.unlink()
    with pytest.raises(
        RefusedFile, match=r"\.metadata was refused: it names posix\.system, and only plain data"
    ) as refused:
        read_metadata(folder / ".metadata")
    assert refused.value.names_code
    with pytest.raises(BaseException, match=r"\.metadata was refused"):
        dcp.load({"model": {}}, storage_reader=SafeReader(folder), no_dist=True)
    assert not marker.exists()


@pytest.mark.parametrize(
    ("module", "name"),
    [
        ("builtins", "exec"),
        ("builtins", "eval"),
        ("os", "system"),
        ("torch", "load"),
        ("pathlib", "Path"),  # Path(...).write_text would be a file write
        ("torch.distributed.checkpoint.metadata", "Metadata.__init__"),  # no attribute paths
        ("torch", "Size.__class__"),
        ("torch.serialization", "load"),
    ],
)
def test_globals_outside_the_list_are_refused(tmp_path, module: str, name: str) -> None:
    """A pickle naming (module, name) by the protocol 4 opcode, which is how torch's metadata names globals."""
    data = (
        b"\x80\x04" + pickle.SHORT_BINUNICODE + bytes([len(module)]) + module.encode()
        + pickle.SHORT_BINUNICODE + bytes([len(name)]) + name.encode() + pickle.STACK_GLOBAL + pickle.STOP
    )  # fmt: skip
    path = tmp_path / ".metadata"
    path.write_bytes(data)
    with pytest.raises(RefusedFile, match=f"it names {module}.{name}"):
        read_metadata(path)


def test_metadata_pointing_outside_its_folder_or_of_another_type_is_refused(tmp_path) -> None:
    folder = _save(tmp_path / "dcp")
    metadata = FileSystemReader(folder).read_metadata()
    next(iter(metadata.storage_data.values())).relative_path = "../../etc/passwd"
    (folder / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(RefusedFile, match="not a plain file name") as refused:
        read_metadata(folder / ".metadata")
    assert not refused.value.names_code  # damage-like: the rank may fall back to an older checkpoint
    (folder / ".metadata").write_bytes(pickle.dumps({"not": "metadata"}))
    with pytest.raises(RefusedFile, match="holds a dict"):
        read_metadata(folder / ".metadata")
    (folder / ".metadata").write_bytes(b"\x80\x04junk")
    with pytest.raises(RefusedFile, match="not a DCP metadata pickle"):
        read_metadata(folder / ".metadata")


def test_a_payload_in_a_non_tensor_value_runs_under_torchs_planner_and_is_refused_here(tmp_path) -> None:
    marker = tmp_path / "ran"
    folder = _save(tmp_path / "dcp", extra=Payload(marker, "exec"))
    assert not marker.exists()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(state := {"optim": {"extra": None}}, checkpoint_id=folder, no_dist=True)
    assert marker.exists() and state  # torch's default planner unpickles it with weights_only=False
    marker.unlink()
    with pytest.raises(RefusedFile, match=r"__0_0\.distcp was refused: it names (builtins\.)?exec"):
        load_full_state(folder)
    assert not marker.exists()


def test_torch_files_are_read_weights_only_and_refusals_name_the_file(tmp_path) -> None:
    marker, good = tmp_path / "ran", tmp_path / "model.pt"
    torch.save({"w": torch.ones(2)}, good)
    assert torch.equal(load_tensor_file(good)["w"], torch.ones(2))
    torch.save({"w": Payload(marker, "exec")}, bad := tmp_path / "optimizer.pt")
    with pytest.raises(
        RefusedFile, match=r"optimizer\.pt was refused: it names (builtins\.)?exec"
    ) as refused:
        load_tensor_file(bad)
    assert "weights_only` set to `False`" not in str(
        refused.value
    )  # torch's advice to load it anyway is dropped
    (junk := tmp_path / "trainer.pt").write_bytes(b"not a torch file")
    with pytest.raises(RefusedFile, match=r"trainer\.pt was refused: it is not a valid file") as refused:
        load_tensor_file(junk)
    assert not refused.value.names_code and not marker.exists()


def test_a_spec_with_a_python_tag_is_refused_naming_it(tmp_path) -> None:
    marker = tmp_path / "ran"
    spec = tmp_path / "spec.yaml"
    spec.write_text(f"model: !!python/object/apply:os.system ['touch {marker}']\n")
    with pytest.raises(SpecFileError, match=r"spec\.yaml was refused: .*python/object/apply:os\.system"):
        load_spec(spec)
    assert not marker.exists()


def _zip_with(pickled: bytes, path: Path) -> Path:
    """A torch zip file whose data.pkl is `pickled` (every other record as torch.save wrote it)."""
    import zipfile

    torch.save({"w": torch.ones(2)}, path)
    records = {}
    with zipfile.ZipFile(path) as archive:
        records = {name: archive.read(name) for name in archive.namelist()}
    with zipfile.ZipFile(path, "w") as archive:
        for name, data in records.items():
            archive.writestr(name, pickled if name.endswith("data.pkl") else data)
    return path


@pytest.mark.parametrize("protocol", [2, 4, 5])
@pytest.mark.parametrize("container", ["raw", "zip"])
def test_a_pickle_that_names_code_is_refused_as_code_whatever_its_protocol_or_container(
    tmp_path, protocol, container
) -> None:
    """Protocol 4's FRAME stops torch's weights-only reader before the global: the opcodes still name it."""
    marker = tmp_path / "ran"
    pickled = pickle.dumps({"w": [1.0, 2.0], "x": Payload(marker)}, protocol=protocol)
    path = tmp_path / "model.pt"
    if container == "raw":
        path.write_bytes(pickled)
    else:
        _zip_with(pickled, path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch notes the pickle protocol it did not expect
        with pytest.raises(
            RefusedFile, match=r"model\.pt was refused: it names (posix|os)\.system"
        ) as refused:
            load_tensor_file(path)
    assert refused.value.names_code and not marker.exists()


def test_opcode_reading_follows_the_memo_and_admits_what_torch_admits(tmp_path) -> None:
    torch.save({"w": torch.ones(2), "d": torch.float16}, plain := tmp_path / "plain.pt")
    assert named_global(plain) is None
    hidden = (  # "posix" and "system" pushed, memoized, popped, then read back for STACK_GLOBAL
        b"\x80\x04" + pickle.SHORT_BINUNICODE + b"\x05posix" + pickle.MEMOIZE + pickle.POP
        + pickle.SHORT_BINUNICODE + b"\x06system" + pickle.MEMOIZE + pickle.POP
        + pickle.BINGET + b"\x00" + pickle.BINGET + b"\x01" + pickle.STACK_GLOBAL + pickle.STOP
    )  # fmt: skip
    (path := tmp_path / "hidden.pt").write_bytes(hidden)
    assert named_global(path) == "posix.system"
    (junk := tmp_path / "junk.pt").write_bytes(b"\x80\x04garbage" * 8)
    assert named_global(junk) is None  # damage, not code


def test_yaml_tags_that_name_code_are_found_without_building_anything(tmp_path) -> None:
    marker = tmp_path / "ran"
    (plain := tmp_path / "plain.yaml").write_text("a: 1\nb: [x, !!str 2]\nc: {d: null}\n")
    assert yaml_tag(plain) is None and refused_yaml(plain, "advice") is None
    (tagged := tmp_path / "spec.yaml").write_text(
        f"a: 1\nb: !!python/object/apply:os.system ['touch {marker}']\n"
    )
    assert yaml_tag(tagged) == "tag:yaml.org,2002:python/object/apply:os.system"
    refused = refused_yaml(tagged, "Keep it.")
    assert refused.names_code and "!!python/object/apply:os.system, which names code" in str(refused)
    assert not marker.exists()


def _calls(tree: ast.AST) -> list[tuple[str, ast.Call]]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            found.append((ast.unparse(node.func), node))
    return found


def _keyword(call: ast.Call, name: str) -> str | None:
    return next((ast.unparse(k.value) for k in call.keywords if k.arg == name), None)


def test_every_read_of_the_package_goes_through_the_allowlists() -> None:
    """torch.load weights-only, dcp.load through SafeReader, no plain pickle or yaml, remote code off."""
    wrong = []
    for path in sorted(Path(launcher.__file__).parent.rglob("*.py")):
        for func, call in _calls(ast.parse(path.read_text())):
            where = f"{path.name}:{call.lineno} {func}"
            if func == "torch.load" and _keyword(call, "weights_only") != "True":
                wrong.append(f"{where} without weights_only=True")
            if func in ("pickle.load", "pickle.loads", "yaml.load", "yaml.unsafe_load", "yaml.full_load"):
                wrong.append(where)
            if func.endswith("FileSystemReader") or func.endswith("dcp_to_torch_save"):
                wrong.append(f"{where}: use launcher.components.files.dcp_reader")
            if func == "dcp.load" and "SafeReader(" not in (_keyword(call, "storage_reader") or ""):
                wrong.append(f"{where} without storage_reader=SafeReader(...)")
            loads_hf = func.endswith(("from_pretrained", "from_config"))
            if (
                loads_hf
                and _keyword(call, "trust_remote_code") != "False"
                and "**local" not in ast.unparse(call)
            ):
                wrong.append(f"{where} without trust_remote_code=False")
    assert not wrong, "reads that could run code from a file:\n" + "\n".join(wrong)


def test_the_unpickler_refuses_persistent_ids(tmp_path) -> None:
    path = tmp_path / ".metadata"
    path.write_bytes(b"\x80\x04" + pickle.SHORT_BINUNICODE + b"\x01x" + pickle.BINPERSID + pickle.STOP)
    with pytest.raises(RefusedFile, match="persistent id"), open(path, "rb") as handle:
        MetadataUnpickler(handle, path).load()
