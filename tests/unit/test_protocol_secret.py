"""The per-job secret file: 0600, atomic, no silent overwrite, refused when others can read it."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from hpc_rl.protocol.secret import (
    SECRET_BYTES,
    Secret,
    create_secret,
    derive_key,
    engine_api_key,
    keep_or_create_secret,
    load_secret,
    secret_path,
)


def test_create_then_load(tmp_path: Path) -> None:
    path = secret_path(tmp_path)
    created = create_secret(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert len(created.key) == SECRET_BYTES
    loaded = load_secret(path)
    assert loaded.key == created.key and loaded.origin == str(path)
    assert created.key.hex() not in repr(loaded)
    assert [p.name for p in tmp_path.iterdir()] == ["secret"]  # no temporary file left behind


def test_create_refuses_to_overwrite_unless_asked(tmp_path: Path) -> None:
    path = secret_path(tmp_path)
    first = create_secret(path)
    with pytest.raises(FileExistsError, match="already exists"):
        create_secret(path)
    assert load_secret(path).key == first.key
    second = create_secret(path, overwrite=True)
    assert second.key != first.key and load_secret(path).key == second.key


def test_create_is_0600_whatever_the_umask(tmp_path: Path) -> None:
    old = os.umask(0o277)
    try:
        path = create_secret(tmp_path / "secret").origin
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o644, 0o660])
def test_load_refuses_group_or_other_access(tmp_path: Path, mode: int) -> None:
    path = secret_path(tmp_path)
    create_secret(path)
    path.chmod(mode)
    with pytest.raises(PermissionError, match=f"mode {mode:04o}.*chmod 600"):
        load_secret(path)


def test_load_errors_name_the_file(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_secret(tmp_path / "missing")
    bad = tmp_path / "bad"
    bad.write_text("zz\n")
    bad.chmod(0o600)
    with pytest.raises(ValueError, match=f"{bad} is not hex"):
        load_secret(bad)
    bad.write_text("ab" * 8)
    with pytest.raises(ValueError, match="holds 8 bytes, expected 32"):
        load_secret(bad)


def test_engine_api_key_is_derived_per_job_and_per_purpose() -> None:
    job, other_job = Secret(key=b"a" * 32), Secret(key=b"b" * 32)
    key = engine_api_key(job)
    assert key == engine_api_key(Secret(key=b"a" * 32)) and len(key) == 64 and int(key, 16) >= 0
    assert key != engine_api_key(other_job) and key != derive_key(job, b"something-else")
    assert job.key.hex() not in key


def test_a_resubmit_keeps_a_usable_secret_and_replaces_an_unusable_one(tmp_path: Path) -> None:
    path = tmp_path / "secret"
    first, kept = keep_or_create_secret(path)
    assert not kept
    again, kept = keep_or_create_secret(path)  # the run's engine jobs keep their engine key
    assert kept and again.key == first.key and engine_api_key(again) == engine_api_key(first)
    os.chmod(path, 0o644)  # readable by others: not trusted any more
    fresh, kept = keep_or_create_secret(path)
    assert not kept and fresh.key != first.key and stat.S_IMODE(path.stat().st_mode) == 0o600
