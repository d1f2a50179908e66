"""The house's module graph: imports never make a circle, counted over every import a module
makes, at its top or inside a function (an import moved into a function still makes the edge);
and what the method loads: a training run, its evaluations included, imports none of the lab's
modules (run-folder analysis, plots, sweeps, studies), and the sampler's concept (rollout.py)
does not import its engine."""
import ast
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODULES = sorted(f[:-3] for f in os.listdir(ROOT) if f.endswith(".py"))


def imports_of(module: str) -> set:
    """The project modules `module` imports, anywhere in its file."""
    with open(os.path.join(ROOT, module + ".py")) as f:
        tree = ast.parse(f.read())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return (names & set(MODULES)) - {module}


def circles(graph: dict) -> list:
    """Every elementary circle's modules, found by a depth-first walk from each module (the
    graph is small)."""
    found = set()

    def walk(path):
        for nxt in graph[path[-1]]:
            if nxt == path[0]:
                found.add(tuple(sorted(path)))
            elif nxt not in path and nxt > path[0]:   # each circle once, from its smallest module
                walk(path + [nxt])
    for m in graph:
        walk([m])
    return sorted(found)


def test_no_import_circles():
    graph = {m: imports_of(m) for m in MODULES}
    found = circles(graph)
    print(f"{len(MODULES)} modules, {sum(map(len, graph.values()))} imports, {len(found)} circles")
    assert found == [], found


def test_the_circle_finder_finds_a_circle():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [("a", "b", "c")]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_nothing_imports_the_entry_points():
    for m in MODULES:
        assert not imports_of(m) & {"train", "sweep"} - {m}, m


LAB = ("analysis", "plots", "sweep", "studies")

RUN = """
import json, sys
import train
train.main(sys.argv[1:])
print(json.dumps(sorted(m for m in sys.modules if m in {lab})))
"""


def test_a_training_run_with_evaluations_loads_no_lab_module(model_dir, tmp_path):
    argv = ["--scale", model_dir, "--data", "toy_math", "--steps", "2", "--eval-every", "1", "--eval-problems", "4",
            "--problems-per-step", "2", "--group-size", "2", "--max-new-tokens", "6", "--out", str(tmp_path / "run"),
            "--quiet"]
    out = subprocess.run([sys.executable, "-c", RUN.format(lab=set(LAB)), *argv], cwd=ROOT, capture_output=True,
                         text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []
    assert len(open(tmp_path / "run" / "eval.jsonl").readlines()) == 3      # steps 0, 1 and 2 were evaluated


def test_the_sampler_concept_does_not_import_its_engine():
    """rollout.py takes its sampler as an argument; the engine imports the concept, not the reverse."""
    assert "engine" not in imports_of("rollout") and "rollout" in imports_of("engine")
