"""Sandbox: running an untrusted program against trusted tests, in helper processes the parent keeps.

The code reward runs programs written by a model that is being optimised to get reward, so this
file fails closed: a timeout, a crash, a lost helper or a malformed reply is a failed run, never
a passed one. What a reward is (which block of a completion is the program, what the two test
kinds mean) is rewards.py's; this file is how that program runs and what it cannot do.

Public API
    run_program(program, tests, *, timeout=None, memory_mb=4096) -> dict
        one sandboxed run with its details: {'passed': bool, 'reason': str, 'pid': the child's
        pid, 'log': tail of its stderr} (stdio runs add 'pids', one per case). `tests` is
        {"kind": "assert", "test": src, "entry_point": name | None} or {"kind": "stdio",
        "cases": [{"stdin": str, "stdout": str}, ...]}, as rewards.py defines them. Time
        limits: `timeout` seconds for a whole assert job (default 6), or per stdio case
        (default 3); memory: `memory_mb` of address space (default 4096, as in the paper).
    sandbox_info() -> dict      which protection layers this machine provides
    shutdown()                  stop every helper process (also done at exit)
    add_helper(kind, module_file, entry, max_procs), call_helper(kind, request, timeout) -> dict,
    helper_count(kind) -> int, serve_requests(handle, hello), HelperError
        the same pool for helpers of another kind (rewards.py runs its sympy checks so)

Helper processes and frames
    The parent keeps one pool of long-lived helper processes per kind: 'sandbox' (one worker
    per CPU core, running _sandbox_main below) and any kind declared with add_helper (a
    function of another module file, such as rewards.py's sympy checker). A helper is
    `python -I` with a scrubbed environment in its own session. It loads this file by path as
    the module `sandbox`, then its own module by path (whose `import sandbox` finds this one),
    so nothing is looked up through sys.path and no project folder is on it. Parent and helper
    talk over the helper's stdin and stdout in frames: an 8-byte big-endian length, then that
    many bytes of ASCII JSON (at most 64 MB). A helper serves one thread at a time; one that
    overruns the caller's deadline or dies is killed and started again on the next call, and a
    forked parent gets helpers of its own. A machine that cannot start a helper raises
    HelperError: a checker that cannot run must say so, not score 0.

How a program runs (and why a program cannot fake its own result)
    Each sandbox worker is a small trusted Python process (non-dumpable, a child subreaper).
    For each program the worker forks a fresh *untrusted child*, which, before running a
    single line of the program: starts a new session, asks to be SIGKILLed if the worker
    dies, moves into an empty temporary folder (deleted afterwards), keeps only its
    stdin/stdout/stderr (files, not the worker's pipes) and, for assert tests, two private
    pipes, clears the environment, sets RLIMIT_CPU/AS/FSIZE/NOFILE/NPROC/CORE, and enters
    two kernel sandboxes when the machine has them:
      - Landlock (unprivileged, Linux >= 5.13): the file system is read-only and limited to
        the Python installation and system libraries (so no /proc, no home, no project
        folder); writes only inside the temporary folder; TCP bind/connect denied (ABI >= 4);
        signals and abstract unix sockets scoped to the child (ABI >= 6);
      - seccomp: no fork/vfork/clone of processes (threads are fine), no sockets, no
        signals to other processes, no ptrace, no exec, no mount/namespace/module/clock/
        reboot-style calls, no chmod/chown/xattr, no raising of resource limits.
    The verdict never comes from the untrusted process. For assert tests the *worker* runs the
    (trusted) test code; every call of a program function is forwarded over the pipe to the
    child, and the child's answer comes back as tagged JSON that decodes only to plain values
    (None, bool, int, float, str, bytes, complex, list, tuple, dict, set, frozenset; a subclass
    such as IntEnum or a numpy scalar becomes its base value, anything else is refused; an
    exception comes back as the same builtin class, else RuntimeError). So printing "PASS",
    exiting early (sys.exit, os._exit), atexit hooks, patching builtins or AssertionError,
    replacing `check`, returning objects whose __eq__ always says True, or killing itself all
    end in a failed test. The child is forked before the worker even reads the test, and
    stdio jobs only send the worker a SHA-256 of each expected output (after the stdout
    normalisation rewards.py describes), so the child cannot find the tests or the answers in
    its memory. For stdio tests the worker compares the digest of the captured stdout. No
    secret token (nonce) is needed: the child never holds a descriptor of the worker's result
    pipe and never produces the verdict, and with Landlock it cannot reach the worker through
    /proc either. After every program the worker kills the child's process group and reaps
    anything re-parented to it; the parent restarts a worker that dies or overruns
    (timeout + 5 s), which also kills its child.

Threat model
    Protects against what a policy can stumble on or be rewarded for: infinite loops, fork
    bombs, memory bombs, huge outputs, deep recursion, early exits, faked output, patched
    builtins or checking code, always-equal objects, atexit tricks, killing or signalling the
    parent, reading the parent's environment or files, deleting or writing files outside the
    temporary folder, network access, and reading the tests. Not covered, so use a container
    or VM when programs are truly adversarial: kernel exploits; side channels and CPU/memory
    contention with the trainer; raw-memory scans of freed data from earlier jobs inside the
    worker image (no live reference to any test ever reaches a child); and, on machines without
    Landlock and seccomp (see sandbox_info(); e.g. non-Linux, old kernels, restrictive
    container profiles), everything except the resource limits, the process isolation and the
    verdict protocol. Running as root does not weaken the layers above (Landlock and seccomp
    apply to root too; the filter denies the root-only system calls), but RLIMIT_NPROC is not
    enforced for root, so there the fork ban rests on seccomp alone.

Run: `python -m pytest tests/test_sandbox.py` (the sandbox needs Linux).
"""
import atexit
import dataclasses
import hashlib
import importlib.util
import json
import math
import os
import queue
import select
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time

_SELF = os.path.abspath(__file__)

# ----------------------------------------------------------------------------------------
# Frames: what parent, helpers and children say to each other
# ----------------------------------------------------------------------------------------

