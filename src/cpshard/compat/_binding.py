"""What the adapters' patches share: bind a module attribute and save what it held, undo in reverse
(leaving alone what someone patched over us), the patch in force, and the ``with`` block."""

from __future__ import annotations

import sys
import threading
from types import ModuleType, TracebackType
from typing import Any, ClassVar, TypeVar

__all__ = ["MISSING", "Bindings", "rebind"]

#: what ``vars(owner)`` held where it held nothing (an attribute that undo deletes again)
MISSING = object()
_B = TypeVar("_B", bound="Bindings")


def rebind(framework: str, pairs: dict[int, tuple[Any, Any]]) -> list[str]:
    """Set every attribute of a loaded ``framework`` / ``framework.*`` module that holds a ``now`` of
    ``pairs`` (``{id(now): (now, then)}``) to its ``then``; the sites changed, as ``module.name``."""
    done = []
    for name, module in list(sys.modules.items()):
        if not isinstance(module, ModuleType) or not (name == framework or name.startswith(framework + ".")):
            continue
        for attr, value in list(vars(module).items()):
            pair = pairs.get(id(value))
            if pair is not None and value is pair[0]:
                setattr(module, attr, pair[1])
                done.append(f"{module.__name__}.{attr}")
    return done


class Bindings:
    """A patch of one framework's attributes: what it bound, and its undo (or leaving the ``with`` block).

    A subclass names its framework (the prefix of the modules :meth:`undo` searches for objects they
    took meanwhile) and its lock; it gets its own in-force slot. Hooks: :meth:`_release` (run first by
    every ``undo()``, active or not), :meth:`_taken` (what modules may have taken), :meth:`_restored`
    (the log line).

    Attributes:
        bound: the sites (``module.attribute``) bound, in binding order.
        skipped: ``{site: reason}``: sites left alone.
        active: whether the bindings are in place.
    """

    _framework: ClassVar[str]
    _lock: ClassVar[threading.RLock]
    _top: ClassVar[list[Any]]  # [the patch whose bindings are in place, or None]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls._top = [None]

    def __init__(self) -> None:
        self.bound: list[str] = []
        self.skipped: dict[str, str] = {}
        self.active = False
        self._saved: list[tuple[Any, str, Any, Any]] = []  # (owner, name, what it held or MISSING, new)

    @classmethod
    def in_force(cls: type[_B]) -> _B | None:
        """The patch of this kind whose bindings are in place in this process, else None."""
        top = cls._top[0]
        return top if top is not None and top.active else None

    def _save(self, owner: Any, name: str, new: Any) -> None:
        """Bind ``owner.name`` to ``new``, saving what ``owner`` itself held there."""
        self._saved.append((owner, name, vars(owner).get(name, MISSING), new))
        setattr(owner, name, new)

    def _hold(self) -> None:
        """The bindings are in place: this patch is the one in force."""
        self.active = True
        type(self)._top[0] = self

    def undo(self) -> None:
        """Put back what every binding replaced (a binding someone patched over stays theirs), then
        what modules imported meanwhile took (:meth:`_taken`). A second call does nothing."""
        with self._lock:
            self._release()
            if not self.active:
                return
            for owner, name, old, new in reversed(self._saved):
                if vars(owner).get(name, MISSING) is not new:  # leave alone what someone patched over us
                    continue
                if old is MISSING:
                    delattr(owner, name)
                else:
                    setattr(owner, name, old)
            taken = rebind(self._framework, self._taken())
            self.active = False
            if type(self)._top[0] is self:
                type(self)._top[0] = None
            self._restored(taken)

    def _release(self) -> None:
        """What every ``undo()`` gives back first, whether the bindings are in place or not."""

    def _taken(self) -> dict[int, tuple[Any, Any]]:
        """``{id(new): (new, original)}``: the objects modules imported while the patch was on may hold."""
        return {}

    def _restored(self, taken: list[str]) -> None:
        """Log the undo (``taken``: the sites :func:`rebind` restored)."""

    def __enter__(self: _B) -> _B:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.undo()
