"""SamplingParams is built from the field table at run time (params.py); type checkers and IDEs read its attributes
from the generated stub, params.pyi, which must say what the dataclass has."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

from outrider import params
from outrider.params import SamplingParams

STUB = Path(params.__file__).with_suffix(".pyi")


def test_the_committed_stub_is_the_one_the_field_table_generates():
    assert STUB.read_text() == params.stub(), "stale outrider/params.pyi: run outrider.params.write_stub()"


def test_the_stub_declares_every_field_of_the_dataclass_in_order():
    tree = ast.parse(params.stub())
    cls = next(node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == "SamplingParams")
    declared = [node.target.id for node in cls.body if isinstance(node, ast.AnnAssign)]
    assert declared == [f.name for f in dataclasses.fields(SamplingParams)]
    methods = {node.name for node in cls.body if isinstance(node, ast.FunctionDef)}
    public = {name for name in dir(SamplingParams) if not name.startswith("_")} - set(declared)
    assert methods == public
