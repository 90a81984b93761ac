"""Finding a run's processes (arguments, redcoast launch, SLURM, Open MPI) and `redcoast launch`.

The detection tests read faked environments and start nothing; the others start real processes
on loopback (faked SLURM / Open MPI variables, the launcher with a failing or killed process).
"""

import collections
import io
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import tomllib

import pytest

from redcoast.multihost import distributed
from redcoast.multihost.distributed import Cluster, detect, first_slurm_host
from redcoast.errors import ConfigError
from redcoast.cli.launch_command import parse_args
from redcoast.cli.main import cli
from redcoast.multihost.launcher import _Output, child_env, describe_exit, free_port

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def slurm_env(n_tasks=2, proc_id=0, local_id=None, nodes="gpu[07-09,12],cpu3", n_nodes=1, **extra):
    env = {"SLURM_JOB_ID": "123456", "SLURM_NTASKS": str(n_tasks),
           "SLURM_STEP_NUM_TASKS": str(n_tasks), "SLURM_PROCID": str(proc_id),
           "SLURM_LOCALID": str(proc_id if local_id is None else local_id),
           "SLURM_STEP_NODELIST": nodes, "SLURM_JOB_NODELIST": nodes, "SLURM_STEP_ID": "0",
           "SLURM_STEP_NUM_NODES": str(n_nodes), "SLURM_NNODES": str(n_nodes)}
    env.update(extra)
    return env


def ompi_env(size=4, rank=1, local_rank=1, local_size=2, **extra):
    env = {"OMPI_COMM_WORLD_SIZE": str(size), "OMPI_COMM_WORLD_RANK": str(rank),
           "OMPI_COMM_WORLD_LOCAL_RANK": str(local_rank),
           "OMPI_COMM_WORLD_LOCAL_SIZE": str(local_size),
           "OMPI_MCA_orte_hnp_uri": "1531576320.0;tcp://10.96.0.1,10.148.0.1:34911"}
    env.update(extra)
    return env


# -- detection, from faked environments --------------------------------------------------------

def test_nothing_found_is_one_process():
    assert detect(env={}) is None
    assert detect(n_processes=1, env=slurm_env()) is None  # explicit arguments win


def test_explicit_arguments_win_over_the_environment():
    env = {"REDCOAST_N_PROCESSES": "8", "REDCOAST_PROCESS_ID": "5",
           "REDCOAST_HOST0_ADDRESS": "10.9.9.9", **slurm_env()}
    c = detect(n_processes=2, host0_address="10.0.0.1", host0_port=1234, process_id=1, env=env)
    assert c == Cluster("Deployer arguments", 2, 1, "10.0.0.1:1234")
    assert detect(n_processes=2, host0_address="10.0.0.1", process_id=0, env={}).coordinator \
        == f"10.0.0.1:{distributed.DEFAULT_PORT}"


@pytest.mark.parametrize("kwargs, needle", [
    (dict(n_processes=2, host0_address="10.0.0.1"), "process_id"),
    (dict(n_processes=2, process_id=0), "host0_address"),
    (dict(n_processes=2, host0_address="h", process_id=2), "distinct id"),
    (dict(n_processes=2, host0_address="h", process_id=0, host0_port=70000), "port"),
])
def test_incomplete_or_wrong_arguments_name_the_fix(kwargs, needle):
    with pytest.raises(ConfigError, match="Fix") as e:
        detect(env={}, **kwargs)
    assert needle in str(e.value)


def test_redcoast_variables_set_by_the_launcher():
    env = child_env({}, 4, 3, "127.0.0.1", 5555, 2)
    c = detect(env=env)
    assert (c.source, c.n_processes, c.process_id, c.coordinator) == \
        ("redcoast launch", 4, 3, "127.0.0.1:5555")
    assert c.local_device_ids == (6, 7)  # on GPUs, process 3 of a machine drives GPUs 6 and 7
    assert detect(env={**env, **slurm_env()}).source == "redcoast launch"  # before SLURM
    with pytest.raises(ConfigError, match="REDCOAST_HOST0_ADDRESS.*Fix"):
        detect(env={"REDCOAST_N_PROCESSES": "2", "REDCOAST_PROCESS_ID": "0"})
    with pytest.raises(ConfigError, match="REDCOAST_PROCESS_ID='x'.*Fix"):
        detect(env={**env, "REDCOAST_PROCESS_ID": "x"})


