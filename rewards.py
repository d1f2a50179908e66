"""Rewards: answer extraction and checking for math, code extraction and sandboxed execution.

The reward is the only signal training learns from, and the code reward runs programs written
by a model that is being optimised to get reward. So both checkers fail closed: anything odd
(no answer, a parse failure, a timeout, a crash, a lost helper process) scores 0.

Public API (all rewards are 1.0 or 0.0)
    last_boxed(text) -> str | None          content of the last \\boxed{...} / \\fbox{...}
    last_code_block(text) -> str | None     the last ```python (or untagged) fenced block
    math_reward(text, gold) -> float
    code_reward(text, tests, *, timeout=None, memory_mb=4096) -> float
    score(texts, problems, task, *, timeout=None, memory_mb=4096) -> list[float]
        the batch entry point training calls once per step ("math" or "code")
    run_program(program, tests, *, timeout=None, memory_mb=4096) -> dict
        one sandboxed run with its details: passed, reason, pid, log (debugging and tests)
    sandbox_info() -> dict                  which protection layers this machine provides
    shutdown()                              stop the helper processes (also done at exit)

Math
    The last box of `text` is compared with `gold` (a GSM8K-style "... #### 18" gold is
    understood; a gold that holds a \\boxed{} is unboxed first). Both sides are normalised:
    `$`, `\\text{}`-style wrappers, `\\left`/`\\right`, thin spaces, degree signs, a trailing
    unit word after a number ("5 cm", "5\\text{ cm}"), "x =" prefixes, thousands separators
    ("1,000", "1{,}000", "1 000"), `\\dfrac`/`\\tfrac` and `\\frac12` shorthands. Then:
    equal strings -> 1; two plain numbers (integers, decimals, a/b, \\frac{a}{b}) -> exact
    rational comparison, a percent sign meaning either v or v/100 ("50\\%" = 50 = 0.5);
    tuples, intervals (bracket types must match), sets (any order) and bare lists are compared
    element by element; anything else is translated to a whitelisted sympy expression and
    `simplify(a - b) == 0` (or a relative difference under 1e-9 for constants) decides.
    Decimals are exact rationals, so 0.333 != 1/3 and 3.14 != pi. Sympy runs in helper
    processes with a 5 s bound per check (killed and restarted past it), so a pathological
    answer (huge exponents, deep nesting) costs at most that and never blocks a thread;
    answers over 1,000 characters are only compared as strings.

Code
    The last fenced python block (```python, ```py, ```python3 or an untagged fence) is the
    program. `tests` is one of two kinds:
      {"kind": "assert", "test": src, "entry_point": name | None}
          HumanEval / MBPP style. `src` either defines check(candidate), which is called with
          the program's function `entry_point` (that name also means the program's function
          while check runs), or is a list of top-level asserts that call the program's
          functions by name (every function the program defines is visible to `src`). The
          test must call the program at least once, and `entry_point` must be defined. The
          test code is trusted (it comes from the data set): it runs in the sandbox worker.
      {"kind": "stdio", "cases": [{"stdin": str, "stdout": str}, ...]}
          DeepCoder / LiveCodeBench / APPS style. The program runs once per case as __main__
          with that stdin; its stdout must equal the expected one after stripping trailing
          whitespace on every line and trailing blank lines; a crash or non-zero exit fails.
    Time limits: `timeout` seconds for a whole assert job (default 6), or per stdio case
    (default 3); memory: `memory_mb` of address space (default 4096, as in the paper).

How a program runs (and why a program cannot fake its own result)
    The parent keeps one long-lived *sandbox worker* per CPU core: a small trusted Python
    process (`python -I`, scrubbed environment, its own session, non-dumpable, a child
    subreaper). For each program the worker forks a fresh *untrusted child*, which, before
    running a single line of the program: starts a new session, asks to be SIGKILLed if the
    worker dies, moves into an empty temporary folder (deleted afterwards), keeps only its
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
    child, and the child's answer comes back as JSON that decodes only to plain values (None,
    bool, int, float, str, bytes, complex, list, tuple, dict, set, frozenset). So printing
    "PASS", exiting early (sys.exit, os._exit), atexit hooks, patching builtins or
    AssertionError, replacing `check`, returning objects whose __eq__ always says True, or
    killing itself all end in a failed test. The child is forked before the worker even
    reads the test, and stdio jobs only send the worker a SHA-256 of each expected output, so
    the child cannot find the tests or the answers in its memory. For stdio tests the worker
    compares the captured stdout. No secret token (nonce) is needed: the child never holds a
    descriptor of the worker's result pipe and never produces the verdict, and with Landlock
    it cannot reach the worker through /proc either. After every program the worker kills
    the child's process group and reaps anything re-parented to it; the parent restarts a
    worker that dies or overruns (timeout + 5 s), which also kills its child.

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

Run: `python -m pytest tests/test_rewards.py` (the sandbox needs Linux); `python bench/rewards.py`.
"""
import atexit
import concurrent.futures
import functools
import hashlib
import json
import math
import os
import queue
import re
import select
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
from fractions import Fraction

