"""``hvd-notebook``: the command line beside the magics.

    hvd-notebook list             this user's clusters, with the kernel that owns each
    hvd-notebook clean            stop this user's orphaned clusters (their kernel is gone)
    hvd-notebook clean --dry-run  only say what would be stopped
    hvd-notebook install-kernel [--user | --sys-prefix | --prefix P] [--name N] [--env K=V ...]
                                  install the "Python 3 (hvd_notebook)" kernelspec

A cluster lives in its own directory under ``$TMPDIR/hvd_notebook-$USER/``
(readable by its owner only), which records the kernel that started it and
every process of the cluster with its start time; ``clean`` kills only
processes that are still the ones recorded (a reused PID is left alone), and
never touches another user's clusters (their directories are not ours).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from .cluster.pids import is_alive, live_processes
from .cluster.reaper import reap
from .cluster.workdir import WorkDir, clusters_dir, find_workdirs


@dataclass
class ClusterDir:
    """A cluster directory as ``list`` and ``clean`` see it."""

    workdir: WorkDir
    kernel_pid: int | None
    kernel_alive: bool
    live_pids: list[int]

    @property
    def path(self) -> Path:
        """The cluster's directory."""
        return self.workdir.path

    @property
    def orphaned(self) -> bool:
        """The kernel that started the cluster is gone."""
        return not self.kernel_alive


def find_clusters(base: Path | None = None) -> list[ClusterDir]:
    """This user's clusters, with their kernel and the processes still theirs."""
    found = []
    for workdir in find_workdirs(base):
        owner = workdir.owner()
        found.append(ClusterDir(workdir, owner[0] if owner else None, owner is not None and is_alive(owner),
                                [p.pid for p in live_processes(workdir.read_pids())]))
    return found


def _describe(c: ClusterDir) -> str:
    owner = f"kernel {c.kernel_pid}" if c.kernel_pid else "unknown kernel"
    state = "running" if c.kernel_alive else "gone"
    return f"{c.path.name}: {owner} ({state}), {len(c.live_pids)} live process(es)"


KERNEL_NAME = "hvd-tensorflow"


def kernel_source() -> Path:
    """The kernelspec shipped with the package: ``kernels/hvd-tensorflow`` of the
    source tree (editable installs), else the copy a wheel puts under the prefix."""
    for candidate in (Path(__file__).resolve().parent.parent / "kernels" / KERNEL_NAME,
                      Path(sys.prefix) / "share" / "jupyter" / "kernels" / KERNEL_NAME):
        if (candidate / "kernel.json").exists():
            return candidate
    raise SystemExit(f"hvd-notebook: the {KERNEL_NAME} kernelspec is not installed with this package.")


def install_kernel(name: str, display_name: str | None, env: list[str], user: bool, prefix: str | None) -> Path:
    """Install the kernelspec (this Python, the extension preloaded, ``env`` set)."""
    from jupyter_client.kernelspec import KernelSpecManager

    with tempfile.TemporaryDirectory() as tmp:
        spec_dir = Path(tmp) / name
        shutil.copytree(kernel_source(), spec_dir)
        spec = json.loads((spec_dir / "kernel.json").read_text())
        spec["argv"][0] = sys.executable  # the environment that has hvd_notebook, not whatever "python" is
        if display_name:
            spec["display_name"] = display_name
        for pair in env:
            key, sep, value = pair.partition("=")
            if not sep or not key:
                raise SystemExit(f"hvd-notebook install-kernel: --env {pair!r} is not KEY=VALUE.")
            spec.setdefault("env", {})[key] = value
        (spec_dir / "kernel.json").write_text(json.dumps(spec, indent=2) + "\n")
        return Path(KernelSpecManager().install_kernel_spec(str(spec_dir), kernel_name=name, user=user,
                                                            prefix=prefix))


def main(argv: list[str] | None = None) -> int:
    """``hvd-notebook list | clean [--dry-run] | install-kernel ...``; the exit status."""
    parser = argparse.ArgumentParser(prog="hvd-notebook", description="Manage hvd_notebook clusters of this user.")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("list", help="list this user's clusters and the kernels that own them")
    clean = sub.add_parser("clean", help="stop this user's clusters whose kernel is gone")
    clean.add_argument("--dry-run", action="store_true", help="say what would be stopped, stop nothing")
    kernel = sub.add_parser("install-kernel", help="install the Jupyter kernel with the extension preloaded")
    where = kernel.add_mutually_exclusive_group()
    where.add_argument("--user", action="store_true", help="for this user only (the default)")
    where.add_argument("--sys-prefix", action="store_true", help="into this environment (sys.prefix)")
    where.add_argument("--prefix", help="under this prefix (PREFIX/share/jupyter/kernels)")
    kernel.add_argument("--name", default=KERNEL_NAME, help=f"kernelspec name (default {KERNEL_NAME})")
    kernel.add_argument("--display-name", help="name shown in the launcher (default: Python 3 (hvd_notebook))")
    kernel.add_argument("--env", action="append", default=[], metavar="K=V",
                        help="environment variable for the kernel, e.g. HVD_NOTEBOOK_GPUS=0,1 (repeatable)")
    args = parser.parse_args(argv)

    if args.command == "install-kernel":
        prefix = sys.prefix if args.sys_prefix else args.prefix
        path = install_kernel(args.name, args.display_name, args.env, user=prefix is None, prefix=prefix)
        print(f"Installed kernelspec {args.name} in {path}")
        return 0

    clusters = find_clusters()
    if args.command == "list":
        if not clusters:
            print(f"No clusters in {clusters_dir()}.")
        for c in clusters:
            print(_describe(c))
        return 0

    orphans = [c for c in clusters if c.orphaned]
    if not orphans:
        kept = len(clusters)
        print("No orphaned clusters." + (f" {kept} cluster(s) belong to running kernels." if kept else ""))
        return 0
    for c in orphans:
        if args.dry_run:
            print(f"would stop {_describe(c)}")
            continue
        pids = sorted(c.live_pids)
        killed = reap(c.workdir)
        print(f"stopped {c.path.name} (kernel {c.kernel_pid or '?'} is gone): killed {killed} process(es)"
              + (f" {pids}" if pids else "") + f", removed {c.path}")
    for c in clusters:
        if not c.orphaned:
            print(f"left alone: {_describe(c)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
