"""A family the kit makes no inputs for, refused before launch by name."""

from __future__ import annotations


class Refused(ValueError):
    """`why` is one sentence shared by every family refused the same way, so a report groups them as one reason
    (the case already names the family); the message adds the family and, where given, `detail`."""

    def __init__(self, model_type: str, why: str, detail: str = ""):
        super().__init__(f"{model_type}: {why}" + (f" ({detail})" if detail else ""))
        self.model_type, self.why = model_type, why
