"""Root's work on a user's clusters, done as that user.

``hvd-notebook clean --user U`` reads files that U wrote (PID files, cards, folder names) and acts on
them: it kills processes and removes folders. Done as root, every check of what U wrote is a race
U may win (a folder swapped for a link between the check and the removal) or a rule a forged file
may dodge. So root does none of it itself: it forks, the child becomes U for good (groups, gid, uid:
real, effective and saved), and runs the same clean-up U could run. Whatever U wrote, the child can
then signal only U's processes and remove only what U may remove: running it as root is never the
way U gets something done that U could not do.
"""

from __future__ import annotations

import os
import pwd
import sys
import traceback
from collections.abc import Callable
from pathlib import Path


def as_user(user: str, work: Callable[[], int]) -> int:
    """Run ``work`` in a child process that is ``user`` alone (root only); its return value, or 1
    where it raised (the traceback on stderr).

    Args:
        user: the login name to run as.
        work: what the child runs; its exit code.
    """
    entry = pwd.getpwnam(user)
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # the child: never returns into the caller's code
        code = 1
        try:
            become(entry)
            code = work()
        except BaseException:
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def become(entry: pwd.struct_passwd) -> None:
    """Drop this process to the user of ``entry`` for good, with the environment that user's own
    commands would see (HOME, USER, LOGNAME, and XDG_RUNTIME_DIR where the system gives them one).

    Args:
        entry: the user's password entry.
    """
    os.initgroups(entry.pw_name, entry.pw_gid)
    os.setresgid(entry.pw_gid, entry.pw_gid, entry.pw_gid)
    os.setresuid(entry.pw_uid, entry.pw_uid, entry.pw_uid)
    if os.getuid() != entry.pw_uid or os.geteuid() != entry.pw_uid:  # (never go on as root)
        raise PermissionError(f"could not become {entry.pw_name}")
    os.environ.update(HOME=entry.pw_dir, USER=entry.pw_name, LOGNAME=entry.pw_name)
    runtime = Path(f"/run/user/{entry.pw_uid}")
    if runtime.is_dir() and runtime.stat().st_uid == entry.pw_uid:
        os.environ["XDG_RUNTIME_DIR"] = str(runtime)
    else:
        os.environ.pop("XDG_RUNTIME_DIR", None)
    try:
        os.chdir(entry.pw_dir)
    except OSError:
        os.chdir("/")