_FRAME_CAP = 64 << 20
_HEADER = struct.Struct(">Q")


def _read_exact(fd: int, n: int, deadline: float | None) -> bytes:
    chunks = []
    while n > 0:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise TimeoutError("timed out")
        b = os.read(fd, min(n, 1 << 20))
        if not b:
            raise EOFError("pipe closed")
        chunks.append(b)
        n -= len(b)
    return b"".join(chunks)


def _read_frame(fd: int, deadline: float | None = None, cap: int = _FRAME_CAP):
    (n,) = _HEADER.unpack(_read_exact(fd, _HEADER.size, deadline))
    if n > cap:
        raise ValueError(f"message of {n} bytes exceeds the cap")
    return json.loads(_read_exact(fd, n, deadline))


def _write_frame(fd: int, obj, deadline: float | None = None) -> None:
    data = json.dumps(obj, ensure_ascii=True, separators=(",", ":")).encode("ascii")
    view = memoryview(_HEADER.pack(len(data)) + data)
    while view:
        if deadline is not None:  # fd is non-blocking: never wait past the deadline
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([], [fd], [], left)[1]:
                raise TimeoutError("timed out")
            try:
                n = os.write(fd, view)
            except BlockingIOError:
                continue
        else:
            n = os.write(fd, view)
        view = view[n:]


# ----------------------------------------------------------------------------------------
# Helper processes: the pools the parent keeps, and how a helper boots and serves
# ----------------------------------------------------------------------------------------


def _n_cpus() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:
        return max(1, os.cpu_count() or 1)


class HelperError(RuntimeError):
    """A helper process could not be started: the machine cannot run this checker."""


class _Pool:
    """Long-lived helper processes of one kind; each serves one thread at a time. A helper
    that overruns or dies is killed and restarted."""

    def __init__(self, kind: str, size: int, module_file: str, entry: str):
        self.kind, self.size, self.owner = kind, size, os.getpid()
        self.module_file, self.entry = module_file, entry
        self.idle = queue.Queue()
        for _ in range(size):
            self.idle.put(None)  # None: not started yet
        self.procs, self.hello, self.lock = set(), None, threading.Lock()

    def _start(self) -> subprocess.Popen:
        # registered in sys.modules before the helper's own module runs its `import sandbox`
        boot = ("import importlib.util as u, sys\n"
                f"s = u.spec_from_file_location('sandbox', {_SELF!r})\n"
                "m = sys.modules['sandbox'] = u.module_from_spec(s)\ns.loader.exec_module(m)\n"
                f"m._boot({self.module_file!r}, {self.entry!r})\n")
        env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8", "TZ": "UTC"}
        proc = subprocess.Popen([sys.executable, "-I", "-c", boot], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, env=env, cwd=tempfile.gettempdir(),
                                start_new_session=True, close_fds=True)
        try:
            hello = _read_frame(proc.stdout.fileno(), time.monotonic() + 120)
        except Exception as e:
            proc.kill()
            proc.wait()
            raise HelperError(f"sandbox: could not start a {self.kind} helper process ({e!r})") from None
        if "hello" not in hello:
            proc.kill()
            raise HelperError(f"sandbox: {self.kind} helper failed: {hello.get('error')}")
        with self.lock:
            self.procs.add(proc)
            self.hello = hello["hello"]
        return proc

    def _stop(self, proc) -> None:
        if proc is None:
            return
        try:
            proc.kill()  # its untrusted child, if any, dies with it (PR_SET_PDEATHSIG)
            proc.wait(timeout=10)
        except Exception:
            pass
        for f in (proc.stdin, proc.stdout):
            try:
                f.close()
            except Exception:
                pass
        with self.lock:
            self.procs.discard(proc)

    def call(self, frames: list, timeout: float) -> dict:
        """Send `frames`, return the reply; {'reason': ...} without 'passed'/'eq' on failure."""
        proc = self.idle.get()
        try:
            for attempt in range(2):
                if proc is None or proc.poll() is not None:
                    self._stop(proc)
                    proc = self._start()  # a machine that cannot start helpers raises
                try:
                    for f in frames:
                        _write_frame(proc.stdin.fileno(), f)
                    break
                except OSError:  # helper died between jobs: restart once and resend
                    self._stop(proc)
                    proc = None
                    if attempt:
                        return {"reason": "helper process lost"}
            try:
                return _read_frame(proc.stdout.fileno(), time.monotonic() + timeout)
            except (TimeoutError, EOFError, OSError, ValueError) as e:
                self._stop(proc)
                proc = None
                return {"reason": f"helper process overran or died ({type(e).__name__})"}
        finally:
            self.idle.put(proc)

    def close(self) -> None:
        with self.lock:
            procs = list(self.procs)
        for p in procs:
            try:
                p.stdin.close()  # EOF: the helper cleans up and exits
            except Exception:
                pass
        for p in procs:
            try:
                p.wait(timeout=2)
            except Exception:
                p.kill()
            self._stop(p)


_POOLS: dict = {}
_POOLS_LOCK = threading.Lock()


# kind -> (file of the module a helper boots, its entry point, most processes or None: one per core)
_KINDS = {"sandbox": (_SELF, "_sandbox_main", None)}


def add_helper(kind: str, module_file: str, entry: str, max_procs: int | None = None) -> None:
    """Declare a kind of helper process: `entry()` of the module at `module_file`, loaded by
    path in a fresh `python -I`, which answers requests through serve_requests(). At most
    `max_procs` run at once (default one per CPU core); none starts before the first call."""
    spec = (os.path.abspath(module_file), entry, max_procs)
    if _KINDS.setdefault(kind, spec) != spec:
        raise ValueError(f"sandbox: helper kind {kind!r} is already declared as {_KINDS[kind]}")


def call_helper(kind: str, request: dict, timeout: float) -> dict:
    """Send `request` to an idle helper of `kind`, return its reply within `timeout` seconds,
    or {'reason': ...} when the helper overran or died (it is then restarted)."""
    return _pool(kind).call([request], timeout)


