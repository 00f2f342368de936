"""``patch()``: verl calls cpshard at every site of :mod:`cpshard.compat.verl.sites`; ``VerlPatch``
reports what it bound, skipped and refused, and undoes it.

Sources read (not copied): verl 0.9.1's and verl main's (1dda039) ``verl/__init__.py`` (how a plugin
loads in every process), and the modules :mod:`cpshard.compat.verl.sites` names.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
from collections import Counter
from types import ModuleType
from typing import Any

from cpshard.base.errors import fail
from cpshard.base.layout import Layout
from cpshard.compat._binding import MISSING, Bindings
from cpshard.compat.verl import _fsdp, _layout
from cpshard.compat.verl._mtp import SITE as MTP_SITE
from cpshard.compat.verl._mtp import mtp_module, route_mtp_loss
from cpshard.compat.verl._plans import WRITTEN_FOR, verl_version
from cpshard.compat.verl._ulysses import ULYSSES_DROP_INS
from cpshard.compat.verl.sites import (
    BINDERS,
    DROP_INS,
    REQUIRED,
    ULYSSES,
    ULYSSES_BINDERS,
    UTIL,
    WRAPS,
    cannot_import,
    describe,
    fsdp_sites,
    import_site,
    optional_sites,
    positional,
    ulysses_names,
)

__all__ = ["LOCK", "VerlPatch", "active", "patch", "show_info"]

logger = logging.getLogger("cpshard.compat.verl")

#: held while a patch binds or undoes, and while cpshard is switched on for the process
LOCK = threading.RLock()
_LOGGED = [False]


class VerlPatch(Bindings):
    """What :func:`patch` did, and its undo (or leaving the ``with`` block).

    Attributes:
        bound: the sites (``module.attribute``) where verl now calls cpshard, in binding order.
        skipped: ``{site: reason}``, sites left alone because their module does not import here (the
            reason is the import error's text) or this verl does not bind the name there.
        refused: ``{site: reason}``, sites left alone because verl's function there takes other
            parameters than the drop-in follows.
        replaced: every attribute changed, ``bound`` plus the MTP loss's two switches.
        layout: the layout rule in force for sites verl passes no ``cp_layout`` (in words).
        ring: the ring size of verl's FSDP engine (``CPSHARD_RING``; 1: plain Ulysses).
        verl_version: the installed verl's.
        active: whether the bindings are in place (False after ``undo()``, and for a patch made while
            another holds them: it binds nothing, and its ``undo()`` only restores the layout it set).
    """

    _framework = "verl"
    _lock = LOCK

    def __init__(self, version: str, layout: str, ring: int = 1) -> None:
        super().__init__()
        self.verl_version = version
        self.layout = layout
        self.ring = ring
        self._ring: int | None = None  # the ring size this patch replaced
        self.refused: dict[str, str] = {}
        self.replaced: list[str] = []
        self._verls: dict[int, tuple[Any, Any]] = {}  # id(drop-in) -> (drop-in, verl's function)
        self._at: dict[str, int] = {}  # site -> its entry in _saved
        self._previous: _layout.Setting | None = None

    def __repr__(self) -> str:
        return (f"VerlPatch(verl {self.verl_version}, {'active' if self.active else 'inactive'}: {len(self.bound)} "
                f"bound, {len(self.skipped)} skipped, {len(self.refused)} refused; ring {self.ring})")

    def _replace(self, owner: Any, name: str, new: Any, site: str | None) -> None:
        self._save(owner, name, new)
        self.replaced.append(f"{_name(owner)}.{name}")
        if site is not None:
            self._at[site] = len(self._saved) - 1
            self.bound.append(site)

    def original(self, site: str) -> Any:
        """verl's own object at a bound ``site`` (what ``undo()`` puts back): to call verl's function
        beside cpshard's, as the tests do.

        Example: ``p.original("verl.utils.seqlen_balancing.rearrange_micro_batches")``."""
        if site not in self._at:
            fail("site", repr(site), "is not a site this patch bound",
                 f"pass one of VerlPatch.bound ({len(self.bound)} sites)")
        old = self._saved[self._at[site]][2]
        return None if old is MISSING else old

    def undo(self) -> None:
        """Restore every binding this patch made, and those that modules imported while it was on took
        by ``from ... import`` (any ``verl.*`` module attribute that is a drop-in gets verl's function
        back); then the layout setting it replaced. A second call does nothing."""
        super().undo()

    def _release(self) -> None:
        if self._ring is not None:
            _fsdp.set_ring(self._ring)
            self._ring = None
        if self._previous is not None:
            _layout.switch(self._previous)
            self._previous = None

    def _taken(self) -> dict[int, tuple[Any, Any]]:
        return self._verls

    def _restored(self, taken: list[str]) -> None:
        logger.info("cpshard.compat.verl: restored verl's functions at %d sites%s", len(self.bound),
                    f" and {len(taken)} bindings that modules imported meanwhile took" if taken else "")


def _name(owner: Any) -> str:
    return f"{owner.__module__}.{owner.__qualname__}" if isinstance(owner, type) else owner.__name__


def active() -> VerlPatch | None:
    """The patch whose bindings are in place in this process (``cpshard.compat.verl.enable``'s, or a
    ``with patch():`` block's), else one undone but partly in force (``state == "partly in force"``: a
    site another library wrapped still holds its wrapper over cpshard's, named in ``unrestored``), else
    None."""
    return VerlPatch.in_force() or VerlPatch.partly()


def patch(layout: Layout | str | None = None, *, ring: int | None = None) -> VerlPatch:
    """Make a running verl call cpshard's drop-ins, in this process; also a context manager that undoes itself.

    This process only: verl trains in Ray worker processes, which a ``with patch():`` in the driver
    never reaches. To switch cpshard on in every process of a verl job, set
    ``VERL_USE_EXTERNAL_MODULES=cpshard.compat.verl.enable`` (docs/verl.md, "cpshard in a verl job").

    Imports megatron-core without Triton first (:mod:`cpshard.megatron._import`), then binds the
    sites of :mod:`cpshard.compat.verl.sites`: util's eight helpers where verl binds them, the MTP
    loss, ``rearrange_micro_batches``, verl's dynamic-CP padding mask, and a wrapper of the Megatron
    engine's ``forward_backward_batch`` that tells the sites verl passes no layout the model's; for
    verl's FSDP backend, its six Ulysses helpers where verl binds them (``verl.utils.ulysses`` and the
    modules of :data:`~cpshard.compat.verl.sites.ULYSSES_BINDERS`) and four wrappers of the FSDP engine
    (:data:`~cpshard.compat.verl.sites.FSDP`: its attention becomes cpshard's, with a ring axis of
    ``ring`` ranks; docs/verl.md, "FSDP backend").
    Checks first, changing nothing on failure (``ValueError`` naming the verl version and the site):
    util's helpers must exist with verl's positional parameters, verl's Megatron path
    (:data:`~cpshard.compat.verl.sites.REQUIRED`) must import, and no site may bind another object
    (a wrapper) in place of util's function. A site whose module does not import, or that this verl
    does not bind, is skipped; an optional site whose function takes other parameters is refused
    (left as it is). Logs one INFO line of what it bound (then DEBUG, in a process that patches
    again) and a WARNING per site skipped or refused, with the reason; the ``cpshard.compat.verl``
    logger gets level INFO where it has none, as under :func:`activate`, so that both show.

    Args:
        layout: the override for the sites verl passes no ``cp_layout`` (``"zigzag"``,
            ``"contiguous"``, ``"auto"``); None reads ``CPSHARD_LAYOUT`` (default ``auto``: the model's
            layout inside verl's Megatron engine, else zigzag). An invalid value is a ``ValueError``.
        ring: the ring ranks of verl's FSDP Ulysses group (a divisor of its
            ``ulysses_sequence_parallel_size``, checked when the engine makes its groups); None reads
            ``CPSHARD_RING`` (default 1: plain Ulysses). Not a positive integer: ``ValueError``.

    Returns:
        :class:`VerlPatch` (``bound``, ``skipped``, ``refused``). Where another patch already holds the
        sites, this one binds nothing and only sets ``layout`` (when given) until its ``undo()``.

    Example::

        from cpshard.compat import verl as cpverl
        with cpverl.patch() as p:          # in one process (a test, a single-process run)
            print(p.bound, p.skipped)
    """
    _fsdp.ring_setting(ring)  # a clear error before anything is imported
    show_info()
    _import_verl()
    return _patch(layout, "", ring)


def show_info() -> None:
    """Give the ``cpshard.compat.verl`` logger level INFO where it has none, so that the line of what was
    bound shows beside the WARNINGs of the sites left out (verl configures the root logger at WARNING,
    which would hide it); a level set on the logger is kept."""
    if logger.level == logging.NOTSET:
        logger.setLevel(logging.INFO)


def _import_verl() -> None:
    """``import verl`` outside the lock: verl's own import may switch cpshard on (its external modules, its
    plugins), which takes the lock; a thread holding it while waiting for verl's import would deadlock."""
    try:
        import verl  # noqa: F401
    except ImportError:
        pass  # patch() names what is missing when it imports verl's Megatron path


