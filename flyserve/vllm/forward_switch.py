"""Which forward flyserve's composite impls run this step: vLLM's own, or flyserve's checked one.

flyserve's checked forward (backends.py) times the armed forward of a timed step and trips the
circuit breaker when the prefill kernel raises. A Python frame around every attention forward
cost the host 0.45-0.7 us a call on the 2-core CI VM (timeit, an empty forward: 0.15-0.23 us
bare, 0.61-0.95 us wrapped), 15-22 us a step at 32 layers, more than everything else flyserve
does per step. So it is installed only for the steps that need it: a step with a timed forward,
or one that runs the prefill path. On every other step vLLM's composite forward runs with no
flyserve frame. The routing flips the switch in select() (a compare or two per step), on the
impl classes (one per platform per process), so a forward call checks nothing at all.

The switch is per process, like the classes it changes. Single writer: the engine thread.
"""

from __future__ import annotations

from typing import Any


class ForwardSwitch:
    """The composite impl classes of this process and which forward they run now."""

    __slots__ = ("_impls", "checked", "timer")

    def __init__(self) -> None:
        self.checked = False
        self.timer: Any = None  # this process's KernelTimer (per-step mode), set by the leader routing
        self._impls: list[tuple[type, Any, Any]] = []

    def register(self, impl_cls: type, plain: Any, checked: Any) -> None:
        """An impl class whose ``forward`` is ``plain`` (vLLM's) or ``checked`` (flyserve's)."""
        self._impls.append((impl_cls, plain, checked))
        impl_cls.forward = checked if self.checked else plain  # type: ignore[attr-defined]

    def set(self, checked: bool) -> None:
        """Install the checked forward (True) or vLLM's (False) on every registered class."""
        self.checked = checked
        for cls, plain, chk in self._impls:
            cls.forward = chk if checked else plain  # type: ignore[attr-defined]


SWITCH = ForwardSwitch()
