"""hvd_notebook.config: the one parser of environment flags, the settings, and %hvd start's options
declared once (ClusterOptions drives argparse)."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from hvd_notebook import config
from hvd_notebook.config import (
    ClusterOptions,
    EnvSetting,
    env_pair,
    non_negative_int,
    positive_int,
    rank_list,
    seconds,
)


def env_flag(name: str, default: bool, environ: dict[str, str] | None = None) -> bool:
    return EnvSetting(name, default, "").flag(environ)


def env_number(name: str, default: float, environ: dict[str, str] | None = None) -> float:
    return EnvSetting(name, default, "").number(environ)


# ------------------------------------------------------------------ EnvSetting.flag
@pytest.mark.parametrize("value", ["1", "true", "TRUE", "True", "yes", "YES", "on", "On", " 1 ", "true\n"])
@pytest.mark.parametrize("default", [True, False])
def test_env_flag_true_spellings(value, default):
    assert env_flag("X", default, {"X": value}) is True


@pytest.mark.parametrize("value", ["0", "false", "FALSE", "no", "No", "off", "OFF", "", " 0 ", "  "])
@pytest.mark.parametrize("default", [True, False])
def test_env_flag_false_spellings(value, default):
    assert env_flag("X", default, {"X": value}) is False


@pytest.mark.parametrize("default", [True, False])
def test_env_flag_unset_or_junk_gives_the_default(default):
    assert env_flag("X", default, {}) is default
    assert env_flag("X", default, {"Y": "1"}) is default
    for junk in ("2", "maybe", "enable", "-1", "truthy"):
        assert env_flag("X", default, {"X": junk}) is default, junk


def test_env_flag_reads_os_environ_by_default(monkeypatch):
    monkeypatch.setenv("HVD_TEST_FLAG", "off")
    assert env_flag("HVD_TEST_FLAG", True) is False
    monkeypatch.delenv("HVD_TEST_FLAG")
    assert env_flag("HVD_TEST_FLAG", True) is True


# ------------------------------------------------------------------ EnvSetting.number
def test_env_number_keeps_the_default_type():
    assert env_number("N", 60.0, {"N": "2.5"}) == 2.5
    assert env_number("N", 128, {"N": "4096"}) == 4096
    assert isinstance(env_number("N", 128, {"N": "4096"}), int)
    assert isinstance(env_number("N", 1.0, {"N": "3"}), float)


@pytest.mark.parametrize("value", ["", "abc", "1.5.2", "1e"])
def test_env_number_unreadable_gives_the_default(value):
    assert env_number("N", 60.0, {"N": value}) == 60.0
    assert env_number("N", 7, {"N": value}) == 7


def test_env_number_an_int_setting_does_not_take_a_fraction():
    assert env_number("N", 7, {"N": "2.5"}) == 7
    assert env_number("N", 7, {}) == 7


# ------------------------------------------------------------------ EnvSetting
def test_env_setting_reads_its_variable():
    flag = EnvSetting("HVD_T_FLAG", True, "a flag")
    assert flag.flag({}) is True and flag.flag({"HVD_T_FLAG": "no"}) is False
    number = EnvSetting("HVD_T_NUM", 60.0, "seconds")
    assert number.number({"HVD_T_NUM": "5"}) == 5.0 and number.number({"HVD_T_NUM": "x"}) == 60.0
    text = EnvSetting("HVD_T_TEXT", None, "a path")
    assert text.text({}) is None and text.text({"HVD_T_TEXT": "/tmp/t.json"}) == "/tmp/t.json"


def test_every_env_setting_is_declared_once_with_help():
    names = [s.name for s in config.ENV_SETTINGS]
    assert len(names) == len(set(names)), names
    declared = {v.name for v in vars(config).values() if isinstance(v, EnvSetting)}
    assert declared == set(names), "an EnvSetting missing from ENV_SETTINGS"
    for s in config.ENV_SETTINGS:
        assert s.help.strip() and s.name.startswith(("HVD_NOTEBOOK_", "HOROVOD_")), s
    assert config.PROGRESS.default in config.choices(config.DashboardMode)


def test_choices_are_the_enum_values():
    assert config.choices(config.Backend) == ["auto", "builtin", "horovod"]
    assert config.choices(config.DashboardMode) == ["auto", "widgets", "text", "none"]


# ------------------------------------------------------------------ argparse types
def _complaint(parse, text: str) -> str:
    with pytest.raises(argparse.ArgumentTypeError) as info:
        parse(text)
    return str(info.value)


def test_positive_int():
    assert positive_int("3") == 3 and positive_int("1") == 1
    assert _complaint(positive_int, "0") == "0 must be at least 1"  # %hvd start -n 0
    assert _complaint(positive_int, "-2") == "-2 must be at least 1"
    assert _complaint(positive_int, "two") == "'two' is not a whole number"  # %hvd start -n two
    assert _complaint(positive_int, "1.5") == "'1.5' is not a whole number"


def test_non_negative_int():
    assert non_negative_int("0") == 0 and non_negative_int("5") == 5
    assert "is negative" in _complaint(non_negative_int, "-1")  # %hvd pull x --rank -1


def test_seconds():
    assert seconds("2.5") == 2.5 and seconds("120") == 120.0
    assert "must be more than 0 seconds" in _complaint(seconds, "-3")  # %hvd start --timeout -3
    assert "must be more than 0 seconds" in _complaint(seconds, "0")
    assert "must be more than 0 seconds" in _complaint(seconds, "nan")
    assert _complaint(seconds, "soon") == "'soon' is not a number of seconds"


def test_rank_list():
    assert rank_list("0,1") == [0, 1] and rank_list("3") == [3] and rank_list("1, 0,") == [1, 0]
    assert "comma-separated list of ranks" in _complaint(rank_list, "a,b")  # %%hvd --ranks a,b
    for bad in ("0,0", "-1", "", ","):
        assert "must list distinct ranks such as 0,1" in _complaint(rank_list, bad), bad


def test_env_pair():
    assert env_pair("K=V") == ("K", "V")
    assert env_pair("K=") == ("K", "")
    assert env_pair("K=a=b") == ("K", "a=b")
    assert _complaint(env_pair, "NOEQUALS") == "'NOEQUALS' is not KEY=VALUE"  # %hvd start --env NOEQUALS
    assert _complaint(env_pair, "=V") == "'=V' is not KEY=VALUE"
    assert _complaint(env_pair, "1K=V") == "'1K=V' is not KEY=VALUE"


# ------------------------------------------------------------------ ClusterOptions <-> argparse
def _parse(*argv: str) -> ClusterOptions:
    parser = argparse.ArgumentParser(exit_on_error=False)
    ClusterOptions.add_arguments(parser)
    return ClusterOptions.from_arguments(parser.parse_args(list(argv)))


def test_no_arguments_give_the_dataclass_defaults():
    options = _parse()
    assert options == ClusterOptions()
    assert options.mpi_args == () and options.env == () and options.start_timeout == config.START_TIMEOUT_S
    assert options.backend == config.Backend.AUTO and options.launcher == "auto"


def test_every_field_is_an_option_with_help():
    added = {}

    class Recording(argparse.ArgumentParser):
        def add_argument(self, *flags, **kwargs):
            added[kwargs["dest"]] = (flags, kwargs)
            return super().add_argument(*flags, **kwargs)

    ClusterOptions.add_arguments(Recording(add_help=False))
    for f in dataclasses.fields(ClusterOptions):
        assert f.metadata["help"].strip()
        if not f.metadata["flags"]:
            assert f.name not in added and f.metadata["run"] is not None  # (a field of hvd-notebook run alone)
            continue
        flags, kwargs = added[f.name]
        assert flags == f.metadata["flags"] and kwargs["help"] == f.metadata["help"]
    assert set(added) == {f.name for f in dataclasses.fields(ClusterOptions) if f.metadata["flags"]}


def test_arguments_round_trip():
    options = _parse("-n", "4", "--mpi-args", "-bind-to core", "--env", "A=1", "--env", "B=x=y", "--timeout", "30",
                     "--gpus", "none", "--backend", "builtin", "--secure", "-H", "n1:2,n2:2", "--ip", "10.0.0.1",
                     "--launcher", "mpiexec", "--mpiexec", "/usr/bin/mpiexec", "--hostfile", "hosts.txt")
    assert options == ClusterOptions(n=4, mpi_args=("-bind-to", "core"), env=(("A", "1"), ("B", "x=y")),
                                     start_timeout=30.0, gpus="none", backend="builtin", secure=True,
                                     hosts="n1:2,n2:2", ip="10.0.0.1", launcher="mpiexec", mpiexec="/usr/bin/mpiexec",
                                     hostfile="hosts.txt")
    assert isinstance(options.mpi_args, tuple) and isinstance(options.env, tuple)
    hash(options)  # frozen and of tuples: %hvd restart keeps it as it is


def test_mpi_args_are_split_like_a_shell():
    assert _parse("--mpi-args", "-bind-to core -genv X 'a b'").mpi_args == ("-bind-to", "core", "-genv", "X", "a b")
    assert _parse("--hosts", "h1:1").hosts == "h1:1"


@pytest.mark.parametrize("argv", [["-n", "0"], ["--backend", "tensorflow"], ["--env", "NOEQUALS"],
                                  ["--timeout", "-3"]])  # (--launcher: the registered placements say, at start)
def test_bad_options_are_refused_by_the_parser(argv):
    with pytest.raises(argparse.ArgumentError):
        _parse(*argv)


def test_hvd_notebook_run_takes_the_options_a_job_needs_as_horovodrun_spells_them():
    """One declaration per option (``ClusterOptions``): ``hvd-notebook run`` derives its own from the fields'
    ``RunSpelling``, with horovodrun's flags and the defaults that differ (the host checks' 30 s)."""
    parser = argparse.ArgumentParser(allow_abbrev=False)  # (as horovodrun's and hvd-notebook run's)
    ClusterOptions.add_arguments(parser, run=True)
    args = parser.parse_args(["-np", "3", "-H", "a:2,b:1", "--reset-limit", "1", "--mpi-args", "-v -x"])
    options = ClusterOptions.from_arguments(args)
    assert (options.n, options.hosts, options.max_resets, options.mpi_args) == (3, "a:2,b:1", 1, ("-v", "-x"))
    assert options.host_check_timeout == config.HOST_CHECK_TIMEOUT_S != config.START_TIMEOUT_S
    assert options.start_timeout == config.START_TIMEOUT_S  # (a job's engines are not ipyparallel's: unused there)
    assert options.env == () and options.gpus == "auto"  # (not options of a job: their defaults)
    taken = {f.name for f in dataclasses.fields(ClusterOptions) if f.metadata["run"] is not None}
    assert taken == {"n", "mpiexec", "mpi_args", "host_check_timeout", "hosts", "hostfile", "max_resets", "launcher"}
    with pytest.raises(SystemExit):
        parser.parse_args(["-np", "2", "--gpus", "none"])  # (not an option of a job)
