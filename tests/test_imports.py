"""The house's module graph: imports never make a circle, counted over every import a module
makes, at its top or inside a function (an import moved into a function still makes the edge)."""
import ast
import os

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
