"""The per-job secret: a random 32-byte key in a 0600 file in the run dir, shared by every process of a job.

Owns creating it (atomically, never silently overwriting), loading it (refusing files that others can
read), the ``Secret`` value passed to the framing layer, and the keys derived from it for other services
(``engine_api_key``: the Bearer key of the job's engines and router). It does not own where the run dir
is, nor how a derived key reaches the process that needs it (the driver hands it over).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import stat
from dataclasses import dataclass, field
from pathlib import Path

SECRET_BYTES = 32
SECRET_FILE_NAME = "secret"


@dataclass(frozen=True)
class Secret:
    """The HMAC key of a job, with where it came from (named in 'bad MAC' errors; the key is never shown)."""

    key: bytes = field(repr=False)
    """Raw key bytes (32 for a job secret)."""
    origin: str = "<in memory>"
    """Where the key was read from, e.g. the secret file's path."""

    def __post_init__(self) -> None:
        if len(self.key) < 16:
            raise ValueError(f"secret from {self.origin} is {len(self.key)} bytes; at least 16 are needed")


def secret_path(run_dir: str | os.PathLike[str]) -> Path:
    """Where a run dir keeps its secret."""
    return Path(run_dir) / SECRET_FILE_NAME


def create_secret(path: str | os.PathLike[str], *, overwrite: bool = False) -> Secret:
    """Write a fresh random secret to ``path`` (mode 0600, hex text) atomically and return it.

    The file appears complete or not at all: it is written to a temporary file in the same directory and
    then linked (no overwrite) or renamed (``overwrite=True``) into place.
    """
    path = Path(path)
    key = secrets.token_bytes(SECRET_BYTES)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.fchmod(fd, 0o600)  # the umask may have removed bits; make it exactly 0600
        os.write(fd, key.hex().encode("ascii") + b"\n")
        os.fsync(fd)
    finally:
        os.close(fd)
    try:
        if overwrite:
            os.replace(tmp, path)
        else:
            try:
                os.link(tmp, path)
            except FileExistsError:
                raise FileExistsError(
                    f"secret file {path} already exists; reuse it with load_secret() or pass overwrite=True "
                    "(every process of the running job would then be locked out)"
                ) from None
    finally:
        tmp.unlink(missing_ok=True)
    return Secret(key=key, origin=str(path))


def keep_or_create_secret(path: str | os.PathLike[str]) -> tuple[Secret, bool]:
    """The run dir's secret for a (re)submission: the one there if it loads (a resubmit into the run dir: engine
    jobs and external engines started with the run's engine key, derived from it, would answer a new one's 401),
    else a fresh one (none yet, or unusable: wrong mode, owner or text). (secret, whether it was kept)."""
    try:
        return load_secret(path), True
    except (OSError, ValueError):
        return create_secret(path, overwrite=True), False


def load_secret(path: str | os.PathLike[str]) -> Secret:
    """Read a secret written by ``create_secret``; refuse it if group or others can access the file."""
    path = Path(path)
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        raise FileNotFoundError(
            f"secret file {path} does not exist; it is written by `python -m hpc_rl.submit` into the run dir"
        ) from None
    try:
        st = os.fstat(fd)  # check the file we read, not whatever the path points to later
        mode = stat.S_IMODE(st.st_mode)
        if mode & 0o077:
            raise PermissionError(
                f"secret file {path} has mode {mode:04o}: group/others can read it, so anyone on the cluster "
                f"could drive this job; run `chmod 600 {path}`"
            )
        if hasattr(os, "getuid") and st.st_uid != os.getuid():
            raise PermissionError(
                f"secret file {path} belongs to uid {st.st_uid}, not to you ({os.getuid()})"
            )
        raw = os.read(fd, 4096)
    finally:
        os.close(fd)
    text = raw.decode("ascii", errors="replace").strip()
    try:
        key = bytes.fromhex(text)
    except ValueError:
        raise ValueError(f"secret file {path} is not hex text; recreate it with create_secret()") from None
    if len(key) != SECRET_BYTES:
        raise ValueError(f"secret file {path} holds {len(key)} bytes, expected {SECRET_BYTES}")
    return Secret(key=key, origin=str(path))


ENGINE_API_KEY_PURPOSE = b"engine-api-key"


def derive_key(secret: Secret, purpose: bytes) -> str:
    """A key for one purpose, as hex: HMAC-SHA256(job secret, purpose). It reveals nothing about the secret
    or about keys for other purposes, and every process holding the secret derives the same one. (A frame
    MAC is an HMAC of bytes that start with the magic b"HRLP" and are longer: never equal to a derived key.)"""
    return hmac.new(secret.key, purpose, hashlib.sha256).hexdigest()


def engine_api_key(secret: Secret) -> str:
    """The job's engine API key (SGLang's ``--api-key``, ``Authorization: Bearer <key>``). Never log it."""
    return derive_key(secret, ENGINE_API_KEY_PURPOSE)
