"""The user's private folder and the checked reads and writes of ``hvd_notebook.private``: what
another user could plant (a folder made first, a link, a FIFO, a file of theirs, a sparse giant) is
refused, not followed, not waited on. Files of "another user" are chowned to ``nobody`` where the
tests run as root; the attacks by a real second Unix user are in tests/integration/test_hostile.py."""

from __future__ import annotations

import os
import pwd
import socket
import tempfile
import time

import pytest

from hvd_notebook import private

as_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to make a file another user owns")


def _nobody() -> int:
    return pwd.getpwnam("nobody").pw_uid


@pytest.fixture
def tmp_base(monkeypatch, tmp_path):
    """TMPDIR and HOME under tmp_path, no XDG_RUNTIME_DIR."""
    (tmp_path / "tmp").mkdir(mode=0o1777)
    (tmp_path / "tmp").chmod(0o1777)
    (tmp_path / "home").mkdir(mode=0o700)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    return tmp_path


def test_the_base_folder_is_made_private_in_tmpdir(tmp_base):
    base = private.base_dir()
    assert base == tmp_base / "tmp" / f"hvd_notebook-{private.user_name()}"
    assert base.stat().st_mode & 0o777 == 0o700 and private.base_dir() == base  # (again: checked, kept)


def test_xdg_runtime_dir_comes_first(tmp_base, monkeypatch):
    runtime = tmp_base / "run"
    runtime.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))
    assert private.base_dir() == runtime / "hvd_notebook"


@as_root
@pytest.mark.parametrize("planted", ["foreign", "open", "link"])
def test_a_folder_made_first_by_someone_else_is_not_used(tmp_base, planted, caplog):
    made = tmp_base / "tmp" / f"hvd_notebook-{private.user_name()}"
    elsewhere = tmp_base / "theirs"
    elsewhere.mkdir(mode=0o700)
    if planted == "foreign":  # another user's, with no access for others: still theirs
        made.mkdir(mode=0o700)
        os.chown(made, _nobody(), -1)
    elif planted == "open":  # ours, but anyone may write into it
        made.mkdir()
        made.chmod(0o777)
    else:  # a link to a folder of another user's choosing
        made.symlink_to(elsewhere)
    with pytest.raises(private.UnsafePathError, match=str(made)):
        private.check_dir(made)
    base = private.base_dir()  # the home's instead, said once
    assert base == tmp_base / "home" / ".cache" / "hvd_notebook" / f"run-{socket.gethostname()}"
    assert base.stat().st_mode & 0o777 == 0o700 and str(made) in caplog.text
    assert not list(elsewhere.iterdir())


def test_nothing_private_anywhere_is_an_error_naming_every_place(tmp_base, monkeypatch):
    (tmp_base / "tmp").chmod(0o777)  # not sticky: others could rename what is in it
    (tmp_base / "home-file").write_text("")
    monkeypatch.setenv("HOME", str(tmp_base / "home-file"))  # (no folder can be made in it)
    with pytest.raises(private.UnsafePathError) as raised:
        private.base_dir()
    assert "can be written by others" in str(raised.value) and "home-file/.cache" in str(raised.value)


@as_root
def test_reads_refuse_links_fifos_other_owners_and_giants_without_waiting(tmp_path):
    good = tmp_path / "good"
    good.write_text("ok")
    assert private.read_text(good) == "ok"
    link = tmp_path / "link"
    link.symlink_to(good)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    theirs = tmp_path / "theirs"
    theirs.write_text("planted")
    os.chown(theirs, _nobody(), -1)
    giant = tmp_path / "giant"
    with open(giant, "wb") as f:
        f.truncate(100 << 20)  # sparse: costs no disk, would cost 100 MiB of memory to read
    started = time.monotonic()
    for path, said in ((link, "symbolic link"), (fifo, "not a regular file"), (theirs, "belongs to nobody"),
                       (giant, "bytes long")):
        with pytest.raises(private.UnsafePathError, match=said):
            private.read_text(path)
    assert time.monotonic() - started < 15  # the FIFO hung nothing (not a speed: the load varies)
    assert private.read_text(theirs, uid=-1) == "planted"  # (anyone's, where the caller says so)


def test_a_write_replaces_a_link_and_never_writes_through_it(tmp_path):
    target = tmp_path / "target"
    target.write_text("precious")
    target.chmod(0o644)
    card = tmp_path / "card"
    card.symlink_to(target)
    private.write_text(card, "new", mode=0o600)
    assert target.read_text() == "precious" and target.stat().st_mode & 0o777 == 0o644
    assert not card.is_symlink() and card.read_text() == "new" and card.stat().st_mode & 0o777 == 0o600
    assert sorted(p.name for p in tmp_path.iterdir()) == ["card", "target"]  # (no temporary left)


def test_user_name_comes_from_the_password_database_not_the_environment(monkeypatch):
    monkeypatch.setenv("USER", "someone-else")
    monkeypatch.setenv("LOGNAME", "someone-else")
    assert private.user_name() == pwd.getpwuid(os.getuid()).pw_name


def test_a_subdir_is_made_private_narrowed_or_refused(tmp_path):
    made = private.subdir("stacks", tmp_path)
    assert made.stat().st_mode & 0o777 == 0o700
    (tmp_path / "readable").mkdir()
    (tmp_path / "readable").chmod(0o755)  # as earlier versions made it: others could look, not write
    assert private.subdir("readable", tmp_path).stat().st_mode & 0o777 == 0o700
    (tmp_path / "open").mkdir()
    (tmp_path / "open").chmod(0o777)  # anyone could have put something in it
    with pytest.raises(private.UnsafePathError, match="no access for others"):
        private.subdir("open", tmp_path)
    assert (tmp_path / "open").stat().st_mode & 0o777 == 0o777