def _patch(layout: Layout | str | None, scope: str, ring: int | None = None) -> VerlPatch:
    with LOCK:
        override, source = _layout.setting(layout)
        setting = _layout.Setting(True, override, source)
        version = verl_version()
        result = VerlPatch(version, _layout.describe(setting), _fsdp.ring_setting(ring))
        if VerlPatch.in_force() is not None:  # another patch holds the sites: only the layout, if given
            if layout is not None:
                result._previous = _layout.switch(setting)
            result.layout = _layout.describe()
            logger.debug("cpshard.compat.verl: already patched; layout: %s", result.layout)
            return result
        _import_megatron_for_verl(version)
        modules = _import_binders(version, result)
        util = modules[UTIL]
        if getattr(util, "preprocess_thd_engine", None) is DROP_INS["preprocess_thd_engine"]:
            logger.debug("cpshard.compat.verl: verl's util is cpshard's already (patched by another copy)")
            return result
        verls = _check_util(util, version)
        sites = _check_binders(modules, verls, version, result)
        mtp, reason = mtp_module(version)
        optional = [(opt, *opt.check()) for opt in [*optional_sites(_engine_hook), *fsdp_sites(_fsdp.hooks())]]
        try:  # every check passed: bind (and on an unforeseen error, put back what was bound)
            _bind(result, sites, verls, mtp, reason, optional)
        except BaseException:
            result.active = True
            result.undo()
            raise
        result._ring = _fsdp.set_ring(result.ring)
        result._previous = _layout.switch(setting)
        result._hold()
        _log(result, scope)
        return result


