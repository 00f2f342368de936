"""A named choice: the enum of the plan's and the losses' variants (``Layout``, ``Padding``, ``Reorder``,
``TwinOrder``, ``GradReduction``, ``verify``'s ``Model`` and ``Kernel``), shown as its value and parsed
from it."""

from __future__ import annotations

import enum
from typing import Any, TypeVar

from cpshard.base.errors import parse_choice

_C = TypeVar("_C", bound="Choice")


class Choice(str, enum.Enum):
    """A named choice: shown as its value in messages ("zigzag", not "Layout.ZIGZAG"), parsed from
    itself or its value with a clear error naming the argument. A subclass names the argument it is
    passed as, what a member is called in an error message and, where it is not ``cpshard.<name>``,
    the path users import it by::

        class Layout(Choice, argument="layout", what="known layout"): ...
        class Model(Choice, argument="model", what="verify model", where="cpshard.verify.Model"): ...
    """

    def __init_subclass__(cls, argument: str = "", what: str = "", where: str = "", **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls._argument, cls._what, cls._where = argument, what, where or f"cpshard.{cls.__name__}"

    def __str__(self) -> str:
        return str(self.value)

    @classmethod
    def parse(cls: type[_C], value: Any, name: str | None = None) -> _C:
        """Accept a member or its string value; anything else is a clear error."""
        return parse_choice(cls, value, name or cls._argument, cls._what, cls._where)
