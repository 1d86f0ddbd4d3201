"""The type stubs (laminar/_laminar.pyi) name exactly what the extension binds."""

import ast
import inspect
import pathlib

import laminar
from laminar import _laminar


def stub_tree():
    path = pathlib.Path(laminar.__file__).with_name("_laminar.pyi")
    return ast.parse(path.read_text())


def public(names):
    return {n for n in names if not n.startswith("_")}


def test_every_name_has_a_stub_and_every_stub_a_name():
    tree = stub_tree()
    stubbed = {node.name for node in tree.body if isinstance(node, (ast.ClassDef, ast.FunctionDef))}
    bound = public(name for name, value in vars(_laminar).items() if inspect.isclass(value) or callable(value))
    assert bound == stubbed
    assert bound <= set(laminar.__all__)


def test_every_member_has_a_stub():
    tree = stub_tree()
    for node in tree.body:
        if not isinstance(node, ast.ClassDef):
            continue
        cls = getattr(_laminar, node.name)
        if issubclass(cls, BaseException):
            continue
        stubbed = set()
        for item in node.body:
            if isinstance(item, (ast.FunctionDef, ast.ClassDef)):
                stubbed.add(item.name)
            elif isinstance(item, ast.AnnAssign):
                stubbed.add(item.target.id)
            elif isinstance(item, ast.Assign):
                stubbed.update(t.id for t in item.targets)
        is_enum = any(isinstance(b, ast.Attribute) and b.attr == "IntEnum" for b in node.bases)
        members = public(vars(cls))
        if is_enum:
            members = set(cls.__members__)
            assert set(cls.__members__) == public(stubbed)
            assert all(int(getattr(cls, m)) == ast.literal_eval(
                next(i.value for i in node.body if isinstance(i, ast.Assign) and i.targets[0].id == m))
                for m in members)
        else:
            assert members == public(stubbed), node.name