def _bind(result: VerlPatch, sites: list[tuple[ModuleType, str]], verls: dict[str, Any], mtp: ModuleType | None,
          reason: str, optional: list[tuple[Any, ...]]) -> None:
    """Bind the checked sites (util's helpers where verl binds them, the MTP loss, the optional sites)."""
    for module, name in sites:
        result._replace(module, name, DROP_INS[name], f"{module.__name__}.{name}")
    result._verls = {id(fn): (fn, verls[name]) for name, fn in DROP_INS.items()}
    if mtp is not None:
        route_mtp_loss(result._replace, mtp)
    else:
        result.skipped[MTP_SITE] = reason
    _bind_ulysses(result)
    for opt, owner, bound, what, why in optional:
        if what != "bind":
            (result.skipped if what == "skipped" else result.refused)[opt.site] = why
            continue
        new = opt.replacement(bound)
        result._replace(owner, opt.attr, new, opt.site)
        if not opt.wrap:
            result._verls.setdefault(id(new), (new, bound))


def _bind_ulysses(result: VerlPatch) -> None:
    """verl's six Ulysses helpers, where verl binds them (:data:`~cpshard.compat.verl.sites.ULYSSES_BINDERS`).
    A module that does not import is skipped; helpers with other positional parameters are refused, all six."""
    util, exc = import_site(ULYSSES)
    if util is None:
        result.skipped[f"{ULYSSES}.*"] = cannot_import(ULYSSES, exc)
        return
    verls = {name: getattr(util, name, None) for name in ULYSSES_DROP_INS}
    odd = [name for name, fn in ULYSSES_DROP_INS.items()
           if verls[name] is None or positional(verls[name]) != positional(fn)]
    if odd:
        result.refused[f"{ULYSSES}.*"] = (f"this verl's {', '.join(odd)} take other parameters than cpshard's drop-ins "
                                          f"(written for verl {WRITTEN_FOR}); the FSDP backend is left as it is")
        return
    modules = {}
    for name in ULYSSES_BINDERS:  # every module imported before any binding: each takes verl's helpers
        module, exc = import_site(name)
        if module is None:
            result.skipped[f"{name}.*"] = cannot_import(name, exc)
        else:
            modules[name] = module
    for name, module in modules.items():
        for attr in ulysses_names(module, verls):
            result._replace(module, attr, ULYSSES_DROP_INS[attr], f"{name}.{attr}")
    result._verls.update({id(fn): (fn, verls[name]) for name, fn in ULYSSES_DROP_INS.items()})


def _import_binders(version: str, result: VerlPatch) -> dict[str, ModuleType]:
    modules = {}
    for name in BINDERS:
        module, exc = import_site(name)
        if module is not None:
            modules[name] = module
            continue
        if name in REQUIRED:
            _fail_import(name, version, exc)
        for attr in BINDERS[name]:
            result.skipped[f"{name}.{attr}"] = cannot_import(name, exc)
    return modules