# ----------------------------------------------------------------------------------------
# Extraction
# ----------------------------------------------------------------------------------------

_BOX_OPEN = re.compile(r"\\(?:boxed|fbox)\s*\{")
_BRACE = re.compile(r"[{}]")


def _matching_braces(text: str, start: int = 0) -> dict:
    """Map the index of every '{' (from `start` on) to the index of its '}'; one linear pass."""
    close, stack = {}, []
    for m in _BRACE.finditer(text, start):
        if m.group() == "{":
            stack.append(m.start())
        elif stack:
            close[stack.pop()] = m.start()
    return close


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (or ``\\fbox{...}``) in ``text``, nested braces
    handled; ``None`` when there is no complete box. Linear in len(text): every brace is
    matched once, so a megabyte of unclosed boxes costs milliseconds."""
    if not isinstance(text, str):
        return None
    openers = [m.end() - 1 for m in _BOX_OPEN.finditer(text)]  # index of each box's '{'
    if not openers:
        return None
    close = _matching_braces(text, openers[0])
    for i in reversed(openers):  # the last box that is closed wins
        j = close.get(i)
        if j is not None:
            return text[i + 1 : j]
    return None


_FENCE_OPEN = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[ \t]*\n")
_PY_TAGS = ("", "python", "py", "python3")


def last_code_block(text: str) -> str | None:
    """The last fenced code block tagged python/py/python3 or untagged; ``None`` if none.
    A fence opens with ``` (optional tag) and a newline and closes at the next ```; the scan
    is linear, so unclosed fences cannot make it quadratic."""
    if not isinstance(text, str):
        return None
    found, pos = None, 0
    while True:
        m = _FENCE_OPEN.search(text, pos)
        if m is None:
            break
        end = text.find("```", m.end())
        if end < 0:  # no closing fence anywhere after: no later block can close either
            break
        if m.group(1).lower() in _PY_TAGS:
            found = (m.end(), end)
        pos = end + 3
    return None if found is None else text[found[0] : found[1]]


# ----------------------------------------------------------------------------------------
# Math: normalisation and comparison
# ----------------------------------------------------------------------------------------

_MAX_ANSWER = 1000  # longer answers: string comparison only
_MAX_SYMBOLIC = 300  # longer expressions never reach sympy
_SYMPY_TIMEOUT = 5.0

_TEXT_CMD = re.compile(r"\\(?:text|textbf|textit|textrm|textnormal|mathrm|mathbf|mathit|mbox|operatorname)\s*\{")
_DROP = [
    "\\left", "\\right", "\\bigl", "\\bigr", "\\Bigl", "\\Bigr", "\\big", "\\Big",
    "\\displaystyle", "\\!", "\\,", "\\;", "\\:", "\\ ", "~", "$",
    "^{\\circ}", "^\\circ", "{}^\\circ", "\\circ", "\\degree", "°",
]
_UNICODE = {"−": "-", "–": "-", "×": "\\times ", "·": "\\cdot ", "π": "\\pi ", "∞": "\\infty ",
            "√": "\\sqrt", "≤": "\\le ", "≥": "\\ge "}
_NUMBER = re.compile(r"^[-+]?(?:\d+(?:\.\d*)?|\.\d+)$")
_FRAC_NUM = re.compile(r"^([-+]?)\\frac\{([-+]?(?:\d+(?:\.\d+)?))\}\{([-+]?(?:\d+(?:\.\d+)?))\}$")
_SLASH_NUM = re.compile(r"^([-+]?(?:\d+(?:\.\d+)?))/([-+]?(?:\d+(?:\.\d+)?))$")
_THOUSANDS = re.compile(r"^[-+]?\d{1,3}(?:,\d{3})+(?:\.\d+)?$")
_THOUSANDS_SP = re.compile(r"^[-+]?\d{1,3}(?: \d{3})+(?:\.\d+)?$")
_UNIT_TAIL = re.compile(r"^([-+]?(?:\d[\d,]*(?:\.\d+)?|\.\d+)|[-+]?\\frac\{[^{}]*\}\{[^{}]*\})"
                        r"\s+[A-Za-z]{2,}\.?(?:[\s/]+[A-Za-z]+\.?)*(?:\^\{?\d\}?)?$")
_LHS = re.compile(r"^(?:[A-Za-z](?:_\{?[A-Za-z0-9]+\}?)?|\\[A-Za-z]+)\s*=(?!=)")


def _unwrap_text(s: str) -> str:
    """\\text{abc} -> ' abc ' (spaces keep '5\\text{cm}' apart as '5 cm'); bounded loop."""
    for _ in range(50):
        m = _TEXT_CMD.search(s)
        if m is None:
            break
        j = _matching_braces(s, m.end() - 1).get(m.end() - 1)
        if j is None:
            break
        s = s[: m.start()] + " " + s[m.end() : j] + " " + s[j + 1 :]
    return s


def _normalize_answer(s) -> tuple[str, bool]:
    """Canonical string of an answer and whether it carried a percent sign."""
    if not isinstance(s, str):
        return "", False
    s = s.strip()
    if len(s) > _MAX_ANSWER:  # no work on pathological input; compared as a string only
        return s, False
    for k, v in _UNICODE.items():
        s = s.replace(k, v)
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac").replace("{,}", ",")
    s = s.replace("\\$", "").replace("\\{", "\\lbrace ").replace("\\}", "\\rbrace ")
    s = _unwrap_text(s)
    for d in _DROP:
        s = s.replace(d, " " if d in ("\\ ", "~") else "")
    s = s.replace("\\lbrace", "\\{").replace("\\rbrace", "\\}")
    pct = False
    for p in ("\\%", "%"):
        if s.rstrip().endswith(p):
            s, pct = s.rstrip()[: -len(p)], True
    s = s.strip().rstrip(".").strip()
    if len(re.findall(r"(?<![<>!=])=(?!=)", s)) == 1 and _LHS.match(s):
        s = s.split("=", 1)[1].strip()  # "x = 5" -> "5"
    m = _UNIT_TAIL.match(s)
    if m:
        s = m.group(1)
    if _THOUSANDS_SP.match(s):
        s = s.replace(" ", "")
    s = re.sub(r"\s+", "", s)
    if _THOUSANDS.match(s):
        s = s.replace(",", "")
    # latex shorthands: \frac12, \frac1{2}, \frac{1}2, \sqrt2
    s = re.sub(r"\\frac(\d)(\d)", r"\\frac{\1}{\2}", s)
    s = re.sub(r"\\frac(\d)\{", r"\\frac{\1}{", s)
    s = re.sub(r"\\frac\{([^{}]*)\}(\d)", r"\\frac{\1}{\2}", s)
    s = re.sub(r"\\sqrt(\d)", r"\\sqrt{\1}", s)
    if re.fullmatch(r"\(([A-Za-z])\)", s):  # multiple choice "(C)" -> "C"
        s = s[1]
    return s, pct


def _as_number(s: str):
    """Exact value of a plain number (int, decimal, a/b, \\frac{a}{b}) or None."""
    if len(s) > 80:
        return None
    try:
        if _NUMBER.match(s):
            return Fraction(s)
        m = _FRAC_NUM.match(s) or _SLASH_NUM.match(s)
        if m:
            sign, a, b = m.groups() if len(m.groups()) == 3 else ("",) + m.groups()
            v = Fraction(a) / Fraction(b)
            return -v if sign == "-" else v
    except (ValueError, ZeroDivisionError):
        pass
    return None


def _split_top(s: str, sep: str = ",") -> list[str]:
    """Split on `sep` outside any brackets."""
    parts, depth, cur = [], 0, []
    i = 0
    while i < len(s):
        c = s[i]
        if s.startswith("\\{", i) or s.startswith("\\}", i):
            depth += 1 if s[i + 1] == "{" else -1
            cur.append(s[i : i + 2])
            i += 2
            continue
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
        if c == sep and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(c)
        i += 1
    parts.append("".join(cur))
    return parts


def _structure(s: str):
    """(kind, elements) for a set, tuple/interval or bare list; None for a single value."""
    if s.startswith("\\{") and s.endswith("\\}"):
        return "set", _split_top(s[2:-2])
    if len(s) >= 2 and s[0] in "([" and s[-1] in ")]" and _wrapped(s):
        parts = _split_top(s[1:-1])
        if len(parts) > 1:
            return s[0] + s[-1], parts
    parts = _split_top(s)
    if len(parts) > 1:
        return "list", parts
    return None


def _wrapped(s: str) -> bool:
    """True if the first bracket of `s` closes at its last character ("(1,2)" but not "(1)+(2)")."""
    depth = 0
    for i, c in enumerate(s):
        depth += 1 if c in "([{" else -1 if c in ")]}" else 0
        if depth == 0 and i < len(s) - 1:
            return False
    return depth == 0


def _answers_equal(answer: str, gold: str) -> bool:
    a, a_pct = _normalize_answer(answer)
    g, g_pct = _normalize_answer(gold)
    if not a or not g:
        return False
    if a == g:
        return True
    if len(a) > _MAX_ANSWER or len(g) > _MAX_ANSWER:
        return False
    if a.isalpha() and g.isalpha():  # words, e.g. "Monday"
        return a.lower() == g.lower()
    sa, sg = _structure(a), _structure(g)
    if sa is not None or sg is not None:
        if sa is None or sg is None or len(sa[1]) != len(sg[1]):
            return False
        kinds = {sa[0], sg[0]}
        if len(kinds) == 2 and "list" not in kinds:  # "(0,1]" != "[0,1]"; a bare list matches any
            return False
        if "set" in kinds:  # any order: greedy one-to-one matching
            left = list(sg[1])
            for x in sa[1]:
                hit = next((k for k, y in enumerate(left) if _leaf_equal(x, y)), None)
                if hit is None:
                    return False
                left.pop(hit)
            return True
        return all(_leaf_equal(x, y) for x, y in zip(sa[1], sg[1]))
    return _leaf_equal(a, g, a_pct, g_pct)


def _leaf_equal(x: str, y: str, x_pct: bool = False, y_pct: bool = False) -> bool:
    if x == y:
        return True
    nx, ny = _as_number(x), _as_number(y)
    if nx is not None and ny is not None:
        xs = {nx, nx / 100} if x_pct else {nx}
        ys = {ny, ny / 100} if y_pct else {ny}
        return bool(xs & ys)
    ex, ey = _to_sympy_syntax(x), _to_sympy_syntax(y)
    if ex is None or ey is None:
        return False
    return ex == ey or _sympy_equal(ex, ey)


# LaTeX -> a small, whitelisted sympy syntax. Only these identifiers (plus single letters)
# can ever reach sympy's parser, which evaluates its input: no quotes, no underscores, no
# attribute access, so no way to name a Python builtin.
_FUNCS = {"sqrt", "pi", "oo", "log", "sin", "cos", "tan", "cot", "sec", "csc", "asin", "acos",
          "atan", "sinh", "cosh", "tanh", "exp"}
_LATEX_WORDS = {"\\pi": " pi ", "\\infty": " oo ", "\\infin": " oo ", "\\cdot": "*", "\\times": "*",
                "\\div": "/", "\\ln": " log ", "\\log": " log ", "\\exp": " exp ", "\\sin": " sin ",
                "\\cos": " cos ", "\\tan": " tan ", "\\cot": " cot ", "\\sec": " sec ", "\\csc": " csc ",
                "\\arcsin": " asin ", "\\arccos": " acos ", "\\arctan": " atan ", "\\sinh": " sinh ",
                "\\cosh": " cosh ", "\\tanh": " tanh "}
_TOKEN = re.compile(r"\\[A-Za-z]+|\\.|\d+(?:\.\d+)?|[A-Za-z]+|\S")
_SAFE_EXPR = re.compile(r"^[0-9A-Za-z+\-*/() .]+$")


class _Unsupported(Exception):
    pass


def _to_sympy_syntax(s: str) -> str | None:
    if len(s) > _MAX_SYMBOLIC:
        return None
    toks = _TOKEN.findall(s)
    try:
        text, pos = _conv_seq(toks, 0, None)
    except (_Unsupported, IndexError, RecursionError):
        return None
    if pos != len(toks):
        return None
    # split unknown letter runs into single-letter products ("xy" -> "x*y")
    text = re.sub(r"[A-Za-z]+", lambda m: m.group() if m.group() in _FUNCS else "*".join(m.group()), text)
    text = re.sub(r"\s+", " ", text).strip()
    if not text or not _SAFE_EXPR.match(text) or re.search(r"(?<!\d)\.|\.(?!\d)", text):
        return None
    return text


def _conv_arg(toks, pos):
    if toks[pos] == "{":
        inner, pos = _conv_seq(toks, pos + 1, "}")
        return inner, pos
    inner, _ = _conv_seq([toks[pos]], 0, None)
    return inner, pos + 1


def _conv_seq(toks, pos, closer):
    out = []
    while pos < len(toks):
        t = toks[pos]
        if t == closer:
            return "".join(out), pos + 1
        if t == "{":
            inner, pos = _conv_seq(toks, pos + 1, "}")
            out.append("(" + inner + ")")
        elif t == "\\frac":
            a, pos = _conv_arg(toks, pos + 1)
            b, pos = _conv_arg(toks, pos)
            out.append(f"(({a})/({b}))")
        elif t == "\\sqrt":
            if toks[pos + 1] == "[":
                n, pos = _conv_seq(toks, pos + 2, "]")
                a, pos = _conv_arg(toks, pos)
                out.append(f"(({a})**(1/({n})))")
            else:
                a, pos = _conv_arg(toks, pos + 1)
                out.append(f" sqrt({a})")
        elif t == "^":
            e, pos = _conv_arg(toks, pos + 1)
            out.append(f"**({e})")
        elif t in _LATEX_WORDS:
            out.append(_LATEX_WORDS[t])
            pos += 1
        elif t.startswith("\\") or t in ("}", "]"):
            raise _Unsupported(t)
        elif t in "()+-*/" or t[0].isdigit() or t[0].isalpha():
            out.append(t)
            pos += 1
        else:
            raise _Unsupported(t)
    if closer is not None:
        raise _Unsupported("unbalanced")
    return "".join(out), pos


def math_reward(text: str, gold: str) -> float:
    """1.0 if the last \\boxed{} of `text` equals `gold` (see the module docstring), else 0.0."""
    return _math_verdict(last_boxed(text), gold)


def _math_verdict(answer: str | None, gold: str) -> float:
    if answer is None or not isinstance(gold, str):
        return 0.0
    if "\\boxed" in gold or "\\fbox" in gold:
        gold = last_boxed(gold) or gold
    if "####" in gold:
        gold = gold.rsplit("####", 1)[1]
    try:
        return 1.0 if _answers_equal(answer, gold) else 0.0
    except HelperError:  # a machine that cannot run the checker must say so, not score 0
        raise
    except Exception:  # a checker bug must not crash training: fail closed
        return 0.0


@functools.lru_cache(maxsize=65536)
def _sympy_equal(a: str, b: str) -> bool:
    reply = _pool("sympy").call([{"a": a, "b": b}], _SYMPY_TIMEOUT)
    return reply.get("eq") is True


def _sympy_check(a: str, b: str) -> bool:
    """Runs inside a sympy helper process."""
    import sympy
    from sympy.parsing.sympy_parser import (convert_xor, implicit_multiplication_application,
                                            parse_expr, rationalize, standard_transformations)
    names = {c: sympy.Symbol(c) for c in "abcdfghjklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"}
    names.update(e=sympy.E, i=sympy.I, pi=sympy.pi, oo=sympy.oo, sqrt=sympy.sqrt, log=sympy.log,
                 exp=sympy.exp, sin=sympy.sin, cos=sympy.cos, tan=sympy.tan, cot=sympy.cot,
                 sec=sympy.sec, csc=sympy.csc, asin=sympy.asin, acos=sympy.acos, atan=sympy.atan,
                 sinh=sympy.sinh, cosh=sympy.cosh, tanh=sympy.tanh)
    tr = standard_transformations + (implicit_multiplication_application, convert_xor, rationalize)

    def parse(s):
        raw = parse_expr(s, local_dict=dict(names), transformations=tr, evaluate=False)
        for node in sympy.preorder_traversal(raw):  # refuse huge powers before evaluating
            if node.is_Pow:
                e = node.exp
                if e.is_Number and abs(e) > 1000:
                    raise ValueError("huge exponent")
                # a tower like 2^(10^10); a division (x**-1) or a root (x**(1/2)) is fine
                if any(n.is_Pow and n.exp.is_Number and n.exp > 1 for n in sympy.preorder_traversal(e)):
                    raise ValueError("power tower")
        return parse_expr(s, local_dict=dict(names), transformations=tr, evaluate=True)

    x, y = parse(a), parse(b)
    if x == y:
        return True
    d = sympy.simplify(x - y)
    if d == 0:
        return True
    if not d.free_symbols:
        try:
            scale = max(1.0, abs(complex(sympy.N(y, 30))))
            return abs(complex(sympy.N(d, 30))) < 1e-9 * scale
        except (TypeError, ValueError):
            return False
    return False


# ----------------------------------------------------------------------------------------
# Helper processes: framing and the pool the parent keeps
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


def _n_cpus() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:
        return max(1, os.cpu_count() or 1)


class HelperError(RuntimeError):
    """A helper process could not be started: the machine cannot run this checker."""


class _Pool:
    """Long-lived helper processes of one kind ('sandbox' or 'sympy'); each serves one
    thread at a time. A helper that overruns or dies is killed and restarted."""

    def __init__(self, kind: str, size: int):
        self.kind, self.size, self.owner = kind, size, os.getpid()
        self.idle = queue.Queue()
        for _ in range(size):
            self.idle.put(None)  # None: not started yet
        self.procs, self.hello, self.lock = set(), None, threading.Lock()

    def _start(self) -> subprocess.Popen:
        boot = ("import importlib.util as u\n"
                f"s = u.spec_from_file_location('marl_rewards_helper', {os.path.abspath(__file__)!r})\n"
                "m = u.module_from_spec(s)\ns.loader.exec_module(m)\n"
                f"m._{self.kind}_main()\n")
        env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8", "TZ": "UTC"}
        proc = subprocess.Popen([sys.executable, "-I", "-c", boot], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, env=env, cwd=tempfile.gettempdir(),
                                start_new_session=True, close_fds=True)
        try:
            hello = _read_frame(proc.stdout.fileno(), time.monotonic() + 120)
        except Exception as e:
            proc.kill()
            proc.wait()
            raise HelperError(f"rewards: could not start a {self.kind} helper process ({e!r})") from None
        if "hello" not in hello:
            proc.kill()
            raise HelperError(f"rewards: {self.kind} helper failed: {hello.get('error')}")
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


def _pool(kind: str) -> _Pool:
    with _POOLS_LOCK:
        p = _POOLS.get(kind)
        if p is None or p.owner != os.getpid():  # a forked trainer gets its own helpers
            size = _n_cpus() if kind == "sandbox" else min(_n_cpus(), 4)
            p = _POOLS[kind] = _Pool(kind, size)
        return p


def shutdown() -> None:
    """Stop every helper process (they restart on the next call)."""
    with _POOLS_LOCK:
        pools = [p for p in _POOLS.values() if p.owner == os.getpid()]
        _POOLS.clear()
    for p in pools:
        p.close()


atexit.register(shutdown)


def _sympy_main() -> None:
    """Entry point of a sympy helper process: answers {'a','b'} -> {'eq'} until EOF."""
    import resource
    sys.stdout = sys.stderr  # fd 1 carries frames only
    resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))
    import sympy  # noqa: F401  (warm the import before saying hello)
    _write_frame(1, {"hello": {"pid": os.getpid()}})
    while True:
        try:
            req = _read_frame(0)
        except EOFError:
            return
        try:
            eq = bool(_sympy_check(str(req["a"]), str(req["b"])))
        except Exception:
            eq = False
        _write_frame(1, {"eq": eq})


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
    sys.stdout = sys.stderr  # fd 1 carries frames only; stray prints of tests go to stderr
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
    _write_frame(1, {"hello": feats})
    try:
        while True:
            try:
                job = _read_frame(0)
            except EOFError:
                return
            try:
                if job.get("op") == "assert":
                    reply = _job_assert(job, base, feats)
                elif job.get("op") == "stdio":
                    reply = _job_stdio(job, base, feats)
                else:
                    reply = {"passed": False, "reason": "unknown job"}
            except Exception as e:  # a worker bug: fail this job, keep serving
                reply = {"passed": False, "reason": f"worker error: {type(e).__name__}: {e}"}
            _write_frame(1, reply)
    finally:
        shutil.rmtree(base, ignore_errors=True)


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
    import io
    import resource
    os.setsid()
    _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != wpid:
        os._exit(_SETUP_FAILED)
    os.chdir(work)
    high = [fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 100) for fd in fds]
    for i, fd in enumerate(high):
        os.dup2(fd, i)
    os.closerange(len(fds), resource.getrlimit(resource.RLIMIT_NOFILE)[0])  # the copies too
    os.environ.clear()
    os.environ.update({"PATH": "/usr/bin:/bin", "HOME": work, "TMPDIR": work, "LANG": "C.UTF-8", "TZ": "UTC"})
    tempfile.tempdir = work  # the worker's cached choice would point outside the sandbox
    cpu = int(math.ceil(job["timeout"])) + 1
    mem = int(job["memory_mb"]) << 20
    for res, val in ((resource.RLIMIT_CPU, cpu), (resource.RLIMIT_AS, mem),
                     (resource.RLIMIT_FSIZE, int(job["out_cap"])), (resource.RLIMIT_NOFILE, 64),
                     (resource.RLIMIT_NPROC, feats["nproc"]), (resource.RLIMIT_CORE, 0)):
        hard = resource.getrlimit(res)[1]
        val = val if hard == resource.RLIM_INFINITY else min(val, hard)
        resource.setrlimit(res, (val, val))
    if feats["landlock"]:
        _install_landlock(feats["landlock"], work)
    if feats["seccomp"]:  # last: from here on limits cannot be raised and nothing can fork
        _install_seccomp(feats["arch"])
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
    for kill in (lambda: os.killpg(pid, signal.SIGKILL), lambda: os.kill(pid, signal.SIGKILL)):
        try:
            kill()
        except OSError:
            pass
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
                for kill in (lambda: os.killpg(child, signal.SIGKILL), lambda: os.kill(child, signal.SIGKILL)):
                    try:
                        kill()
                    except OSError:
                        pass
            time.sleep(0.01)


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


def _job_assert(job: dict, base: str, feats: dict) -> dict:
    jdir, work = _new_job_dir(base)
    req_r, req_w = os.pipe()
    resp_r, resp_w = os.pipe()
    log = os.open(os.path.join(jdir, "log"), os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    null = os.open(os.devnull, os.O_RDONLY)
    pid = None
    try:
        # fork before reading the test: the child's memory never holds it
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
    deadline = time.monotonic() + float(job["timeout"])
    calls, passed, reason = [0], False, ""

    def proxy(name):
        def call(*args, **kwargs):
            calls[0] += 1
            _write_frame(req_w, {"call": name, "args": _enc(list(args)), "kwargs": _enc(kwargs)}, deadline)
            reply = _read_frame(resp_r, deadline, cap=int(job["out_cap"]) * 16)
            if type(reply) is dict and "ok" in reply:
                return _dec(reply["ok"])
            if type(reply) is dict and "raise" in reply:
                raise _rebuild_exception(reply)
            raise ValueError("malformed reply from the sandbox")
        call.__name__ = call.__qualname__ = name
        return call

    try:
        hello = _read_frame(resp_r, deadline, cap=1 << 20)
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
        if calls[0] == 0:
            raise _Fail("the test never called the program")
        passed = True
    except _Fail as e:
        reason = str(e)
    except TimeoutError:
        reason = "timeout"
    except (EOFError, BrokenPipeError):
        reason = "the program exited or crashed"
    except AssertionError as e:
        reason = f"assertion failed {e}".strip()
    except BaseException as e:
        reason = f"{type(e).__name__}: {e}"[:500]
    finally:
        os.close(req_w)
        _kill_and_reap(pid)
        os.close(resp_r)
        tail = _tail(log)
        os.close(log)
        _remove_dir(jdir)
    return {"passed": passed, "reason": reason[:500], "pid": pid, "log": tail}


class _Fail(Exception):
    pass


def _normalize_stdout(s: str) -> str:
    lines = [line.rstrip() for line in s.replace("\r\n", "\n").split("\n")]
    while lines and not lines[-1]:
        lines.pop()
    return "\n".join(lines)


def _digest(s: str) -> str:
    return hashlib.sha256(_normalize_stdout(s).encode("utf-8", "surrogatepass")).hexdigest()


def _job_stdio(job: dict, base: str, feats: dict) -> dict:
    pids = []
    for k, case in enumerate(job["cases"]):
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
            pids.append(pid)
            os.close(fin)
            status = _wait_exit(pid, time.monotonic() + float(job["timeout"]))
            _kill_and_reap(pid)
            out = os.pread(fout, cap + 1, 0)
            err = _tail(ferr)
        finally:
            os.close(fout)
            os.close(ferr)
            _remove_dir(jdir)
        fail = None
        if status is None:
            fail = "timeout"
        elif os.waitstatus_to_exitcode(status) == _SETUP_FAILED:
            fail = "sandbox setup failed"
        elif os.waitstatus_to_exitcode(status) != 0:
            fail = f"exit status {os.waitstatus_to_exitcode(status)}"
        elif len(out) > cap:
            fail = "output too long"
        elif _digest(out.decode("utf-8", "replace")) != case["digest"]:
            fail = "wrong output"
        if fail:
            return {"passed": False, "reason": f"case {k}: {fail}", "pid": pid, "pids": pids, "log": err}
    return {"passed": bool(job["cases"]), "reason": "" if job["cases"] else "no cases", "pid": pids[-1] if pids else None,
            "pids": pids, "log": ""}


# ----------------------------------------------------------------------------------------
# Code reward: parent side
# ----------------------------------------------------------------------------------------

_ASSERT_TIMEOUT, _STDIO_TIMEOUT, _GRACE = 6.0, 3.0, 5.0
_MAX_PROGRAM = 1 << 20


def run_program(program: str, tests: dict, *, timeout: float | None = None, memory_mb: int = 4096) -> dict:
    """Run `program` against `tests` in the sandbox; returns {'passed': bool, 'reason': str,
    'pid': child pid, 'log': tail of the child's stderr, ...}."""
    if not isinstance(program, str) or not program.strip():
        return {"passed": False, "reason": "no program"}
    if len(program) > _MAX_PROGRAM:
        return {"passed": False, "reason": "program too long"}
    if sys.platform != "linux":
        raise RuntimeError("rewards: the code sandbox needs Linux (fork, prctl, /proc)")
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


def code_reward(text: str, tests: dict, *, timeout: float | None = None, memory_mb: int = 4096) -> float:
    """1.0 if the last python block of `text` passes every test (see the module docstring)."""
    program = last_code_block(text)
    if program is None:
        return 0.0
    return 1.0 if run_program(program, tests, timeout=timeout, memory_mb=memory_mb)["passed"] is True else 0.0


def sandbox_info() -> dict:
    """Protection layers of this machine: {'landlock': ABI or 0, 'seccomp': bool, 'root': ...}."""
    pool = _pool("sandbox")
    if pool.hello is None:
        run_program("def f():\n    return 1\n", {"kind": "assert", "test": "assert f() == 1", "entry_point": "f"})
    return dict(pool.hello)


def score(texts: list, problems: list, task: str, *, timeout: float | None = None,
          memory_mb: int = 4096) -> list[float]:
    """Rewards of a batch: texts[i] graded against problems[i] ('answer' for math, 'tests'
    for code). Identical (answer, gold) or (program, tests) pairs are checked once; code runs
    on one sandbox worker per core in parallel; math runs in this process, sympy checks in
    helper processes."""
    if len(texts) != len(problems):
        raise ValueError(f"score: {len(texts)} texts for {len(problems)} problems")
    if task == "math":
        keys = [(last_boxed(t), p.get("answer")) for t, p in zip(texts, problems)]

        def check(key):
            return _math_verdict(*key)
    elif task == "code":
        keys = [(last_code_block(t), json.dumps(p.get("tests"), sort_keys=True)) for t, p in zip(texts, problems)]

        def check(key):
            prog, tests = key
            if prog is None:
                return 0.0
            return 1.0 if run_program(prog, json.loads(tests), timeout=timeout, memory_mb=memory_mb)["passed"] is True else 0.0
    else:
        raise ValueError(f"score: unknown task {task!r} (expected 'math' or 'code')")
    unique = list(dict.fromkeys(keys))
    if task == "math" and not any(k[0] is not None and _needs_sympy(*k) for k in unique):
        results = [check(k) for k in unique]  # all fast paths: threads would only add overhead
    else:
        workers = _pool("sandbox" if task == "code" else "sympy").size
        with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as ex:
            results = list(ex.map(check, unique))
    verdict = dict(zip(unique, results))
    return [verdict[k] for k in keys]


def _needs_sympy(box: str, gold) -> bool:
    """Cheap guess whether checking this pair may need sympy (only decides threading)."""
    if not isinstance(gold, str):
        return False
    g = gold.rsplit("####", 1)[1] if "####" in gold else gold
    a, _ = _normalize_answer(box)
    g, _ = _normalize_answer(g)
    return a != g and (_as_number(a) is None or _as_number(g) is None)
