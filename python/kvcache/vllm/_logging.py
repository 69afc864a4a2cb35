"""kvcache's log lines inside a vLLM process, in vLLM's format and at vLLM's level.

vLLM configures only its own ``vllm`` logger (its handler, its level, ``propagate=False``) and
leaves the root logger alone, so records of the ``kvcache.*`` loggers would reach no handler:
INFO is dropped and warnings come out bare through Python's last-resort handler. When vLLM's
logging is configured, :func:`route_to_vllm` sends the whole ``kvcache`` logger tree through
the handlers of the ``vllm`` logger, looked up at each record, so a later reconfiguration of
vLLM's logging is followed. It changes neither the root logger nor vLLM's loggers, and does
nothing when the ``kvcache`` logger already has handlers of its own (configured by the user).
"""

from __future__ import annotations

import logging
import os

KVCACHE_LOGGER = "kvcache"
VLLM_LOGGER = "vllm"


class _ToVllmHandler(logging.Handler):
    """Hands each record to the ``vllm`` logger's handlers, as if logged there."""

    def emit(self, record: logging.LogRecord) -> None:
        vllm_logger = logging.getLogger(VLLM_LOGGER)
        if vllm_logger.isEnabledFor(record.levelno):
            vllm_logger.handle(record)  # its filters, handlers and levels, as vLLM set them


def vllm_logging_configured() -> bool:
    """vLLM's logging is on (``VLLM_CONFIGURE_LOGGING`` not 0) and has set up its handlers."""
    try:
        configure = bool(int(os.environ.get("VLLM_CONFIGURE_LOGGING", "1")))
    except ValueError:
        configure = True  # vLLM itself would fail on this value; do not hide our lines for it
    return configure and bool(logging.getLogger(VLLM_LOGGER).handlers)


def route_to_vllm() -> bool:
    """Routes the ``kvcache`` logger tree through vLLM's handlers and level when vLLM's logging
    is configured and the user has not given ``kvcache`` handlers; True when routed (now or
    before). Idempotent: call it whenever vLLM may have configured its logging since."""
    ours = logging.getLogger(KVCACHE_LOGGER)
    if any(isinstance(h, _ToVllmHandler) for h in ours.handlers):
        return True
    if ours.handlers or not vllm_logging_configured():
        return False
    if ours.level == logging.NOTSET:
        ours.setLevel(logging.getLogger(VLLM_LOGGER).getEffectiveLevel())
    ours.addHandler(_ToVllmHandler())
    # As vLLM's own logger does: its lines go to its handlers only, never twice via the root.
    ours.propagate = False
    return True