def _fail_import(name: str, version: str, exc: Any) -> None:
    """The error of a required module that does not import, naming what is missing and how to get it."""
    if isinstance(exc, ImportError):
        missing = f"the module {exc.name!r} is missing" if exc.name else "an import failed"
        fail("verl", version, f"cannot import {name}: {missing} ({exc})",
             f"install {exc.name or 'the missing package'} (verl's Megatron path needs megatron-core; "
             "see the README's install section), then patch again")
    fail("verl", version, cannot_import(name, exc), "fix that import (verl's Megatron path), then patch again")


def _check_util(util: ModuleType, version: str) -> dict[str, Any]:
    """verl's eight helpers in util, each with the positional parameters the drop-in follows."""
    verls = {}
    for name, drop_in in DROP_INS.items():
        original = getattr(util, name, None)
        if original is None:
            fail("verl", version, f"{UTIL} has no {name} (cpshard's drop-ins follow verl {WRITTEN_FOR})",
                 f"install verl=={WRITTEN_FOR}, or call cpshard.compat.verl.{name} yourself")
        want, got = positional(drop_in), positional(original)
        if got != want:
            fail("verl", version, f"{UTIL}.{name} takes ({', '.join(got)}), but cpshard's drop-in is written "
                 f"for verl {WRITTEN_FOR}'s ({', '.join(want)})",
                 f"install verl=={WRITTEN_FOR}, or call cpshard.compat.verl.{name} yourself")
        verls[name] = original
    return verls


def _check_binders(modules: dict[str, ModuleType], verls: dict[str, Any], version: str,
                   result: VerlPatch) -> list[tuple[ModuleType, str]]:
    sites = []
    for module_name, module in modules.items():
        for name in BINDERS[module_name]:
            bound = getattr(module, name, MISSING)
            if bound is MISSING:  # this verl no longer binds it there (verl main's model_forward_fused)
                result.skipped[f"{module_name}.{name}"] = (f"this verl's {module_name.rsplit('.', 1)[-1]} does not "
                                                           f"bind {name} (nothing to replace)")
                continue
            if bound is not verls[name]:
                fail("verl", version, f"{module_name}.{name} is {describe(bound)}, not {UTIL}.{name} (verl "
                     "wrapped or replaced it; cpshard would not know what the wrapper adds)",
                     "patch that module yourself, or call cpshard.compat.verl's functions from the wrapper")
            sites.append((module, name))
    return sites


def _engine_hook(original: Any) -> Any:
    """verl's ``MegatronEngine.forward_backward_batch``, run with its model's layout noted
    (:func:`cpshard.compat.verl._layout.running`): the packing and the forward it drives see it."""

    @functools.wraps(original)
    def forward_backward_batch(self: Any, *args: Any, **kwargs: Any) -> Any:
        with _layout.running(_layout.engine_layout(self)):
            return original(self, *args, **kwargs)

    setattr(forward_backward_batch, WRAPS, original)
    return forward_backward_batch


def _import_megatron_for_verl(version: str) -> None:
    """Import megatron-core the way cpshard does on a machine without Triton, before verl's modules
    import it themselves (verl's util imports ``megatron.core``; the Triton stand-in exists only
    while the one file that needs it runs: ``cpshard.megatron.import_megatron``)."""
    from cpshard.megatron import INSTALL_HINT, import_megatron

    try:
        import_megatron("parallel_state")
        import_megatron("packed_seq_params")
    except ImportError as exc:
        fail("verl", version, f"needs megatron-core for its Megatron path, and importing it failed: {exc}",
             INSTALL_HINT.replace("megatron-core is not installed. ", "install it: "))


def owner(site: str) -> str:
    """The module of a site (a class's method: the module before the class)."""
    parts = site.split(".")
    cut = next((i for i, p in enumerate(parts) if p[:1].isupper()), len(parts) - 1)
    return ".".join(parts[:cut])


def _log(result: VerlPatch, scope: str) -> None:
    """One INFO line of what was bound (DEBUG once a process has logged one), a WARNING per site left out."""
    modules = Counter(owner(site) for site in result.bound)
    where = ", ".join(f"{m} {n}" for m, n in modules.items())
    (logger.debug if _LOGGED[0] and not scope else logger.info)(
        "cpshard.compat.verl: verl %s calls cpshard at %d sites%s (pid %d; %s); layout: %s; FSDP ring size %d "
        "(%s); %d skipped, %d refused", result.verl_version, len(result.bound), scope, os.getpid(), where,
        result.layout, result.ring, _fsdp.describe_ring(result.ring), len(result.skipped), len(result.refused))
    _LOGGED[0] = True
    for what, sites in (("skipped", result.skipped), ("refused", result.refused)):
        for site, reason in sites.items():
            _layout.once(logging.WARNING, f"{what} {site} {reason}", "cpshard.compat.verl: %s %s: %s", what, site,
                         reason)
