"""cluster.shm and cluster.shmguard, on real files in /dev/shm, real processes and real MPI worlds:

- the MPICH segment names that ``shmguard`` predicts are the names a live gforker world uses;
- ``shmguard`` refuses a launch whose segment name another Unix user (made here with useradd) holds, and
  clears the user's own stale file of that name;
- the check of a starting world (``foreign_mappings``, ``check_world``, ``StartWatch``) finds another user's
  file (or one open to others) that a process has open or mapped;
- a start without room in /dev/shm is refused, and a rank killed by SIGBUS is told why;
- what killed ranks leave is removed once nothing maps it, and only then.
"""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from hvd_notebook.cluster.errors import ClusterError
from hvd_notebook.cluster.launching import diagnosis
from hvd_notebook.cluster.launching.placements import GFORKER
from hvd_notebook.cluster.launching.placements.one_host import OneHost
from hvd_notebook.cluster.node import shm, shmguard
from hvd_notebook.config import ClusterOptions

BIN = Path(sys.executable).parent
GFORKER_PATH = BIN / GFORKER
needs_gforker = pytest.mark.skipif(not GFORKER_PATH.exists(), reason=f"no {GFORKER} beside this Python")
needs_root = pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("useradd"),
                                reason="makes a second Unix user (useradd) to own files: needs root")

MAPPER = """
import mmap, sys
f = open(sys.argv[1], "r+b")
m = mmap.mmap(f.fileno(), 4096)
if sys.argv[2:] == ["close"]:
    f.close()
print("mapped", flush=True)
sys.stdin.read()
"""

OPENER = """
import sys
f = open(sys.argv[1], "rb")  # (open, not mapped: a rank waiting in MPI_Init for the segment's size)
print("mapped", flush=True)
sys.stdin.read()
"""

RANK = """
import os
from mpi4py import MPI
comm = MPI.COMM_WORLD
comm.Barrier()
maps = sorted({line.split()[-1] for line in open("/proc/self/maps") if "/dev/shm/mpich_shm_" in line})
print(f"MAPS {comm.Get_rank()} {os.getppid()} {' '.join(maps)}\\n", end="", flush=True)  # (one write a rank)
comm.Barrier()
"""


def _segment(tag: str, mode: int = 0o600, owner: int | None = None, size: int = 4096) -> Path:
    path = shm.SHM_DIR / f"{shm.PREFIX}test{tag}_{uuid.uuid4().hex[:8]}"
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_NOFOLLOW, mode)
    try:
        os.ftruncate(fd, size)
        os.fchmod(fd, mode)
        if owner is not None:
            os.fchown(fd, owner, owner)
    finally:
        os.close(fd)
    return path


class Holder:
    """A real process that maps (or only opens) a file, until closed."""

    def __init__(self, path: Path, code: str = MAPPER, *args: str) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", code, str(path), *args], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout.readline().strip() == "mapped"
        self.pid = self.proc.pid

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()


@pytest.fixture(scope="module")
def stranger():
    """The uid of a second Unix user, made for this module and removed after it."""
    name = f"hvdt-shm{os.getpid() % 10000}"
    subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", name], check=True)
    try:
        yield int(subprocess.run(["id", "-u", name], capture_output=True, text=True, check=True).stdout)
    finally:
        subprocess.run(["userdel", name], check=True)


@pytest.fixture
def cleanup():
    paths: list[Path] = []
    holders: list[Holder] = []
    yield paths, holders
    for holder in holders:
        holder.close()
    for path in paths:
        path.unlink(missing_ok=True)


# ------------------------------------------------------------------ the names MPICH uses
def test_fnv1a_is_mpichs_hash():
    assert shmguard.fnv1a_32(b"") == 0x811C9DC5
    assert shmguard.fnv1a_32(b"a") == 0xE40C292C  # the published FNV-1a 32-bit test vectors
    assert shmguard.fnv1a_32(b"foobar") == 0xBF9CF968
    assert shmguard.world_segment_names(6126) == ["mpich_shm_f22c3768_0", "mpich_vci_f22c3768_0"]
    assert shmguard.world_segment_names(6126, nodes=2)[2:] == ["mpich_shm_f22c3768_1", "mpich_vci_f22c3768_1"]
    assert shmguard.ranks_of(["mpiexec", "-exitinfo", "-n", "4", "python"]) == 4
    assert shmguard.ranks_of(["mpiexec", "python"]) == 1


