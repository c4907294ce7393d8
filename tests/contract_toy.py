"""An adapter written outside paracheck's package, the way a third library would: it implements the contract's
required members and one optional one, and is registered by a dist-info entry point the tests put on sys.path."""

from __future__ import annotations

import contextlib

from paracheck.domain.case import Case
from paracheck.adapters.diffusers.layout import DiffusersLayout
from paracheck.domain.records import CheckId


class ToyAdapter:
    name = "toy"
    dtypes = ("fp32",)
    columns = (CheckId.FORWARD,)

    def parse_layout(self, name, order="cp-fastest"):
        return DiffusersLayout.parse(name, order)

    def fixtures(self):
        return {"toy1": "tests.contract_toy:make"}

    def installed(self):
        return True

    def unsupported(self):
        return None

    def claims(self, factory):
        return False

    def variants(self):
        return ("base",)

    def expand(self, request):
        return [Case(name, factory, self.parse_layout("u2", request.order), library=self.name)
                for name, factory in request.models]

    def controls(self):
        return {}

    def case_options(self, case):
        return []

    def case_body(self, ctx):
        return contextlib.nullcontext(None)

    def preload(self):
        return None

    def explore_target(self, factory, layouts_text, world, order="cp-fastest"):
        raise ValueError("the toy adapter explores nothing")

    def explore_case(self, name, factory, space, layout, shape, dtype, extras=None):
        raise ValueError("the toy adapter explores nothing")

    def mixins(self):
        return {}

    def will_run(self, case):  # one optional member
        return True


def make():
    return None


ADAPTER = ToyAdapter()
