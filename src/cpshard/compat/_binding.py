"""What the adapters' patches share: bind a module attribute and save what it held, undo in reverse
(leaving alone what someone patched over us, and saying so), the patch in force (wholly or partly),
and the ``with`` block."""

from __future__ import annotations

import logging
import sys
import threading
from types import ModuleType, TracebackType
from typing import Any, ClassVar, TypeVar

__all__ = ["IN_FORCE", "MISSING", "OFF", "PARTLY", "Bindings", "rebind"]

#: a patch's ``state``: its bindings in place; some left behind another library's wrapper after
#: ``undo()`` (calls through those sites may still reach cpshard); none
IN_FORCE, PARTLY, OFF = "in force", "partly in force", "off"

#: what ``vars(owner)`` held where it held nothing (an attribute that undo deletes again)
MISSING = object()
_B = TypeVar("_B", bound="Bindings")


def _where(owner: Any) -> str:
    return f"{owner.__module__}.{owner.__qualname__}" if isinstance(owner, type) else owner.__name__


def _left_reason(now: Any, new: Any) -> str:
    """Why ``undo()`` left ``now`` where it had bound ``new``: a wrapper over it, or another object."""
    seen, fn = 0, now
    while fn is not None and seen < 32:
        if fn is new:
            return ("another library's wrapper over cpshard's (its __wrapped__): calls through it still reach "
                    "cpshard; undo that wrapper first, then this patch")
        fn, seen = getattr(fn, "__wrapped__", None), seen + 1
    return (f"another library set {type(now).__name__} {getattr(now, '__qualname__', '')} over cpshard's, left as "
            "it is (it may still call cpshard's through a reference it kept)")


def rebind(framework: str, pairs: dict[int, tuple[Any, Any]]) -> list[str]:
    """Set every attribute of a loaded ``framework`` / ``framework.*`` module (every loaded module where
    ``framework`` is ``""``) that holds a ``now`` of ``pairs`` (``{id(now): (now, then)}``) to its
    ``then``; the sites changed, as ``module.name``."""
    done = []
    for name, module in list(sys.modules.items()):
        if not isinstance(module, ModuleType) or framework and not (name == framework or
                                                                    name.startswith(framework + ".")):
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
        unrestored: ``{site: reason}`` after ``undo()``: sites where another library had set its own object
            (a wrapper) over this patch's, which ``undo()`` left as it is; calls through them may still
            reach cpshard (``state`` is then ``"partly in force"`` while they hold it).
    """

    _framework: ClassVar[str]
    _scope: ClassVar[str | None] = None  # the modules undo() searches (rebind's framework): None, _framework's
    _lock: ClassVar[threading.RLock]
    _top: ClassVar[list[Any]]  # [the patch whose bindings are in place, or None]
    _partial: ClassVar[list[Any]]  # [the last patch undone with sites left behind a wrapper, or None]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls._top = [None]
        cls._partial = [None]

    def __init__(self) -> None:
        self.bound: list[str] = []
        self.skipped: dict[str, str] = {}
        self.unrestored: dict[str, str] = {}
        self.active = False
        self._saved: list[tuple[Any, str, Any, Any]] = []  # (owner, name, what it held or MISSING, new)
        self._left: list[tuple[Any, str, Any]] = []  # (owner, name, the object undo() left there)

    @classmethod
    def in_force(cls: type[_B]) -> _B | None:
        """The patch of this kind whose bindings are in place in this process, else None."""
        top = cls._top[0]
        return top if top is not None and top.active else None

    @classmethod
    def partly(cls: type[_B]) -> _B | None:
        """The patch of this kind undone with sites left behind another library's objects, while one of
        them still holds what it held at the undo (``state == "partly in force"``), else None."""
        last = cls._partial[0]
        return last if last is not None and last.state == PARTLY else None

    @property
    def state(self) -> str:
        """``"in force"``, ``"partly in force"`` (undone, but sites left behind another library's wrapper
        still hold it: :attr:`unrestored`) or ``"off"``."""
        if self.active:
            return IN_FORCE
        if any(vars(owner).get(name, MISSING) is held for owner, name, held in self._left):
            return PARTLY
        return OFF

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
                now = vars(owner).get(name, MISSING)
                if now is not new:  # leave alone what someone patched over us, and say so
                    if now is not old:
                        self._left.append((owner, name, now))
                        self.unrestored[f"{_where(owner)}.{name}"] = _left_reason(now, new)
                    continue
                if old is MISSING:
                    delattr(owner, name)
                else:
                    setattr(owner, name, old)
            taken = rebind(self._framework if self._scope is None else self._scope, self._taken())
            self.active = False
            if type(self)._top[0] is self:
                type(self)._top[0] = None
            if self._left:
                type(self)._partial[0] = self
                for site, reason in self.unrestored.items():
                    logging.getLogger(f"cpshard.compat.{self._framework}").warning(
                        "cpshard.compat.%s: undo() could not restore %s: %s", self._framework, site, reason)
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
