"""The README's promises that can rot: the reading path's line counts, and the two commands."""
import ast
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def definitions(path):
    """{qualified name: lines} of every function and class in a file (decorators included)."""
    out = {}

    def walk(node, prefix=""):
        for n in ast.iter_child_nodes(node):
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                start = min([n.lineno] + [d.lineno for d in n.decorator_list])
                out[prefix + n.name] = n.end_lineno - start + 1
                if isinstance(n, ast.ClassDef):
                    walk(n, prefix + n.name + ".")
    with open(path) as f:
        walk(ast.parse(f.read()))
    return out


def reading_path():
    """[(file, [names], stated lines)] and the stated total, from the README's table."""
    with open(os.path.join(ROOT, "README.md")) as f:
        text = f.read()
    section = text[text.index("## Reading path"):]
    section = section[:section.index("\n## ", 4)]
    rows, total = [], None
    for line in section.splitlines():
        m = re.match(r"\| \d+ \| `([\w./]+)` \| (.+) \| (\d+) \|$", line)
        if m:
            rows.append((m.group(1), re.findall(r"`([\w.]+)`", m.group(2)), int(m.group(3))))
        m = re.match(r"\| \| \| in all \| (\d+) \|$", line)
        if m:
            total = int(m.group(1))
    return rows, total, section


def test_the_reading_path_counts_are_true():
    rows, total, section = reading_path()
    assert len(rows) >= 5 and total is not None
    for file, names, stated in rows:
        defs = definitions(os.path.join(ROOT, file))
        missing = [n for n in names if n not in defs]
        assert not missing, f"{file}: the reading path names {missing}, which it does not define"
        assert sum(defs[n] for n in names) == stated, (file, {n: defs[n] for n in names})
    assert sum(r[2] for r in rows) == total
    m = re.search(r"about (\d+) lines", section)
    assert m and abs(int(m.group(1)) - total) <= 0.05 * total   # the prose's round figure


def test_the_readme_shows_the_two_commands_ci_runs():
    """The README's first two commands: install and run the main job, and run the tests; CI
    (.ci/run) installs as the first says (quietly) and runs the second as written."""
    with open(os.path.join(ROOT, "README.md")) as f:
        install_and_run, tests = re.findall(r"```bash\n(.*?)\n```", f.read(), re.S)[:2]
    with open(os.path.join(ROOT, ".ci", "run")) as f:
        ci = f.read().splitlines()
    assert install_and_run.startswith("pip install torch==2.13.0 -r requirements.txt")
    *installs, run = install_and_run.split(" && ")
    assert run == "python train.py" and tests.startswith("python -m pytest -q")
    assert [c.replace("pip install", "pip install -q", 1) for c in installs] + [tests] == ci[-len(installs) - 1:]
