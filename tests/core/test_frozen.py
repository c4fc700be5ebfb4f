"""quick_init: the same objects as the dataclass's own __init__, built cheaper."""

from __future__ import annotations

import copy
import dataclasses
import pickle
from dataclasses import dataclass, field
from typing import ClassVar

import pytest

from miles_core.ci.register import register_cpu_ci
from miles_core.frozen import quick_init

register_cpu_ci(est_time=2, suite="stage-a-cpu")


@quick_init
@dataclass(frozen=True)
class Point:
    x: int
    y: int = 2
    tags: tuple[str, ...] = field(default_factory=tuple)
    norm: int = field(init=False)
    label: str = field(default="p", kw_only=True)

    def __post_init__(self) -> None:
        object.__setattr__(self, "norm", abs(self.x) + abs(self.y))


#: fields for the classes whose __post_init__ reads them
POST_INIT_SAMPLES = {
    "Turn": {"seq": 1, "parent": None, "messages": (), "keys": (("user", "x", None, None, ()),), "trim": 0,
             "observation_ids": (1, 2), "completion": None, "token_ids": (1, 2, 3), "record": None},
}


def _quick_classes() -> list[type]:
    """Every class of miles that uses quick_init."""
    from miles_core.engine import base as engine_base
    from miles_core.rl.rollout import types as rollout_types
    from miles_core.session import client, completion, normalize, service, tokenizer, trajectory, upstream

    modules = [engine_base, rollout_types, client, completion, normalize, service, tokenizer, trajectory, upstream]
    return [c for m in modules for c in vars(m).values()
            if isinstance(c, type) and c.__module__ == m.__name__ and "__dataclass_init__" in vars(c)]


@pytest.mark.parametrize("args, kwargs", [((1,), {}), ((1, 5), {"tags": ("a",), "label": "q"}), ((-3,), {"y": -4})])
def test_the_same_instance_as_the_generated_init(args, kwargs) -> None:
    quick = Point(*args, **kwargs)
    generated = object.__new__(Point)
    Point.__dataclass_init__(generated, *args, **kwargs)  # type: ignore[attr-defined]
    assert vars(quick) == vars(generated) and list(vars(quick)) == list(vars(generated))
    assert quick == generated and hash(quick) == hash(generated) and repr(quick) == repr(generated)
    assert Point(1).tags == () and Point(1, tags=("t",)).tags == ("t",)
    with pytest.raises(dataclasses.FrozenInstanceError):
        quick.x = 9  # type: ignore[misc]
    assert dataclasses.replace(quick, y=7).norm == abs(quick.x) + 7
    assert pickle.loads(pickle.dumps(quick)) == quick == copy.copy(quick)


def test_a_default_factory_gives_each_instance_its_own() -> None:
    @quick_init
    @dataclass(frozen=True, eq=False)
    class Bag:
        items: list[int] = field(default_factory=list)

    assert Bag().items == [] and Bag().items is not Bag().items and Bag([1]).items == [1]


def test_the_same_signature_errors() -> None:
    with pytest.raises(TypeError):
        Point()  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        Point(1, 2, (), "q")  # type: ignore[misc]  # label is keyword-only
    with pytest.raises(TypeError):
        Point(1, norm=3)  # type: ignore[call-arg]  # not an init field


def test_refuses_what_it_cannot_build() -> None:
    @dataclass
    class Mutable:
        x: int

    @dataclass(frozen=True, slots=True)
    class Slotted:
        x: int

    @dataclass(frozen=True)
    class WithClassVar:
        x: int
        kind: ClassVar[str] = "k"

    for cls in (Mutable, Slotted, WithClassVar):
        with pytest.raises(TypeError):
            quick_init(cls)


def test_miles_classes_build_what_their_dataclass_init_builds() -> None:
    """Each quick class, from the defaults and sample values of its fields, both ways."""
    classes = _quick_classes()
    assert classes
    for cls in classes:
        values = {f.name: object() for f in dataclasses.fields(cls) if f.init}
        if "__post_init__" in vars(cls):
            values = POST_INIT_SAMPLES[cls.__qualname__]
        quick = cls(**values)
        generated = object.__new__(cls)
        cls.__dataclass_init__(generated, **values)
        assert vars(quick) == vars(generated), cls
