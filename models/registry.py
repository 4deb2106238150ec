"""One registry pattern for models, renderers and parsers: a name → class table filled by a
decorator, with an error that lists what is available."""
from __future__ import annotations

from typing import Callable, Generic, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    def __init__(self, kind: str):
        self.kind = kind
        self._entries: dict[str, T] = {}

    def register(self, *names: str) -> Callable[[T], T]:
        def deco(obj: T) -> T:
            for name in names:
                self._entries[name] = obj
            return obj
        return deco

    def get(self, name: str) -> T:
        try:
            return self._entries[name]
        except KeyError:
            raise ValueError(f"unsupported {self.kind} {name!r}; supported: "
                             f"{', '.join(sorted(self._entries))}") from None

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def names(self) -> list[str]:
        return sorted(self._entries)


# HF `architectures` name → model class (families register themselves)
MODELS: Registry[type] = Registry("model architecture")
