"""``patch()``: torchtitan's ``cp_shard`` accepts cpshard's balancer types; ``TitanPatch`` reports
what it bound and undoes it; ``activate()`` switches it on for the life of a process.

Where it binds (the *sites*): ``cp_shard`` in torchtitan's ``context_parallel/api.py`` (required:
``prepare_context_parallel_input`` calls that module's global, so every reference to it, the
trainer's and the validator's taken by name at import included, now reaches cpshard), in the
``torchtitan.distributed.context_parallel`` package (where Flux imports it from), and in every loaded
``torchtitan.*`` module that bound it by name. ``prepare_context_parallel_input`` itself is left as
it is: the replacement recognizes a call from it (its code object) and takes the batch's positions
from it, so torchtitan passes nothing new. Other balancer types go to torchtitan's own ``cp_shard``
unchanged.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
import threading
from collections.abc import Callable
from types import CodeType, FrameType, ModuleType
from typing import Any

from cpshard.base.errors import fail
from cpshard.compat._binding import Bindings, rebind
from cpshard.compat.torchtitan import _titan
from cpshard.compat.torchtitan._shard import KINDS, shard

__all__ = ["LOCK", "WRAPS", "TitanPatch", "activate", "active", "patch", "process_patch", "replacement"]

logger = logging.getLogger("cpshard.compat.torchtitan")
LOCK = threading.RLock()
WRAPS = "__cpshard_wraps__"  # the attribute of the replacement that holds torchtitan's cp_shard
_PROCESS: list[TitanPatch | None] = [None]  # activate()'s


class TitanPatch(Bindings):
    """What :func:`patch` bound, and its undo (or leaving the ``with`` block).

    Attributes:
        bound: the sites (``module.cp_shard``) where torchtitan now calls cpshard's ``cp_shard``.
        skipped: ``{site: reason}``: sites left alone (the package or a module does not bind it).
        kinds: the ``load_balancer_type`` names it adds (``"cpshard"``, ``"cpshard_zigzag"``).
        torchtitan_version: the installed torchtitan's.
        active: whether the bindings are in place (False after ``undo()``, and for a patch made while
            another holds them: it binds nothing).
    """

    _framework = "torchtitan"
    _lock = LOCK

    def __init__(self, version: str | None) -> None:
        super().__init__()
        self.torchtitan_version = version
        self.kinds = tuple(KINDS)
        self._original: Callable[..., Any] | None = None
        self._replacement: Callable[..., Any] | None = None

    def __repr__(self) -> str:
        return (f"TitanPatch(torchtitan {self.torchtitan_version}, {'active' if self.active else 'inactive'}: "
                f"{len(self.bound)} bound, {len(self.skipped)} skipped)")

    def original(self) -> Callable[..., Any]:
        """torchtitan's own ``cp_shard`` (what ``undo()`` puts back)."""
        if self._original is None:
            fail("patch", repr(self), "bound nothing", "use the patch in force: cpshard.compat.torchtitan.active()")
        return self._original

    def _bind(self, module: ModuleType, name: str, new: Any) -> None:
        self._save(module, name, new)
        self.bound.append(f"{module.__name__}.{name}")

    def undo(self) -> None:
        """Put torchtitan's ``cp_shard`` back at every site, and wherever a ``torchtitan.*`` module
        imported while the patch was on took the replacement by name. A second call does nothing."""
        super().undo()

    def _taken(self) -> dict[int, tuple[Any, Any]]:
        return {} if self._replacement is None else {id(self._replacement): (self._replacement, self._original)}

    def _restored(self, taken: list[str]) -> None:
        logger.info("cpshard.compat.torchtitan: restored torchtitan's cp_shard at %d sites%s", len(self.bound),
                    f" and {len(taken)} taken meanwhile" if taken else "")


def active() -> TitanPatch | None:
    """The patch whose bindings are in place in this process, else None."""
    return TitanPatch.in_force()


def _positions_of(frame: FrameType | None, prepare: CodeType) -> Any:
    """The positions of a ``cp_shard`` call made by torchtitan's ``prepare_context_parallel_input``
    (its ``positions`` local, what it passes third), else None."""
    return frame.f_locals.get("positions") if frame is not None and frame.f_code is prepare else None


