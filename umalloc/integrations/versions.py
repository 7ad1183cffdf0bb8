"""The one error every integration raises for an engine release it was not tested against.

Each integration (:mod:`umalloc.integrations.vllm`, :mod:`umalloc.integrations.sglang`,
:mod:`umalloc.integrations.transformers`) declares ``SUPPORTED_VERSIONS`` (exact releases its peer suite ran) and
refuses any other with :class:`EngineVersionError` (or its engine-named subclass), before it changes anything.
"""

from __future__ import annotations

from collections.abc import Sequence

from umalloc.errors import UmallocValueError


class EngineVersionError(UmallocValueError):
    """An engine release outside an integration's ``SUPPORTED_VERSIONS``.

    Attributes:
        engine: the engine's name (``"vLLM"``, ``"SGLang"``, ``"transformers"``).
        version: the release found.
        supported: the releases the integration was tested against.
    """

    def __init__(self, engine: str, version: str, supported: Sequence[str], extra: str) -> None:
        self.engine = engine
        self.version = version
        self.supported = tuple(supported)
        super().__init__(f"{engine} {version} is untested with umalloc.integrations.{engine.lower()}; allowed "
                         f"{', '.join(self.supported)} (pip install 'umalloc[{extra}]')")


def check_engine_version(engine: str, version: str, supported: Sequence[str], extra: str,
                         error: type[EngineVersionError] = EngineVersionError) -> str:
    """Return ``version`` if it is one of ``supported``, else raise ``error`` (an :class:`EngineVersionError`).

    >>> check_engine_version("vLLM", "0.33.0", ("0.33.0",), "vllm")
    '0.33.0'
    >>> check_engine_version("vLLM", "0.32.1", ("0.33.0",), "vllm")
    Traceback (most recent call last):
    ...
    umalloc.integrations.versions.EngineVersionError: vLLM 0.32.1 is untested with umalloc.integrations.vllm; allowed 0.33.0 (pip install 'umalloc[vllm]')
    """
    if version not in supported:
        raise error(engine, version, supported, extra)
    return version


__all__ = ["EngineVersionError", "check_engine_version"]