def test_launcher_environment_strips_a_forced_device_count():
    env = child_env({"XLA_FLAGS": "--xla_foo=1 --xla_force_host_platform_device_count=8"},
                    2, 0, "127.0.0.1", 1, 4)
    assert env["XLA_FLAGS"] == "--xla_foo=1" and env["REDCOAST_N_LOCAL_DEVICES"] == "4"
    env = child_env({"XLA_FLAGS": "--xla_force_host_platform_device_count=8"}, 2, 0, "h", 1, 4)
    assert "XLA_FLAGS" not in env
    keep = child_env({"XLA_FLAGS": "--xla_force_host_platform_device_count=8"}, 2, 0, "h", 1, None)
    assert keep["XLA_FLAGS"] == "--xla_force_host_platform_device_count=8"


@pytest.mark.parametrize("nodes, first", [
    ("node001", "node001"), ("node001,host2", "node001"), ("node[001-015],host2", "node001"),
    ("node[007,001-003]", "node007"), ("rack[2-3]-gpu[10-11]", "rack2-gpu10"),
    ("gpu[07-09,12],cpu3", "gpu07")])
def test_first_host_of_a_slurm_node_list(nodes, first):
    assert first_slurm_host(nodes) == first


def test_slurm_tasks_of_one_step():
    clusters = [detect(env=slurm_env(n_tasks=16, proc_id=i, local_id=i % 8, n_nodes=2))
                for i in range(16)]
    assert {c.coordinator for c in clusters} == {clusters[0].coordinator}  # all agree
    host, port = clusters[0].coordinator.split(":")
    assert host == "gpu07" and 61440 <= int(port) <= 65535
    assert [c.process_id for c in clusters] == list(range(16))
    assert clusters[9].source == "SLURM" and clusters[9].n_processes == 16
    assert clusters[9].local_device_ids == (1,)  # 8 tasks per node: one GPU each
    # SLURM already bound one GPU to each task: use it, whatever its number.
    assert detect(env=slurm_env(n_tasks=2, proc_id=1, CUDA_VISIBLE_DEVICES="1")).local_device_ids is None
    # One task per node drives all the node's GPUs.
    assert detect(env=slurm_env(n_tasks=2, proc_id=1, n_nodes=2)).local_device_ids is None
    env = slurm_env(REDCOAST_HOST0_ADDRESS="10.1.2.3", REDCOAST_HOST0_PORT="4321")
    assert detect(env=env).coordinator == "10.1.2.3:4321"


def test_slurm_shells_that_are_not_a_multi_task_step_stay_single():
    assert detect(env=slurm_env(n_tasks=1)) is None  # srun -n1, or an interactive step
    allocation = {"SLURM_JOB_ID": "1", "SLURM_NTASKS": "4", "SLURM_PROCID": "0",
                  "SLURM_JOB_NODELIST": "a[1-2]", "SLURM_NNODES": "2"}  # salloc / sbatch shell
    assert detect(env=allocation) is None


def test_open_mpi_ranks():
    c = detect(env=ompi_env())
    assert (c.source, c.n_processes, c.process_id) == ("Open MPI", 4, 1)
    host, port = c.coordinator.split(":")
    assert host == "10.96.0.1" and 61440 <= int(port) <= 65535
    assert c.local_device_ids == (1,)
    pmix = ompi_env(size=2, rank=0, local_size=1, PMIX_SERVER_URI41="prterun-h-1@0.0;tcp4://10.0.0.7:4000",
                    PMIX_NAMESPACE="prterun-h-1@1")
    del pmix["OMPI_MCA_orte_hnp_uri"]
    assert detect(env=pmix).coordinator.startswith("10.0.0.7:")  # Open MPI 5 (PMIx)
    assert detect(env=ompi_env(size=1, rank=0)) is None
    bare = ompi_env()
    del bare["OMPI_MCA_orte_hnp_uri"]
    with pytest.raises(ConfigError, match="REDCOAST_HOST0_ADDRESS"):
        detect(env=bare)
    assert detect(env={**bare, "REDCOAST_HOST0_ADDRESS": "10.0.0.2"}).coordinator.startswith("10.0.0.2:")