def helper_count(kind: str) -> int:
    """How many helpers of `kind` run at once: the most threads worth feeding them."""
    return _pool(kind).size


def _pool(kind: str) -> _Pool:
    with _POOLS_LOCK:
        p = _POOLS.get(kind)
        if p is None or p.owner != os.getpid():  # a forked trainer gets its own helpers
            module_file, entry, most = _KINDS[kind]
            size = _n_cpus() if most is None else min(_n_cpus(), most)
            p = _POOLS[kind] = _Pool(kind, size, module_file, entry)
        return p


def shutdown() -> None:
    """Stop every helper process (they restart on the next call)."""
    with _POOLS_LOCK:
        pools = [p for p in _POOLS.values() if p.owner == os.getpid()]
        _POOLS.clear()
    for p in pools:
        p.close()


atexit.register(shutdown)


def _boot(module_file: str, entry: str) -> None:
    """The first code of every helper process, in this file loaded as `sandbox`: run `entry`
    of the module at `module_file` (this one for the sandbox workers)."""
    sys.stdout = sys.stderr  # fd 1 carries frames only; stray prints (of tests too) go to stderr
    module = sys.modules[__name__]
    if module_file != _SELF:
        spec = importlib.util.spec_from_file_location("marl_helper", module_file)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    getattr(module, entry)()


def serve_requests(handle, hello: dict) -> None:
    """The loop of a helper process: send {'hello': hello}, then answer each request frame
    on fd 0 with handle(request) on fd 1 until the parent closes the pipe."""
    _write_frame(1, {"hello": hello})
    while True:
        try:
            request = _read_frame(0)
        except EOFError:
            return
        _write_frame(1, handle(request))


# ----------------------------------------------------------------------------------------
# Values that cross the sandbox boundary: JSON with tags, decoding only to plain values
# ----------------------------------------------------------------------------------------


def _enc(x, depth: int = 0):
    if depth > 200:
        raise ValueError("value nested too deeply")
    t = type(x)
    if x is None or t in (bool, int, float, str):
        return x
    if t is list:
        return [_enc(v, depth + 1) for v in x]
    if t is tuple:
        return {"t": [_enc(v, depth + 1) for v in x]}
    if t is dict:
        return {"d": [[_enc(k, depth + 1), _enc(v, depth + 1)] for k, v in x.items()]}
    if t is set or t is frozenset:
        return {"s" if t is set else "f": [_enc(v, depth + 1) for v in x]}
    if t is bytes:
        return {"b": x.decode("latin-1")}
    if t is complex:
        return {"c": [x.real, x.imag]}
    # subclasses and look-alikes (IntEnum, Counter, numpy scalars, ...) become their base value
    for base in (bool, int, float, str, bytes, complex, tuple, list, dict, frozenset, set):
        if isinstance(x, base):
            return _enc(base(x), depth + 1)
    if hasattr(x, "item") and callable(x.item) and type(x).__module__ == "numpy":
        return _enc(x.item(), depth + 1)
    raise TypeError(f"a {t.__name__} cannot be passed between the checker and the sandbox")


def _dec(x, depth: int = 0):
    if depth > 200:
        raise ValueError("value nested too deeply")
    t = type(x)
    if x is None or t in (bool, int, float, str):
        return x
    if t is list:
        return [_dec(v, depth + 1) for v in x]
    if t is dict and len(x) == 1:
        (tag, v), = x.items()
        if tag in ("t", "s", "f") and type(v) is list:
            items = [_dec(e, depth + 1) for e in v]
            return tuple(items) if tag == "t" else set(items) if tag == "s" else frozenset(items)
        if tag == "d" and type(v) is list and all(type(p) is list and len(p) == 2 for p in v):
            return {_dec(k, depth + 1): _dec(val, depth + 1) for k, val in v}
        if tag == "b" and type(v) is str:
            return v.encode("latin-1")
        if tag == "c" and type(v) is list and len(v) == 2 and all(type(p) in (int, float) for p in v):
            return complex(v[0], v[1])
    raise ValueError("malformed value from the sandbox")


def _rebuild_exception(reply) -> Exception:
    """The program raised: re-raise as the same builtin exception type (or RuntimeError)."""
    import builtins
    name, msg = str(reply.get("raise", "Exception"))[:100], str(reply.get("msg", ""))[:300]
    cls = getattr(builtins, name, None)
    if isinstance(cls, type) and issubclass(cls, Exception):
        try:
            return cls(msg)
        except Exception:
            pass
    return RuntimeError(f"{name}: {msg}")


# ----------------------------------------------------------------------------------------
# Kernel sandbox layers (Linux): Landlock and seccomp through ctypes
# ----------------------------------------------------------------------------------------

_PR_SET_PDEATHSIG, _PR_SET_DUMPABLE, _PR_SET_SECCOMP = 1, 4, 22
_PR_SET_CHILD_SUBREAPER, _PR_SET_NO_NEW_PRIVS = 36, 38
_LIBC = None


def _libc():
    global _LIBC
    if _LIBC is None:
        import ctypes
        _LIBC = ctypes.CDLL(None, use_errno=True)
    return _LIBC


def _prctl(option: int, arg: int = 0) -> int:
    import ctypes
    return _libc().prctl(ctypes.c_int(option), ctypes.c_ulong(arg), ctypes.c_ulong(0),
                         ctypes.c_ulong(0), ctypes.c_ulong(0))


def _syscall(nr: int, *args) -> int:
    import ctypes
    r = _libc().syscall(ctypes.c_long(nr), *args)
    if r < 0:
        raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
    return r