def _world(code: str, stdin: int | None = None) -> subprocess.Popen:
    """A 2-rank gforker world running ``code``, launched through ``shmguard``, once it has become gforker
    (``shmguard`` execs it where no name of the world's is another user's: a bounded wait for that). A
    launch the guard refuses fails the test, saying why (another user's planted names on this node)."""
    world = subprocess.Popen([*shm.guard_command(), str(GFORKER_PATH), "-n", "2", sys.executable, "-c", code],
                             stdin=stdin, stdout=subprocess.PIPE, text=True, start_new_session=True,
                             env={**os.environ, "UCX_TLS": "self,posix,cma"})
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if world.poll() is not None:
            if world.returncode == shmguard.REFUSED_EXIT:
                pytest.fail("shmguard refused the launch: a segment name of the world is another user's "
                            "(someone plants this node's names; hvd-notebook clean --user removes them)")
            return world
        try:
            program = Path(f"/proc/{world.pid}/cmdline").read_bytes().split(b"\0", 1)[0]
        except OSError:
            continue
        if program == bytes(GFORKER_PATH):
            return world
        time.sleep(0.01)
    _end(world)
    pytest.fail("shmguard neither launched gforker nor refused within 30 s")


def _end(world: subprocess.Popen) -> None:
    try:
        os.killpg(world.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    world.wait()


@needs_gforker
def test_predicted_names_are_those_of_a_live_gforker_world():
    launched = _world(RANK)
    try:
        out, _ = launched.communicate(timeout=120)
    finally:
        _end(launched)
    assert launched.returncode == 0, out
    maps = {line.split()[1]: line.split()[3:] for line in out.splitlines() if line.startswith("MAPS")}
    parents = {line.split()[2] for line in out.splitlines() if line.startswith("MAPS")}
    assert parents == {str(launched.pid)} and set(maps) == {"0", "1"}, out  # gforker forks the ranks itself
    expected = str(shm.SHM_DIR / shmguard.world_segment_names(launched.pid)[0])
    assert maps["0"] == maps["1"] == [expected], (maps, expected)  # both ranks map exactly the predicted name
    assert not Path(expected).exists()  # MPI_Finalize unlinked it


# ------------------------------------------------------------------ shmguard before the launcher
def _guarded_child(*command: str) -> subprocess.Popen:
    """A process that becomes ``shmguard COMMAND`` (keeping its pid) once a line is written to its stdin:
    its pid, that names its world's segments, is known before the guard looks."""
    exec_guard = ("import os, sys; sys.stdin.readline(); "
                  f"os.execv(sys.executable, [sys.executable, '-I', '-S', {shmguard.__file__!r}, *sys.argv[1:]])")
    for _ in range(50):
        child = subprocess.Popen([sys.executable, "-c", exec_guard, *command], stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        if not any(path.exists() for path in shm.world_segments(child.pid)):
            return child
        child.kill()  # (a pid whose names someone planted already: a hostile test may be running beside)
        child.communicate()
    pytest.fail("every pid tried had its segment names planted by someone else")


@needs_root
def test_the_guard_refuses_a_segment_name_another_user_made(stranger, cleanup):
    paths, _ = cleanup
    child = _guarded_child("/bin/echo", "launched")
    planted = shm.world_segments(child.pid)[0]
    fd = os.open(planted, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o666)  # as the stranger would: theirs, 0666
    os.fchmod(fd, 0o666)
    os.fchown(fd, stranger, stranger)
    os.close(fd)
    paths.append(planted)
    out, err = child.communicate("go\n", timeout=30)
    assert child.returncode == shmguard.REFUSED_EXIT and "launched" not in out
    assert err.startswith(shmguard.REFUSED_PREFIX) and str(planted) in err and f"uid {stranger}" in err
    assert "mode 0666" in err and planted.exists()  # (not ours to remove)
    assert shm.refused_by_guard(err) and str(planted) in diagnosis.diagnose_launch(err)[0]


def test_the_guard_clears_a_stale_file_of_the_users_own_and_becomes_the_launcher(cleanup):
    paths, _ = cleanup
    child = _guarded_child("/bin/sh", "-c", "echo launched $$")
    stale = shm.world_segments(child.pid)[0]  # a killed world's, whose launcher had this pid
    stale.write_bytes(b"\0" * 4096)
    stale.chmod(0o600)
    paths.append(stale)
    out, err = child.communicate("go\n", timeout=30)
    assert child.returncode == 0 and out.split() == ["launched", str(child.pid)], err  # exec kept the pid
    assert not stale.exists()


def test_the_guard_refuses_the_users_own_file_open_to_others(cleanup):
    paths, _ = cleanup
    child = _guarded_child("/bin/echo", "launched")
    loose = shm.world_segments(child.pid)[0]
    loose.write_bytes(b"")
    loose.chmod(0o644)
    paths.append(loose)
    out, err = child.communicate("go\n", timeout=30)
    assert child.returncode == shmguard.REFUSED_EXIT and "open to others" in err and loose.exists()


# ------------------------------------------------------------------ the check of a starting world
@needs_root
def test_a_process_mapping_another_users_segment_is_found(stranger, cleanup):
    paths, holders = cleanup
    theirs = _segment("theirs", 0o666, owner=stranger)
    ours = _segment("ours")
    paths += [theirs, ours]
    holders += [Holder(theirs), Holder(ours), Holder(theirs, MAPPER, "close"), Holder(theirs, OPENER)]
    mapping, clean, mapped_only, opened_only = holders
    found = shm.foreign_mappings([mapping.pid, clean.pid])
    assert len(found) == 1 and str(theirs) in found[0] and f"uid {stranger}" in found[0], found
    assert f"process {mapping.pid}" in found[0] and "mode 0666" in found[0]
    assert shm.foreign_mappings([clean.pid]) == []
    assert str(theirs) in " ".join(shm.foreign_mappings([mapped_only.pid]))  # mapped, its file closed
    assert str(theirs) in " ".join(shm.foreign_mappings([opened_only.pid]))  # open, not yet mapped
    with pytest.raises(shm.ShmError, match=str(theirs)) as refused:
        shm.check_world(None, [clean.pid, opened_only.pid])
    assert isinstance(refused.value, ClusterError) and "another user" in str(refused.value)
    theirs.unlink()  # hidden after the rank attached: the open file still tells
    assert str(theirs) in " ".join(shm.foreign_mappings([mapping.pid]))


def test_the_users_own_segment_open_to_others_is_found(cleanup):
    paths, holders = cleanup
    loose = _segment("loose", 0o644)
    paths.append(loose)
    holders.append(Holder(loose))
    (found,) = shm.foreign_mappings([holders[0].pid])
    assert str(loose) in found and "mode 0644" in found
    loose.unlink()  # no name left by which another user could open it: the user's own affair
    assert shm.foreign_mappings([holders[0].pid]) == []


def test_a_worlds_descendants_are_checked_and_the_watch_reports_once(cleanup):
    paths, holders = cleanup
    loose = _segment("watched", 0o666)
    paths.append(loose)
    # a "launcher" whose child maps the file, as a rank does
    launcher = subprocess.Popen(["/bin/sh", "-c", f'{sys.executable} -c "$0" {loose}; sleep 60', MAPPER],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert launcher.stdout.readline().strip() == "mapped"
        with pytest.raises(shm.ShmError, match=str(loose)):
            shm.check_world(launcher.pid)
        reports: list[str] = []
        watch = shm.StartWatch.for_launch(launcher.pid, ["/bin/sh"], reports.append)
        deadline = time.monotonic() + 10
        while not reports and time.monotonic() < deadline:
            time.sleep(0.05)
        watch.stop()
        assert len(reports) == 1 and str(loose) in reports[0] and not watch.gforker
    finally:
        os.killpg(launcher.pid, signal.SIGKILL)
        launcher.wait()


@needs_gforker
def test_a_real_world_passes_the_check():
    world = _world(RANK + "import sys; sys.stdin.read()\n", stdin=subprocess.PIPE)
    try:
        lines = [world.stdout.readline(), world.stdout.readline()]
        assert all(line.startswith("MAPS") for line in lines), lines
        shm.check_world(world.pid, gforker=True, n=2)  # nothing of another user, nothing open to others
        segment = shm.world_segments(world.pid)[0]
        assert segment.exists() and shm.foreign_world_segments(world.pid, nodes=2) == []
    finally:
        _end(world)
    assert shm.remove_world(world.pid, 2) == [segment] and not segment.exists()  # killed: left behind, removed


# ------------------------------------------------------------------ room in /dev/shm
def test_a_start_without_room_in_dev_shm_is_refused():
    free, size = shm.free_bytes()
    assert 0 < free <= size
    shm.check_space(2)  # this machine's /dev/shm has room for two ranks
    too_many = 2 * size // shm.BYTES_PER_RANK  # (whatever other processes free meanwhile)
    with pytest.raises(ClusterError, match=r"/dev/shm has .* MiB free of .* ranks need about .* SIGBUS"):
        shm.check_space(too_many)


def test_a_rank_killed_by_sigbus_is_told_of_dev_shm():
    output = "[0]0:Return code = 0, signaled with Quit\n[0]1:Return code = 0, signaled with Bus error\n"
    reports = OneHost(ClusterOptions()).exit_reports(output)
    assert reports[0] == "signal Quit"
    assert reports[1].startswith("signal Bus; a full /dev/shm is a likely cause (") and "MiB free of" in reports[1]
    assert diagnosis.signal_name(reports[1]) == "Bus" and diagnosis.signal_name("exit code 3") is None
    assert any("SIGBUS" in cause and "/dev/shm" in cause for cause in OneHost(ClusterOptions()).diagnose(output))


@needs_gforker
@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare"),
                    reason="mounts a small /dev/shm in a mount namespace of its own: needs root")
def test_ranks_on_a_full_dev_shm_die_of_sigbus_and_are_told_why():
    py, rank = shlex.quote(sys.executable), shlex.quote("from mpi4py import MPI; MPI.COMM_WORLD.Barrier()")
    tell = shlex.quote("import sys; from hvd_notebook.cluster.launching.placements.one_host import OneHost; "
                       "from hvd_notebook.config import ClusterOptions; "
                       "print(OneHost(ClusterOptions()).exit_reports(sys.argv[1]))")
    script = (f"mount -t tmpfs -o size=1M tmpfs /dev/shm || exit 3\n"  # (in this namespace only)
              f"out=$({shlex.quote(str(GFORKER_PATH))} -exitinfo -n 2 {py} -c {rank} 2>&1)\n"
              f'{py} -c {tell} "$out"\n')
    done = subprocess.run(["unshare", "-m", "sh", "-c", script], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "UCX_TLS": "self,posix,cma"})
    assert "signal Bus; a full /dev/shm is a likely cause (" in done.stdout, done.stdout + done.stderr
    assert "MiB free of 1.0 MiB" in done.stdout


# ------------------------------------------------------------------ what killed ranks leave
@pytest.fixture
def segments():
    """Three segments of this user: old and unmapped, old and mapped by a live process, new."""
    tag = uuid.uuid4().hex[:8]
    paths = [shm.SHM_DIR / f"{shm.PREFIX}test{tag}_{i}" for i in range(3)]
    for path in paths:
        path.write_bytes(b"\0" * 4096)
    old = time.time() - 2 * shm.MIN_AGE_S
    for path in paths[:2]:
        os.utime(path, (old, old))
    mapper = Holder(paths[1])
    yield paths
    mapper.close()
    for path in paths:
        path.unlink(missing_ok=True)


def test_only_old_unmapped_segments_are_removed(segments):
    unmapped, mapped, new = segments
    removed = shm.remove_orphaned()
    assert unmapped in removed and not unmapped.exists()
    assert mapped.exists() and new.exists()  # a live rank's, and a world that may be starting now
    assert mapped not in removed and new not in removed


def test_another_users_segments_are_left_alone(segments):
    unmapped = segments[0]
    assert shm.remove_orphaned(uid=os.getuid() + 12345) == []
    assert unmapped.exists()
    assert shm.remove_world(12345, uid=os.getuid() + 12345) == []
