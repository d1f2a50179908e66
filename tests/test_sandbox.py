"""Tests of sandbox.py: values and exceptions that cross the boundary, the assert protocol,
the protection layers, and the hostile-program suite (each hostile program scores 0, the
caller keeps working, nothing is left behind). CPU, offline, about 20 s on 2 cores."""
import os
import socket
import sys
import time

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import sandbox  # noqa: E402

linux_only = pytest.mark.skipif(sys.platform != "linux", reason="the code sandbox needs Linux")

# the same function and tests as in test_rewards.py
F_TESTS = {"kind": "assert", "test": "assert f(1) == 5\nassert f(2) == 8\nassert f(0) == 2\n", "entry_point": "f"}
F_CHECK = {"kind": "assert", "entry_point": "f",
           "test": "def check(candidate):\n    assert candidate(1) == 5\n    assert candidate(2) == 8\n"}
GOOD = "def f(x):\n    return x * 3 + 2\n"


# ----------------------------------------------------------------------------------------
# The boundary: values, exceptions, the assert protocol, the layers
# ----------------------------------------------------------------------------------------


@linux_only
def test_values_keep_their_types_and_exceptions_their_class():
    tests = {"kind": "assert", "entry_point": "f", "test": (
        "assert f(1) == (1, [2], {3: 'x'}, {4}, b'5', 6.5, None, True)\n"
        "assert type(f(1)[0]) is int and type(f(1)[7]) is bool\n"
        "try:\n    f(-1)\nexcept ValueError:\n    pass\nelse:\n    raise AssertionError('no error')\n")}
    good = ("def f(x):\n    if x < 0:\n        raise ValueError('negative')\n"
            "    return (1, [2], {3: 'x'}, {4}, b'5', 6.5, None, True)\n")
    assert sandbox.run_program(good, tests)["passed"] is True
    as_list = good.replace("return (1, [2], {3: 'x'}, {4}, b'5', 6.5, None, True)", "return [1, [2], {3: 'x'}, {4}, b'5', 6.5, None, True]")
    assert sandbox.run_program(as_list, tests)["passed"] is False  # a list is not a tuple


@linux_only
def test_assert_tests_must_call_the_program():
    r = sandbox.run_program(GOOD, {"kind": "assert", "test": "assert 1 == 1\n", "entry_point": None})
    assert r["passed"] is False and "never called" in r["reason"]


@linux_only
def test_sandbox_layers_are_reported():
    info = sandbox.sandbox_info()
    assert {"landlock", "seccomp", "pid", "root"} <= set(info)


def test_sandbox_imports_nothing_of_the_project():
    """rewards.py imports sandbox.py, never the reverse (the helpers boot sandbox.py by path)."""
    import subprocess
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    src = ("import sys\nsys.path.insert(0, sys.argv[1])\nimport sandbox\n"
           "print(sorted(m for m in ('rewards', 'tasks', 'toy', 'workflows') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", src, root], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "[]", (out.stdout, out.stderr)


# ----------------------------------------------------------------------------------------
# Hostile programs: each scores 0, the caller keeps working, nothing is left behind
# ----------------------------------------------------------------------------------------


def _session_members(sid: int) -> list[int]:
    """Processes whose session id is `sid` (the sandbox child starts its own session)."""
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                if int(fields[3]) == sid:
                    out.append(int(d))
            except (OSError, IndexError, ValueError):
                pass
    return out


@pytest.fixture(scope="module")
def arena(tmp_path_factory):
    """A folder of the 'parent' with a file to protect, a secret in the environment and a
    local server that would hand out the right answer to anyone who connects."""
    folder = tmp_path_factory.mktemp("parent")
    victim = folder / "precious.txt"
    victim.write_text("keep me")
    os.environ["MARL_SECRET_ANSWER"] = "5"
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    server.settimeout(0)
    yield {"folder": str(folder), "victim": str(victim), "port": server.getsockname()[1], "server": server}
    server.close()
    os.environ.pop("MARL_SECRET_ANSWER", None)


