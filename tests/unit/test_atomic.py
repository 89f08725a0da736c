"""Atomic writes: a target appears whole or not at all."""

from __future__ import annotations

import pytest

from elastic_rl.atomic import atomic_directory, write_file_atomic

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]


def test_directory_appears_only_on_success(tmp_path):
    target = tmp_path / "weights" / "3"
    with pytest.raises(RuntimeError):
        with atomic_directory(target) as temp:
            (temp / "model.safetensors").write_bytes(b"partial")
            raise RuntimeError("crash mid-write")
    assert not target.exists()
    assert list((tmp_path / "weights").iterdir()) == []

    with atomic_directory(target) as temp:
        (temp / "model.safetensors").write_bytes(b"whole")
    assert (target / "model.safetensors").read_bytes() == b"whole"


def test_published_directory_is_never_overwritten(tmp_path):
    target = tmp_path / "v1"
    target.mkdir()
    with pytest.raises(FileExistsError):
        with atomic_directory(target):
            pass


def test_file_replace_leaves_no_temporaries(tmp_path):
    target = tmp_path / "manifest.json"
    write_file_atomic(target, b"one")
    write_file_atomic(target, b"two")
    assert target.read_bytes() == b"two"
    assert [p.name for p in tmp_path.iterdir()] == ["manifest.json"]
