"""``_ColumnarPlan``'s written-out ``__init__`` against the fields it stands for: every field of
``StepPlan`` and its own is set, to its declared default (fresh lists, a fresh StepSlots), except
``budget`` (the argument) and ``lean_prefill`` (True: the columnar step's prefill entries)."""

from __future__ import annotations

import dataclasses

from pagedkv.sched.columnar import _ColumnarPlan
from pagedkv.sched.output import StepSlots


def test_columnar_plan_sets_every_field_to_its_default() -> None:
    plan, other = _ColumnarPlan(123), _ColumnarPlan(5)
    fields = dataclasses.fields(_ColumnarPlan)
    assert {f.name for f in fields} >= {"budget", "scheduled", "segments", "step_slots"}
    for f in fields:
        value = getattr(plan, f.name)  # AttributeError for a field the __init__ forgot
        if f.name == "budget":
            assert value == 123
        elif f.name == "lean_prefill":
            assert value is True
        elif f.default_factory is not dataclasses.MISSING:
            want = f.default_factory()
            assert type(value) is type(want)
            if isinstance(want, StepSlots):
                assert value.slots == []
                assert value.slots is not other.step_slots.slots
            else:
                assert value == want
                assert value is not getattr(other, f.name)  # not shared between plans
        else:
            assert value == f.default
