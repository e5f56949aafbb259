"""The base of every controller message (`Message`) and the registry of message types (type name -> class).

Owns what a message class is (a versioned, kw-only dataclass with a unique wire ``TYPE``) and the registry it
joins when defined. The messages themselves live by concern (session_messages, trainer_messages,
weight_messages, engine_messages); their conversion to and from (JSON header, arrays) is message_codec.py;
``hpc_rl.protocol.messages`` gathers them all.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

REGISTRY: dict[str, type[Message]] = {}
"""Every message class, by its ``TYPE``."""


@dataclass(kw_only=True)
class Message:
    """Base of all messages; subclasses set ``TYPE`` (unique wire name) and ``VERSION``."""

    TYPE: ClassVar[str] = ""
    VERSION: ClassVar[int] = 1
    """Set in a subclass only when bumped."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if not cls.TYPE:
            raise TypeError(f"message class {cls.__name__} must set TYPE")
        if cls.TYPE in REGISTRY and REGISTRY[cls.TYPE].__qualname__ != cls.__qualname__:
            raise TypeError(
                f"message TYPE {cls.TYPE!r} of {cls.__name__} is already used by {REGISTRY[cls.TYPE].__name__}"
            )
        REGISTRY[cls.TYPE] = cls