# system call numbers (x86_64, aarch64); None where the architecture lacks the call
_NR = {
    "fork": (57, None), "vfork": (58, None), "clone": (56, 220), "clone3": (435, 435),
    "socket": (41, 198), "socketpair": (53, 199), "kill": (62, 129), "tkill": (200, 130),
    "tgkill": (234, 131), "rt_sigqueueinfo": (129, 138), "rt_tgsigqueueinfo": (297, 240),
    "ptrace": (101, 117), "process_vm_readv": (310, 270), "process_vm_writev": (311, 271),
    "pidfd_open": (434, 434), "pidfd_send_signal": (424, 424), "pidfd_getfd": (438, 438),
    "unshare": (272, 97), "setns": (308, 268), "mount": (165, 40), "umount2": (166, 39),
    "pivot_root": (155, 41), "chroot": (161, 51), "io_uring_setup": (425, 425),
    "io_uring_enter": (426, 426), "io_uring_register": (427, 427), "bpf": (321, 280),
    "perf_event_open": (298, 241), "userfaultfd": (323, 282), "keyctl": (250, 219),
    "add_key": (248, 217), "request_key": (249, 218), "kexec_load": (246, 104),
    "kexec_file_load": (320, 294), "init_module": (175, 105), "finit_module": (313, 273),
    "delete_module": (176, 106), "reboot": (169, 142), "swapon": (167, 224), "swapoff": (168, 225),
    "acct": (163, 89), "settimeofday": (164, 170), "clock_settime": (227, 112),
    "clock_adjtime": (305, 266), "adjtimex": (159, 171), "sethostname": (170, 161),
    "setdomainname": (171, 162), "iopl": (172, None), "ioperm": (173, None), "syslog": (103, 116),
    "quotactl": (179, 60), "open_by_handle_at": (304, 265), "name_to_handle_at": (303, 264),
    "setrlimit": (160, 164), "prlimit64": (302, 261), "capset": (126, 91), "mknod": (133, None),
    "mknodat": (259, 33), "execve": (59, 221), "execveat": (322, 281), "chmod": (90, None),
    "fchmod": (91, 52), "fchmodat": (268, 53), "fchmodat2": (452, 452), "chown": (92, None),
    "fchown": (93, 55), "lchown": (94, None), "fchownat": (260, 54), "setxattr": (188, 5),
    "lsetxattr": (189, 6), "fsetxattr": (190, 7), "removexattr": (197, 14),
    "lremovexattr": (198, 15), "fremovexattr": (199, 16), "fanotify_init": (300, 262),
    "vhangup": (153, 58), "mount_setattr": (442, 442), "move_mount": (429, 429),
    "open_tree": (428, 428), "fsopen": (430, 430), "fsconfig": (431, 431), "fsmount": (432, 432),
    "fspick": (433, 433), "kcmp": (312, 272), "process_madvise": (440, 440),
}
_ARCHES = {"x86_64": (0, 0xC000003E), "aarch64": (1, 0xC00000B7)}
_DENY_EPERM = ["fork", "vfork", "ptrace", "process_vm_readv", "process_vm_writev", "pidfd_open",
               "pidfd_send_signal", "pidfd_getfd", "tkill", "unshare", "setns", "mount", "umount2",
               "pivot_root", "chroot", "io_uring_setup", "io_uring_enter", "io_uring_register", "bpf",
               "perf_event_open", "userfaultfd", "keyctl", "add_key", "request_key", "kexec_load",
               "kexec_file_load", "init_module", "finit_module", "delete_module", "reboot", "swapon",
               "swapoff", "acct", "settimeofday", "clock_settime", "clock_adjtime", "adjtimex",
               "sethostname", "setdomainname", "iopl", "ioperm", "syslog", "quotactl",
               "open_by_handle_at", "name_to_handle_at", "setrlimit", "capset", "mknod", "mknodat",
               "execve", "execveat", "chmod", "fchmod", "fchmodat", "fchmodat2", "chown", "fchown",
               "lchown", "fchownat", "setxattr", "lsetxattr", "fsetxattr", "removexattr",
               "lremovexattr", "fremovexattr", "fanotify_init", "vhangup", "mount_setattr",
               "move_mount", "open_tree", "fsopen", "fsconfig", "fsmount", "fspick", "kcmp",
               "process_madvise"]


def _seccomp_program(arch: str, mypid: int) -> bytes:
    """A classic-BPF seccomp filter, default allow, denying what the module docstring lists."""
    col, audit = _ARCHES[arch]
    nr = {k: v[col] for k, v in _NR.items() if v[col] is not None}
    LD, JEQ, JGE, JSET, RET = 0x20, 0x15, 0x35, 0x45, 0x06
    ALLOW, KILL = 0x7FFF0000, 0x80000000

    def err(e):
        return 0x00050000 | e

    p = [(LD, 0, 0, 4), (JEQ, 1, 0, audit), (RET, 0, 0, KILL), (LD, 0, 0, 0)]  # arch, then nr
    if arch == "x86_64":
        p += [(JGE, 0, 1, 0x40000000), (RET, 0, 0, KILL)]  # x32 system calls
    for name in _DENY_EPERM:
        if name in nr:
            p += [(JEQ, 0, 1, nr[name]), (RET, 0, 0, err(1))]
    p += [(JEQ, 0, 1, nr["socket"]), (RET, 0, 0, err(13)), (JEQ, 0, 1, nr["socketpair"]), (RET, 0, 0, err(13))]
    p += [(JEQ, 0, 1, nr["clone3"]), (RET, 0, 0, err(38))]  # ENOSYS: libc falls back to clone
    arg0, me, neg = 16, mypid & 0xFFFFFFFF, (-mypid) & 0xFFFFFFFF
    blocks = [
        (nr["clone"], [(LD, 0, 0, arg0), (JSET, 0, 1, 0x00010000), (RET, 0, 0, ALLOW), (RET, 0, 0, err(1))]),
        (nr["prlimit64"], [(LD, 0, 0, 32), (JEQ, 0, 3, 0), (LD, 0, 0, 36), (JEQ, 0, 1, 0),
                           (RET, 0, 0, ALLOW), (RET, 0, 0, err(1))]),  # reading limits only
    ]
    for name in ("kill", "rt_sigqueueinfo"):  # only to itself or its own group
        blocks.append((nr[name], [(LD, 0, 0, arg0), (JEQ, 3, 0, me), (JEQ, 2, 0, 0), (JEQ, 1, 0, neg),
                                  (RET, 0, 0, err(1)), (RET, 0, 0, ALLOW)]))
    for name in ("tgkill", "rt_tgsigqueueinfo"):
        blocks.append((nr[name], [(LD, 0, 0, arg0), (JEQ, 1, 0, me), (RET, 0, 0, err(1)), (RET, 0, 0, ALLOW)]))
    for number, body in blocks:
        p += [(JEQ, 0, len(body), number)] + body
    p += [(RET, 0, 0, ALLOW)]
    return b"".join(struct.pack("=HBBI", *ins) for ins in p)


