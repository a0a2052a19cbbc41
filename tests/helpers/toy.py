"""A module whose functions and methods the tests patch (MMRazor's documented toy example)."""

from __future__ import annotations

import random

import torch


def toy_func() -> int:
    return random.randint(0, 1000000)


def add(a: float, b: float = 10.0, *rest: float, scale: float = 1.0, **extra: float) -> float:
    return (a + b + sum(rest)) * scale


def double(x: torch.Tensor) -> torch.Tensor:
    return x * 2


def raises(x: int) -> int:
    raise ValueError(f"bad input {x}")


CONSTANT = 3


class Toy:
    def toy_func(self) -> int:
        return random.randint(0, 1000000)

    def scale(self, x: float, factor: float = 2.0) -> float:
        return x * factor

    @staticmethod
    def static(x: int) -> int:
        return x + 1

    @classmethod
    def klass(cls, x: int) -> str:
        return f"{cls.__name__}:{x}"

    @property
    def prop(self) -> int:
        return 1


class SubToy(Toy):
    pass


def uses_double(x: torch.Tensor) -> torch.Tensor:
    return double(x) + 1