# Walks every module, frame and gc-tracked object for "(1) == 5"-style asserts and answers
# from them (no braces in the source: the hostile programs go through str.format).
MEMORY_CHEAT = (
    "import gc, re, sys\n"
    "table = dict()\n"
    "def walk(o, depth=0):\n"
    "    if isinstance(o, str):\n"
    "        table.update((int(a), int(b)) for a, b in re.findall(r'\\((-?\\d+)\\) == (-?\\d+)', o))\n"
    "    elif depth < 4 and isinstance(o, dict):\n"
    "        for v in list(o.values()):\n"
    "            walk(v, depth + 1)\n"
    "    elif depth < 4 and isinstance(o, (list, tuple)):\n"
    "        for v in o:\n"
    "            walk(v, depth + 1)\n"
    "roots = [vars(m) for m in list(sys.modules.values())] + gc.get_objects()\n"
    "frame = sys._getframe()\n"
    "while frame:\n"
    "    roots.append(frame.f_locals)\n"
    "    frame = frame.f_back\n"
    "for r in roots:\n"
    "    walk(r)\n"
    "def f(x):\n"
    "    return table.get(x, 0)\n"
)


def test_memory_cheat_works_when_the_tests_are_in_memory():
    import subprocess
    # a plain process that holds the tests as a live object: the cheat answers every assert
    src = f"tests = {F_TESTS!r}\n" + MEMORY_CHEAT + "print(f(0), f(1), f(2))\n"
    out = subprocess.run([sys.executable, "-I", "-c", src], capture_output=True, text=True, timeout=60)
    assert out.stdout.split() == ["2", "5", "8"], out.stderr


HOSTILE = {
    "infinite loop": "while True:\n    pass\n",
    "fork bomb": "import os\nwhile True:\n    os.fork()\n",
    "subprocess": "import subprocess\nsubprocess.Popen(['sleep', '100'])\ndef f(x):\n    return x * 3 + 2\n",
    "memory bomb": "x = bytearray(1 << 40)\ndef f(x):\n    return x * 3 + 2\n",
    "growing memory": "keep = []\nwhile True:\n    keep.append(' ' * 10**7)\n",
    "1 GB print": "print('x' * 10**9)\ndef f(x):\n    return x * 3 + 2\n",
    "endless print": "while True:\n    print('x' * 100000)\n",
    "sys.exit(0) before tests": "import sys\nsys.exit(0)\n",
    "os._exit(0) after printing PASS": "import os\nprint('PASS')\nos._exit(0)\n",
    "os._exit(0) inside the call": "import os\ndef f(x):\n    os._exit(0)\n",
    "kill the parent": "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\ndef f(x):\n    return 0\n",
    "kill everyone": ("import os, signal\nfor p in range(2, 1 << 15):\n    try:\n        os.kill(p, signal.SIGKILL)\n"
                      "    except OSError:\n        pass\ndef f(x):\n    return 0\n"),
    "delete the parent's files": "import os\nos.remove({victim!r})\ndef f(x):\n    return 0\n",
    "write outside the folder": "open({folder!r} + '/evil.txt', 'w').write('x')\ndef f(x):\n    return 0\n",
    "remove the parent folder": "import shutil\nshutil.rmtree('..')\ndef f(x):\n    return 0\n",
    "read the parent's environment": (
        "import os\nv = os.environ.get('MARL_SECRET_ANSWER')\n"
        "if v is None:\n    v = open(f'/proc/{{os.getppid()}}/environ').read()\n"
        "def f(x):\n    return int(v) if x == 1 else 8\n"),
    "read the trainer's environment": (
        "import os\nppid = lambda p: int(open(f'/proc/{{p}}/stat').read().rsplit(')', 1)[1].split()[1])\n"
        "env = open(f'/proc/{{ppid(os.getppid())}}/environ').read()\n"
        "v = env.split('MARL_SECRET_ANSWER=')[1].split(chr(0))[0]\n"
        "def f(x):\n    return int(v) if x == 1 else 8\n"),
    "ask the network": ("import socket\ns = socket.create_connection(('127.0.0.1', {port}))\n"
                        "def f(x):\n    return int(s.recv(10))\n"),
    "patch builtins and AssertionError": ("import builtins\nclass Quiet(Exception):\n    pass\n"
                                          "builtins.AssertionError = Quiet\nbuiltins.print = lambda *a: None\n"
                                          "def f(x):\n    return 0\n"),
    "always-equal object": "class A:\n    def __eq__(self, other):\n        return True\ndef f(x):\n    return A()\n",
    "always-equal int": "class A(int):\n    def __eq__(self, other):\n        return True\ndef f(x):\n    return A(0)\n",
    "redefine check": "def check(candidate):\n    pass\ndef f(x):\n    return 0\n",
    "atexit hides a failure": "import atexit, os\natexit.register(lambda: os._exit(0))\ndef f(x):\n    return 0\n",
    "deep recursion": "import sys\nsys.setrecursionlimit(10**7)\ndef f(x):\n    return f(x + 1) + 1\n",
    "thread prints PASS": ("import threading\ndef spam():\n    while True:\n        print('PASS')\n"
                           "threading.Thread(target=spam, daemon=True).start()\ndef f(x):\n    return 0\n"),
    "search memory for the tests": MEMORY_CHEAT,
    "sleep forever": "import time\ntime.sleep(1000)\n",
    "ignore signals": ("import signal\nfor s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):\n"
                       "    signal.signal(s, signal.SIG_IGN)\nwhile True:\n    pass\n"),
}
NEEDS_LAYERS = {"delete the parent's files", "write outside the folder", "remove the parent folder",
                "read the trainer's environment", "ask the network", "fork bomb", "subprocess"}


