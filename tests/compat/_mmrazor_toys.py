"""Functions and classes for the MMRazor compatibility tests to patch.

The recorders and deliveries under test patch these by dotted path
(``"compat._mmrazor_toys.<name>"``), the way MMRazor's own tests patch their toy modules.
"""

from __future__ import annotations

import random

TOY_VAR = "not a function"


def identity(a: object) -> object:
    return a


def pair(a: object, b: object) -> tuple[object, object]:
    return a, b


def calls_identity(a: object) -> None:
    identity(a)


def calls_pair(a: object, b: object) -> None:
    pair(a, b)


def draw() -> int:
    return random.randint(0, 10**9)


class Counter:
    TOY_CLS = "a class attribute"

    def __init__(self) -> None:
        self._count = 0

    def tick(self) -> int:
        self._count += 1
        return self._count

    def add(self, x: int, y: int = 0) -> int:
        return x + y

    def draw(self) -> int:
        return random.randint(0, 10**9)

    def draws(self) -> list[int]:
        return [random.randint(0, 10**9) for _ in range(3)]

    @property
    def count(self) -> int:
        return self._count
