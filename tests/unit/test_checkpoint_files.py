"""The sealed save: the digest taken while writing is the file's, from several threads at once too; older
manifests with SHA-256 still verify."""

from __future__ import annotations

import hashlib
import json
import threading

import torch
import xxhash

from launcher.components.checkpoint_files import CheckpointFiles, content_problem, file_digest, merge_digests


def _xxh3(path) -> str:
    return xxhash.xxh3_128(path.read_bytes()).hexdigest()


def test_saves_from_several_threads_record_each_files_own_digest(tmp_path) -> None:
    files = CheckpointFiles(tmp_path, rank=0)
    states = {f"part{i}.pt": {"w": torch.randn(300_000 + i), "step": i} for i in range(4)}  # 1.2 MB blocks
    threads = [threading.Thread(target=files.save, args=(state, name)) for name, state in states.items()]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert torch.serialization.get_crc32_options()  # switched back for every other torch.save
    for name, state in states.items():
        assert files.digests[name] == {
            "bytes": (tmp_path / name).stat().st_size,
            "xxh3_128": _xxh3(tmp_path / name),
        }
        loaded = torch.load(tmp_path / name, weights_only=True)
        assert torch.equal(loaded["w"], state["w"]) and loaded["step"] == state["step"]


def test_adopted_files_and_reads_of_any_length_hash_like_the_libraries(tmp_path) -> None:
    sizes = [0, 1, 4095, 16 * 2**20 + 3]  # empty, tiny, and past one read block
    for size in sizes:
        (tmp_path / f"f{size}.bin").write_bytes(bytes(range(256)) * (size // 256) + b"x" * (size % 256))
    files = CheckpointFiles(tmp_path, rank=0)
    files.adopt(tmp_path.glob("f*.bin"))
    for size in sizes:
        path = tmp_path / f"f{size}.bin"
        assert files.digests[path.name] == {"bytes": size, "xxh3_128": _xxh3(path)}
        assert file_digest(path) == (size, _xxh3(path))
        assert file_digest(path, kind="sha256") == (size, hashlib.sha256(path.read_bytes()).hexdigest())


def test_verification_finds_one_changed_byte_among_several_files(tmp_path) -> None:
    files = CheckpointFiles(tmp_path, rank=0)
    for i in range(3):
        files.save({"w": torch.randn(200_000)}, f"part{i}.pt")
    files.finish()
    (tmp_path / "COMPLETE").write_text(json.dumps({"step": 1, "files": merge_digests(tmp_path)}))
    assert content_problem(tmp_path) is None
    with open(tmp_path / "part1.pt", "r+b") as handle:
        handle.seek(400_000)
        byte = handle.read(1)
        handle.seek(400_000)
        handle.write(bytes([byte[0] ^ 1]))
    assert content_problem(tmp_path) == (
        "file part1.pt does not match the XXH3-128 digest its manifest recorded (changed on disk)"
    )


def test_a_manifest_of_sha256_digests_still_verifies_and_finds_a_change(tmp_path) -> None:
    """Checkpoints written before the XXH3-128 manifest carry SHA-256 digests: they verify as before."""
    torch.save({"w": torch.randn(50_000)}, tmp_path / "model.pt")
    data = (tmp_path / "model.pt").read_bytes()
    entry = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (tmp_path / "COMPLETE").write_text(json.dumps({"step": 1, "files": {"model.pt": entry}}))
    assert content_problem(tmp_path) is None
    (tmp_path / "model.pt").write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    assert content_problem(tmp_path) == (
        "file model.pt does not match the SHA-256 its manifest recorded (changed on disk)"
    )
