"""Telemetry across processes (engine/src/telemetry.cpp): shared segments, the process-tree reader, the Prometheus
collector of activekv._telemetry, and the telemetry_json option of the Builder.

Engines run in child processes started by this test (as vLLM's engine core is a child of its API server), each with
its own ACTIVEKV_TELEMETRY_DIR under tmp_path, so other tests' engines and other users of /dev/shm never interfere.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import stat
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import activekv._backend as backend  # after torch: the modules' import guard needs it
import activekv._telemetry as telemetry

REPO = Path(__file__).resolve().parents[1]

# A child that builds an engine, drives one step on layer 0 (tests/test_telemetry.py's drive), prints READY and
# waits for stdin to close. With DAEMON=1 it double-forks first, so the engine lives in a process that does not
# descend from the test.
CHILD = textwrap.dedent(
    """
    import os, sys
    import torch
    from tests.test_telemetry import make_engine, drive
    if os.environ.get("DAEMON") == "1":
        r, w = os.pipe()
        if os.fork() > 0:
            os.close(w)
            sys.stdout.write(os.read(r, 100).decode())
            sys.stdout.flush()
            os._exit(0)
        os.setsid()
        if os.fork() > 0:
            os._exit(0)
        devnull = os.open(os.devnull, os.O_RDWR)  # let the caller's pipes close: it waits for their EOF
        for fd in (0, 1, 2):
            os.dup2(devnull, fd)
        engine = make_engine()
        cache = drive(engine)
        os.write(w, f"READY {os.getpid()}\\n".encode())
        import time
        time.sleep(float(os.environ.get("HOLD", "30")))
        os._exit(0)
    engine = make_engine()
    cache = drive(engine)
    print("READY", os.getpid(), flush=True)
    sys.stdin.read()
    """
)


def start_child(env: dict[str, str], code: str = CHILD) -> tuple[subprocess.Popen[str], int]:
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, env=env, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = proc.stdout.readline()  # type: ignore[union-attr]
    assert line.startswith("READY"), line
    return proc, int(line.split()[1])


@pytest.fixture
def seg_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    monkeypatch.setenv("ACTIVEKV_TELEMETRY_DIR", str(tmp_path))
    return {**os.environ, "ACTIVEKV_TELEMETRY_DIR": str(tmp_path), "PYTHONPATH": str(REPO)}


def segments(pattern: str = "activekv-telemetry.*") -> list[Path]:
    """The segment files in this process's telemetry folder (telemetry_dir(), under ACTIVEKV_TELEMETRY_DIR)."""
    return sorted(Path(telemetry.telemetry_dir()).glob(pattern))


def child_snapshots(pid: int) -> list[dict]:
    return [s for s in telemetry.process_tree_snapshots() if s["pid"] == pid]


def test_a_child_engine_is_read_from_its_segment_and_gone_when_it_exits(seg_dir: dict[str, str]) -> None:
    proc, pid = start_child(seg_dir)
    try:
        (segment,) = segments(f"activekv-telemetry.{pid}.*")
        assert segment.stat().st_mode & 0o777 == 0o600
        (snap,) = child_snapshots(pid)
        assert (snap["build_calls"], snap["kv_update_calls"], snap["forward_calls"]) == (1, 1, 1)
        assert snap["tokens_written"] == 11 and snap["padding_slots"] == 2
        assert snap["histograms"]["forward_latency_us"]["count"] == 1
        assert snap["histograms"]["blocks_admitted_per_forward"]["sum"] == 3.0
        assert snap["info"]["num_layers"] == 2
    finally:
        _, err = proc.communicate("", timeout=60)
    assert err == ""
    assert child_snapshots(pid) == []
    assert segments(f"activekv-telemetry.{pid}.*") == []


