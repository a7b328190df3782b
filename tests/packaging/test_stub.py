"""The checked-in type stub (python/candle_gate/_native.pyi) against the built module: every
public name, every class member and every parameter name, both ways."""
import ast
import inspect
from pathlib import Path

import candle_gate
from candle_gate import _native

STUB = Path(candle_gate.__file__).parent / "_native.pyi"


def _stub():
    tree = ast.parse(STUB.read_text())
    names, classes, funcs = set(), {}, {}
    for node in tree.body:
        if isinstance(node, ast.AnnAssign):
            names.add(node.target.id)
        elif isinstance(node, ast.ClassDef):
            names.add(node.name)
            classes[node.name] = {f.name: f for f in node.body if isinstance(f, ast.FunctionDef)}
        elif isinstance(node, ast.FunctionDef):
            names.add(node.name)
            funcs[node.name] = node
    return names, classes, funcs


def _params(fn):
    a = fn.args
    return [p.arg for p in a.posonlyargs + a.args + a.kwonlyargs if p.arg != "self"]


def _native_params(obj):
    sig = getattr(obj, "__text_signature__", None)
    if sig is None:
        return None
    return [p for p in inspect.signature(obj).parameters if p not in ("self", "$self")]


def test_the_stub_and_the_module_name_the_same_things():
    names, classes, funcs = _stub()
    public = {n for n in dir(_native) if not n.startswith("__") or n == "__version__"}
    assert names == public, (sorted(names - public), sorted(public - names))
    for cname, members in classes.items():
        cls = getattr(_native, cname)
        if issubclass(cls, Exception):
            continue
        real = {m for m in dir(cls) if not m.startswith("__")}
        stubbed = set(members) - {"__init__"}
        assert stubbed == real, (cname, sorted(stubbed - real), sorted(real - stubbed))


def test_the_stub_s_parameters_are_the_module_s():
    _, classes, funcs = _stub()
    checked = 0
    for name, fn in funcs.items():
        real = _native_params(getattr(_native, name))
        if real is not None:
            assert _params(fn) == real, name
            checked += 1
    for cname, members in classes.items():
        cls = getattr(_native, cname)
        for mname, fn in members.items():
            obj = cls if mname == "__init__" else inspect.getattr_static(cls, mname)
            if isinstance(obj, staticmethod):
                obj = obj.__func__
            if any(isinstance(d, ast.Name) and d.id == "property" for d in fn.decorator_list):
                assert type(obj).__name__ == "getset_descriptor", (cname, mname)
                continue
            real = _native_params(obj)
            if real is not None:
                assert _params(fn) == real, (cname, mname)
                checked += 1
    assert checked >= 20, checked


def test_the_package_is_typed():
    assert (STUB.parent / "py.typed").exists()