# -- the command line -------------------------------------------------------------------------

def test_command_line(tmp_path, capsys):
    script = tmp_path / "train.py"
    script.write_text("")
    options, command = parse_args(["-n", "4", "--local-devices=2", str(script), "-n", "x"])
    assert (options.n_processes, options.local_devices) == (4, 2)
    assert command == [sys.executable, "-u", str(script), "-n", "x"]  # the script's own -n
    _, command = parse_args(["-n", "2", "-m", "pkg.train", "--lr", "1"])
    assert command == [sys.executable, "-u", "-m", "pkg.train", "--lr", "1"]
    for argv, needle in [(["-n", "0", str(script)], "at least 1"),
                         (["-n", "2", "missing.py"], "not found"), (["-n", "2"], "no script")]:
        with pytest.raises(SystemExit):
            parse_args(argv)
        assert needle in capsys.readouterr().err
    assert cli(["frobnicate"]) == 2 and "redcoast launch" in capsys.readouterr().err
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        assert tomllib.load(f)["project"]["scripts"]["redcoast"] == "redcoast.cli.main:cli"
    assert describe_exit(-9) == "was killed by signal 9 (SIGKILL)"
    assert describe_exit(3) == "exited with code 3"


@pytest.mark.parametrize("flags, needle", [
    (["-n", "x"], "argument -n/--n-processes: 'x' is not a positive integer"),
    (["-n", "2", "--local-devices", "0"], "argument --local-devices: '0' is not a positive integer"),
    (["-n", "2", "--stall-timeout", "-1"], "argument --stall-timeout: '-1' is not a number of seconds"),
    (["-n", "2", "--grace-period", "nan"], "argument --grace-period: 'nan' is not a number of seconds"),
    (["-n", "2", "--exit-timeout", "soon"], "argument --exit-timeout: 'soon'"),
    (["-n", "2", "--local-devices", "100000"],
     "-n 2 --local-devices 100000: 200000 devices in all (on CPUs, 100000 simulated in each"),
    (["-n", "100000"], "-n 100000: 100000 processes on this machine, more than the 64"),
])
def test_launch_arguments_are_refused_before_anything_starts(tmp_path, capsys, flags, needle):
    script = tmp_path / "train.py"
    script.write_text("")
    with pytest.raises(SystemExit) as e:
        parse_args(flags + [str(script)])
    err = capsys.readouterr().err
    assert e.value.code == 2 and needle in err and "Traceback" not in err, err
    if "more than" in needle:  # asked for: allowed, and said when the launch starts
        options, _ = parse_args(flags[:-2] + ["--allow-many"] + flags[-2:] + [str(script)])
        assert options.allow_many


def test_redcoast_without_a_command_prints_its_usage_as_an_error(capsys):
    assert cli([]) == 2
    out = capsys.readouterr()
    assert "usage: redcoast launch" in out.err and not out.out


# -- the output relay ------------------------------------------------------------------------

def relay(data, **kwargs):
    """``(what _Output wrote, its tail, seconds)`` for ``data`` written into a pipe."""
    read, write = os.pipe()
    sink, tail = io.BytesIO(), collections.deque(maxlen=30)
    writer = threading.Thread(target=lambda: os.fdopen(write, "wb").write(data) and None)
    start = time.monotonic()
    writer.start()
    out = _Output(os.fdopen(read, "rb"), "[0] ", sink, tail, **kwargs)
    out.thread.join(timeout=5)  # 5 MB: well under 1 s linear; a rescan per read took minutes
    took = time.monotonic() - start
    assert not out.thread.is_alive(), f"the relay of {len(data)} bytes took over {took:.0f} s"
    writer.join()
    return sink.getvalue(), list(tail), took


