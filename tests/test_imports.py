"""No import cycles between the files of loom (imports inside functions count): each module can be
read, tested and moved knowing only what it imports. The package layers and the independence of
the parallel dimensions are contracts of ``.importlinter`` (``lint-imports``); this test is finer,
file by file, through the graph import-linter builds (grimp)."""

from __future__ import annotations

import grimp


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, children = work[-1]
            w = next(children, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                component = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    component.append(w)
                    if w == v:
                        break
                if len(component) > 1:
                    out.append(sorted(component))
    return sorted(out)


def test_cycles_finds_a_cycle_and_only_it():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set(), "f": {"f"}}
    assert _cycles(graph) == [["a", "b", "c"]]


def test_no_import_cycles_between_the_files_of_loom():
    g = grimp.build_graph("loom", cache_dir=None)
    graph = {m: set(g.find_modules_directly_imported_by(m)) for m in g.modules}
    cycles = _cycles(graph)
    lines = []
    for component in cycles:
        members = set(component)
        lines.append(" <-> ".join(component))
        for m in component:
            for t in sorted(graph[m] & members):
                at = sorted(d["line_number"] for d in g.get_import_details(importer=m, imported=t))
                lines.append(f"    {m} -> {t} (line {', '.join(map(str, at))})")
    assert not cycles, "import cycles in loom:\n" + "\n".join(lines)
