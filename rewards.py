"""Rewards: answer extraction and checking for math, code extraction and the two kinds of code test.

The reward is the only signal training learns from, and the code reward runs programs written
by a model that is being optimised to get reward. So both checkers fail closed: anything odd
(no answer, a parse failure, a timeout, a crash, a lost helper process) scores 0.

Public API (all rewards are 1.0 or 0.0)
    last_boxed(text) -> str | None          content of the last \\boxed{...} / \\fbox{...}
    last_code_block(text) -> str | None     the last ```python (or untagged) fenced block
    math_reward(text, gold) -> float
    last_number(text) -> Fraction | None    the value of the last number written in the text
    number_reward(text, gold) -> float      the text's last number equals gold (the arith kind)
    code_reward(text, tests, *, timeout=None, memory_mb=4096) -> float
    needs_sympy(answer, gold) -> bool       whether checking a pair may need sympy (a cheap guess)
The batch entry point training calls, taskkinds.score, grades each task kind with its reward;
math, code and arith are registered there with math_reward, code_reward and number_reward.

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
    processes (sandbox.py's pool, booting this file's _sympy_main) with a 5 s bound per check
    (killed and restarted past it) and 2 GB of address space, so a pathological answer (huge
    exponents, deep nesting) costs at most that and never blocks a thread; answers over 1,000
    characters are only compared as strings.

Arithmetic (number_reward)
    The last number written anywhere in the text is the answer, as a reader takes "8 + 9 = 17.
    The answer is 17." to answer 17: an integer or a decimal, with thousands separators
    ("1,234"), negative when a minus sign stands before it and not after a word or a digit ("5-3"
    holds 5 and 3). It must equal `gold` exactly (rationals); no number scores 0, and so does a
    text whose last number is not its answer ("17, I think, or 2").

Code
    The last fenced python block (```python, ```py, ```python3 or an untagged fence) is the
    program. `tests` is one of two kinds:
      {"kind": "assert", "test": src, "entry_point": name | None}
          HumanEval / MBPP style. `src` either defines check(candidate), which is called with
          the program's function `entry_point` (that name also means the program's function
          while check runs), or is a list of top-level asserts that call the program's
          functions by name (every function the program defines is visible to `src`). The
          test must call the program at least once, and `entry_point` must be defined. The
          test code is trusted (it comes from the data set): it runs in the sandbox worker,
          and each call of a program function is forwarded to the untrusted program.
      {"kind": "stdio", "cases": [{"stdin": str, "stdout": str}, ...]}
          DeepCoder / LiveCodeBench / APPS style. The program runs once per case as __main__
          with that stdin; its stdout must equal the expected one after stripping trailing
          whitespace on every line and trailing blank lines; a crash or non-zero exit fails.
    sandbox.run_program runs the program against them (how, under which time and memory
    limits, and what a program cannot do: see sandbox.py); passed is 1, anything else 0.

Run: `python -m pytest tests/test_rewards.py` (code tests need Linux); `python bench/rewards.py`.
"""
import functools
import os
import re
from fractions import Fraction

import sandbox

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
    except sandbox.HelperError:  # a machine that cannot run the checker must say so, not score 0
        raise
    except Exception:  # a checker bug must not crash training: fail closed
        return 0.0


# ----------------------------------------------------------------------------------------
# Math: symbolic equivalence, decided by sympy in helper processes
# ----------------------------------------------------------------------------------------

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


@functools.lru_cache(maxsize=65536)
def _sympy_equal(a: str, b: str) -> bool:
    reply = sandbox.call_helper("sympy", {"a": a, "b": b}, _SYMPY_TIMEOUT)
    return reply.get("eq") is True


def _sympy_check(a: str, b: str) -> bool:
    """Runs inside a sympy helper process (see _sympy_main)."""
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


# sympy evaluates what it parses and may take unbounded time or memory, so it runs in helper
# processes of sandbox.py's pool: the check and the helpers' entry point stay in this file
sandbox.add_helper("sympy", __file__, "_sympy_main", max_procs=4)


def _sympy_main() -> None:
    """Entry point of a sympy helper process: answers {'a', 'b'} with {'eq'} until EOF."""
    import resource
    resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))
    import sympy  # noqa: F401  (warm the import before saying hello)
    sandbox.serve_requests(_sympy_request, {"pid": os.getpid()})


def _sympy_request(req) -> dict:
    try:
        eq = bool(_sympy_check(str(req["a"]), str(req["b"])))
    except Exception:
        eq = False
    return {"eq": eq}


# ----------------------------------------------------------------------------------------
# Arithmetic: the last number
# ----------------------------------------------------------------------------------------

# a minus sign belongs to the number unless a word character or a closing bracket stands before
# it ("5-3", "x-1", "(2)-1" are subtractions); "1,234" is one number, "1, 234" two
_LAST_NUMBER = re.compile(r"(?:(?<![\w)\]])-)?(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?")


def last_number(text: str) -> Fraction | None:
    """The value of the last number in `text` (module docstring), exactly; None when it has none."""
    if not isinstance(text, str):
        return None
    last = None
    for last in _LAST_NUMBER.finditer(text):
        pass
    return None if last is None else Fraction(last.group().replace(",", ""))


def number_reward(text: str, gold: str) -> float:
    """1.0 when the last number of `text` equals the number `gold`, else 0.0."""
    value = last_number(text)
    return float(value is not None and value == Fraction(str(gold).strip()))


# ----------------------------------------------------------------------------------------
# Code
# ----------------------------------------------------------------------------------------


def code_reward(text: str, tests: dict, *, timeout: float | None = None, memory_mb: int = 4096) -> float:
    """1.0 if the last python block of `text` passes every test (see the module docstring)."""
    return _code_verdict(last_code_block(text), tests, timeout, memory_mb)


def _code_verdict(program: str | None, tests: dict, timeout: float | None, memory_mb: int) -> float:
    if program is None:
        return 0.0
    return 1.0 if sandbox.run_program(program, tests, timeout=timeout, memory_mb=memory_mb)["passed"] is True else 0.0


def needs_sympy(box: str, gold) -> bool:
    """Cheap guess whether checking this pair may need sympy (only decides threading)."""
    if not isinstance(gold, str):
        return False
    g = gold.rsplit("####", 1)[1] if "####" in gold else gold
    a, _ = _normalize_answer(box)
    g, _ = _normalize_answer(g)
    return a != g and (_as_number(a) is None or _as_number(g) is None)