_FPROG = None


def _fprog_type():
    """ctypes struct sock_fprog {unsigned short len; struct sock_filter *filter;}."""
    global _FPROG
    if _FPROG is None:
        import ctypes

        class _FProg(ctypes.Structure):
            _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]
        _FPROG = _FProg
    return _FPROG


def _install_seccomp(arch: str) -> None:
    import ctypes
    prog = _seccomp_program(arch, os.getpid())
    buf = ctypes.create_string_buffer(prog, len(prog))
    fprog = _fprog_type()(len(prog) // 8, ctypes.cast(buf, ctypes.c_void_p))
    if _prctl(_PR_SET_NO_NEW_PRIVS, 1) != 0:
        raise OSError("PR_SET_NO_NEW_PRIVS failed")
    r = _libc().prctl(ctypes.c_int(_PR_SET_SECCOMP), ctypes.c_ulong(2), ctypes.byref(fprog),
                      ctypes.c_ulong(0), ctypes.c_ulong(0))
    if r != 0:
        raise OSError(ctypes.get_errno(), "seccomp filter refused")


def _landlock_abi() -> int:
    import ctypes
    try:  # landlock_create_ruleset(NULL, 0, LANDLOCK_CREATE_RULESET_VERSION)
        return _syscall(444, None, ctypes.c_size_t(0), ctypes.c_uint32(1))
    except OSError:
        return 0


def _landlock_read_paths() -> list[str]:
    paths = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix,
             "/usr", "/lib", "/lib64", "/lib32", "/bin"}
    paths.update(p for p in sys.path if p)
    return sorted(p for p in paths if os.path.isdir(p))


def _install_landlock(abi: int, work: str) -> None:
    import ctypes
    fs_all = (1 << 13) - 1
    if abi >= 2:
        fs_all |= 1 << 13  # REFER
    if abi >= 3:
        fs_all |= 1 << 14  # TRUNCATE
    if abi >= 5:
        fs_all |= 1 << 15  # IOCTL_DEV
    read = (1 << 0) | (1 << 2) | (1 << 3)  # EXECUTE, READ_FILE, READ_DIR
    file_rw = (1 << 1) | (1 << 2) | (fs_all & ((1 << 14) | (1 << 15)))
    no_devices = fs_all & ~((1 << 6) | (1 << 11))  # never MAKE_CHAR / MAKE_BLOCK
    attr = struct.pack("=QQQ", fs_all, 0b11 if abi >= 4 else 0, 0b11 if abi >= 6 else 0)
    size = 8 if abi < 4 else 16 if abi < 6 else 24
    abuf = ctypes.create_string_buffer(attr, 24)
    rfd = _syscall(444, abuf, ctypes.c_size_t(size), ctypes.c_uint32(0))
    try:
        rules = [(p, read) for p in _landlock_read_paths()]
        rules += [(p, file_rw) for p in ("/dev/null", "/dev/zero", "/dev/urandom", "/dev/random")]
        rules += [(work, no_devices)]
        for path, access in rules:
            try:
                fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
            except OSError:
                continue
            try:
                rule = ctypes.create_string_buffer(struct.pack("=Qi", access, fd), 12)
                _syscall(445, ctypes.c_int(rfd), ctypes.c_int(1), rule, ctypes.c_uint32(0))
            finally:
                os.close(fd)
        if _prctl(_PR_SET_NO_NEW_PRIVS, 1) != 0:
            raise OSError("PR_SET_NO_NEW_PRIVS failed")
        _syscall(446, ctypes.c_int(rfd), ctypes.c_uint32(0))
    finally:
        os.close(rfd)


# ----------------------------------------------------------------------------------------
# The sandbox worker (trusted) and its untrusted children
# ----------------------------------------------------------------------------------------

_SETUP_FAILED = 120  # exit code of a child whose sandbox could not be set up
_LOG_TAIL = 2000


def _sandbox_main() -> None:
    """Entry point of a sandbox worker process: runs jobs from the parent until EOF."""
    sys.set_int_max_str_digits(100_000)  # big ints may cross the pipe, but not slow-to-parse ones
    import ctypes, fcntl, io, platform, resource, traceback  # noqa: F401,E401  import once, not per child
    _fprog_type()
    try:
        _prctl(_PR_SET_DUMPABLE, 0)  # no same-user ptrace or /proc/<pid>/mem of the worker
        _prctl(_PR_SET_CHILD_SUBREAPER, 1)  # orphans of a child come back to us, to be killed
    except OSError:
        pass
    base = tempfile.mkdtemp(prefix="marl-sandbox-")
    arch = platform.machine()
    feats = {"pid": os.getpid(), "arch": arch, "root": os.geteuid() == 0,
             "landlock": _landlock_abi(), "seccomp": arch in _ARCHES, "nproc": _nproc_limit()}
    feats.update(_probe(base, feats))
    try:
        serve_requests(lambda job: _run_job(job, base, feats), feats)
    finally:
        shutil.rmtree(base, ignore_errors=True)


def _run_job(job: dict, base: str, feats: dict) -> dict:
    try:
        if job.get("op") == "assert":
            return _job_assert(job, base, feats)
        if job.get("op") == "stdio":
            return _job_stdio(job, base, feats)
        return {"passed": False, "reason": "unknown job"}
    except Exception as e:  # a worker bug: fail this job, keep serving
        return {"passed": False, "reason": f"worker error: {type(e).__name__}: {e}"}