def test_a_long_line_is_relayed_in_linear_time_in_prefixed_pieces():
    data = b"x" * (5 << 20) + b"\nend\n"
    written, tail, took = relay(data)
    lines = written.split(b"\n")[:-1]
    assert all(line.startswith(b"[0] ") for line in lines)
    assert max(len(line) for line in lines) <= 4 + (1 << 20)  # pieces of 1 MiB at most
    assert b"".join(line[4:] for line in lines) == data.replace(b"\n", b"")
    assert tail[-1] == "end" and tail[-2].endswith("more bytes)") and len(tail[-2]) < 2100
    print(f"5 MiB line relayed in {took:.2f} s")


def test_pieces_of_a_long_line_split_no_utf8_character_and_lines_keep_their_ends():
    data = "é".encode() * 10 + b"\rbar\r\nbaz"  # 2-byte characters: a 5-byte cut would split one
    written, tail, _ = relay(data, max_line=5)
    two = "éé".encode()
    assert written.split(b"[0] ")[1:] == [two + b"\n"] * 4 + [two + b"\r", b"bar\r", b"\n", b"baz\n"]
    assert tail == ["éé"] * 5 + ["bar", "baz"]


# -- real processes ---------------------------------------------------------------------------

HELLO = textwrap.dedent("""
    import sys
    import jax
    import numpy as np
    from jax.experimental import multihost_utils
    from redcoast import Deployer

    deployer = Deployer(verbose=False)
    ids = multihost_utils.process_allgather(np.array([jax.process_index()]))
    print(f"process {jax.process_index()} of {jax.process_count()}: {jax.local_device_count()} "
          f"local / {jax.device_count()} devices, saw {ids.ravel().tolist()}, args {sys.argv[1:]}")
""")


def env_for_children(**extra):
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "OMPI_", "PMIX_", "REDCOAST_"))}
    env["XLA_FLAGS"] = " ".join(f for f in env.get("XLA_FLAGS", "").split()
                                if not f.startswith("--xla_force_host_platform_device_count"))
    env["PYTHONPATH"] = os.pathsep.join([ROOT, HERE, env.get("PYTHONPATH", "")])
    env.update(extra)
    return env