def test_a_killed_child_segment_is_removed_and_unrelated_processes_are_ignored(seg_dir: dict[str, str]) -> None:
    proc, pid = start_child(seg_dir)
    os.kill(pid, signal.SIGKILL)
    proc.wait(timeout=30)
    assert len(segments(f"activekv-telemetry.{pid}.*")) == 1
    assert child_snapshots(pid) == []  # dead: skipped, and its segment removed
    assert segments(f"activekv-telemetry.{pid}.*") == []
    daemon = subprocess.run([sys.executable, "-c", CHILD], cwd=REPO, env={**seg_dir, "DAEMON": "1", "HOLD": "600"},
                            stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=120)
    dpid = int(daemon.stdout.split()[1])
    try:
        assert len(segments(f"activekv-telemetry.{dpid}.*")) == 1
        assert child_snapshots(dpid) == []  # alive but not a descendant: not ours to report (nor to remove)
        assert len(segments(f"activekv-telemetry.{dpid}.*")) == 1
    finally:
        os.kill(dpid, signal.SIGKILL)


def test_collector_exposes_prometheus_families_that_move(seg_dir: dict[str, str]) -> None:
    prometheus_client = pytest.importorskip("prometheus_client")
    from prometheus_client.openmetrics.exposition import generate_latest as openmetrics_latest

    registry = prometheus_client.CollectorRegistry()
    registry.register(telemetry.Collector({"model_name": "tiny"}))

    def value(name: str) -> float:
        return registry.get_sample_value(name, {"model_name": "tiny"}) or 0.0

    forward0, engines0 = value("activekv_forward_calls_total"), value("activekv_engines")
    proc, pid = start_child(seg_dir)
    try:
        assert value("activekv_forward_calls_total") == forward0 + 1
        assert value("activekv_engines") == engines0 + 1
        text = prometheus_client.generate_latest(registry).decode()
        assert "# TYPE activekv_forward_calls_total counter" in text
        assert "# TYPE activekv_forward_latency_seconds histogram" in text
        assert 'activekv_forward_latency_seconds_bucket{le="+Inf",model_name="tiny"}' in text
        assert "# TYPE activekv_host_to_pool_bytes_total counter" in text
        om = openmetrics_latest(registry).decode()  # what a Prometheus server asks for
        assert "# UNIT activekv_forward_latency_seconds seconds" in om and om.endswith("# EOF\n")
        # Buckets are cumulative and the +Inf bucket equals _count.
        le = [registry.get_sample_value("activekv_blocks_admitted_per_forward_bucket", {"model_name": "tiny", "le": b})
              for b in ("1.0", "2.0", "4.0", "+Inf")]
        assert le == sorted(le) and le[-1] == value("activekv_blocks_admitted_per_forward_count")
    finally:
        proc.communicate("", timeout=60)
    assert value("activekv_engines") == engines0


@pytest.mark.parametrize("config", [None, 3, SimpleNamespace()])
def test_stat_logger_without_a_vllm_config_is_a_type_error(config: object) -> None:
    with pytest.raises(TypeError, match=r"vllm_config must be vLLM's VllmConfig \(with a model_config\), got "):
        telemetry.StatLogger(config, [0], lambda: None)


def test_stat_logger_registers_once_with_the_registry_vllm_serves() -> None:
    prometheus_client = pytest.importorskip("prometheus_client")
    registry = prometheus_client.CollectorRegistry()
    config = SimpleNamespace(model_config=SimpleNamespace(served_model_name="tiny"))
    first = telemetry.StatLogger(config, [0], lambda: registry)
    second = telemetry.StatLogger(config, [0], lambda: registry)  # a second AsyncLLM: no DuplicateTimeseries
    assert registry.get_sample_value("activekv_engines", {"model_name": "tiny"}) is not None
    assert first.record(None, None) is None and first.log_engine_initialized() is None
    assert second.collector is not first.collector


# ------------------------------------------------------------------------------------------ telemetry_json option


def vllm_config(options: dict) -> SimpleNamespace:
    model_config = SimpleNamespace(get_num_attention_heads=lambda parallel_config: 4)
    return SimpleNamespace(model_config=model_config, parallel_config=SimpleNamespace(),
                           additional_config={"activekv": options})


SPEC = SimpleNamespace(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float32, sliding_window=None)


