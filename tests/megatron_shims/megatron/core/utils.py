"""SHIM (tests only) for ``megatron/core/utils.py``, which imports torch.

What Megatron's client, server and requests import from it, behaving as main d98e8a64's:
``get_asyncio_loop`` (the running loop, else one made and kept), ``trace_async_exceptions``
(a coroutine or async generator that raises logs it and exits the process, as Megatron's
does), ``experimental_api`` (a marker), ``nvtx_range_push`` / ``nvtx_range_pop`` (no-ops).
"""

import asyncio
import functools
import inspect
import logging
import sys
import traceback

logger = logging.getLogger(__name__)
_ASYNC_IO_LOOP = None


def get_asyncio_loop(loop=None):
    """The given loop, else the running one, else one made (and kept) here."""
    global _ASYNC_IO_LOOP  # noqa: PLW0603
    if loop is None:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            if _ASYNC_IO_LOOP is not None:
                return _ASYNC_IO_LOOP
            _ASYNC_IO_LOOP = loop = asyncio.new_event_loop()
            asyncio.set_event_loop(loop)
    return loop


def trace_async_exceptions(func=None, *, verbose=False):
    """Log an exception of a task's coroutine and exit, as Megatron's decorator does."""

    def decorate(fn):
        if inspect.isasyncgenfunction(fn):

            @functools.wraps(fn)
            async def generator(*args, **kwargs):
                try:
                    async for item in fn(*args, **kwargs):
                        yield item
                except Exception as e:
                    logger.error(f"Exception in async generator {fn.__name__}: {e}")
                    traceback.print_exc()
                    sys.exit(1)

            return generator

        @functools.wraps(fn)
        async def wrapper(*args, **kwargs):
            try:
                return await fn(*args, **kwargs)
            except Exception as e:
                logger.error(f"Exception in async function {fn.__name__}: {e}")
                traceback.print_exc()
                sys.exit(1)

        return wrapper

    return decorate if func is None else decorate(func)


def experimental_api(func):
    """Mark ``func`` experimental (Megatron sets an attribute; nothing else)."""
    func._experimental_api = True
    return func


def nvtx_range_push(msg=None, suffix=None):
    """No NVTX here."""


def nvtx_range_pop(msg=None, suffix=None):
    """No NVTX here."""