def replacement(original: Callable[..., Any], prepare: CodeType) -> Callable[..., Any]:
    """torchtitan's ``cp_shard`` with cpshard's balancer types added (:mod:`._shard`); ``positions=``
    (keyword only) names the batch's position ids where a caller other than
    ``prepare_context_parallel_input`` has them."""

    @functools.wraps(original)
    def cp_shard(cp_mesh: Any, inputs: tuple[Any, ...], attention_masks: Any, load_balancer_type: str | None =
                 "headtail", input_seq_dim: int = 1, ptrr_mask_key: str | None = None, *,
                 positions: Any = None) -> tuple[tuple[Any, ...], Any]:
        if load_balancer_type not in KINDS:
            return original(cp_mesh, inputs, attention_masks, load_balancer_type, input_seq_dim,
                            ptrr_mask_key=ptrr_mask_key)
        if positions is None:
            positions = _positions_of(sys._getframe(1), prepare)
        return shard(cp_mesh, inputs, attention_masks, load_balancer_type, input_seq_dim, positions)

    setattr(cp_shard, WRAPS, original)
    return cp_shard


def patch() -> TitanPatch:
    """Make torchtitan's ``cp_shard`` (and so ``prepare_context_parallel_input``) accept
    ``load_balancer_type="cpshard"`` and ``"cpshard_zigzag"``, in this process; also a context manager
    that undoes itself. Checks torchtitan first (:func:`cpshard.compat.torchtitan._titan.api`:
    ``ImportError`` where it is missing, ``ValueError`` where its ``cp_shard`` differs from
    torchtitan 0.3.0's), then binds (module docstring) and logs one INFO line of what it bound.
    Where another patch holds the sites, returns an inactive patch that binds nothing.

    Example::

        from cpshard.compat import torchtitan as cptitan
        with cptitan.patch() as p:         # one process (a test); a job: import cpshard.compat.torchtitan.enable
            print(p.bound)
    """
    api = _titan.api()
    with LOCK:
        result = TitanPatch(_titan.torchtitan_version())
        if active() is not None:
            return result
        original = vars(api)["cp_shard"]
        if hasattr(original, WRAPS):  # another copy of cpshard bound it
            result.skipped[f"{_titan.API}.cp_shard"] = "cpshard's already (bound by another copy)"
            return result
        new = replacement(original, api.prepare_context_parallel_input.__code__)
        result._original, result._replacement = original, new
        result._bind(api, "cp_shard", new)
        for site in rebind("torchtitan", {id(original): (original, new)}):
            if site not in result.bound:
                result.bound.append(site)
                result._saved.append((sys.modules[site.rsplit(".", 1)[0]], site.rsplit(".", 1)[1], original, new))
        if f"{_titan.PACKAGE}.cp_shard" not in result.bound:
            result.skipped[f"{_titan.PACKAGE}.cp_shard"] = "the package does not bind torchtitan's cp_shard here"
        result._hold()
        logger.info("cpshard.compat.torchtitan: torchtitan %s's cp_shard takes load_balancer_type %s at %d sites "
                    "(pid %d): %s", result.torchtitan_version, " / ".join(map(repr, KINDS)), len(result.bound),
                    os.getpid(), ", ".join(result.bound))
        return result


def activate() -> TitanPatch:
    """Switch cpshard on in this process until ``undo()``: :func:`patch`, once. Idempotent: every call
    returns the same patch while it is active (a ``with patch():`` block in force becomes the
    process's). The ``cpshard.compat.torchtitan`` logger gets level INFO where it has none."""
    with LOCK:
        current = _PROCESS[0]
        if current is not None and current.active:
            return current
        if logger.level == logging.NOTSET:
            logger.setLevel(logging.INFO)
        held = active()
        _PROCESS[0] = held if held is not None else patch()
        return _PROCESS[0]


def process_patch() -> TitanPatch | None:
    """The patch :func:`activate` made, while it is active."""
    current = _PROCESS[0]
    return current if current is not None and current.active else None
