"""A family the kit makes no inputs for, refused before launch by name."""

from __future__ import annotations


class Refused(ValueError):
    """`why` is one sentence shared by every family refused the same way, so a report groups them as one reason
    (the case already names the family); the message adds the family and, where given, `detail`."""

    def __init__(self, model_type: str, why: str, detail: str = ""):
        super().__init__(f"{model_type}: {why}" + (f" ({detail})" if detail else ""))
        self.model_type, self.why = model_type, why


class NoBuilder(Refused):
    """A family whose inputs of some modality (an image, an audio clip) the kit cannot make."""


def lookup(builders: dict, refused: dict, config, modality: str, what: str):
    """`builders`' entry for `config`'s model type (each modality keeps its own table); `NoBuilder` with
    `refused`'s reason for it, else naming the families the kit makes `modality` inputs for (`what`: the thing a
    processor turns into them). One rule, so every modality's refusal reads alike and the sweep groups them alike."""
    found = builders.get(config.model_type)
    if found is None:
        why = refused.get(config.model_type) or (f"the kit makes {modality} inputs for {', '.join(sorted(builders))} "
                                                 f"only (each family's processor turns {what} into its own "
                                                 "placeholders and tensors)")
        raise NoBuilder(config.model_type, why)
    return found