def _nproc_limit() -> int:
    """RLIMIT_NPROC counts every process of the user, so allow what exists now plus 64."""
    uid, n = os.getuid(), 0
    try:
        for d in os.listdir("/proc"):
            if d.isdigit():
                try:
                    if os.stat(f"/proc/{d}").st_uid == uid:
                        n += 1
                except OSError:
                    pass
    except OSError:
        return 4096
    return n + 64


def _probe(base: str, feats: dict) -> dict:
    """Fork once to learn which layers really work here (a container may refuse them)."""
    want_ll, want_sc = feats["landlock"] > 0, feats["seccomp"]
    work = tempfile.mkdtemp(dir=base)
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            if want_ll:
                try:
                    _install_landlock(feats["landlock"], work)
                    code |= 1
                except OSError:
                    pass
            if want_sc:
                try:
                    _install_seccomp(feats["arch"])
                    try:
                        os.fork()
                        os._exit(code)  # fork still works: the filter is not effective
                    except OSError:
                        code |= 2
                except OSError:
                    pass
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    shutil.rmtree(work, ignore_errors=True)
    code = os.waitstatus_to_exitcode(status)
    code = code if code >= 0 else 0
    return {"landlock": feats["landlock"] if code & 1 else 0, "seccomp": bool(code & 2)}


def _enter_child(work: str, fds: list, feats: dict, job: dict, wpid: int) -> None:
    """In a freshly forked child: confine it. Any failure exits with _SETUP_FAILED."""
    import fcntl
    import resource
    os.setsid()
    _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != wpid:  # the worker died before the line above: nobody would kill us
        os._exit(_SETUP_FAILED)
    os.chdir(work)
    high = [fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 100) for fd in fds]
    for i, fd in enumerate(high):
        os.dup2(fd, i)
    os.closerange(len(fds), resource.getrlimit(resource.RLIMIT_NOFILE)[0])  # the copies too
    os.environ.clear()
    os.environ.update({"PATH": "/usr/bin:/bin", "HOME": work, "TMPDIR": work, "LANG": "C.UTF-8", "TZ": "UTC"})
    tempfile.tempdir = work  # the worker's cached choice would point outside the sandbox
    _set_limits(job, feats)
    if feats["landlock"]:
        _install_landlock(feats["landlock"], work)
    if feats["seccomp"]:  # last: from here on limits cannot be raised and nothing can fork
        _install_seccomp(feats["arch"])
    _own_stdio()


def _set_limits(job: dict, feats: dict) -> None:
    import resource
    cpu = int(math.ceil(job["timeout"])) + 1
    mem = int(job["memory_mb"]) << 20
    for res, val in ((resource.RLIMIT_CPU, cpu), (resource.RLIMIT_AS, mem),
                     (resource.RLIMIT_FSIZE, int(job["out_cap"])), (resource.RLIMIT_NOFILE, 64),
                     (resource.RLIMIT_NPROC, feats["nproc"]), (resource.RLIMIT_CORE, 0)):
        hard = resource.getrlimit(res)[1]
        val = val if hard == resource.RLIM_INFINITY else min(val, hard)
        resource.setrlimit(res, (val, val))


def _own_stdio() -> None:
    """Python's streams on the child's fds 0-2 (the inherited objects wrap the worker's)."""
    import io
    sys.stdin = sys.__stdin__ = io.open(0, "r", encoding="utf-8", errors="replace", closefd=False)
    sys.stdout = sys.__stdout__ = io.open(1, "w", encoding="utf-8", closefd=False)
    sys.stderr = sys.__stderr__ = io.open(2, "w", encoding="utf-8", errors="backslashreplace",
                                          closefd=False, buffering=1)
    sys.argv = ["solution.py"]