@pytest.mark.parametrize(
    ("value", "error", "match"),
    [
        (3, TypeError, r"telemetry_json'\] must be a str, got 3"),
        ("", ValueError, r"telemetry_json'\] must be a file path"),
        ("/nonexistent-dir/t.json", ValueError, r"directory '/nonexistent-dir' must exist and be writable"),
        # /proc takes no new file, though access() calls it writable for root: the shutdown write failed there.
        ("/proc/activekv-t.json", ValueError,
         r"(cannot create a file beside '/proc/activekv-t\.json' \(.*\); the snapshot is written there at shutdown"
         r"|directory '/proc' must exist and be writable)"),
        # A NUL ends the path the C library sees: '/tmp/run' would have been checked and written instead.
        ("/tmp/run\0.json", ValueError,
         r"telemetry_json'\] must be a file path without NUL characters, got '/tmp/run\\x00\.json'"),
        # A lone surrogate that os.fsencode() cannot encode: was pybind11's "Unable to cast ... to C++ type '?'".
        ("/tmp/run-\ud800.json", ValueError,
         r"telemetry_json'\] must be a path os\.fsencode\(\) can encode, got '/tmp/run-\\ud800\.json'"),
        # An existing directory: the rename of the JSON over it fails at shutdown, where no one sees the error.
        (str(REPO), ValueError, r"telemetry_json'\] must name a file, got '.*' \(an existing directory\)"),
        (str(REPO / "tests") + "/.", ValueError, r"must name a file, got '.*/tests/\.' \(an existing directory\)"),
    ],
)
def test_telemetry_json_is_validated(value: object, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        backend.Builder(SPEC, ["l0"], vllm_config({"telemetry_json": value}), torch.device("cpu"))


def test_telemetry_json_that_is_not_a_regular_file_is_refused_and_left_as_it_is(tmp_path: Path) -> None:
    """The shutdown write renames a new file over the path: a FIFO, a device or a symbolic link there would be
    replaced (as root, /dev/null became a JSON file; a FIFO stands in for a device here, the same branch). Each is
    refused at start-up, and stays what it was."""
    fifo, target, link = tmp_path / "fifo", tmp_path / "target.json", tmp_path / "link.json"
    os.mkfifo(fifo)
    target.write_text("{}")
    link.symlink_to(target)
    cases = [(fifo, r"must name a regular file, got '.*/fifo' \(a device, FIFO or socket: the snapshot would "
                    r"replace it\)"),
             (link, r"must name a regular file, got '.*/link\.json' \(a symbolic link: the snapshot would replace the "
                    r"link, not write its target; name the target\)")]
    for path, match in cases:
        with pytest.raises(ValueError, match=match):
            backend.Builder(SPEC, ["l0"], vllm_config({"telemetry_json": str(path)}), torch.device("cpu"))
    assert fifo.is_fifo() and link.is_symlink() and target.read_text() == "{}"


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write any file: access(W_OK) holds")
def test_telemetry_json_naming_a_file_this_process_may_not_write_is_refused(tmp_path: Path) -> None:
    ro = tmp_path / "ro.json"
    ro.write_text("{}")
    ro.chmod(0o444)
    with pytest.raises(ValueError, match=r"must name a file this process may write, got '.*/ro\.json' \(Permission "
                                         r"denied\)"):
        backend.Builder(SPEC, ["l0"], vllm_config({"telemetry_json": str(ro)}), torch.device("cpu"))


def test_telemetry_json_keeps_an_existing_files_permissions_and_never_replaces_a_fifo(tmp_path: Path) -> None:
    """A private (0600) file stays private after the snapshot replaces it; a FIFO put at the path after start-up is
    not replaced: one line on stderr says so, without a C++ backtrace, once (the engine's destructor and the exit
    writer both meet it)."""
    private, later = tmp_path / "private.json", tmp_path / "later.json"
    private.write_text("{}")
    private.chmod(0o600)
    code = textwrap.dedent(
        f"""
        import gc, os, torch
        import activekv._backend as backend
        from tests.test_telemetry_publish import SPEC, vllm_config
        a = backend.Builder(SPEC, ["l0"], vllm_config({{"telemetry_json": {str(private)!r}}}), torch.device("cpu"))
        b = backend.Builder(SPEC, ["l0"], vllm_config({{"telemetry_json": {str(later)!r}}}), torch.device("cpu"))
        os.mkfifo({str(later)!r})  # after the start-up check
        del a, b
        gc.collect()
        """
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert json.loads(private.read_text())["info"]["num_layers"] == 1
    assert private.stat().st_mode & 0o777 == 0o600
    assert later.is_fifo()
    lines = [line for line in done.stderr.splitlines() if "later.json" in line]
    assert lines == [f"activekv: cannot write ActiveKV telemetry to {later}: it is no longer a regular file (a device, "
                     "FIFO, socket, directory or symbolic link is never replaced); nothing written"], done.stderr
    assert "Exception raised from" not in done.stderr and "frame #" not in done.stderr, done.stderr
    assert not list(tmp_path.glob("*.tmp.*"))


def test_telemetry_json_may_name_a_file_of_undecodable_bytes(tmp_path: Path) -> None:
    # os.fsdecode(b"run-\xff.json") is "run-\udcff.json": a valid path, written under its bytes.
    out = os.path.join(os.fsdecode(bytes(tmp_path)), os.fsdecode(b"run-\xff.json"))
    code = textwrap.dedent(
        f"""
        import gc, torch
        import activekv._backend as backend
        from tests.test_telemetry_publish import SPEC, vllm_config
        b = backend.Builder(SPEC, ["l0"], vllm_config({{"telemetry_json": {out!r}}}), torch.device("cpu"))
        del b
        gc.collect()
        """
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    with open(bytes(tmp_path) + b"/run-\xff.json", "rb") as f:
        assert json.loads(f.read())["info"]["num_layers"] == 1


def test_telemetry_json_is_written_when_the_engine_goes(tmp_path: Path) -> None:
    out = tmp_path / "telemetry.json"
    code = textwrap.dedent(
        f"""
        import gc, torch
        import activekv._backend as backend
        from tests.test_telemetry_publish import SPEC, vllm_config
        b = backend.Builder(SPEC, ["l0", "l1"], vllm_config({{"telemetry_json": {str(out)!r}}}), torch.device("cpu"))
        del b
        gc.collect()
        """
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    data = json.loads(out.read_text())
    assert set(data) == {"counters", "histograms", "info"}
    assert set(data["counters"]) == set(telemetry.COUNTERS)
    assert data["info"]["num_layers"] == 2
    assert data["histograms"]["forward_latency_us"]["le"][-1] == "+Inf"
    assert len(data["histograms"]["forward_latency_us"]["counts"]) == 24


def test_telemetry_json_is_written_at_exit_for_a_live_engine(tmp_path: Path) -> None:
    out = tmp_path / "telemetry.json"
    code = textwrap.dedent(
        f"""
        import torch
        import activekv._backend as backend
        from tests.test_telemetry_publish import SPEC, vllm_config
        keep = backend.Builder(SPEC, ["l0"], vllm_config({{"telemetry_json": {str(out)!r}}}), torch.device("cpu"))
        """
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert json.loads(out.read_text())["info"]["num_layers"] == 1


def end_engine_core_with_os_exit(env: dict[str, str], out: Path) -> Path:
    """Run a child that builds a 3-layer engine with telemetry_json=out and ends with os._exit, as vLLM's engine-core
    process does (no destructor, no atexit); returns the segment it leaves."""
    code = textwrap.dedent(
        f"""
        import os, torch
        import activekv._backend as backend
        from tests.test_telemetry_publish import SPEC, vllm_config
        b = backend.Builder(SPEC, ["l0", "l1", "l2"], vllm_config({{"telemetry_json": {str(out)!r}}}),
                            torch.device("cpu"))
        os._exit(0)
        """
    )
    before = set(segments())
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    (segment,) = set(segments()) - before
    return segment


def api_server_configured_with(out: Path) -> object:
    """A StatLogger as vLLM's API server builds it, from a config whose additional_config names telemetry_json=out:
    this process may then write that file for a descendant engine that ended without writing it."""
    prometheus_client = pytest.importorskip("prometheus_client")
    config = SimpleNamespace(model_config=SimpleNamespace(served_model_name="tiny"),
                             additional_config={"activekv": {"telemetry_json": str(out)}})
    return telemetry.StatLogger(config, [0], prometheus_client.CollectorRegistry)


def test_telemetry_json_of_a_child_that_ends_with_os_exit_is_written_by_its_ancestor(
    seg_dir: dict[str, str], tmp_path: Path
) -> None:
    # vLLM's engine-core process ends with os._exit: no destructor, no atexit. The segment keeps the final values and
    # the ancestor's reader (the API server's collector, configured with the same option) writes the file when it
    # finds the process gone.
    out = tmp_path / "engine-core.json"
    api_server_configured_with(out)
    end_engine_core_with_os_exit(seg_dir, out)
    assert not out.exists()
    assert len(segments()) == 1
    telemetry.process_tree_snapshots()
    assert json.loads(out.read_text())["info"]["num_layers"] == 3
    assert segments() == []


# An "engine core" (env: OUT, HOLD): builds a 3-layer engine with telemetry_json=$OUT, says READY with its pid, lives
# HOLD seconds more, then ends with os._exit.
ENGINE_CORE_LIVES_ON = textwrap.dedent(
    """
    import os, time, torch
    import activekv._backend as backend
    from tests.test_telemetry_publish import SPEC, vllm_config
    b = backend.Builder(SPEC, ["l0", "l1", "l2"], vllm_config({"telemetry_json": os.environ["OUT"]}),
                        torch.device("cpu"))
    print("READY", os.getpid(), flush=True)
    time.sleep(float(os.environ["HOLD"]))
    os._exit(0)
    """
)

# vLLM's API server in small (env: ACTIVEKV_TELEMETRY_DIR, PYTHONPATH, OUT, HOLD, CHILD): it builds its StatLogger from
# a config naming telemetry_json=$OUT (which registers the exit-time collection), starts $CHILD (the engine core
# above) and exits normally as soon as that engine is built, as after vLLM's shutdown, whose SIGKILL a loaded engine
# core outlives for a moment.
EXITS_BEFORE_ITS_ENGINE = textwrap.dedent(
    """
    import os, subprocess, sys, torch
    import prometheus_client
    from types import SimpleNamespace
    import activekv._telemetry as telemetry
    config = SimpleNamespace(model_config=SimpleNamespace(served_model_name="tiny"),
                             additional_config={"activekv": {"telemetry_json": os.environ["OUT"]}})
    telemetry.StatLogger(config, [0], prometheus_client.CollectorRegistry)
    child = subprocess.Popen([sys.executable, "-c", os.environ["CHILD"]], stdin=subprocess.DEVNULL,
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    print(child.stdout.readline().strip(), flush=True)
    """
)


@pytest.mark.parametrize("hold_s", [1.0, 60.0])
def test_an_engine_still_running_when_the_api_server_exits_gets_its_json_written(
    seg_dir: dict[str, str], tmp_path: Path, hold_s: float
) -> None:
    """vLLM's shutdown (--shutdown-timeout 0, its default) SIGKILLs the engine core and exits at once; on a loaded
    machine the killed process was still ending when the API server's exit-time collection ran, which took it for a
    live process and wrote no file. The collection waits for such a descendant (up to 5 s in all), then writes the
    file from its segment: removed once its process ended (1 s), kept while it still runs (60 s)."""
    pytest.importorskip("prometheus_client")
    out = tmp_path / "engine-core.json"
    env = {**seg_dir, "OUT": str(out), "HOLD": str(hold_s), "CHILD": ENGINE_CORE_LIVES_ON}
    done = subprocess.run([sys.executable, "-c", EXITS_BEFORE_ITS_ENGINE], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    ready, pid = done.stdout.split()
    assert ready == "READY", done.stdout
    try:
        assert json.loads(out.read_text())["info"]["num_layers"] == 3
        stat_line = Path(f"/proc/{pid}/stat").read_text() if Path(f"/proc/{pid}").exists() else ""
        still_runs = bool(stat_line) and stat_line.rsplit(")", 1)[1].split()[0] not in "ZX"  # a zombie has ended
        assert still_runs == (hold_s > 5), (hold_s, still_runs)
        assert len(segments()) == int(still_runs)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(pid), signal.SIGKILL)


# ------------------------------------------------------------------ hostile input in the telemetry folder (issue 29)
# The base folder (/dev/shm, or ACTIVEKV_TELEMETRY_DIR) is writable by every local user. Running as root here,
# "another user" is a file chown-ed to OTHER_UID.

OTHER_UID = 65534

# Run as a child (env: ACTIVEKV_TELEMETRY_DIR, PYTHONPATH): one StatLogger as vLLM's API server builds it (which also
# registers the exit-time collection), one reading of the process tree and one Prometheus scrape, then a normal exit.
SCRAPE = textwrap.dedent(
    """
    import torch
    import prometheus_client
    from types import SimpleNamespace
    import activekv._telemetry as telemetry
    registry = prometheus_client.CollectorRegistry()
    telemetry.StatLogger(SimpleNamespace(model_config=SimpleNamespace(served_model_name="tiny")), [0], lambda: registry)
    telemetry.process_tree_snapshots()
    print("SCRAPED", prometheus_client.generate_latest(registry).decode().count("activekv_engines{"), flush=True)
    """
)

# Prepended to CHILD: plant a link to $TARGET at the name the engine's segment had (`activekv-telemetry.<pid>.0`),
# in the base folder and in telemetry_dir(), before the engine is built.
PLANT_LINKS = textwrap.dedent(
    """
    import os, torch
    import activekv._telemetry as telemetry
    os.makedirs(telemetry.telemetry_dir(), mode=0o700, exist_ok=True)
    for folder in {os.environ["ACTIVEKV_TELEMETRY_DIR"], telemetry.telemetry_dir()}:
        os.symlink(os.environ["TARGET"], f"{folder}/activekv-telemetry.{os.getpid()}.0")
    """
)


def user_folder(env: dict[str, str]) -> Path:
    return Path(env["ACTIVEKV_TELEMETRY_DIR"]) / f"activekv-telemetry-{os.geteuid()}"


def tree(root: Path) -> list[str]:
    """Every path under root, links not followed."""
    return sorted(os.path.join(d, n) for d, dirs, files in os.walk(root) for n in dirs + files)


def test_a_fifo_named_like_a_segment_never_hangs_a_scrape_or_the_exit_time_collection(
    seg_dir: dict[str, str]
) -> None:
    pytest.importorskip("prometheus_client")
    folder = Path(telemetry.telemetry_dir())
    folder.mkdir(mode=0o700, exist_ok=True)
    fifos = {where / "activekv-telemetry.1.0" for where in (Path(seg_dir["ACTIVEKV_TELEMETRY_DIR"]), folder)}
    for fifo in fifos:
        os.mkfifo(fifo, 0o600)
    try:
        done = subprocess.run([sys.executable, "-c", SCRAPE], cwd=REPO, env=seg_dir, capture_output=True, text=True,
                              timeout=60)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"the scrape or the exit-time collection hung on a FIFO (killed after {e.timeout} s; "
                    f"stdout so far: {e.stdout!r})")
    assert done.returncode == 0, done.stderr
    assert done.stdout == "SCRAPED 1\n"
    assert all(stat.S_ISFIFO(fifo.lstat().st_mode) for fifo in fifos)


@pytest.mark.parametrize("kind", ["owned by another user", "mode 0644", "a link to a segment", "one byte longer"])
def test_a_segment_that_is_not_a_0600_file_of_this_user_is_neither_read_nor_removed(
    seg_dir: dict[str, str], tmp_path: Path, kind: str
) -> None:
    # A page another user wrote names the file the serving user is to overwrite. This process is configured with that
    # very path, so only the collector's check of the file keeps it from writing there.
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    api_server_configured_with(victim)
    segment = end_engine_core_with_os_exit(seg_dir, victim)
    if kind == "owned by another user":
        os.chown(segment, OTHER_UID, OTHER_UID)
    elif kind == "mode 0644":
        segment.chmod(0o644)
    elif kind == "a link to a segment":
        away = tmp_path / "away"
        away.mkdir()
        segment.rename(away / segment.name)
        segment.symlink_to(away / segment.name)
    else:
        with segment.open("ab") as f:
            f.write(b"\0")
    telemetry.process_tree_snapshots()
    assert victim.read_text() == "precious\n"
    assert segment.is_symlink() or segment.is_file()  # not ours to remove either


def test_the_collector_never_writes_a_json_path_it_was_not_configured_with(
    seg_dir: dict[str, str], tmp_path: Path
) -> None:
    # The page's json_path is data from a shared file: the collector writes only a path its own configuration names.
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    end_engine_core_with_os_exit(seg_dir, victim)
    api_server_configured_with(tmp_path / "configured.json")
    telemetry.process_tree_snapshots()
    assert victim.read_text() == "precious\n"
    assert not (tmp_path / "configured.json").exists()


def test_a_link_planted_at_the_segment_name_is_never_followed(seg_dir: dict[str, str], tmp_path: Path) -> None:
    target = tmp_path / "precious"
    target.write_text("precious\n")
    proc, pid = start_child({**seg_dir, "TARGET": str(target)}, PLANT_LINKS + CHILD)
    try:
        assert target.read_bytes() == b"precious\n"  # neither truncated nor resized
        (segment,) = [p for p in segments(f"activekv-telemetry.{pid}.*") if not p.is_symlink()]
        assert stat.S_ISREG(segment.lstat().st_mode) and segment.lstat().st_mode & 0o777 == 0o600
        (snap,) = child_snapshots(pid)
        assert snap["forward_calls"] == 1
    finally:
        _, err = proc.communicate("", timeout=60)
    assert err == ""
    assert target.read_text() == "precious\n"
    assert all(p.is_symlink() for p in segments(f"activekv-telemetry.{pid}.*"))  # the engine removed only its own


def test_segments_live_in_a_private_folder_of_the_user_under_unpredictable_names(seg_dir: dict[str, str]) -> None:
    folder = user_folder(seg_dir)
    proc, pid = start_child(seg_dir)
    try:
        assert telemetry.telemetry_dir() == str(folder)
        st = folder.lstat()
        assert stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid() and st.st_mode & 0o7777 == 0o700
        (segment,) = folder.glob(f"activekv-telemetry.{pid}.*")
        assert re.fullmatch(rf"activekv-telemetry\.{pid}\.\d+\.[0-9a-f]{{16}}", segment.name), segment.name
        assert tree(Path(seg_dir["ACTIVEKV_TELEMETRY_DIR"])) == [str(folder), str(segment)]
    finally:
        proc.communicate("", timeout=60)


@pytest.mark.parametrize(
    ("plant", "found"),
    [
        ("a link to a folder of ours", "a symbolic link"),
        ("mode 0755", "mode 0755"),
        ("another user's", f"owner uid {OTHER_UID}"),
        ("a regular file", "a regular file"),
    ],
)
def test_a_telemetry_folder_that_is_not_private_disables_publishing_with_a_warning(
    seg_dir: dict[str, str], capfd: pytest.CaptureFixture[str], plant: str, found: str
) -> None:
    base, folder = Path(seg_dir["ACTIVEKV_TELEMETRY_DIR"]), user_folder(seg_dir)
    if plant == "a link to a folder of ours":
        (base / "elsewhere").mkdir(mode=0o700)
        folder.symlink_to(base / "elsewhere")
    elif plant == "mode 0755":
        folder.mkdir()
        folder.chmod(0o755)
    elif plant == "another user's":
        folder.mkdir(mode=0o700)
        os.chown(folder, OTHER_UID, OTHER_UID)
    else:
        folder.write_text("")
    before = tree(base)
    proc, pid = start_child(seg_dir)  # its engine runs (READY after a step), unpublished
    try:
        assert child_snapshots(pid) == []
        assert tree(base) == before  # no segment anywhere: not in the base, the folder or the link's target
    finally:
        _, err = proc.communicate("", timeout=60)
    assert proc.returncode == 0
    expected = (f"must be a directory owned by uid {os.geteuid()} with mode 0700 (not a symbolic link), "
                f"found {found}")
    assert err.count("activekv: ") == 1 and "telemetry publishing disabled" in err, err
    assert str(folder) in err and expected in err, err
    reader = capfd.readouterr().err  # this process's collector skipped the folder, and said why
    assert "telemetry of other processes not read" in reader and expected in reader, reader


def test_the_json_is_written_through_a_new_temporary_file_never_through_a_planted_link(tmp_path: Path) -> None:
    # The temporary file beside telemetry_json was `<path>.tmp.<pid>`, opened with truncation: a link planted at that
    # name in a shared folder (/tmp) made the engine overwrite the link's target.
    out, target = tmp_path / "run.json", tmp_path / "precious"
    target.write_text("precious\n")
    code = textwrap.dedent(
        f"""
        import gc, os, torch
        import activekv._backend as backend
        from tests.test_telemetry_publish import SPEC, vllm_config
        os.symlink({str(target)!r}, {str(out)!r} + ".tmp." + str(os.getpid()))
        print(os.getpid(), os.umask(0o022), flush=True)
        b = backend.Builder(SPEC, ["l0"], vllm_config({{"telemetry_json": {str(out)!r}}}), torch.device("cpu"))
        del b
        gc.collect()
        """
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    pid = int(done.stdout.split()[0])
    assert target.read_text() == "precious\n"
    assert json.loads(out.read_text())["info"]["num_layers"] == 1
    assert not out.is_symlink() and out.stat().st_mode & 0o777 == 0o644  # 0666 less the umask, as before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["precious", "run.json", f"run.json.tmp.{pid}"]


# ------------------------------------------------------------------------------------------ Collector labels


@pytest.mark.parametrize(
    ("labels", "error", "message"),
    [
        ({"model-name": "tiny"}, ValueError, "label name must match [a-zA-Z_][a-zA-Z0-9_]*, got 'model-name'"),
        ({"9lives": "tiny"}, ValueError, "label name must match [a-zA-Z_][a-zA-Z0-9_]*, got '9lives'"),
        ({"": "tiny"}, ValueError, "label name must match [a-zA-Z_][a-zA-Z0-9_]*, got ''"),
        ({"modèle": "tiny"}, ValueError, "label name must match [a-zA-Z_][a-zA-Z0-9_]*, got 'modèle'"),
        ({"__name__": "tiny"}, ValueError, "label name must not start with '__' (reserved for Prometheus), got "
                                           "'__name__'"),
        ({"le": "1.0"}, ValueError, "label name must not be 'le' (the histograms' bucket label), got 'le'"),
        ({"model_name": "\udc80"}, ValueError, "the value of 'model_name' must be valid UTF-8 text, got '\\udc80'"),
        ({"model_name": 3}, TypeError, "the value of 'model_name' must be a str, got 3"),
        ({3: "tiny"}, TypeError, "label names must be str, got 3"),
    ],
)
def test_collector_rejects_labels_that_would_break_every_scrape(labels: dict, error: type, message: str) -> None:
    with pytest.raises(error, match="^Collector labels: " + re.escape(message) + "$"):
        telemetry.Collector(labels)


def test_a_stat_logger_with_a_served_model_name_that_is_not_utf8_fails_at_construction() -> None:
    prometheus_client = pytest.importorskip("prometheus_client")
    registry = prometheus_client.CollectorRegistry()
    config = SimpleNamespace(model_config=SimpleNamespace(served_model_name=["\udc80"]))
    with pytest.raises(ValueError, match=re.escape("the value of 'model_name' must be valid UTF-8 text")):
        telemetry.StatLogger(config, [0], lambda: registry)
    assert prometheus_client.generate_latest(registry) == b""


def test_collector_label_values_are_escaped_in_exposition_and_copied_at_construction() -> None:
    prometheus_client = pytest.importorskip("prometheus_client")
    from prometheus_client.parser import text_string_to_metric_families

    value = 'ti"ny\\ \n é'
    labels = {"model_name": value, "replica": ""}
    registry = prometheus_client.CollectorRegistry()
    registry.register(telemetry.Collector(labels))
    labels["bad-name"] = 3  # the caller's dict changed later: the collector keeps what it checked
    text = prometheus_client.generate_latest(registry).decode()
    assert 'model_name="ti\\"ny\\\\ \\n é"' in text
    engines = [s for f in text_string_to_metric_families(text) for s in f.samples if s.name == "activekv_engines"]
    assert [s.labels for s in engines] == [{"model_name": value, "replica": ""}]
