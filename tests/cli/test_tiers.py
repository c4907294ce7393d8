"""The quick tier's pick of a case per known-failure entry (`cli.tiers._alone`), in process."""

from types import SimpleNamespace

from paracheck.cli.tiers import _alone
from paracheck.results.known import KnownFailure


def _meets(entry, case) -> bool:
    return case.model in entry.model.split("|")


def test_an_entry_is_shown_on_a_case_where_a_check_it_names_has_no_later_rival():
    """Of entries naming one check, the file's last names a case (`known.apply`): a case both meet shows the later
    one for that check. A listed entry is still the one named for its other checks there."""
    a, b = SimpleNamespace(model="a", control=None), SimpleNamespace(model="b", control=None)
    listed = KnownFailure("listed", model="a|b", check=("parity.forward", "parity.grads"))
    grads = KnownFailure("grads", model="a", check="parity.grads")
    only_grads = KnownFailure("only grads", model="a|b", check="parity.grads")
    entries = [listed, only_grads, grads]
    pick = _alone(listed, entries, [a, b], _meets)
    assert pick(a) and pick(b)  # forward: no later entry names it
    pick = _alone(only_grads, entries, [a, b], _meets)
    assert not pick(a) and pick(b)  # on a, grads is the later entry's
    whole = KnownFailure("whole", model="a", check="error")
    pick = _alone(whole, [whole, KnownFailure("later", model="a", check="error")], [a], _meets)
    assert pick(a)  # no case alone: any case meeting it