def _child_run_main(program: str) -> None:
    """Untrusted: run the program as __main__ (stdio tests), then exit. Never returns."""
    out, err, status = sys.stdout, sys.stderr, 0
    try:
        exec(compile(program, "solution.py", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
    except SystemExit as e:
        status = 0 if e.code in (None, 0) else 1
    except BaseException:
        import traceback
        traceback.print_exc()
        status = 1
    for f in (out, err):
        try:
            f.flush()
        except BaseException:
            status = 1
    os._exit(status)


def _child_serve(program: str) -> None:
    """Untrusted: load the program, report its callables on fd 4, then answer calls from fd 3."""
    ns = {"__name__": "solution", "__builtins__": __builtins__}
    try:
        exec(compile(program, "solution.py", "exec"), ns)
        names = [k for k, v in list(ns.items()) if type(k) is str and not k.startswith("__") and callable(v)]
        _write_frame(4, {"loaded": names[:5000]})
    except BaseException as e:
        try:
            _write_frame(4, {"error": f"{type(e).__name__}: {e}"[:300]})
        finally:
            os._exit(1)
    while True:
        try:
            req = _read_frame(3)
        except BaseException:
            os._exit(0)
        try:
            result = ns[req["call"]](*_dec(req["args"]), **_dec(req["kwargs"]))
            out = {"ok": _enc(result)}
        except BaseException as e:
            try:
                out = {"raise": type(e).__name__, "msg": str(e)[:300]}
            except BaseException:
                out = {"raise": "Exception", "msg": ""}
        try:
            _write_frame(4, out)
        except BaseException:
            os._exit(1)


def _fork_child(work: str, fds: list, feats: dict, job: dict, serve: bool) -> int:
    wpid = os.getpid()
    pid = os.fork()
    if pid == 0:  # the child: never returns into worker code
        try:
            _enter_child(work, fds, feats, job, wpid)
        except BaseException as e:
            try:  # to the log when fd 2 is already the child's, else to the worker's stderr
                os.write(2, f"sandbox setup failed: {type(e).__name__}: {e}\n".encode())
            finally:
                os._exit(_SETUP_FAILED)
        try:
            if serve:
                _child_serve(job["program"])
            else:
                _child_run_main(job["program"])
        finally:
            os._exit(1)
    return pid


def _kill_and_reap(pid: int) -> None:
    """Kill the child's process group, reap it, then anything re-parented to the worker."""
    _kill(pid)
    try:
        os.waitpid(pid, 0)
    except ChildProcessError:
        pass
    for _ in range(200):  # normally nothing is left: seccomp forbids forking
        try:
            wpid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if wpid == 0:
            for child in _children_of(os.getpid()):
                _kill(child)
            time.sleep(0.01)


def _kill(pid: int) -> None:
    """SIGKILL the process group led by `pid`, then `pid` itself (it may have left the group)."""
    for kill in (lambda: os.killpg(pid, signal.SIGKILL), lambda: os.kill(pid, signal.SIGKILL)):
        try:
            kill()
        except OSError:
            pass


def _children_of(ppid: int) -> list[int]:
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                if int(fields[1]) == ppid:
                    out.append(int(d))
            except (OSError, IndexError, ValueError):
                pass
    return out


def _wait_exit(pid: int, deadline: float):
    """Exit status of child `pid`, or None if it is still running at `deadline`."""
    try:
        pfd = os.pidfd_open(pid)
    except (AttributeError, OSError):
        pfd = None
    try:
        while True:
            wpid, status = os.waitpid(pid, os.WNOHANG)
            if wpid == pid:
                return status
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            if pfd is not None:
                select.select([pfd], [], [], left)
            else:
                time.sleep(min(left, 0.002))
    finally:
        if pfd is not None:
            os.close(pfd)


def _tail(fd: int) -> str:
    try:
        size = os.fstat(fd).st_size
        return os.pread(fd, _LOG_TAIL, max(0, size - _LOG_TAIL)).decode("utf-8", "replace")
    except OSError:
        return ""


def _new_job_dir(base: str) -> tuple[str, str]:
    d = tempfile.mkdtemp(dir=base)
    work = os.path.join(d, "work")  # the child's empty working folder
    os.mkdir(work, 0o700)
    return d, work


def _remove_dir(d: str) -> None:
    def fix(func, path, _):  # a child may have removed permissions on its own files
        try:
            os.chmod(os.path.dirname(path), 0o700)
            os.chmod(path, 0o700)
            func(path)
        except OSError:
            pass
    shutil.rmtree(d, onerror=fix)


# ----------------------------------------------------------------------------------------
# The two jobs a worker runs: assert tests and stdio cases
# ----------------------------------------------------------------------------------------


class _Fail(Exception):
    pass


@dataclasses.dataclass
class _Server:
    """An untrusted child that has loaded the program and answers calls of its functions,
    with the worker's ends of its pipes."""
    pid: int
    calls_w: int  # requests to the child (non-blocking)
    replies_r: int  # the child's answers
    log: int  # the child's stdout and stderr
    jdir: str  # its job folder, removed afterwards
    calls: int = 0  # how many calls the test made


def _job_assert(job: dict, base: str, feats: dict) -> dict:
    """Run the trusted test here, each call of a program function a round trip to the child."""
    child, test = _fork_server(job, base, feats)
    deadline = time.monotonic() + float(job["timeout"])
    passed, reason = False, ""
    try:
        hello = _read_frame(child.replies_r, deadline, cap=1 << 20)
        cap = int(job["out_cap"]) * 16
        _run_test(test, hello, lambda name: _proxy(name, child, deadline, cap))
        if child.calls == 0:
            raise _Fail("the test never called the program")
        passed = True
    except BaseException as e:  # whatever the test or the program raised fails the job
        reason = _failure_reason(e)
    finally:
        tail = _stop_server(child)
    return {"passed": passed, "reason": reason[:500], "pid": child.pid, "log": tail}


def _fork_server(job: dict, base: str, feats: dict) -> tuple[_Server, dict]:
    """Fork the child that serves the program, then read the test frame: forking first keeps
    the test out of the child's memory."""
    jdir, work = _new_job_dir(base)
    req_r, req_w = os.pipe()
    resp_r, resp_w = os.pipe()
    log = os.open(os.path.join(jdir, "log"), os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    null = os.open(os.devnull, os.O_RDONLY)
    pid = None
    try:
        pid = _fork_child(work, [null, log, log, req_r, resp_w], feats, job, serve=True)
    finally:
        test = _read_frame(0)  # always consume the second frame, even if the fork failed
        for fd in (req_r, resp_w, null):
            os.close(fd)
        if pid is None:
            for fd in (req_w, resp_r, log):
                os.close(fd)
            _remove_dir(jdir)
    os.set_blocking(req_w, False)
    return _Server(pid, req_w, resp_r, log, jdir), test


def _proxy(name: str, child: _Server, deadline: float, cap: int):
    """A stand-in for the program's function `name` that forwards each call to the child."""
    def call(*args, **kwargs):
        child.calls += 1
        _write_frame(child.calls_w, {"call": name, "args": _enc(list(args)), "kwargs": _enc(kwargs)}, deadline)
        reply = _read_frame(child.replies_r, deadline, cap=cap)
        if type(reply) is dict and "ok" in reply:
            return _dec(reply["ok"])
        if type(reply) is dict and "raise" in reply:
            raise _rebuild_exception(reply)
        raise ValueError("malformed reply from the sandbox")
    call.__name__ = call.__qualname__ = name
    return call


def _run_test(test: dict, hello, proxy) -> None:
    """Run the trusted test code against proxies of the functions the program loaded."""
    names = hello.get("loaded") if type(hello) is dict else None
    if type(names) is not list or not all(type(n) is str for n in names):
        raise _Fail(f"program failed to load: {str(hello.get('error') if type(hello) is dict else '')[:300]}")
    entry = test.get("entry_point")
    if entry and entry not in names:
        raise _Fail(f"the program does not define {entry}")
    g = {"__name__": "__check__"}
    g.update({n: proxy(n) for n in names})
    exec(compile(test["test"], "test.py", "exec"), g)
    if entry and callable(g.get("check")):
        g[entry] = proxy(entry)  # the test may also call the function by name (HumanEval/33)
        g["check"](g[entry])


def _failure_reason(e: BaseException) -> str:
    if isinstance(e, _Fail):
        return str(e)
    if isinstance(e, TimeoutError):
        return "timeout"
    if isinstance(e, (EOFError, BrokenPipeError)):
        return "the program exited or crashed"
    if isinstance(e, AssertionError):
        return f"assertion failed {e}".strip()
    return f"{type(e).__name__}: {e}"[:500]


def _stop_server(child: _Server) -> str:
    """Kill the child and clean up; returns the tail of its log."""
    os.close(child.calls_w)
    _kill_and_reap(child.pid)
    os.close(child.replies_r)
    tail = _tail(child.log)
    os.close(child.log)
    _remove_dir(child.jdir)
    return tail


def _normalize_stdout(s: str) -> str:
    lines = [line.rstrip() for line in s.replace("\r\n", "\n").split("\n")]
    while lines and not lines[-1]:
        lines.pop()
    return "\n".join(lines)


def _digest(s: str) -> str:
    return hashlib.sha256(_normalize_stdout(s).encode("utf-8", "surrogatepass")).hexdigest()


def _job_stdio(job: dict, base: str, feats: dict) -> dict:
    """Run the program once per case, as __main__ with that stdin; stop at the first failure."""
    pids = []
    for k, case in enumerate(job["cases"]):
        pid, status, out, err = _run_case(job, case, base, feats)
        pids.append(pid)
        fail = _case_failure(status, out, case)
        if fail:
            return {"passed": False, "reason": f"case {k}: {fail}", "pid": pid, "pids": pids, "log": err}
    return {"passed": bool(job["cases"]), "reason": "" if job["cases"] else "no cases", "pid": pids[-1] if pids else None,
            "pids": pids, "log": ""}


def _run_case(job: dict, case: dict, base: str, feats: dict) -> tuple[int, int | None, bytes, str]:
    """(child pid, its exit status or None on timeout, its stdout up to cap + 1 bytes, stderr tail)."""
    jdir, work = _new_job_dir(base)
    inp = os.path.join(jdir, "stdin")
    with open(inp, "w", encoding="utf-8", errors="surrogatepass") as f:
        f.write(case["stdin"])
    fin = os.open(inp, os.O_RDONLY)
    fout = os.open(os.path.join(jdir, "stdout"), os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    ferr = os.open(os.path.join(jdir, "stderr"), os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    cap = int(case["cap"])
    try:
        pid = _fork_child(work, [fin, fout, ferr], feats, dict(job, out_cap=cap), serve=False)
        os.close(fin)
        status = _wait_exit(pid, time.monotonic() + float(job["timeout"]))
        _kill_and_reap(pid)
        out = os.pread(fout, cap + 1, 0)  # one byte more than allowed tells "too long"
        err = _tail(ferr)
    finally:
        os.close(fout)
        os.close(ferr)
        _remove_dir(jdir)
    return pid, status, out, err


def _case_failure(status: int | None, out: bytes, case: dict) -> str | None:
    if status is None:
        return "timeout"
    if os.waitstatus_to_exitcode(status) == _SETUP_FAILED:
        return "sandbox setup failed"
    if os.waitstatus_to_exitcode(status) != 0:
        return f"exit status {os.waitstatus_to_exitcode(status)}"
    if len(out) > int(case["cap"]):
        return "output too long"
    if _digest(out.decode("utf-8", "replace")) != case["digest"]:
        return "wrong output"
    return None


# ----------------------------------------------------------------------------------------
# Parent side: one sandboxed run
# ----------------------------------------------------------------------------------------

_ASSERT_TIMEOUT, _STDIO_TIMEOUT, _GRACE = 6.0, 3.0, 5.0
_MAX_PROGRAM = 1 << 20


def run_program(program: str, tests: dict, *, timeout: float | None = None, memory_mb: int = 4096) -> dict:
    """Run `program` against `tests` on a sandbox worker; returns {'passed': bool, 'reason': str,
    'pid': child pid, 'log': tail of the child's stderr, ...}."""
    if not isinstance(program, str) or not program.strip():
        return {"passed": False, "reason": "no program"}
    if len(program) > _MAX_PROGRAM:
        return {"passed": False, "reason": "program too long"}
    if sys.platform != "linux":
        raise RuntimeError("sandbox: running a program needs Linux (fork, prctl, /proc)")
    kind = tests.get("kind") if isinstance(tests, dict) else None
    if kind == "assert":
        t = float(timeout or _ASSERT_TIMEOUT)
        frames = [{"op": "assert", "program": program, "timeout": t, "memory_mb": memory_mb, "out_cap": 1 << 20},
                  {"test": tests["test"], "entry_point": tests.get("entry_point")}]
        wait = t + _GRACE
    elif kind == "stdio":
        t = float(timeout or _STDIO_TIMEOUT)
        cases = [{"stdin": c["stdin"], "digest": _digest(c["stdout"]), "cap": 2 * len(c["stdout"]) + (64 << 10)}
                 for c in tests["cases"]]
        frames = [{"op": "stdio", "program": program, "timeout": t, "memory_mb": memory_mb, "cases": cases}]
        wait = (t + 0.5) * max(1, len(cases)) + _GRACE
    else:
        raise ValueError(f"unknown tests kind {kind!r} (expected 'assert' or 'stdio')")
    reply = _pool("sandbox").call(frames, wait)
    reply.setdefault("passed", False)
    return reply


def sandbox_info() -> dict:
    """Protection layers of this machine: {'landlock': ABI or 0, 'seccomp': bool, 'root': ...}."""
    pool = _pool("sandbox")
    if pool.hello is None:
        run_program("def f():\n    return 1\n", {"kind": "assert", "test": "assert f() == 1", "entry_point": "f"})
    return dict(pool.hello)