def run_together(envs, script, timeout=120):
    procs = [subprocess.Popen([sys.executable, str(script)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for env in envs]
    try:
        return [p.communicate(timeout=timeout)[0] for p in procs], [p.returncode for p in procs]
    finally:
        for p in procs:
            p.kill()


@pytest.mark.parametrize("kind", ["slurm", "open_mpi"])
def test_faked_scheduler_starts_jax_distributed(tmp_path, kind):
    """Two processes that only see SLURM's (or Open MPI's) variables form one run."""
    script = tmp_path / "hello.py"
    script.write_text(HELLO)
    port = str(free_port())
    if kind == "slurm":
        envs = [env_for_children(**slurm_env(n_tasks=2, proc_id=i, nodes="localhost"),
                                 JAX_COORDINATOR_PORT=port) for i in range(2)]
    else:
        envs = [env_for_children(**ompi_env(size=2, rank=i, local_rank=i, REDCOAST_HOST0_PORT=port,
                                            OMPI_MCA_orte_hnp_uri="99.0;tcp://127.0.0.1:1"))
                for i in range(2)]
    outputs, codes = run_together(envs, script)
    for i in range(2):
        assert codes[i] == 0, outputs[i][-3000:]
        assert f"process {i} of 2: 1 local / 2 devices, saw [0, 1]" in outputs[i]


def test_a_missing_peer_times_out_with_the_fix(tmp_path):
    """Process 1 with no process 0, and process 0 with no process 1, each give up and say why."""
    script = tmp_path / "hello.py"
    script.write_text(HELLO)
    envs = [env_for_children(**child_env({}, 2, i, "127.0.0.1", free_port(), 1),
                             REDCOAST_INIT_TIMEOUT="3") for i in (1, 0)]
    start = time.monotonic()
    (alone_1, alone_0), codes = run_together(envs, script)
    assert all(code != 0 for code in codes) and time.monotonic() - start < 60
    assert "ConfigError: process 1 of 2 (redcoast launch) could not reach the coordinator" in alone_1
    assert "Fix: start all 2 processes within 3 s" in alone_1
    # JAX itself aborts process 0; redcoast said beforehand what it was waiting for.
    assert "process 0 of 2 (redcoast launch) is still waiting for the other processes" in alone_0
    assert "Fix: start all 2 processes within 3 s" in alone_0


def launch(args, cwd, timeout=120, **extra_env):
    return subprocess.Popen([sys.executable, "-m", "redcoast.cli.launch_command"] + args, cwd=cwd,
                            env=env_for_children(**extra_env), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def test_launch_prefixes_output_and_passes_arguments(tmp_path):
    (tmp_path / "hello.py").write_text(HELLO)
    proc = launch(["-n", "2", "--local-devices", "3", "hello.py", "-n", "x"], tmp_path,
                  XLA_FLAGS=os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8")
    out = proc.communicate(timeout=120)[0]
    assert proc.returncode == 0, out
    for i in range(2):
        assert f"[{i}] process {i} of 2: 3 local / 6 devices, saw [0, 1], args ['-n', 'x']" in out


@pytest.mark.slow  # 200 MB through the launcher: a few seconds
def test_launch_relays_a_100_mb_line_without_a_newline_in_seconds(tmp_path):
    (tmp_path / "flood.py").write_text(textwrap.dedent("""
        import sys
        sys.stdout.buffer.write(b"x" * 100_000_000)  # one line, no newline
        sys.stdout.flush()
        print("\\nafter the flood", flush=True)
    """))
    start = time.monotonic()
    with open(tmp_path / "out", "wb") as out:
        proc = subprocess.run([sys.executable, "-m", "redcoast.cli.launch_command", "-n", "2", "flood.py"],
                              cwd=tmp_path, env=env_for_children(), stdout=out,
                              stderr=subprocess.PIPE, timeout=120)
    took = time.monotonic() - start
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = (tmp_path / "out").read_bytes().split(b"\n")
    for i in range(2):
        mine = [line[4:] for line in lines if line.startswith(f"[{i}] ".encode())]
        assert b"".join(mine[:-1]) == b"x" * 100_000_000 and mine[-1] == b"after the flood"
    assert took < 30, f"the launch took {took:.1f} s"
    print(f"two 100 MB lines through redcoast launch -n 2 in {took:.1f} s")


def test_part_of_a_line_is_progress():
    """--stall-timeout's progress: bytes without a newline count, though not written yet."""
    read, write = os.pipe()
    sink, progress = io.BytesIO(), [0.0]
    out = _Output(os.fdopen(read, "rb"), "[0] ", sink, collections.deque(), progress, 0)
    before = time.monotonic()
    os.write(write, b"loading")
    deadline = time.monotonic() + 5
    while progress[0] < before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert progress[0] >= before and sink.getvalue() == b""
    os.close(write)
    out.thread.join(timeout=5)
    assert sink.getvalue() == b"[0] loading\n"


@pytest.mark.slow  # 9 s: a stall timeout of 2 s after 3 s of dots
def test_launch_counts_part_of_a_line_as_progress_and_names_the_process_that_then_hangs(tmp_path):
    """Process 1 prints one line a dot at a time for 3 s (longer than --stall-timeout 2), then
    hangs mid-line while process 0 keeps printing: process 1 is named, its unfinished line
    whole in the report; a rule of complete lines would have named it after 2 s, at 10 dots."""
    (tmp_path / "dots.py").write_text(textwrap.dedent("""
        import os, sys, time
        if os.environ["REDCOAST_PROCESS_ID"] == "0":
            while True:
                print("still here", flush=True)
                time.sleep(0.2)
        sys.stdout.write("loading")
        for _ in range(15):
            sys.stdout.write("."); sys.stdout.flush(); time.sleep(0.2)
        time.sleep(120)  # hangs, its line unfinished
    """))
    proc = launch(["-n", "2", "--stall-timeout", "2", "dots.py"], tmp_path)
    out = proc.communicate(timeout=60)[0]
    assert proc.returncode == 1, out
    report = out.split("FAILED")[1]
    assert report.startswith(": process 1 of 2") and "made no progress" in report, out
    assert "  [1] loading" + "." * 15 + "\n" in report


KILLED = textwrap.dedent("""
    import os, signal
    import optax
    from redcoast import Deployer, Trainer
    from tiny_lm import collate_fn, loss_fn, make_examples, make_model

    deployer = Deployer(n_model_shards=1, verbose=False)
    model, params = make_model()
    calls = []

    def collate(examples):
        calls.append(len(examples))
        if deployer.process_index == 1 and len(calls) == 8:  # a few steps into training
            print("process 1 kills itself mid-training", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        return collate_fn(examples)

    trainer = Trainer(deployer, collate, model.apply, loss_fn, params, optax.sgd(0.1))
    trainer.fit(make_examples(400), per_device_batch_size=1, n_epochs=100)
""")

RAISING = textwrap.dedent("""
    import jax
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P
    from redcoast import Deployer

    deployer = Deployer(verbose=False)
    rows = NamedSharding(deployer.mesh, P("dp"))
    total = jax.jit(lambda x: x.sum(), out_shardings=NamedSharding(deployer.mesh, P()))
    for step in range(10**6):  # the others wait in this all-reduce for process 1
        if deployer.process_index == 1 and step == 20:
            raise RuntimeError("deliberate error in process 1 at step 20")
        x = jax.make_array_from_process_local_data(rows, np.ones(jax.local_device_count()),
                                                   (jax.device_count(),))
        float(total(x))
""")


# the killed process runs in CI's slow step (the default suite is near its 15 minutes)
@pytest.mark.parametrize("how", [pytest.param("kill", marks=pytest.mark.slow), "raise"])
def test_a_failed_process_stops_the_run(tmp_path, how):
    (tmp_path / "train.py").write_text(KILLED if how == "kill" else RAISING)
    proc = launch(["-n", "2", "--local-devices", "2", "train.py"], tmp_path)
    lines, failed_at = [], None
    for line in proc.stdout:  # the kill / error time, seen as the launcher shows it
        lines.append(line)
        if failed_at is None and ("kills itself" in line or "RuntimeError: deliberate" in line):
            failed_at = time.monotonic()
    proc.wait(timeout=60)
    out = "".join(lines)
    assert failed_at is not None, out
    took = time.monotonic() - failed_at
    assert proc.returncode != 0, out
    assert took < 30, f"the launcher took {took:.1f} s to stop after the failure"
    if how == "kill":
        assert proc.returncode == 128 + signal.SIGKILL
        assert "FAILED: process 1 of 2" in out and "was killed by signal 9 (SIGKILL)" in out
    else:
        assert proc.returncode == 1
        assert "FAILED: process 1 of 2" in out and "exited with code 1" in out
        assert "[1] Traceback (most recent call last)" in out
        assert "  [1] RuntimeError: deliberate error in process 1 at step 20" in out  # summary
    print(f"launcher exit {took:.2f} s after the failure ({how})")


def until_both_ready(proc):
    ready = 0
    for line in proc.stdout:
        ready += "ready" in line
        if ready == 2:
            return


def test_launch_kills_a_process_ignoring_a_forwarded_sigterm_after_the_stop_timeout(tmp_path):
    (tmp_path / "stubborn.py").write_text(textwrap.dedent("""
        import signal, time
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # never reaches a step boundary
        print("ready", flush=True)
        time.sleep(120)
    """))
    proc = launch(["-n", "2", "--stop-timeout", "2", "stubborn.py"], tmp_path)
    until_both_ready(proc)
    start = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    out = proc.communicate(timeout=60)[0]
    assert time.monotonic() - start < 20 and proc.returncode == 128 + signal.SIGTERM, out
    assert "still running 2 s after the signal (--stop-timeout); killing them" in out


def test_launch_forwards_sigint(tmp_path):
    (tmp_path / "wait.py").write_text(textwrap.dedent("""
        import sys, time
        try:
            print("ready", flush=True)
            time.sleep(60)
        except KeyboardInterrupt:
            print("got SIGINT", flush=True)
            sys.exit(130)
    """))
    proc = launch(["-n", "2", "wait.py"], tmp_path)
    until_both_ready(proc)
    start = time.monotonic()
    proc.send_signal(signal.SIGINT)
    out = proc.communicate(timeout=30)[0]
    assert proc.returncode == 130 and time.monotonic() - start < 10
    assert "[0] got SIGINT" in out and "[1] got SIGINT" in out
    assert "stopped by SIGINT, forwarded to all 2 processes" in out
