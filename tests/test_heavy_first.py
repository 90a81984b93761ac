"""The order CI's workers take the tests in (tests/heavy_first.py)."""

import os
from types import SimpleNamespace

import heavy_first

HERE = os.path.dirname(os.path.abspath(__file__))


def test_every_file_named_heaviest_exists():
    # a renamed file would silently lose its place at the front
    assert [f for f in heavy_first.HEAVIEST if not os.path.isfile(os.path.join(HERE, f))] == []


def test_the_heaviest_files_come_first_each_whole_and_in_its_own_order():
    ranked = sorted(heavy_first.HEAVIEST, key=heavy_first.HEAVIEST.get)
    heavy, heavier = ranked[0], ranked[-1]
    assert heavy_first.HEAVIEST[heavy] < heavy_first.HEAVIEST[heavier]
    names = ["tests/test_light_a.py::one", f"tests/{heavy}::a", "tests/test_light_b.py::one",
             f"tests/{heavier}::x[1]", f"tests/{heavy}::b", "tests/test_light_a.py::two",
             f"tests/{heavier}::x[2]"]
    items = [SimpleNamespace(nodeid=n) for n in names]
    heavy_first.pytest_collection_modifyitems(None, items)
    assert [i.nodeid for i in items] == [
        f"tests/{heavier}::x[1]", f"tests/{heavier}::x[2]", f"tests/{heavy}::a",
        f"tests/{heavy}::b", "tests/test_light_a.py::one", "tests/test_light_a.py::two",
        "tests/test_light_b.py::one"]