@linux_only
@pytest.mark.parametrize("name", sorted(HOSTILE))
@pytest.mark.parametrize("tests", [F_TESTS, F_CHECK], ids=["asserts", "check"])
def test_hostile_program_scores_zero(name, tests, arena):
    info = sandbox.sandbox_info()
    if name in NEEDS_LAYERS and not (info["landlock"] and info["seccomp"]):
        pytest.skip("this machine lacks Landlock or seccomp: see sandbox.sandbox_info()")
    program = HOSTILE[name].format(**arena)
    workers = {p.pid for p in sandbox._pool("sandbox").procs}
    t = time.perf_counter()
    r = sandbox.run_program(program, tests, timeout=1.5, memory_mb=512)
    assert r["passed"] is False, r
    assert time.perf_counter() - t < 10
    # nothing left behind: the child's session is empty
    assert r.get("pid") and _session_members(r["pid"]) == []
    # the parent's folder, environment and network are untouched, the workers are alive
    assert open(arena["victim"]).read() == "keep me"
    assert sorted(os.listdir(arena["folder"])) == ["precious.txt"]
    with pytest.raises(BlockingIOError):
        arena["server"].accept()
    assert all(p.poll() is None for p in sandbox._pool("sandbox").procs)
    if name.startswith("kill"):
        assert workers <= {p.pid for p in sandbox._pool("sandbox").procs}
    assert sandbox.run_program(GOOD, tests)["passed"] is True


@linux_only
def test_stdio_program_that_ignores_stdin_fails():
    tests = {"kind": "stdio", "cases": [{"stdin": "2\n", "stdout": "4\n"}, {"stdin": "3\n", "stdout": "9\n"}]}
    r = sandbox.run_program("print(4)\n", tests)
    assert r["passed"] is False and r["reason"] == "case 1: wrong output"
    for pid in r["pids"]:
        assert _session_members(pid) == []
    assert sandbox.run_program("n = int(input())\nprint(n * n)\n", tests)["passed"] is True


@linux_only
def test_stdio_hostile_output_and_time():
    tests = {"kind": "stdio", "cases": [{"stdin": "", "stdout": "1\n"}]}
    for prog in ("while True:\n    print('x' * 10**5)\n", "import time\ntime.sleep(100)\n", "import os\nos.fork()\nprint(1)\n"):
        r = sandbox.run_program(prog, tests, timeout=1)
        assert r["passed"] is False
        assert _session_members(r["pid"]) == []
