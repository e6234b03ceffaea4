"""host.set_threads: without --threads, one thread per physical core, written into TVM_NUM_THREADS (TVM otherwise
re-reads the CPU count from sysfs at every parallel kernel launch); a count the user set is kept. bench's local
device sizes threads the same way (TVM runs a kernel serially where that variable's count is 1). The pool's threads
share its cores (host.pool_cpus) instead of TVM's one core per worker."""

import os
import shutil
import subprocess
import sys

import pytest

CODE = """
import os, compiler.target.host as host, tvm
host.set_threads({threads})
print(os.environ.get("TVM_NUM_THREADS"), tvm.get_global_func("runtime.NumThreads")())
"""


def _run(threads, code=CODE, **env):
    """What `code` (CODE with `threads`) prints, split, in a process without the thread-count variables (plus `env`)."""
    clean = {k: v for k, v in __import__("os").environ.items() if k not in ("TVM_NUM_THREADS", "OMP_NUM_THREADS")}
    done = subprocess.run([sys.executable, "-c", code.format(threads=threads)], capture_output=True, text=True,
                          check=True, env={**clean, **env})
    return done.stdout.split()


def physical_cores_by_lscpu() -> int:
    """The (core, socket) pairs of the CPUs this process may use, as lscpu lists them."""
    rows = subprocess.run(["lscpu", "-p=CPU,CORE,SOCKET"], capture_output=True, text=True, check=True).stdout
    usable = os.sched_getaffinity(0)
    return len({tuple(row.split(",")[1:]) for row in rows.splitlines()
                if not row.startswith("#") and int(row.split(",")[0]) in usable})


@pytest.mark.skipif(shutil.which("lscpu") is None, reason="no lscpu (util-linux) to count the cores with")
def test_default_count_is_one_per_physical_core_and_pinned_in_the_variable():
    """TVM's own default halves x86's logical CPUs whether or not they are SMT siblings (1 thread on a 2-core VM
    without SMT, where this count is 2)."""
    variable, threads = _run(None)
    assert variable == threads == str(physical_cores_by_lscpu())


@pytest.mark.parametrize("env,expected", [({"TVM_NUM_THREADS": "1"}, "1"), ({"OMP_NUM_THREADS": "1"}, "None")])
def test_a_count_the_user_set_is_kept(env, expected):
    assert _run(None, **env)[0] == expected


def test_threads_option_sets_the_variable():
    assert _run(1)[0] == "1"


def test_threads_option_leaves_the_process_on_every_core():
    """TVM pins the thread that sizes its pool to that many cores; set_threads undoes it, so processes started
    later (bench's server, a subprocess) get every core this one had."""
    code = ("import os, compiler.target.host as host; before = len(os.sched_getaffinity(0)); host.set_threads(1); "
            "print(before, len(os.sched_getaffinity(0)))")
    before, after = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                   check=True).stdout.split()
    assert after == before


def test_bench_threads_on_this_machine_set_the_variable_too():
    """`mobilec bench --threads N` without --rpc: the local device's set_threads writes TVM_NUM_THREADS and leaves the
    process on every core. Sizing only the pool (runtime.config_threadpool) ran every kernel on one thread on a
    2-core x86 machine, whose default count is its one physical core: bench decoded at the 1-thread rate."""
    code = ("import os; from compiler.runtime.remote import local_device; before = len(os.sched_getaffinity(0)); "
            "local_device().set_threads({threads}); print(os.environ.get('TVM_NUM_THREADS'), before, "
            "len(os.sched_getaffinity(0)))")
    variable, before, after = _run(2, code)
    assert variable == "2" and after == before


def test_a_count_that_is_not_a_number_is_refused():
    done = subprocess.run([sys.executable, "-c", "import compiler.target.host as host; host.set_threads(None)"],
                          capture_output=True, text=True,
                          env={**os.environ, "TVM_NUM_THREADS": "", "OMP_NUM_THREADS": "two"})
    assert done.returncode != 0 and "OMP_NUM_THREADS='two' is not a thread count" in done.stderr


def test_pool_cpus_are_one_per_physical_core_first():
    from compiler.target.host import pool_cpus  # pylint: disable=import-outside-toplevel
    usable = sorted(os.sched_getaffinity(0))
    for threads in range(1, len(usable) + 2):
        cpus = pool_cpus(threads)
        assert len(cpus) == min(threads, len(usable)) and len(set(cpus)) == len(cpus) and set(cpus) <= set(usable)
        cores = [core_of(cpu) for cpu in cpus[:physical_cores_by_lscpu()]]
        assert len(set(cores)) == len(cores), (cpus, cores)


def core_of(cpu: int) -> str:
    path = f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list"
    return open(path, encoding="utf-8").read().strip() if os.path.exists(path) else str(cpu)


AFFINITIES = """
import glob, compiler.target.host as host
host.set_threads({threads})
for status in glob.glob("/proc/self/task/*/status"):
    print(next(line for line in open(status) if line.startswith("Cpus_allowed_list")).split(":")[1].strip())
"""


def cpu_list(text: str) -> set[int]:
    """A Linux CPU list ("0-3,6") as a set."""
    cpus = set()
    for part in text.split(","):
        first, _, last = part.partition("-")
        cpus.update(range(int(first), int(last or first) + 1))
    return cpus


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores for a pool of two threads")
@pytest.mark.parametrize("bind", [None, "1"])
def test_pool_threads_share_its_cores(bind):
    """TVM pins each worker to one core and lets the calling thread, which runs each launch's first share, roam over
    all of them: where Linux left it on the worker's core (2 of 6 processes on a 2-core VM) the shares ran one after
    the other. After set_threads no thread of the pool is held to one core. Negative control: TVM_BIND_THREADS keeps
    TVM's placement, a worker on one core."""
    from compiler.target.host import pool_cpus  # pylint: disable=import-outside-toplevel
    env = {} if bind is None else {"TVM_BIND_THREADS": bind}
    threads = [cpu_list(line) for line in _run(2, AFFINITIES, **env)]
    assert len(threads) >= 2  # the calling thread and TVM's worker
    if bind is None:
        assert all(set(pool_cpus(2)) <= cpus for cpus in threads), threads
    else:
        assert any(len(cpus) == 1 for cpus in threads), threads
